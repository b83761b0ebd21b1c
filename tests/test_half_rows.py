"""Half-precision rows and adapters (guide: Half precision).

Rows of float16 or bfloat16 (``ml_dtypes.bfloat16``) go through a
``LoraAdapter``, a bound batch and a sequence-bound hook; every output must be
within one unit in the last place of the output dtype of the float64 result
(plus the float32 bound of section 0), rows without an adapter bit-identical,
and mixed dtypes a ``TypeError`` with nothing written.  Both conversion paths
(the CPU's instructions and the portable one) are run.
"""
import pickle

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from lorahook import (AdapterSet, apply_lora_rows, LoraAdapter, LoraHook, LoraLayer)  # noqa: E402
from lorahook._core import halfconv as _halfconv  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPES = [F16, BF16]
KEY = (2, "up_proj")
D_IN, D_OUT = 48, 72


@pytest.fixture(params=["best", "portable"])
def path(request):
    old = _halfconv.set_isa("portable") if request.param == "portable" else None
    yield request.param
    if old is not None:
        _halfconv.set_isa(old)


def _layer(rng, rank=8, scale=0.75, bias=False):
    return LoraLayer(rng.standard_normal((rank, D_IN)) / 4, rng.standard_normal((D_OUT, rank)) / 2,
                     scale, rng.standard_normal(D_OUT) if bias else None)


def _delta64(layer, x):
    a = layer.a.astype(np.float64)
    b = layer.b.astype(np.float64)
    d = (np.asarray(x, dtype=np.float64) @ a.T) @ b.T
    if layer.bias is not None:
        d = d + layer.bias
    return layer.scale * d


def _ulp(ref, dt):
    """One unit in the last place of ``dt`` at each value of ``ref`` (float64)."""
    return np.spacing(np.abs(ref).astype(dt)).astype(np.float64)


def _assert_within_one_ulp(got, ref, dt):
    if not np.size(ref):
        return
    got = got.astype(np.float64)
    bound = _ulp(ref, dt) + 1e-5 * np.max(np.abs(ref))
    err = np.abs(got - ref)
    assert (err <= bound).all(), f"max err/ulp {np.max(err / _ulp(ref, dt)):.3g}"


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 3, 31, 32, 300])
@pytest.mark.parametrize("flat", [False, True])
def test_adapter_rows_within_one_ulp(path, dt, n, flat):
    rng = np.random.default_rng(n)
    layer = _layer(rng, bias=n % 2 == 1)
    adapter = LoraAdapter({KEY: layer})
    x = rng.standard_normal((n, D_IN)).astype(dt)
    y0 = rng.standard_normal((n, D_OUT)).astype(dt)
    y = y0.copy()
    xs, ys = (x.reshape(-1), y.reshape(-1)) if flat else (x, y)
    apply_lora_rows(adapter, *KEY, xs, ys, D_IN, D_OUT)
    assert y.dtype == dt
    _assert_within_one_ulp(y, y0.astype(np.float64) + _delta64(layer, x), dt)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("n", [4, 40, 200])
def test_bound_batches_and_sequences_with_half_rows(path, dt, n):
    rng = np.random.default_rng(n + 1)
    s = AdapterSet()
    layers = {"a": _layer(rng, 4, 2.0), "b": _layer(rng, 16, 0.5, bias=True)}
    for name, layer in layers.items():
        s.add(name, LoraAdapter({KEY: layer}))
    rows = [["a", None, "b", "a"][i % 4] for i in range(n)]
    x = rng.standard_normal((n, D_IN)).astype(dt)
    y0 = rng.standard_normal((n, D_OUT)).astype(dt)
    for hook, names in ((s.bind(rows), rows),
                        (s.bind_sequences(["b", None, "a", "a"]),
                         [["b", None, "a", "a"][i // (n // 4)] for i in range(n)])):
        y = y0.copy()
        apply_lora_rows(hook, *KEY, x, y, D_IN, D_OUT)
        for i, name in enumerate(names):
            if name is None:
                assert y[i].tobytes() == y0[i].tobytes()  # bit-identical
            else:
                ref = y0[i].astype(np.float64) + _delta64(layers[name], x[i:i + 1])[0]
                _assert_within_one_ulp(y[i], ref, dt)


@pytest.mark.parametrize("pair", [(np.float32, F16), (F16, np.float32), (BF16, F16),
                                  (F16, BF16), (np.float32, BF16)], ids=str)
def test_mixed_dtypes_are_a_type_error_naming_both_with_nothing_written(pair):
    rng = np.random.default_rng(2)
    adapter = LoraAdapter({KEY: _layer(rng)})
    x = np.ones((3, D_IN), pair[0])
    y = np.zeros((3, D_OUT), pair[1])
    with pytest.raises(TypeError, match="share one dtype.*input .* and output "):
        apply_lora_rows(adapter, *KEY, x, y, D_IN, D_OUT)
    assert not y.astype(np.float32).any()


def test_python_hooks_take_float32_rows_only():
    class Hook(LoraHook):
        def apply(self, layer_idx, module, x, output):  # pragma: no cover - never called
            output += 1

    y = np.zeros((2, 4), F16)
    with pytest.raises(TypeError, match="float32 rows only"):
        apply_lora_rows(Hook(), 0, "q", np.ones((2, 4), F16), y, 4, 4)
    assert not y.astype(np.float32).any()


def test_other_dtypes_stay_refused():
    adapter = LoraAdapter({KEY: _layer(np.random.default_rng(3))})
    for dt in (np.float64, np.int16, np.uint16):
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            apply_lora_rows(adapter, *KEY, np.ones((1, D_IN), dt), np.ones((1, D_OUT), dt),
                            D_IN, D_OUT)


def test_fast_and_portable_paths_give_the_same_bits():
    paths = _halfconv.isas()
    rng = np.random.default_rng(4)
    adapter = LoraAdapter({KEY: _layer(rng, bias=True)})
    for dt in DTYPES:
        x = rng.standard_normal((64, D_IN)).astype(dt)
        y0 = rng.standard_normal((64, D_OUT)).astype(dt)
        outs = []
        for name in ("portable", paths["active"]):
            old = _halfconv.set_isa(name)
            try:
                y = y0.copy()
                apply_lora_rows(adapter, *KEY, x, y, D_IN, D_OUT)
                outs.append(y.view(np.uint16).copy())
            finally:
                _halfconv.set_isa(old)
        assert np.array_equal(outs[0], outs[1])


# --------------------------------------------------------------------------- half adapters


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_astype_keeps_arrays_in_the_dtype_and_halves_nbytes(path, dt):
    rng = np.random.default_rng(5)
    full = LoraAdapter({KEY: _layer(rng, 16, bias=True), (0, "q_proj"): _layer(rng, 4)})
    half = full.astype(dt)
    assert half.nbytes * 2 == full.nbytes  # a, b and the bias, each value in 16 bits
    for key, layer in half.layers.items():
        assert layer.a.dtype == dt and layer.b.dtype == dt and not layer.a.flags.writeable
        assert layer.bias is None or layer.bias.dtype == dt
        np.testing.assert_array_equal(layer.a, full.layers[key].a.astype(dt))  # round to nearest
    x = rng.standard_normal((40, D_IN)).astype(np.float32)
    for n in (1, 40):
        y = np.zeros((n, D_OUT), np.float32)
        apply_lora_rows(half, *KEY, x[:n], y, D_IN, D_OUT)
        ref = _delta64(half.layers[KEY], x[:n])  # from the rounded arrays
        assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))
    # float32 results from delta_weight, in float32
    dw = half.delta_weight(*KEY)
    layer = half.layers[KEY]
    ref = layer.scale * layer.b.astype(np.float64) @ layer.a.astype(np.float64)
    assert dw.dtype == np.float32 and np.max(np.abs(dw - ref)) <= 1e-5 * np.max(np.abs(ref))
    back = pickle.loads(pickle.dumps(half, protocol=5))
    assert back.layers[KEY].a.dtype == dt and not back.layers[KEY].a.flags.writeable
    assert half.astype(np.float32).layers[KEY].a.dtype == np.float32
    # an adapter already in the dtype is itself (immutable: no copy, no new object)
    assert half.astype(dt) is half and full.astype(np.float32) is full
    mixed = LoraAdapter({KEY: half.layers[KEY], (0, "q_proj"): full.layers[(0, "q_proj")]})
    assert mixed.astype(dt) is not mixed and mixed.astype(dt).layers[KEY] is half.layers[KEY]


def test_astype_refuses_other_dtypes():
    adapter = LoraAdapter({KEY: _layer(np.random.default_rng(6))})
    for bad in (np.float64, np.uint8, "float8"):
        with pytest.raises(TypeError, match="float32, float16, bfloat16 or int8"):
            adapter.astype(bad)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_half_adapter_files_round_trip(tmp_path, dt):
    rng = np.random.default_rng(7)
    half = LoraAdapter({(1, "q_proj"): LoraLayer(rng.standard_normal((4, 32)),
                                                 rng.standard_normal((24, 4)))}).astype(dt)
    half.save_peft(tmp_path / "a", architecture="llama")
    from lorahook.files.safetensors_file import read_safetensors_header
    tensors = read_safetensors_header(tmp_path / "a" / "adapter_model.safetensors")[0]
    assert {t["dtype"] for t in tensors.values()} == {"F16" if dt == F16 else "BF16"}
    again = LoraAdapter.from_peft(tmp_path / "a", dtype=dt)
    widened = LoraAdapter.from_peft(tmp_path / "a")
    layer = half.layers[(1, "q_proj")]
    assert again.layers[(1, "q_proj")].a.view(np.uint16).tobytes() == layer.a.view(np.uint16).tobytes()
    assert widened.layers[(1, "q_proj")].a.dtype == np.float32
    np.testing.assert_array_equal(widened.layers[(1, "q_proj")].a, layer.a.astype(np.float32))
