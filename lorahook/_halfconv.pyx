# cython: language_level=3
"""Half-precision conversions: float16 and bfloat16 to float32 and back.

float16 and bfloat16 values are 16-bit patterns (uint16); ``_halfconv.h`` widens
them to float32 and narrows float32 back with round-to-nearest-even, on the
fastest path this CPU supports (AVX-512 BF16, AVX2 + F16C) or on a portable
path that gives the same bits.  This module owns which path is active, so one
choice holds for the whole package: the kernels ask :c:func:`active_path`
once per call and convert inline on it, the file reader converts through
:c:func:`widen_n` / :c:func:`narrow_n` (declared in ``_halfconv.pxd``).

The Python functions are private to lorahook: :func:`widen` and
:func:`narrow` serve the adapters (``astype``), the others select and report
paths for tests and benchmarks.  ``LORAHOOK_HALF_PORTABLE=1`` in the
environment forces the portable path; it is read once, when this module is
imported, and changes nothing but the choice of conversion path.
"""
cimport numpy as cnp
from libc.stdint cimport uint16_t

import os
import warnings

import numpy as np

cnp.import_array()

cdef extern from "_halfconv.h" nogil:
    int LORAHOOK_HALF_AVX2
    int LORAHOOK_HALF_AVX512
    int lorahook_half_best_path() noexcept
    int lorahook_half_path() noexcept
    int lorahook_half_set_path(int path) noexcept
    void lorahook_half_widen(const uint16_t *src, float *dst, size_t n, int kind) noexcept
    void lorahook_half_narrow(const float *src, uint16_t *dst, size_t n, int kind) noexcept


cdef int active_path() noexcept nogil:
    """The conversion path in force (a ``LORAHOOK_HALF_*`` path), for the kernels."""
    return lorahook_half_path()


cdef void widen_n(const uint16_t *src, float *dst, size_t n, int kind) noexcept nogil:
    """Widen ``n`` 16-bit values of ``kind`` (``LORAHOOK_HALF_F16`` / ``_BF16``) to float32."""
    lorahook_half_widen(src, dst, n, kind)


cdef void narrow_n(const float *src, uint16_t *dst, size_t n, int kind) noexcept nogil:
    """Narrow ``n`` float32 values to 16-bit values of ``kind``, to nearest even."""
    lorahook_half_narrow(src, dst, n, kind)


_KINDS = {"float16": LORAHOOK_HALF_F16, "bfloat16": LORAHOOK_HALF_BF16}
_PATHS = {"portable": LORAHOOK_HALF_PORTABLE, "avx2": LORAHOOK_HALF_AVX2,
          "avx512": LORAHOOK_HALF_AVX512}
_PATH_NAMES = {v: k for k, v in _PATHS.items()}
_PATH_NEEDS = {"portable": "nothing", "avx2": "avx2, f16c",
               "avx512": "avx512f, avx512vl, avx512bf16"}
_ENV = "LORAHOOK_HALF_PORTABLE"


cdef int half_kind(object kind) except -1:
    if not isinstance(kind, str):
        raise TypeError(f"kind must be 'float16' or 'bfloat16', got {type(kind).__name__}")
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'float16' or 'bfloat16', got {kind!r}")
    return _KINDS[kind]


cdef cnp.ndarray half_array(object arr, object dtype, str name):
    """``arr`` when it is a C-contiguous array of exactly ``dtype`` (native order); read-only is fine."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of {np.dtype(dtype)}, "
                        f"got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype) or not arr.dtype.isnative:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)} (native byte order), "
                        f"got {arr.dtype.str}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got a strided array "
                         f"of shape {arr.shape}")
    return arr


def widen(src, kind):
    """Widen 16-bit patterns to float32: a new array of ``src``'s shape.

    ``src`` is a C-contiguous ``uint16`` array holding ``float16`` or
    ``bfloat16`` bit patterns, ``kind`` is ``'float16'`` or ``'bfloat16'``.
    Exact for every value.  bfloat16: the float32 bits are ``h << 16``, NaNs
    included.  float16: a NaN keeps its sign and payload (shifted left by 13)
    and becomes quiet (bit 22 set).  The GIL is released during the
    conversion.
    """
    return _convert(src, kind, True)


def narrow(src, kind):
    """Narrow float32 to 16-bit patterns: a new ``uint16`` array of ``src``'s shape.

    ``src`` is a C-contiguous ``float32`` array, ``kind`` is ``'float16'`` or
    ``'bfloat16'``.  Rounding is to nearest, ties to even, whatever the
    floating-point environment; subnormal results are kept (never flushed);
    values that round past the largest finite value become infinities of their
    sign.  NaNs stay NaN, keep their sign and their top payload bits and become
    quiet: float16 ``sign | 0x7E00 | ((bits >> 13) & 0x3FF)``, bfloat16
    ``(bits >> 16) | 0x0040``.  Every path gives the same bits.  The GIL is
    released during the conversion.
    """
    return _convert(src, kind, False)


cdef object _convert(object src, object kind, bint up):
    """``src`` widened (``up``) or narrowed into a new array of its shape, without the GIL."""
    cdef int k = half_kind(kind)
    cdef cnp.ndarray a = half_array(src, np.uint16 if up else np.float32, "src")
    cdef cnp.ndarray out = np.empty((<object>a).shape, dtype=np.float32 if up else np.uint16)
    cdef size_t n = <size_t>a.size
    cdef const void *s = cnp.PyArray_DATA(a)
    cdef void *d = cnp.PyArray_DATA(out)
    if n:
        with nogil:
            if up:
                lorahook_half_widen(<const uint16_t *>s, <float *>d, n, k)
            else:
                lorahook_half_narrow(<const float *>s, <uint16_t *>d, n, k)
    return out


def set_path(name):
    """Make the named conversion path active; return the name of the previous one.

    ``name`` is ``'portable'``, ``'avx2'`` or ``'avx512'``; a path this build
    or CPU cannot run is a ``ValueError`` and changes nothing.  For tests and
    benchmarks: every path gives the same bits, only the speed differs.
    """
    if name not in _PATHS:
        raise ValueError(f"path must be one of {sorted(_PATHS)}, got {name!r}")
    old = lorahook_half_set_path(_PATHS[name])
    if old < 0:
        raise ValueError(f"the {name!r} conversion path is not available here "
                         f"(it needs an x86-64 build and a CPU with {_PATH_NEEDS[name]})")
    return _PATH_NAMES[old]


def set_portable(flag):
    """Force the portable path (``True``) or go back to the fastest one (``False``).

    Returns whether the portable path was active before.
    """
    cdef int old = lorahook_half_path()
    if flag:
        lorahook_half_set_path(LORAHOOK_HALF_PORTABLE)
    else:
        lorahook_half_set_path(lorahook_half_best_path())
    return old == LORAHOOK_HALF_PORTABLE


def paths():
    """Which conversion path is active and which ones this build and CPU can run.

    A dict: ``active`` and ``best`` (path names), ``supported`` (a tuple of
    names, slowest first), ``needs`` (the CPU features each path requires) and
    ``env_portable`` (whether ``LORAHOOK_HALF_PORTABLE=1`` was set at import).
    """
    cdef int mask = lorahook_half_supported()
    return {
        "active": _PATH_NAMES[lorahook_half_path()],
        "best": _PATH_NAMES[lorahook_half_best_path()],
        "supported": tuple(_PATH_NAMES[p] for p in sorted(_PATH_NAMES) if mask & (1 << p)),
        "needs": dict(_PATH_NEEDS),
        "env_portable": _env_portable,
    }


def portable_from_env(value):
    """Read a value of ``LORAHOOK_HALF_PORTABLE``: whether it forces the portable path.

    Unset, empty or ``'0'``: no (the default); ``'1'``: yes.  Anything else is
    a ``RuntimeWarning`` naming the variable and the default, which then applies.
    """
    if value is None:
        return False
    v = value.strip()
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    warnings.warn(
        f"{_ENV}={value!r} is not '0' or '1'; using the default "
        f"({_ENV}=0: the fastest conversion path this CPU supports)",
        RuntimeWarning, stacklevel=2)
    return False


_env_portable = portable_from_env(os.environ.get(_ENV))
if _env_portable:
    lorahook_half_set_path(LORAHOOK_HALF_PORTABLE)
