# cython: language_level=3
"""Entry points of the compiled core for tests and benchmarks only (not part of lorahook).

Built by ``testing_core.py`` against the lorahook under test; nothing in the package calls these; they expose kernels and conversions in
shapes a test or a timing loop needs (a list of groups applied at once, a
conversion repeated without a Python call per pass, the state of the vector
registers after a conversion, the row-major BLAS helpers of ``blas.pxd``
called on numpy arrays).
"""
cimport numpy as cnp
from libc.stdint cimport uint16_t

from lorahook._core cimport blas as _blas
from lorahook._core.checks cimport check_buffers
from lorahook._core.halfconv cimport half_array, half_kind, narrow_n, widen_n
from lorahook._core.plans cimport GroupPlan

import numpy as np

cnp.import_array()

ctypedef void (*widen_fn)(const uint16_t *, float *, size_t, int) noexcept nogil
ctypedef void (*narrow_fn)(const float *, uint16_t *, size_t, int) noexcept nogil

cdef extern from "halfconv.h":
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
        if (lh_isa_supported() == (1 << LH_ISA_PORTABLE))
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

    ``groups`` is the list :class:`lorahook._core.plans.GroupPlan` takes.  The
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


# --------------------------------------------------------------------------- the BLAS shim


cdef int _row_stride(cnp.ndarray a, str name) except -1:
    """The row stride, in values, of a 2-D float32 matrix whose rows are contiguous."""
    if a.dtype != np.float32 or a.ndim != 2:
        raise ValueError(f"{name} must be a 2-D float32 array, got {a.dtype} with {a.ndim} dims")
    if a.shape[1] > 1 and a.strides[1] != 4:
        raise ValueError(f"{name}'s rows must be contiguous (stride 4 bytes), got {a.strides[1]}")
    if a.shape[0] <= 1:
        return max(1, a.shape[1])
    if a.strides[0] % 4 or a.strides[0] // 4 < a.shape[1]:
        raise ValueError(f"{name}'s row stride must be a multiple of 4 bytes covering a row, "
                         f"got {a.strides[0]}")
    return a.strides[0] // 4


cdef float *_vector(cnp.ndarray v, Py_ssize_t n, str name, bint write) except NULL:
    """A contiguous float32 vector of ``n`` values (``n`` < 0: any number)."""
    if v.dtype != np.float32 or v.ndim != 1 or not v.flags.c_contiguous or (
            n >= 0 and v.shape[0] != n):
        raise ValueError(f"{name} must be a contiguous float32 vector"
                         + (f" of {n} values" if n >= 0 else ""))
    if write and not v.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return <float *>cnp.PyArray_DATA(v)


def blas_gemv(bint trans, float alpha, cnp.ndarray a not None, cnp.ndarray x not None,
              float beta, cnp.ndarray y not None):
    """``y = alpha * op(a) @ x + beta * y`` through ``_blas.gemv`` (``a`` row-major, any row stride)."""
    cdef int lda = _row_stride(a, "a")
    cdef int m = a.shape[0], n = a.shape[1]
    cdef float *xp = _vector(x, m if trans else n, "x", False)
    cdef float *yp = _vector(y, n if trans else m, "y", True)
    with nogil:
        _blas.gemv(trans, m, n, alpha, <const float *>cnp.PyArray_DATA(a), lda, xp, beta, yp)


def blas_gemm(bint trans_a, bint trans_b, float alpha, cnp.ndarray a not None,
              cnp.ndarray b not None, float beta, cnp.ndarray c not None):
    """``c = alpha * op(a) @ op(b) + beta * c`` through ``_blas.gemm``, every matrix row-major."""
    cdef int lda = _row_stride(a, "a"), ldb = _row_stride(b, "b"), ldc = _row_stride(c, "c")
    cdef int m = c.shape[0], n = c.shape[1]
    cdef int k = a.shape[0] if trans_a else a.shape[1]
    if (a.shape[1] if trans_a else a.shape[0]) != m:
        raise ValueError(f"op(a) must have {m} rows, got shape {(<object>a).shape} (trans_a={trans_a})")
    if ((b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])) != (k, n):
        raise ValueError(f"op(b) must be ({k}, {n}), got shape {(<object>b).shape} (trans_b={trans_b})")
    if not c.flags.writeable:
        raise ValueError("c must be writable")
    with nogil:
        _blas.gemm(trans_a, trans_b, m, n, k, alpha, <const float *>cnp.PyArray_DATA(a), lda,
                   <const float *>cnp.PyArray_DATA(b), ldb, beta,
                   <float *>cnp.PyArray_DATA(c), ldc)


def blas_axpy(float alpha, cnp.ndarray x not None, cnp.ndarray y not None):
    """``y += alpha * x`` through ``_blas.axpy``."""
    cdef float *xp = _vector(x, -1, "x", False)
    cdef float *yp = _vector(y, x.shape[0], "y", True)
    with nogil:
        _blas.axpy(<int>x.shape[0], alpha, xp, yp)


def blas_scal(float alpha, cnp.ndarray x not None):
    """``x *= alpha`` through ``_blas.scal``."""
    cdef float *xp = _vector(x, -1, "x", True)
    with nogil:
        _blas.scal(<int>x.shape[0], alpha, xp)
