"""Threads used by lorahook's compiled core.

lorahook's kernels call BLAS through ``scipy.linalg.cython_blas``: SciPy's own
BLAS (with SciPy's wheels, a private OpenBLAS under ``scipy.libs``), a
different library with its own thread pool from the BLAS inside numpy.
threadpoolctl lists both.  lorahook uses threads in two places, each with
its own setting:

**lorahook's threads** (``set_num_threads`` / ``get_num_threads``): a
batched call large enough to be worth it is cut into chunks of rows, and
lorahook's own helper threads run chunks next to the calling thread.  The
default is the number of CPUs the process may use, at most 4.

**SciPy's BLAS threads** (``set_blas_threads`` / ``get_blas_threads``): held
to **one** on import; numpy's BLAS is left alone.

Why this split, measured on a 2-core machine with ``lorahook bench`` (see
:mod:`lorahook.bench` for the method):

* In a server loop that runs, for each projection, the base matmul in numpy
  and then the LoRA update, two multi-threaded OpenBLAS pools hand the cores
  back and forth: each pool's idle workers spin for a while after a call, so
  the other pool's next call competes with them (a 128-row prefill loop took
  about 3x as long with SciPy's BLAS on 2 threads).  lorahook's helpers never
  spin: between calls they sleep, so they cost the next numpy matmul nothing.
* A lone large call uses the second core: 512 rows, 4096 -> 4096, rank 16
  ran about 1.7x faster on 2 threads.
* Several Python threads calling lorahook at once (the kernels release the
  GIL) scale when each call keeps to its own core.  A helper takes another
  chunk only while the call it helps is the only lorahook call running, and a
  call that finds the helpers busy runs alone, so concurrent callers do not
  oversubscribe the machine.
* Decode (one row, ``sgemv``) and small batches stay on the calling thread:
  a batch is split only into chunks of at least 64 rows (and never fewer
  than the gemm crossover) and 4 MFLOP (``lorahook._rows.get_split_grain``),
  below which handing work to another thread costs more than it saves.
* Chunk boundaries depend only on the batch's shape, never on timing, so a
  result is the same bits whichever thread ran which chunk, and the same for
  every thread count ``>= 2``.  With 1 thread the batch is not chunked, which
  can change the last bits of float32 rounding.
* If SciPy's BLAS is given more than one thread (``set_blas_threads`` or
  threadpoolctl), lorahook stops splitting and leaves threading to BLAS, so
  the two never multiply.  The core reads that count from OpenBLAS (what
  SciPy's wheels ship); with a BLAS it cannot ask, keep that BLAS at one
  thread or call ``set_num_threads(1)``.

Override it
-----------
* ``set_num_threads(n)`` (``1 <= n <= 64``) at any time; ``1`` keeps every
  call on the calling thread.  ``LORAHOOK_NUM_THREADS=n`` sets it at import.
* ``set_blas_threads(n)`` at any time; ``LORAHOOK_BLAS_THREADS=n`` at import,
  or ``LORAHOOK_BLAS_THREADS=keep`` to leave SciPy's BLAS as it is.
* threadpoolctl keeps working on SciPy's BLAS: ``threadpool_limits`` and
  ``ThreadpoolController`` (or :func:`blas_controller`) see and change the
  same library, and whatever they set last wins.

The BLAS setting is process-wide for SciPy's BLAS, so it also applies to
other users of ``scipy.linalg`` in the process.  Numpy's BLAS is never
changed.  lorahook's helper threads start on the first split call; they
block asynchronous signals, and a forked child starts its own when it needs
them.
"""
import os
import threading

__all__ = ["get_num_threads", "set_num_threads", "get_blas_threads", "set_blas_threads",
           "default_num_threads", "blas_controller", "blas_info", "DEFAULT_BLAS_THREADS",
           "MAX_DEFAULT_THREADS"]

#: SciPy's BLAS threads set on import unless ``LORAHOOK_BLAS_THREADS`` says otherwise.
DEFAULT_BLAS_THREADS = 1

#: The most threads lorahook uses by default for one call (more cores add
#: little: the kernels are limited by memory bandwidth at LoRA ranks).
MAX_DEFAULT_THREADS = 4

_ENV = "LORAHOOK_NUM_THREADS"
_BLAS_ENV = "LORAHOOK_BLAS_THREADS"
_lock = threading.Lock()


def _cython_blas_library_path():
    """The file of the BLAS that ``scipy.linalg.cython_blas`` calls, or None.

    The compiled core finds it at import: it looks ``sgemm`` up through the
    extension's own handle (so the search runs over its dependencies, not
    over whatever numpy loaded first) and asks the dynamic loader which file
    holds that address.
    """
    from . import _rows
    path = _rows._blas_library_path()
    return None if path is None else os.path.realpath(path)


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


def _check_count(n):
    if isinstance(n, bool) or not hasattr(type(n), "__index__"):
        raise TypeError(f"n must be an int, got {type(n).__name__} ({n!r})")
    n = int(n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return n


def default_num_threads():
    """CPUs this process may run on, at most :data:`MAX_DEFAULT_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_THREADS))


def get_num_threads():
    """Threads one large batched lorahook call may use (the caller plus helpers)."""
    from . import _rows
    return _rows._get_num_threads()


def set_num_threads(n):
    """Set the threads one large batched call may use; returns the previous value.

    ``n`` is an int, ``1 <= n <= 64``; ``1`` keeps every call on the calling
    thread.  Takes effect from the next call, for every thread of the process.
    """
    from . import _rows
    return _rows._set_num_threads(_check_count(n))


def get_blas_threads():
    """The number of threads of the BLAS lorahook's kernels call (SciPy's)."""
    return int(_the_library().num_threads)


def set_blas_threads(n):
    """Set the threads of the BLAS lorahook's kernels call; returns the previous value.

    ``n`` is an int ``>= 1``.  This changes SciPy's BLAS for the whole
    process (the same library ``threadpoolctl`` reports with the path
    :func:`blas_info` gives); numpy's BLAS is untouched.  While it is above
    1, lorahook does not split calls over its own threads.
    """
    n = _check_count(n)
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


def _env_count(name, value):
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return n


def _apply_defaults():
    from . import _rows
    value = os.environ.get(_ENV, "").strip()
    if value.lower() == "keep":
        raise ValueError(f"{_ENV} sets lorahook's own threads and must be an integer from 1 "
                         f"to 64, got {value!r}; to leave SciPy's BLAS as it is, set "
                         f"{_BLAS_ENV}=keep")
    if value:
        n = _env_count(_ENV, value)
        if n > 64:
            raise ValueError(f"{_ENV} must be at most 64, got {value!r}")
    else:
        n = default_num_threads()
    _rows._set_num_threads(n)

    value = os.environ.get(_BLAS_ENV, "").strip()
    if value.lower() != "keep":
        try:
            set_blas_threads(_env_count(_BLAS_ENV, value) if value else DEFAULT_BLAS_THREADS)
        except (ImportError, RuntimeError):
            # Without threadpoolctl or an identifiable BLAS, leave BLAS as it is.
            pass


_apply_defaults()
