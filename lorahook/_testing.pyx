# cython: language_level=3
"""Entry points of the compiled core for tests and benchmarks only.

Nothing in the package calls these; they expose kernels and conversions in
shapes a test or a timing loop needs (a list of groups applied at once, a
conversion repeated without a Python call per pass, the state of the vector
registers after a conversion).
"""
cimport numpy as cnp
from libc.stdint cimport uint16_t

from lorahook._checks cimport check_buffers
from lorahook._halfconv cimport half_array, half_kind, narrow_n, widen_n
from lorahook._kernels cimport GroupPlan

import numpy as np

cnp.import_array()

ctypedef void (*widen_fn)(const uint16_t *, float *, size_t, int) noexcept nogil
ctypedef void (*narrow_fn)(const float *, uint16_t *, size_t, int) noexcept nogil

cdef extern from "_halfconv.h":
    pass

cdef extern from *:
    """
    /* Whether the fast paths leave the upper halves of the vector registers
       in use (XINUSE bits 2 and 6, read with XGETBV ECX=1), which would slow
       every later SSE instruction of the thread. */
    typedef void (*lorahook_widen_fn)(const uint16_t *, float *, size_t, int);
    typedef void (*lorahook_narrow_fn)(const float *, uint16_t *, size_t, int);
    #if LORAHOOK_HALF_X86
    #include <cpuid.h>
    static int lorahook_xinuse_upper(void) {
        unsigned int a, b, c, d, lo, hi;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))  /* OSXSAVE */
            return -1;
        if (!__get_cpuid_count(0xD, 1, &a, &b, &c, &d) || !(a & 4u))  /* XGETBV ECX=1 */
            return -1;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
        (void)hi;
        return (lo & 0x44u) != 0;
    }
    __attribute__((target("avx"))) static void lorahook_clear_upper(void) {
        _mm256_zeroupper();
    }
    /* -1: cannot tell; else whether the upper halves are in use after a
       narrow and a widen of n values through the given functions. */
    static int lorahook_upper_after(lorahook_narrow_fn narrow, lorahook_widen_fn widen,
                                    const float *f, uint16_t *h, float *w, size_t n, int kind) {
        if (lorahook_half_supported() == (1 << LORAHOOK_HALF_PORTABLE))
            return -1;
        lorahook_clear_upper();
        if (lorahook_xinuse_upper() != 0)
            return -1;
        narrow(f, h, n, kind);
        widen(h, w, n, kind);
        return lorahook_xinuse_upper();
    }
    #else
    static int lorahook_upper_after(lorahook_narrow_fn narrow, lorahook_widen_fn widen,
                                    const float *f, uint16_t *h, float *w, size_t n, int kind) {
        (void)narrow; (void)widen; (void)f; (void)h; (void)w; (void)n; (void)kind;
        return -1;
    }
    #endif
    """
    int lorahook_upper_after(narrow_fn narrow, widen_fn widen, const float *f, uint16_t *h,
                             float *w, size_t n, int kind) noexcept nogil


def apply_groups(list groups not None, input, output, Py_ssize_t n_rows,
                 Py_ssize_t d_in, Py_ssize_t d_out):
    """Apply several layers, each to its own rows of one batch.

    ``groups`` is the list :class:`lorahook._kernels.GroupPlan` takes.  The
    same as ``GroupPlan(groups, n_rows, d_in, d_out).apply(input, output)``,
    with the buffers checked first.
    """
    kind = check_buffers(input, output, n_rows, d_in, d_out)
    (<GroupPlan>GroupPlan(groups, n_rows, d_in, d_out)).run(<cnp.ndarray>input,
                                                            <cnp.ndarray>output, kind)


def half_repeat(src, out, kind, Py_ssize_t loops):
    """Convert ``src`` into ``out`` ``loops`` times without the GIL (for the benchmark).

    A ``float32`` ``src`` is narrowed into a ``uint16`` ``out``; a ``uint16``
    ``src`` is widened into a ``float32`` ``out``.  Both C-contiguous, of one
    size, not overlapping; ``out`` writable.  Timing this call measures the
    conversion as the kernels see it, without a Python call per row.
    """
    cdef int k = half_kind(kind)
    cdef bint narrow = isinstance(src, np.ndarray) and src.dtype == np.float32
    cdef cnp.ndarray a = half_array(src, np.float32 if narrow else np.uint16, "src")
    cdef cnp.ndarray b = half_array(out, np.uint16 if narrow else np.float32, "out")
    if not b.flags.writeable:
        raise ValueError("out must be writable, got a read-only array")
    if a.size != b.size:
        raise ValueError(f"out must have {a.size} values like src, got {b.size}")
    if np.may_share_memory(a, b):
        raise ValueError("src and out must not overlap")
    if loops < 0:
        raise ValueError(f"loops must be >= 0, got {loops}")
    cdef size_t n = <size_t>a.size
    cdef Py_ssize_t i
    cdef void *s = cnp.PyArray_DATA(a)
    cdef void *d = cnp.PyArray_DATA(b)
    if n == 0:
        return
    with nogil:
        for i in range(loops):
            if narrow:
                narrow_n(<const float *>s, <uint16_t *>d, n, k)
            else:
                widen_n(<const uint16_t *>s, <float *>d, n, k)


def half_upper_state_after(kind):
    """Whether a narrow and a widen on the active path leave the vector registers' upper halves in use.

    ``None`` when this CPU cannot tell (or has no vector path).  ``True`` is a
    performance bug: every later SSE instruction of the thread pays for it.
    """
    cdef int k = half_kind(kind)
    cdef cnp.ndarray f = np.linspace(-3, 3, 100, dtype=np.float32)
    cdef cnp.ndarray h = np.empty(100, dtype=np.uint16)
    cdef cnp.ndarray w = np.empty(100, dtype=np.float32)
    cdef int r = lorahook_upper_after(narrow_n, widen_n, <const float *>cnp.PyArray_DATA(f),
                                      <uint16_t *>cnp.PyArray_DATA(h),
                                      <float *>cnp.PyArray_DATA(w), 100, k)
    return None if r < 0 else bool(r)
