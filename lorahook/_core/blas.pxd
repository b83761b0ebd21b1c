# cython: language_level=3
"""Row-major BLAS for the kernels: SciPy's Fortran BLAS behind C-order helpers.

A row-major ``(m, n)`` matrix with row stride ``ld`` is the column-major
``(n, m)`` matrix with leading dimension ``ld``, so each helper swaps the
operands and transposition flags once, here, and the kernels speak of their
arrays in the layout they keep them in.  Arguments are passed by value; the
Fortran interface's pointers (and its lack of ``const``) stay in this file.
Every helper is ``nogil`` and inlined into the module that uses it.
"""
from scipy.linalg.cython_blas cimport saxpy, sgemm, sgemv, sscal


cdef inline void gemv(bint trans, int m, int n, float alpha, const float *a, int lda,
                      const float *x, float beta, float *y) noexcept nogil:
    """``y = alpha * op(a) @ x + beta * y``, ``a`` row-major ``(m, n)`` with row stride ``lda``.

    ``op(a)`` is ``a`` (``x`` has ``n`` values, ``y`` ``m``) or, with
    ``trans``, ``a.T`` (``x`` has ``m`` values, ``y`` ``n``).
    """
    cdef char t = b'N' if trans else b'T'
    cdef int one = 1
    sgemv(&t, &n, &m, &alpha, <float *>a, &lda, <float *>x, &one, &beta, y, &one)


cdef inline void gemm(bint trans_a, bint trans_b, int m, int n, int k, float alpha,
                      const float *a, int lda, const float *b, int ldb, float beta,
                      float *c, int ldc) noexcept nogil:
    """``c = alpha * op(a) @ op(b) + beta * c``, every matrix row-major.

    ``c`` is ``(m, n)`` with row stride ``ldc``; ``op(a)`` is ``(m, k)``
    (``a`` itself, or with ``trans_a`` the transpose of a ``(k, m)`` ``a``),
    ``op(b)`` is ``(k, n)`` likewise; ``lda`` / ``ldb`` are the row strides of
    ``a`` and ``b`` as stored.
    """
    # row-major C = A B  <=>  column-major C^T = B^T A^T: operands swapped
    cdef char ta = b'T' if trans_a else b'N'
    cdef char tb = b'T' if trans_b else b'N'
    sgemm(&tb, &ta, &n, &m, &k, &alpha, <float *>b, &ldb, <float *>a, &lda, &beta, c, &ldc)


cdef inline void axpy(int n, float alpha, const float *x, float *y) noexcept nogil:
    """``y += alpha * x`` over ``n`` contiguous values."""
    cdef int one = 1
    saxpy(&n, &alpha, <float *>x, &one, y, &one)


cdef inline void scal(int n, float alpha, float *x) noexcept nogil:
    """``x *= alpha`` over ``n`` contiguous values."""
    cdef int one = 1
    sscal(&n, &alpha, x, &one)
