# cython: language_level=3
"""Half-precision conversions, and the instruction-set target of the whole core.

float16 and bfloat16 values are 16-bit patterns (uint16); ``halfconv.h`` widens
them to float32 and narrows float32 back with round-to-nearest-even, with the
code of the active target (``isa.h``: AVX-512 BF16, AVX2 + F16C, or portable
code that gives the same bits).  This module owns the target, one value for
the process: every compiled module attaches to it at import
(:c:func:`isa_cell`), and every kernel reads it (``lh_isa_active``).

The target is the best this CPU supports unless ``LORAHOOK_ISA`` names another
(``portable``, ``avx2``, ``avx512`` or ``avx512bf16``), read once, when this
module is imported; :func:`set_isa` changes it later.  ``LORAHOOK_HALF_PORTABLE=1``,
the older spelling, means ``LORAHOOK_ISA=portable``.  The target changes how
fast the kernels run, never a converted value; the pairs kernel's sums may
differ in their last bits between targets (each target gives the same bits
from run to run).  :func:`widen` and :func:`narrow` serve the adapters
(``astype``).
"""
cimport numpy as cnp
from libc.stdint cimport uint16_t

import os
import warnings

import numpy as np

cnp.import_array()

cdef extern from "isa.h" nogil:
    int LH_ISA_PORTABLE
    int LH_ISA_COUNT
    const char *lh_isa_name(int isa) noexcept
    const char *lh_isa_needs(int isa) noexcept
    int lh_isa_supported() noexcept
    int lh_isa_best() noexcept
    void lh_isa_attach(const int *cell) noexcept
    void lh_isa_store(int *cell, int isa) noexcept

cdef extern from "halfconv.h" nogil:
    void lorahook_half_widen(const uint16_t *src, float *dst, size_t n, int kind) noexcept
    void lorahook_half_narrow(const float *src, uint16_t *dst, size_t n, int kind) noexcept


# The process's target: every compiled module of lorahook reads this cell.
cdef int _isa = lh_isa_best()
lh_isa_attach(&_isa)


cdef const int *isa_cell() noexcept nogil:
    """The process's target, for ``lh_isa_attach`` in every compiled module."""
    return &_isa


cdef void widen_n(const uint16_t *src, float *dst, size_t n, int kind) noexcept nogil:
    """Widen ``n`` 16-bit values of ``kind`` (``LORAHOOK_HALF_F16`` / ``_BF16``) to float32."""
    lorahook_half_widen(src, dst, n, kind)


cdef void narrow_n(const float *src, uint16_t *dst, size_t n, int kind) noexcept nogil:
    """Narrow ``n`` float32 values to 16-bit values of ``kind``, to nearest even."""
    lorahook_half_narrow(src, dst, n, kind)


_KINDS = {"float16": LORAHOOK_HALF_F16, "bfloat16": LORAHOOK_HALF_BF16}
_ISA_NAMES = tuple(lh_isa_name(t).decode() for t in range(LH_ISA_COUNT))
_ENV = "LORAHOOK_ISA"
_OLD_ENV = "LORAHOOK_HALF_PORTABLE"



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


def supported_isas():
    """The targets this build and CPU run, lowest first (``'portable'`` always)."""
    cdef int mask = lh_isa_supported()
    return tuple(name for t, name in enumerate(_ISA_NAMES) if mask & (1 << t))


def set_isa(name):
    """Make ``name`` the process's target; return the previous target's name.

    ``name`` is ``'portable'``, ``'avx2'``, ``'avx512'`` or ``'avx512bf16'``,
    or ``None`` for the best this CPU supports.  A target this build or CPU
    cannot run is a ``ValueError`` that says what it needs, and changes
    nothing.  Calls already running finish on the target they read.
    """
    cdef int t
    if name is None:
        t = lh_isa_best()
    elif name in _ISA_NAMES:
        t = _ISA_NAMES.index(name)
        if not lh_isa_supported() & (1 << t):
            raise ValueError(f"the {name!r} instruction set is not available here (it needs an "
                             f"x86-64 build and a CPU with {lh_isa_needs(t).decode()})")
    else:
        raise ValueError(f"the instruction set must be one of {list(_ISA_NAMES)} or None, "
                         f"got {name!r}")
    old = _ISA_NAMES[lh_isa_active()]
    lh_isa_store(&_isa, t)
    return old


def isas():
    """The target in force and what this build and CPU can run.

    A dict: ``active`` and ``best`` (target names), ``supported`` (names,
    lowest first), ``needs`` (the CPU features each target requires) and
    ``env`` (the target the environment chose at import, or ``None``).
    """
    return {
        "active": _ISA_NAMES[lh_isa_active()],
        "best": _ISA_NAMES[lh_isa_best()],
        "supported": supported_isas(),
        "needs": {n: lh_isa_needs(t).decode() for t, n in enumerate(_ISA_NAMES)},
        "env": _env_isa,
    }


def isa_from_env(value, old_value=None):
    """The target named by ``LORAHOOK_ISA`` (``value``), or ``None`` for the best.

    Unset or empty: ``None``, unless ``LORAHOOK_HALF_PORTABLE`` (``old_value``)
    is ``'1'``, the older spelling of ``'portable'``.  A name that is not a
    target, a target this CPU cannot run, or an older value other than
    ``''``, ``'0'`` and ``'1'``, is a ``RuntimeWarning`` naming the variable
    and the default, which then applies.
    """
    v = (value or "").strip()
    if not v:
        old = (old_value or "").strip()
        if old == "1":
            return "portable"
        if old not in ("", "0"):
            warnings.warn(f"{_OLD_ENV}={old_value!r} is not '0' or '1'; using the default "
                          f"(the best instruction set this CPU supports)",
                          RuntimeWarning, stacklevel=2)
        return None
    if v not in supported_isas():
        why = ("is not available on this CPU" if v in _ISA_NAMES
               else f"is not one of {list(_ISA_NAMES)}")
        warnings.warn(f"{_ENV}={value!r} {why}; using the default (the best instruction set "
                      f"this CPU supports, {_ISA_NAMES[lh_isa_best()]!r})",
                      RuntimeWarning, stacklevel=2)
        return None
    return v


_env_isa = isa_from_env(os.environ.get(_ENV), os.environ.get(_OLD_ENV))
if _env_isa is not None:
    set_isa(_env_isa)
