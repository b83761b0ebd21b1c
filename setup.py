"""Build the compiled core.  Metadata lives in pyproject.toml.

Set LORAHOOK_CYTHON_DEBUG=1 to build with bounds, wraparound and
initialisation checks on (the extension then reports ``DEBUG_BUILD = True``).
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

debug = os.environ.get("LORAHOOK_CYTHON_DEBUG", "") not in ("", "0")
# this process's CPUs: Cython translates, and the compiler compiles, that many modules at once
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
    "embedsignature": True,
}

# dladdr/dlopen/dlsym (finding the BLAS file, the OpenMP runtime already
# loaded): in libdl before glibc 2.34
LIBDL = {"libraries": ["dl"] if sys.platform.startswith("linux") else []}

# The compiled modules: the compiled face, lorahook._rows, and behind it the core
# (lorahook/_core, each module named after what it holds: lorahook/_rows.pyx says which
# holds what) and the loading kernels of the files package.  They share declarations
# through their .pxd files and C headers.
MODULES = {
    "lorahook._core.checks": {},
    "lorahook._core.halfconv": {},
    "lorahook._core.segments": LIBDL,
    "lorahook._core.plans": {},
    "lorahook._core.sources": {},
    "lorahook._rows": {},
    "lorahook.files._load": {},
    "lorahook._core.slot_rows": {},
    "lorahook._core.slot_pairs": LIBDL,
}

extensions = [
    Extension(
        name,
        [name.replace(".", "/") + ".pyx"],
        include_dirs=["lorahook/_core", "lorahook/files", numpy.get_include()],
        define_macros=[
            ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
            # the oldest NumPy in pyproject's dependencies: a build against the newest NumPy
            # still imports with it (NumPy's own default target moves as it drops Pythons)
            ("NPY_TARGET_VERSION", "NPY_1_25_API_VERSION"),
            ("LORAHOOK_DEBUG_BUILD", "1" if debug else "0"),
        ],
        **extra,
    )
    for name, extra in MODULES.items()
]


class ParallelBuildExt(build_ext):
    """``build_ext`` compiling the modules on every CPU unless ``--parallel`` / ``-j`` says
    otherwise (pip and ``python -m build`` pass no option)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = CPUS


# force=True: the generated C depends on the directives above, which file
# times cannot tell, so it is always regenerated (on every CPU, nthreads).
setup(ext_modules=cythonize(extensions, compiler_directives=directives, force=True,
                            nthreads=CPUS),
      cmdclass={"build_ext": ParallelBuildExt})
