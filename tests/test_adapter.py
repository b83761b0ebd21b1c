"""LoraLayer / LoraAdapter and the compiled kernel, against a float64 numpy reference."""
import pickle
import threading
import time

import numpy as np
import pytest

from lorahook import apply_lora_rows, LoraAdapter, LoraLayer
from lorahook._core import segments as _segments


def close(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    peak = np.abs(ref).max(initial=0.0)
    err = np.abs(got - ref).max(initial=0.0)
    return err <= (1e-5 * peak if peak > 0 else 1e-6), (err, peak)


def make_layer(rng, rank, d_in, d_out, scale=0.7, bias=False):
    a = rng.standard_normal((rank, d_in))
    b = rng.standard_normal((d_out, rank))
    bv = rng.standard_normal(d_out) if bias else None
    return LoraLayer(a, b, scale, bv), a, b, bv


@pytest.fixture(params=["rowloop", "gemm"])
def path(request):
    old = _segments.set_gemm_crossover(10**9 if request.param == "rowloop" else 1)
    yield request.param
    _segments.set_gemm_crossover(old)


_SHAPES = [
    (0, 5, 7, 3),
    (1, 1, 1, 1),
    (4, 16, 1, 5),       # one output column
    (9, 4, 6, 7),        # rank above min(d_in, d_out)
    (8, 64, 48, 0),
    (8, 64, 48, 1),
    (16, 128, 96, 300),  # hundreds of rows
    (3, 33, 17, 129),
]
# a rank-0 layer cannot carry a bias
_CASES = [shape + (bias,) for shape in _SHAPES for bias in (False, True) if shape[0] or not bias]


@pytest.mark.parametrize("rank, d_in, d_out, n, bias", _CASES)
@pytest.mark.parametrize("flat", [True, False])
def test_matches_float64_reference(path, rank, d_in, d_out, n, flat, bias):
    rng = np.random.default_rng(rank * 1000 + d_in + n)
    layer, a, b, bv = make_layer(rng, rank, d_in, d_out, scale=-1.3, bias=bias)
    adapter = LoraAdapter({(2, "q_proj"): layer})
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y = rng.standard_normal((n, d_out)).astype(np.float32)
    # the reference uses the float32-rounded adapter values the layer holds
    a64, b64 = layer.a.astype(np.float64), layer.b.astype(np.float64)
    delta = -1.3 * (x.astype(np.float64) @ a64.T @ b64.T)
    if bias:
        delta += -1.3 * layer.bias.astype(np.float64)
    ref = y.astype(np.float64) + delta
    before = y.copy()
    xs, ys = (x.reshape(-1), y.reshape(-1)) if flat else (x, y)
    apply_lora_rows(adapter, 2, "q_proj", xs, ys, d_in, d_out)
    ok, info = close(y, ref)
    assert ok, info
    ok, info = close(y.astype(np.float64) - before, delta)
    assert ok, info
    assert adapter.is_active(2, "q_proj") == (rank > 0)


def test_missing_key_is_inactive_and_a_no_op():
    rng = np.random.default_rng(1)
    adapter = LoraAdapter({(0, "q_proj"): make_layer(rng, 4, 8, 8)[0]})
    assert not adapter.is_active(0, "k_proj") and not adapter.is_active(1, "q_proj")
    y = rng.standard_normal(16).astype(np.float32)
    before = y.copy()
    apply_lora_rows(adapter, 0, "k_proj", np.ones(16, np.float32), y, 8, 8)
    assert np.array_equal(y, before)


def test_width_mismatch_raises_and_writes_nothing():
    rng = np.random.default_rng(2)
    adapter = LoraAdapter({(0, "q_proj"): make_layer(rng, 4, 8, 6)[0]})
    x = np.ones((3, 8), np.float32)
    y = np.zeros((3, 12), np.float32)
    with pytest.raises(ValueError) as info:
        apply_lora_rows(adapter, 0, "q_proj", x.reshape(-1), y.reshape(-1), 8, 12)
    msg = str(info.value)
    assert "(8, 6)" in msg and "(8, 12)" in msg and "q_proj" in msg
    assert not y.any()


def test_single_row_apply_checks_lengths():
    rng = np.random.default_rng(3)
    layer, a, b, _ = make_layer(rng, 2, 4, 3, scale=2.0)
    adapter = LoraAdapter({(0, "v_proj"): layer})
    x = rng.standard_normal(4).astype(np.float32)
    y = np.zeros(3, np.float32)
    adapter.apply(0, "v_proj", x, y)
    ok, info = close(y, 2.0 * layer.b.astype(float) @ (layer.a.astype(float) @ x))
    assert ok, info
    with pytest.raises(ValueError, match="whole rows of input_row_width = 4"):
        adapter.apply(0, "v_proj", np.zeros(5, np.float32), y)
    with pytest.raises(ValueError, match="apply takes one row.*got 2 rows"):
        adapter.apply(0, "v_proj", np.zeros(8, np.float32), np.zeros(6, np.float32))


def test_adapter_properties_and_immutability():
    rng = np.random.default_rng(4)
    l1 = make_layer(rng, 4, 8, 8)[0]
    l2 = make_layer(rng, 2, 8, 16, bias=True)[0]
    adapter = LoraAdapter({(1, "q_proj"): l1, (0, "qury"): l2}, name="t", metadata={"base": "x"})
    assert adapter.num_adapted_layers == 2
    assert adapter.num_parameters == 4 * 16 + 2 * 24 + 16
    assert adapter.has_adapter(1, "q_proj") and not adapter.has_adapter(1, "k_proj")
    assert adapter.validate_modules({"q_proj", "k_proj"}) == [(0, "qury")]
    with pytest.raises(TypeError):
        adapter.layers[(2, "x")] = l1
    with pytest.raises(AttributeError):
        adapter.name = "other"
    meta = adapter.metadata
    meta["base"] = "changed"
    assert adapter.metadata == {"base": "x"}
    with pytest.raises(TypeError):
        LoraAdapter({(0, "q"): "not a layer"})
    with pytest.raises(TypeError):
        LoraAdapter({("0", "q"): l1})


def test_scaled_shares_arrays():
    rng = np.random.default_rng(5)
    layer = make_layer(rng, 3, 5, 4, scale=0.5)[0]
    adapter = LoraAdapter({(0, "q"): layer})
    s = adapter.scaled(-2.0)
    assert s.layers[(0, "q")].scale == -1.0
    assert s.layers[(0, "q")].a is layer.a
    assert adapter.layers[(0, "q")].scale == 0.5


def test_pickle_round_trip_keeps_results():
    rng = np.random.default_rng(6)
    layer = make_layer(rng, 4, 12, 10, bias=True)[0]
    adapter = LoraAdapter({(3, "up_proj"): layer}, name="p", metadata={"k": "v"},
                          module_paths={(3, "up_proj"): "model.layers.3.mlp.up_proj"})
    clone = pickle.loads(pickle.dumps(adapter))
    assert clone.name == "p" and clone.metadata == {"k": "v"}
    assert clone.module_paths[(3, "up_proj")] == "model.layers.3.mlp.up_proj"
    x = rng.standard_normal((5, 12)).astype(np.float32)
    y1 = np.zeros((5, 10), np.float32)
    y2 = np.zeros((5, 10), np.float32)
    apply_lora_rows(adapter, 3, "up_proj", x, y1, 12, 10)
    apply_lora_rows(clone, 3, "up_proj", x, y2, 12, 10)
    assert np.array_equal(y1, y2) and y1.any()


def test_subclass_overriding_apply_uses_the_row_loop():
    calls = []

    class Counting(LoraAdapter):
        def apply(self, layer_idx, module, x, output):
            calls.append(1)
            super().apply(layer_idx, module, x, output)

    rng = np.random.default_rng(7)
    layer = make_layer(rng, 2, 4, 4)[0]
    adapter = Counting({(0, "q"): layer})
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = np.zeros((6, 4), np.float32)
    apply_lora_rows(adapter, 0, "q", x, y, 4, 4)
    assert len(calls) == 6
    ref = 0.7 * x.astype(float) @ layer.a.astype(float).T @ layer.b.astype(float).T
    assert close(y, ref)[0]


def test_gil_is_released_during_a_long_call():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    rng = np.random.default_rng(8)
    d, rank, n = 1024, 64, 20000
    adapter = LoraAdapter({(0, "q"): make_layer(rng, rank, d, d)[0]})
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = np.zeros((n, d), np.float32)
    ticks = []
    done = threading.Event()

    def call():
        try:
            apply_lora_rows(adapter, 0, "q", x, y, d, d)
        finally:
            done.set()

    old = _segments.set_gemm_crossover(10**9)  # the row loop: one long GIL-free call
    try:
        with threadpoolctl.threadpool_limits(1, user_api="blas"):
            worker = threading.Thread(target=call)
            worker.start()
            time.sleep(0.01)
            while not done.is_set():
                ticks.append(time.perf_counter())
                time.sleep(0.001)
            worker.join()
    finally:
        _segments.set_gemm_crossover(old)
    # the call must have taken a while, and this thread ran throughout it
    assert len(ticks) >= 20, f"main thread ticked only {len(ticks)} times during the call"
    gaps = np.diff(ticks)
    assert gaps.max() < 0.25, f"the main thread stalled for {gaps.max():.3f} s"


def test_a_second_init_is_refused_before_it_changes_anything():
    rng = np.random.default_rng(5)
    first = {(0, "q_proj"): LoraLayer(rng.standard_normal((2, 8)), rng.standard_normal((6, 2)))}
    other = {(1, "v_proj"): LoraLayer(rng.standard_normal((2, 8)), rng.standard_normal((6, 2)))}
    adapter = LoraAdapter(first, name="first")
    with pytest.raises(TypeError, match="immutable"):
        adapter.__init__(other, name="other")
    assert list(adapter.layers) == [(0, "q_proj")] and adapter.name == "first"
    assert adapter.has_adapter(0, "q_proj") and not adapter.has_adapter(1, "v_proj")
    x = rng.standard_normal((3, 8)).astype(np.float32)
    y = np.zeros((3, 6), np.float32)
    apply_lora_rows(adapter, 0, "q_proj", x, y)
    layer = first[(0, "q_proj")]
    ref = x.astype(np.float64) @ layer.a.T.astype(np.float64) @ layer.b.T.astype(np.float64)
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_numpy_str_module_names_are_module_names():
    rng = np.random.default_rng(6)
    adapter = LoraAdapter({(0, "q_proj"): LoraLayer(rng.standard_normal((2, 8)),
                                                     rng.standard_normal((6, 2)))})
    x = rng.standard_normal((4, 8)).astype(np.float32)
    got = np.zeros((4, 6), np.float32)
    apply_lora_rows(adapter, np.int64(0), np.str_("q_proj"), x, got)
    layer = adapter.layers[(0, "q_proj")]
    ref = x.astype(np.float64) @ layer.a.T.astype(np.float64) @ layer.b.T.astype(np.float64)
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))
