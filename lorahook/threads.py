"""BLAS threads used by lorahook's compiled core.

lorahook's kernels call BLAS through ``scipy.linalg.cython_blas``, which is
SciPy's own BLAS (with SciPy's wheels, a private OpenBLAS under
``scipy.libs``), a different library with its own thread pool from the BLAS
inside numpy.  threadpoolctl lists both.

The choice
----------
On import, lorahook holds **SciPy's BLAS to one thread** (numpy's BLAS is
left alone).  The reasons, measured on a 2-core machine with
``lorahook bench`` (see :mod:`lorahook.bench` for the method):

* In a server loop that runs, for each projection, the base matmul in numpy
  and then the LoRA update through SciPy's BLAS, two multi-threaded OpenBLAS
  pools hand the cores back and forth: each pool's idle workers spin for a
  while after a call, so the other pool's next call competes with them.  With
  SciPy's BLAS on one thread the hook costs what its flops cost.
* Decode (``sgemv``, one row) is slower with a second BLAS thread.  A lone
  large batched call is faster with two (512 rows, 4096 -> 4096, rank 16:
  about 1.4x on 2 cores), which is the price of this default: a program that
  makes such calls alone, with no other BLAS work around them, can call
  ``set_num_threads(2)``.
* Several Python threads calling lorahook at once (the kernels release the
  GIL) scale only when each call stays on its own core; BLAS threads inside
  every call oversubscribe the machine.

Override it
-----------
* ``set_num_threads(n)`` at any time (``get_num_threads()`` reads it back);
* the environment variable ``LORAHOOK_NUM_THREADS`` read at import: an
  integer ``>= 1`` is used instead of 1, ``keep`` leaves SciPy's BLAS as it is;
* threadpoolctl keeps working: ``threadpool_limits`` and
  ``ThreadpoolController`` see and change the same library, and whatever they
  set last wins (lorahook does not re-apply its default later).

The setting is process-wide for SciPy's BLAS, so it also applies to other
users of ``scipy.linalg`` in the process.  Numpy's BLAS is never changed.
"""
import ctypes
import os
import threading

__all__ = ["get_num_threads", "set_num_threads", "blas_controller", "blas_info",
           "DEFAULT_NUM_THREADS"]

#: SciPy's BLAS threads set on import unless ``LORAHOOK_NUM_THREADS`` says otherwise.
DEFAULT_NUM_THREADS = 1

_ENV = "LORAHOOK_NUM_THREADS"
_lock = threading.Lock()
_cached_path = None

# Fortran symbols cython_blas resolves against, newest wheel naming first.
_PROBE_SYMBOLS = ("scipy_sgemm_", "sgemm_", "sgemm", "scipy_sgemm_64_", "sgemm_64_")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _dladdr_path(address):
    for name in (None, "libc.so.6", "libdl.so.2", "libSystem.dylib"):
        try:
            lib = ctypes.CDLL(name)
            dladdr = lib.dladdr
        except (OSError, AttributeError):
            continue
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        if dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
        return None
    return None


def _cython_blas_library_path():
    """The file of the BLAS that ``scipy.linalg.cython_blas`` calls, or None.

    Looks up ``sgemm`` through the extension's own handle (so the search runs
    over its dependencies, not over whatever numpy loaded first) and asks the
    dynamic loader which file holds that address.
    """
    global _cached_path
    if _cached_path is not None:
        return _cached_path
    import scipy.linalg.cython_blas as cython_blas
    try:
        handle = ctypes.CDLL(cython_blas.__file__)
    except OSError:
        return None
    for symbol in _PROBE_SYMBOLS:
        try:
            func = getattr(handle, symbol)
        except AttributeError:
            continue
        path = _dladdr_path(ctypes.cast(func, ctypes.c_void_p).value)
        if path and os.path.realpath(path) != os.path.realpath(cython_blas.__file__):
            _cached_path = os.path.realpath(path)
            return _cached_path
    return None


def blas_controller():
    """The threadpoolctl controller of the BLAS lorahook's kernels use.

    Returns a ``threadpoolctl.ThreadpoolController`` holding exactly that
    library, or raises ``RuntimeError`` when it cannot be identified.
    """
    import scipy.linalg.cython_blas  # noqa: F401  (loads the library)
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    blas = [lc for lc in controller.lib_controllers if lc.user_api == "blas"]
    path = _cython_blas_library_path()
    chosen = []
    if path is not None:
        chosen = [lc for lc in blas if os.path.realpath(lc.filepath) == path]
    if not chosen:
        # Fall back on where SciPy's wheels keep their private BLAS.
        import scipy
        scipy_root = os.path.dirname(os.path.dirname(os.path.realpath(scipy.__file__)))
        marks = (os.path.join(scipy_root, "scipy.libs") + os.sep,
                 os.path.join(scipy_root, "scipy", ".dylibs") + os.sep)
        chosen = [lc for lc in blas if os.path.realpath(lc.filepath).startswith(marks)]
    if not chosen and len(blas) == 1:
        chosen = blas  # one BLAS in the process: numpy and SciPy share it
    if not chosen:
        raise RuntimeError(
            "lorahook could not identify the BLAS library used by scipy.linalg.cython_blas "
            f"among the BLAS libraries threadpoolctl found: {[lc.filepath for lc in blas]}")
    make = getattr(ThreadpoolController, "_from_controllers", None)
    if make is not None:
        return make(chosen[:1])
    controller.lib_controllers = chosen[:1]
    return controller


def _the_library():
    return blas_controller().lib_controllers[0]


def get_num_threads():
    """The number of threads of the BLAS lorahook's kernels call (SciPy's)."""
    return int(_the_library().num_threads)


def set_num_threads(n):
    """Set the threads of the BLAS lorahook's kernels call; returns the previous value.

    ``n`` is an int ``>= 1``.  This changes SciPy's BLAS for the whole
    process (the same library ``threadpoolctl`` reports with the path
    :func:`blas_info` gives); numpy's BLAS is untouched.
    """
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):
        raise TypeError(f"n must be an int, got {type(n).__name__} ({n!r})")
    n = int(n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    with _lock:
        lib = _the_library()
        old = int(lib.num_threads)
        lib.set_num_threads(n)
    return old


def blas_info():
    """threadpoolctl's description of every BLAS/OpenMP library in the process.

    A list of dicts (``threadpoolctl.threadpool_info()``), each with an extra
    ``"lorahook"`` key that is True for the library lorahook's kernels call.
    """
    from threadpoolctl import threadpool_info

    try:
        ours = os.path.realpath(_the_library().filepath)
    except RuntimeError:
        ours = None
    info = threadpool_info()
    for entry in info:
        entry["lorahook"] = ours is not None and os.path.realpath(entry["filepath"]) == ours
    return info


def _apply_default():
    value = os.environ.get(_ENV, "").strip()
    if value.lower() == "keep":
        return
    n = DEFAULT_NUM_THREADS
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{_ENV} must be an integer >= 1 or 'keep', got {value!r}")
    try:
        set_num_threads(n)
    except (ImportError, RuntimeError):
        # Without threadpoolctl or an identifiable BLAS, leave BLAS as it is.
        pass


_apply_default()
