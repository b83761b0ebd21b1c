"""Build the compiled core.  Metadata lives in pyproject.toml.

Set LORAHOOK_CYTHON_DEBUG=1 to build with bounds, wraparound and
initialisation checks on (the extension then reports ``DEBUG_BUILD = True``).
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("LORAHOOK_CYTHON_DEBUG", "") not in ("", "0")

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
    "embedsignature": True,
}

extension = Extension(
    "lorahook._rows",
    ["lorahook/_rows.pyx"],
    include_dirs=["lorahook", numpy.get_include()],
    # dladdr/dlopen/dlsym (finding the BLAS file): in libdl before glibc 2.34
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    define_macros=[
        ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
        ("LORAHOOK_DEBUG_BUILD", "1" if debug else "0"),
    ],
)

# force=True: the generated C depends on the directives above, which file
# times cannot tell, so it is always regenerated (one small module).
setup(ext_modules=cythonize([extension], compiler_directives=directives, force=True))
