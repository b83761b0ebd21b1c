"""The row-major BLAS shim (``blas.pxd``) against numpy in float64, through the tests' compiled entry points (``tests/support/_testing.pyx``).

Every kernel product goes through these four helpers, so each is checked on
its own: both transposition flags, contiguous rows and rows with a padded
stride (a slice of a wider array), and Fortran-ordered matrices, which are
row-major matrices of the transposed shape and reach the shim as such.
"""
import numpy as np
import pytest

from testing_core import core as _testing

RTOL, ATOL = 2e-5, 2e-5


@pytest.fixture
def rng():
    return np.random.default_rng(20261204)


def matrix(rng, shape, layout):
    """A float32 matrix of ``shape`` whose rows are contiguous, laid out as ``layout`` says.

    ``"C"``: C order; ``"padded"``: rows with a longer stride (a column slice of
    a wider array).  The ``"F"`` layout is made by the caller from a "C" one.
    """
    if layout == "C":
        return rng.standard_normal(shape).astype(np.float32)
    wide = rng.standard_normal((shape[0], shape[1] + 5)).astype(np.float32)
    return wide[:, 2:2 + shape[1]]


def as_row_major(a, trans):
    """``a`` given to the shim: a Fortran-ordered ``a`` is its row-major transpose, flag flipped."""
    if a.flags.c_contiguous or not a.flags.f_contiguous:
        return a, trans
    return a.T, not trans


@pytest.mark.parametrize("layout", ["C", "padded", "F"])
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("m, n", [(1, 1), (1, 7), (7, 1), (5, 9), (33, 17)])
def test_gemv(rng, layout, trans, m, n):
    a = matrix(rng, (m, n), "C" if layout == "F" else layout)
    if layout == "F":
        a = np.asfortranarray(a)
    x = rng.standard_normal(m if trans else n).astype(np.float32)
    y = rng.standard_normal(n if trans else m).astype(np.float32)
    alpha, beta = 0.75, -1.5
    expected = alpha * ((a.T if trans else a).astype(np.float64) @ x) + beta * y.astype(np.float64)
    shim_a, shim_trans = as_row_major(a, trans)
    _testing.blas_gemv(shim_trans, alpha, shim_a, x, beta, y)
    np.testing.assert_allclose(y, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", ["C", "padded", "F"])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 9, 4), (6, 1, 3), (7, 5, 11), (40, 24, 16)])
def test_gemm(rng, layout, trans_a, trans_b, m, n, k):
    def operand(rows, cols):
        mat = matrix(rng, (rows, cols), "C" if layout == "F" else layout)
        return np.asfortranarray(mat) if layout == "F" else mat

    a = operand(*((k, m) if trans_a else (m, k)))
    b = operand(*((n, k) if trans_b else (k, n)))
    c = matrix(rng, (m, n), "C" if layout == "F" else layout)  # the output stays row-major
    alpha, beta = -0.5, 0.25
    op_a = (a.T if trans_a else a).astype(np.float64)
    op_b = (b.T if trans_b else b).astype(np.float64)
    expected = alpha * (op_a @ op_b) + beta * c.astype(np.float64)
    shim_a, ta = as_row_major(a, trans_a)
    shim_b, tb = as_row_major(b, trans_b)
    untouched = c.base.copy() if c.base is not None else None
    _testing.blas_gemm(ta, tb, alpha, shim_a, shim_b, beta, c)
    np.testing.assert_allclose(c, expected, rtol=RTOL, atol=ATOL)
    if untouched is not None:  # the padding around a strided output is never written
        np.testing.assert_array_equal(c.base[:, :2], untouched[:, :2])
        np.testing.assert_array_equal(c.base[:, 2 + n:], untouched[:, 2 + n:])


def test_gemm_with_beta_zero_ignores_what_the_output_held(rng):
    a = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal((3, 5)).astype(np.float32)
    c = np.full((4, 5), np.nan, np.float32)
    _testing.blas_gemm(False, False, 1.0, a, b, 0.0, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [1, 3, 1000])
def test_axpy_and_scal(rng, n):
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    expected = 2.5 * x.astype(np.float64) + y
    _testing.blas_axpy(2.5, x, y)
    np.testing.assert_allclose(y, expected, rtol=RTOL, atol=ATOL)
    _testing.blas_scal(-3.0, y)
    np.testing.assert_allclose(y, -3.0 * expected, rtol=RTOL, atol=ATOL)


def test_the_entry_points_refuse_what_the_shim_cannot_take(rng):
    a = rng.standard_normal((4, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        _testing.blas_gemv(False, 1.0, a[:, ::2], np.zeros(2, np.float32), 0.0,
                           np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="x must be a contiguous float32 vector of 3 values"):
        _testing.blas_gemv(False, 1.0, a, np.zeros(4, np.float32), 0.0, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"op\(b\) must be \(3, 2\)"):
        _testing.blas_gemm(False, False, 1.0, a, np.zeros((2, 2), np.float32), 0.0,
                           np.zeros((4, 2), np.float32))
