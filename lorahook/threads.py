"""Threads and BLAS: what lorahook runs on, and the one setting that changes it.

lorahook's kernels run on the thread that calls them, with the GIL released;
lorahook starts no thread of its own and, on import, changes nothing
process-wide.  The kernels call BLAS through ``scipy.linalg.cython_blas``:
SciPy's BLAS, which with SciPy's wheels is a private OpenBLAS under
``scipy.libs``, a different library (with its own thread pool) from the BLAS
inside numpy.  threadpoolctl lists both.

The one setting
---------------
:func:`configure` ``(blas_threads=1)`` holds SciPy's BLAS to one thread, for
the whole process.  It is the setting for a server loop that, for every
projection, runs the base matmul in numpy and then lorahook: two
multi-threaded OpenBLAS pools then hand the cores back and forth, because
each pool's idle workers spin for a while after a call and compete with the
other pool's next call (measured on a 2-core machine: a prefill loop about 6x
slower).  One thread for the small LoRA products costs little, since they
are bound by memory bandwidth.  Call it once, at start-up; benchmarks and
server recipes do.

When SciPy and numpy share one BLAS (conda-forge, Debian's ``libblas.so.3``)
there is one pool and nothing to separate: :func:`configure` leaves it alone
and :func:`info` says so.  ``configure(blas_threads=None)`` gives back the
thread count lorahook found before it first changed it, and from then on
leaves the BLAS alone.

A trap that is hard to see
--------------------------
When the first batched (``sgemm``) kernel of the process runs and
:func:`configure` was never called, lorahook checks the BLAS libraries'
thread counts: when SciPy's and numpy's are separate and both run more than
one thread, it warns once, with a ``RuntimeWarning`` that names both and the
fix.  Which libraries those are is looked up once (threadpoolctl, a
read-only look) when the first adapter or adapter set is made, at start-up,
not in the first request.  Calling :func:`configure`
with any value, or filtering the warning, silences it.

For a large single call, threads are better left to the BLAS
(``configure(blas_threads=n)``), which splits one product over its own pool,
than to a second pool of lorahook's: measured on this kind of machine, a
256-row 1024->3584 rank-16 call split over helper threads ran no faster than
one thread.  Several Python threads calling lorahook at once scale, since the
kernels release the GIL.
"""
import os
import threading
import warnings

from ._core.segments import blas_library_path, get_gemm_crossover, set_first_batched

__all__ = ["configure", "info"]

_lock = threading.Lock()
# lorahook's own settings: the configured BLAS thread count (None: never
# configured, or configured to leave the BLAS alone), whether configure was
# called at all, and the count found before lorahook first changed it.
_settings = {"blas_threads": None, "configured": False, "found_blas_threads": None}


def _blas_path():
    path = blas_library_path()
    return None if path is None else os.path.realpath(path)


def _libraries():
    """threadpoolctl's controllers: (SciPy's BLAS as lorahook calls it, numpy's BLAS)."""
    import numpy  # noqa: F401  (both libraries are loaded by now)
    import scipy.linalg.cython_blas  # noqa: F401
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    blas = [lc for lc in controller.lib_controllers if lc.user_api == "blas"]
    path = _blas_path()
    ours = [lc for lc in blas if path is not None and os.path.realpath(lc.filepath) == path]
    if not ours:
        # Fall back on where SciPy's wheels keep their private BLAS.
        import scipy
        root = os.path.dirname(os.path.dirname(os.path.realpath(scipy.__file__)))
        marks = (os.path.join(root, "scipy.libs") + os.sep,
                 os.path.join(root, "scipy", ".dylibs") + os.sep)
        ours = [lc for lc in blas if os.path.realpath(lc.filepath).startswith(marks)]
    if not ours and len(blas) == 1:
        ours = blas  # one BLAS in the process: numpy and SciPy share it
    numpy_blas = _numpy_blas(blas)
    return (ours[0] if ours else None), numpy_blas


def _numpy_blas(blas):
    import numpy
    root = os.path.dirname(os.path.realpath(numpy.__file__))
    libs = os.path.join(os.path.dirname(root), "numpy.libs") + os.sep
    dylibs = os.path.join(root, ".dylibs") + os.sep
    mine = [lc for lc in blas
            if os.path.realpath(lc.filepath).startswith((libs, dylibs))]
    if mine:
        return mine[0]
    # numpy linked against a system BLAS: the library numpy's own config names
    try:
        config = numpy.show_config(mode="dicts")
        name = config["Build Dependencies"]["blas"].get("name", "") or ""
    except Exception:  # numpy < 1.26, or a config without that entry
        name = ""
    for lc in blas:
        if name and name.lower() in os.path.basename(lc.filepath).lower():
            return lc
    return None


def _describe(lc):
    if lc is None:
        return None
    return {
        "filepath": lc.filepath,
        "internal_api": lc.internal_api,
        "version": lc.version,
        "architecture": getattr(lc, "architecture", None),
        "threading_layer": getattr(lc, "threading_layer", None),
        "num_threads": int(lc.num_threads),
    }


def _shared(ours, numpy_blas):
    return (ours is not None and numpy_blas is not None
            and os.path.realpath(ours.filepath) == os.path.realpath(numpy_blas.filepath))


def configure(blas_threads=None):
    """Set the threads of the BLAS lorahook's kernels call; the one process-wide setting.

    Parameters
    ----------
    blas_threads : int or None
        An int ``>= 1`` sets SciPy's BLAS (the library :func:`info` reports
        as lorahook's) to that many threads, for every user of that library
        in the process; numpy's BLAS is never touched, and when numpy shares
        SciPy's BLAS nothing is changed (there is one pool, nothing to
        separate).  ``None`` gives back the thread count lorahook found
        before it first changed it and leaves the BLAS alone from then on.

    Returns
    -------
    int or None
        The previous ``blas_threads`` setting (``None`` when unset).

    Raises
    ------
    TypeError
        For a count that is not an integer.
    ValueError
        For a count below 1.

    Notes
    -----
    Either call counts as an explicit choice, so the one-time warning about
    two fighting BLAS pools is not given.
    """
    if blas_threads is not None:
        if isinstance(blas_threads, bool) or not hasattr(type(blas_threads), "__index__"):
            raise TypeError(f"blas_threads must be an int >= 1 or None, got "
                            f"{type(blas_threads).__name__} ({blas_threads!r})")
        blas_threads = int(blas_threads)
        if blas_threads < 1:
            raise ValueError(f"blas_threads must be >= 1 or None, got {blas_threads}")
    with _lock:
        old = _settings["blas_threads"]
        ours, numpy_blas = _libraries()
        if ours is not None and not _shared(ours, numpy_blas):
            if blas_threads is not None:
                if _settings["found_blas_threads"] is None:
                    _settings["found_blas_threads"] = int(ours.num_threads)
                ours.set_num_threads(blas_threads)
            elif _settings["found_blas_threads"] is not None:
                ours.set_num_threads(_settings["found_blas_threads"])
                _settings["found_blas_threads"] = None
        _settings["blas_threads"] = blas_threads
        _settings["configured"] = True
    return old


def info():
    """What lorahook runs on, as a dict (a read-only look; nothing changes).

    Returns
    -------
    dict
        With these keys:

    * ``"blas"``: the BLAS lorahook's kernels call (SciPy's): ``filepath``,
      ``internal_api``, ``version``, ``architecture`` (the kernel OpenBLAS
      chose for this CPU), ``threading_layer``, ``num_threads``; ``None`` when
      threadpoolctl cannot identify it;
    * ``"numpy_blas"``: the same for numpy's BLAS (``None`` when unknown);
    * ``"numpy_shares_blas"``: whether the two are one library (then
      :func:`configure` leaves it alone);
    * ``"configured"``, ``"blas_threads"``: whether :func:`configure` was
      called, and its setting;
    * ``"gemm_crossover"``: rows from which a batch uses the ``sgemm`` pair;
    * ``"threads_started"``: threads lorahook starts (always ``0``: kernels
      run on the calling thread).
    """
    ours, numpy_blas = _libraries()
    return {
        "blas": _describe(ours),
        "numpy_blas": _describe(numpy_blas),
        "numpy_shares_blas": _shared(ours, numpy_blas),
        "configured": _settings["configured"],
        "blas_threads": _settings["blas_threads"],
        "gemm_crossover": get_gemm_crossover(),
        "threads_started": 0,
    }


# The BLAS libraries as threadpoolctl found them, looked up once per process
# (their thread counts are read live): (SciPy's as lorahook calls it, numpy's).
_found = None
_found_lock = threading.Lock()


def look_ahead():
    """Look up the BLAS libraries once, ahead of the first request.

    Called when the first adapter or :class:`~lorahook.AdapterSet` is made
    (a server's start-up), so that the one-time check before the first
    batched kernel only reads thread counts: the look (threadpoolctl scanning
    the process's libraries, about 10 ms) never lands in a served request.
    """
    global _found
    if _found is None:
        with _found_lock:
            if _found is None:
                try:
                    _found = _libraries()
                except Exception:  # no threadpoolctl answer: nothing to say later
                    _found = (None, None)
    return _found


def _two_pools_warning():
    """The one-time check before the first batched kernel (see the module docstring)."""
    if _settings["configured"]:
        return
    ours, numpy_blas = look_ahead()
    if ours is None or numpy_blas is None or _shared(ours, numpy_blas):
        return
    if ours.num_threads > 1 and numpy_blas.num_threads > 1:
        warnings.warn(
            f"lorahook calls SciPy's BLAS ({os.path.basename(ours.filepath)}, "
            f"{ours.num_threads} threads), a different library from numpy's BLAS "
            f"({os.path.basename(numpy_blas.filepath)}, {numpy_blas.num_threads} threads). "
            f"In a loop that alternates numpy matmuls and lorahook calls the two thread pools "
            f"fight over the cores (a prefill loop measured 6x slower). Call "
            f"lorahook.threads.configure(blas_threads=1) once at start-up, or "
            f"configure(blas_threads=None) to keep SciPy's BLAS as it is and silence this "
            f"warning.", RuntimeWarning, stacklevel=2)


set_first_batched(_two_pools_warning)


def _obsolete_environment():
    """Warn about settings this version no longer reads (never an import failure)."""
    for name, default in (("LORAHOOK_NUM_THREADS", "kernels run on the calling thread"),
                          ("LORAHOOK_BLAS_THREADS", "SciPy's BLAS is left as the process has it")):
        if os.environ.get(name):
            warnings.warn(f"{name}={os.environ[name]!r} is not read by lorahook (default: "
                          f"{default}); call lorahook.threads.configure(blas_threads=n) instead",
                          RuntimeWarning, stacklevel=3)


_obsolete_environment()
