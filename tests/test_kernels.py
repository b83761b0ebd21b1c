"""lorahook._core.plans: LayerKernel and GroupPlan on their own, against float64 numpy.

Both paths of the segment kernels run (the row loop below the crossover, the
batched routine at or above it), for float32 and 16-bit weights.
"""
import numpy as np
import pytest

from lorahook._core import segments as _segments
from lorahook._core.halfconv import narrow
from lorahook._core.plans import LORA, GroupPlan, LayerKernel, apply_layer


@pytest.fixture(params=["row_loop", "batched"])
def path(request):
    old = _segments.set_gemm_crossover(10**9 if request.param == "row_loop" else 1)
    yield request.param
    _segments.set_gemm_crossover(old)


def factors(rng, rank=4, d_in=12, d_out=10):
    return (rng.standard_normal((rank, d_in)).astype(np.float32),
            rng.standard_normal((rank, d_out)).astype(np.float32))


def widened(v, weights):
    """float32 values, or 16-bit patterns (uint16), as float64 (numpy's own conversions)."""
    if weights == "float32":
        return v.astype(np.float64)
    if weights == "float16":
        return v.view(np.float16).astype(np.float64)
    return (v.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def assert_near(got, ref, rel=1e-5):
    ref = np.asarray(ref, np.float64)
    assert np.abs(np.asarray(got, np.float64) - ref).max() <= rel * max(np.abs(ref).max(), 1.0)


@pytest.mark.parametrize("weights", ["float32", "float16", "bfloat16"])
def test_a_layer_kernel_adds_its_delta_and_bias(path, weights):
    rng = np.random.default_rng(0)
    a, bt = factors(rng)
    bias = rng.standard_normal(10).astype(np.float32)
    if weights != "float32":  # the 16-bit patterns the kernel widens per call
        a, bt, bias = (narrow(v, weights) for v in (a, bt, bias))
    kernel = LayerKernel(a, bt, 0.5, bias, weights)
    assert (kernel.rank, kernel.d_in, kernel.d_out, kernel.kind) == (4, 12, 10, LORA)
    wide = [widened(v, weights) for v in (a, bt, bias)]
    x = rng.standard_normal((40, 12)).astype(np.float32)
    y = rng.standard_normal((40, 10)).astype(np.float32)
    ref = y + 0.5 * (x.astype(np.float64) @ wide[0].T @ wide[1] + wide[2])
    apply_layer(kernel, x, y, 40)
    assert_near(y, ref)


def test_a_plan_runs_each_group_on_its_rows_only(path):
    rng = np.random.default_rng(1)
    (a1, b1), (a2, b2) = factors(rng), factors(rng, rank=2)
    k1, k2 = LayerKernel(a1, b1, 1.0), LayerKernel(a2, b2, 2.0)
    rows1 = np.array([0, 3, 4, 9], np.int32)
    rows2 = np.array([1, 3, 7], np.int32)
    scales2 = np.array([1.0, 0.5, -2.0], np.float32)
    plan = GroupPlan([(k1, 1.0, rows1, None), (k2, 2.0, rows2, scales2)], 10, 12, 10)
    x = rng.standard_normal((10, 12)).astype(np.float32)
    y = np.zeros((10, 10), np.float32)
    plan.apply(x, y)
    ref = np.zeros((10, 10))
    x64 = x.astype(np.float64)
    ref[rows1] += x64[rows1] @ a1.T.astype(np.float64) @ b1.astype(np.float64)
    ref[rows2] += (scales2[:, None] * x64[rows2]) @ a2.T.astype(np.float64) @ b2.astype(np.float64)
    assert_near(y, ref)
    untouched = np.setdiff1d(np.arange(10), np.union1d(rows1, rows2))
    assert not y[untouched].any()  # rows no group names are never written


@pytest.mark.parametrize("rows, match", [
    (np.array([2, 1], np.int32), "strictly ascending"),
    (np.array([0, 10], np.int32), r"\[0, 10\)"),
    (np.array([0, 1], np.int64), "int32"),
])
def test_a_plan_refuses_bad_rows(rows, match):
    a, bt = factors(np.random.default_rng(2))
    with pytest.raises((TypeError, ValueError), match=match):
        GroupPlan([(LayerKernel(a, bt, 1.0), 1.0, rows, None)], 10, 12, 10)


def test_a_kernel_refuses_factors_that_do_not_fit():
    a, bt = factors(np.random.default_rng(3))
    with pytest.raises(ValueError, match="bt must have shape"):
        LayerKernel(a, bt[:3], 1.0)
    with pytest.raises(ValueError, match="weights must be"):
        LayerKernel(a, bt, 1.0, weights="int4")
    with pytest.raises(ValueError, match="int8 weights take scales"):
        LayerKernel(a.astype(np.int8), bt.astype(np.int8), 1.0, weights="int8")
    with pytest.raises(ValueError, match="float32 weights take no scales"):
        LayerKernel(a, bt, 1.0, scales=(np.ones(a.shape[0], np.float32),) * 2)
    with pytest.raises(ValueError, match="int8 scales must have shapes"):
        LayerKernel(a.astype(np.int8), bt.astype(np.int8), 1.0, weights="int8",
                    scales=(np.ones(a.shape[0], np.float32), np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="does not match the call"):
        GroupPlan([(LayerKernel(a, bt, 1.0), 1.0, None, None)], 4, 12, 11)
