"""The compiled entry points the tests and benchmarks call (``_testing.pyx``), built for the lorahook they import.

``_testing.pyx`` (beside this file) is not part of lorahook: it exposes kernels,
conversions and the row-major BLAS helpers in shapes a test or a timing loop
needs.  It is compiled here against the lorahook being tested -- the ``.pxd``
files and headers that lorahook installs with itself, and the compiled modules
it cimports from at run time -- once per lorahook build, into a cache folder
(``LORAHOOK_TEST_BUILD_DIR``, else ``tests/support/.build``).  It needs Cython
and a C compiler, as building lorahook from source does.

``core`` is the compiled module::

    from testing_core import core as _testing
"""
import hashlib
import importlib.util
import os
import sys
import sysconfig

import lorahook

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "_testing.pyx")
PACKAGE = os.path.dirname(os.path.abspath(lorahook.__file__))
CORE = os.path.join(PACKAGE, "_core")       # the core's .pxd files and headers
FILES = os.path.join(PACKAGE, "files")      # the loading kernels'


def _key():
    """What the build depends on: the source, the Python, and every compiled module of lorahook."""
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    h.update(sys.version.encode())
    h.update(PACKAGE.encode())
    for folder in (PACKAGE, CORE, FILES):
        for name in sorted(os.listdir(folder)):
            if name.endswith((".so", ".pyd", ".pxd", ".h")):
                st = os.stat(os.path.join(folder, name))
                h.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _build(out_dir):
    import numpy
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    ext = Extension("_testing", [SOURCE], include_dirs=[CORE, FILES, numpy.get_include()],
                    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])
    # cimport lorahook._core.checks and friends from the installed package's .pxd files
    modules = cythonize([ext], include_path=[os.path.dirname(PACKAGE)], quiet=True,
                        build_dir=os.path.join(out_dir, "c"),
                        compiler_directives={"language_level": 3})
    dist = Distribution({"ext_modules": modules})
    cmd = build_ext(dist)
    cmd.build_lib = out_dir
    cmd.build_temp = os.path.join(out_dir, "tmp")
    cmd.ensure_finalized()
    cmd.run()


def load():
    """The compiled module, built first when this lorahook has none yet."""
    root = os.environ.get("LORAHOOK_TEST_BUILD_DIR") or os.path.join(HERE, ".build")
    out_dir = os.path.join(root, _key())
    path = os.path.join(out_dir, "_testing" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        _build(out_dir)
    spec = importlib.util.spec_from_file_location("_testing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


core = load()
