"""Adapters held in int8 (guide: Many adapters, int8), against float64 numpy.

The kernels must give, to float32 accuracy (SPEC section 0's bound), what
float64 gives on the dequantized weights ``A = a_scale[:, None] * a``, ``B =
b_scale[:, None] * b``: in float32 and 16-bit rows (16-bit outputs within one
unit in the last place), at every row count (one row, the few-row steps, many
rows), through one adapter, a bound batch mixing adapters, per-row scales,
embeddings and on both code paths (the CPU's vector instructions and plain C).
Quantization is symmetric and to nearest; hostile values are refused or
handled as documented; bytes are counted as held.
"""
import pickle

import numpy as np
import pytest

from lorahook import (AdapterSet, LoraAdapter, LoraLayer, apply_lora_embedding, apply_lora_rows,
                      blend)

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
KEY = (1, "q_proj")


# ``path``: the vector code (AVX2 + FMA where the CPU has it) and plain C, chosen with the
# half-precision conversions' path (the portable one runs int8 factors in plain C)
from test_half_rows import path  # noqa: E402,F401  (a fixture)


def int8_layer(rng, rank, d_in, d_out, scale=0.5, bias=False):
    layer = LoraLayer(rng.standard_normal((rank, d_in)) / 4, rng.standard_normal((d_out, rank)),
                      scale, rng.standard_normal(d_out) if bias else None)
    return layer.astype("int8")


def factors64(layer):
    """The dequantized factors, exactly, in float64."""
    return (layer.a_scale.astype(np.float64)[:, None] * layer.a,
            layer.b_scale.astype(np.float64)[:, None] * layer.b)


def delta64(layer, x):
    a, b = factors64(layer)
    d = (np.asarray(x, np.float64) @ a.T) @ b.T
    if layer.bias is not None:
        d = d + layer.bias
    return layer.scale * d


def assert_float32_close(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if ref.size:
        assert np.abs(got - ref).max() <= 1e-5 * max(np.abs(ref).max(), 1e-1)


def assert_within_one_ulp(got, ref, dt):
    ulp = np.spacing(np.abs(ref).astype(dt)).astype(np.float64)
    err = np.abs(got.astype(np.float64) - ref)
    assert (err <= ulp + 1e-5 * np.abs(ref).max()).all(), f"max err/ulp {np.max(err / ulp):.3g}"


# shapes with remainders for every step of the vector code: d_in and d_out not
# multiples of 8 or 16, ranks not multiples of 2 or 4
SHAPES = [(1, 1, 1), (3, 5, 7), (8, 64, 64), (5, 37, 70), (16, 257, 131), (64, 512, 1024)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9, 40, 300])
def test_float32_rows_equal_float64_on_the_dequantized_weights(path, shape, n):
    rng = np.random.default_rng(n + sum(shape))
    layer = int8_layer(rng, *shape, bias=n % 2 == 1)
    adapter = LoraAdapter({KEY: layer})
    _, d_in, d_out = shape
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y0 = rng.standard_normal((n, d_out)).astype(np.float32)
    y = y0.copy()
    apply_lora_rows(adapter, *KEY, x, y, d_in, d_out)
    assert_float32_close(y - y0.astype(np.float64), delta64(layer, x))


@pytest.mark.parametrize("dt", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("n", [1, 3, 6, 70])
def test_half_rows_within_one_ulp(path, dt, n):
    rng = np.random.default_rng(n)
    layer = int8_layer(rng, 8, 45, 67, bias=True)
    x = rng.standard_normal((n, 45)).astype(dt)
    y0 = rng.standard_normal((n, 67)).astype(dt)
    y = y0.copy()
    apply_lora_rows(LoraAdapter({KEY: layer}), *KEY, x, y, 45, 67)
    assert y.dtype == dt
    assert_within_one_ulp(y, y0.astype(np.float64) + delta64(layer, x), dt)


@pytest.mark.parametrize("n", [5, 64, 257])
def test_a_bound_batch_mixes_int8_float32_and_16_bit_adapters(path, n):
    rng = np.random.default_rng(3)
    s = AdapterSet()
    layers = {"q8": int8_layer(rng, 4, 48, 72, 2.0),
              "r8": int8_layer(rng, 16, 48, 72, 0.5, bias=True),
              "f32": LoraLayer(rng.standard_normal((8, 48)), rng.standard_normal((72, 8)), 0.25),
              "bf16": LoraLayer(rng.standard_normal((2, 48)), rng.standard_normal((72, 2))
                                ).astype(BF16)}
    for name, layer in layers.items():
        s.add(name, LoraAdapter({KEY: layer}))
    names = ["q8", None, "r8", "f32", "q8", "bf16"]
    rows = [names[i % len(names)] for i in range(n)]
    x = rng.standard_normal((n, 48)).astype(np.float32)
    y0 = rng.standard_normal((n, 72)).astype(np.float32)
    y = y0.copy()
    apply_lora_rows(s.bind(rows), *KEY, x, y, 48, 72)
    for i, name in enumerate(rows):
        if name is None:
            assert y[i].tobytes() == y0[i].tobytes()
            continue
        layer = layers[name]
        if layer.dtype == np.int8:
            ref = delta64(layer, x[i:i + 1])[0]
        else:
            a, b = (layer.a.astype(np.float64), layer.b.astype(np.float64))
            ref = layer.scale * (b @ (a @ x[i].astype(np.float64)))
        assert_float32_close(y[i] - y0[i].astype(np.float64), ref)


def test_per_row_scales(path):
    rng = np.random.default_rng(4)
    s = AdapterSet()
    layers = {"a": int8_layer(rng, 4, 40, 24), "b": int8_layer(rng, 6, 40, 24, bias=True)}
    for name, layer in layers.items():
        s.add(name, LoraAdapter({KEY: layer}))
    n = 9
    rows = ["a", "b", "b"] * 3
    scales = rng.uniform(-2, 2, n)
    x = rng.standard_normal((n, 40)).astype(np.float32)
    y0 = rng.standard_normal((n, 24)).astype(np.float32)
    y = y0.copy()
    apply_lora_rows(s.bind(rows, scales=list(scales)), *KEY, x, y, 40, 24)
    for i, name in enumerate(rows):
        ref = float(np.float32(scales[i])) * delta64(layers[name], x[i:i + 1])[0]
        assert_float32_close(y[i] - y0[i].astype(np.float64), ref)


@pytest.mark.parametrize("n", [1, 5, 70])
def test_embedding_rows_equal_float64(path, n):
    rng = np.random.default_rng(n)
    layer = LoraLayer(rng.standard_normal((3, 50)), rng.standard_normal((12, 3)), 0.5,
                      embedding=True).astype("int8")
    adapter = LoraAdapter({(None, "embed_tokens"): layer})
    ids = rng.integers(0, 50, n)
    base = rng.standard_normal((n, 12)).astype(np.float32)
    out = base.copy()
    apply_lora_embedding(adapter, None, "embed_tokens", ids.astype(np.int32), out)
    a, b = factors64(layer)
    assert_float32_close(out - base.astype(np.float64), 0.5 * (b @ a[:, ids]).T)


def test_a_dora_layer_in_int8_runs_on_its_dequantized_factors():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((4, 20)) / 4, rng.standard_normal((16, 4))
    w, wb = rng.standard_normal((16, 20)), rng.standard_normal(16)
    m = rng.uniform(0.5, 2.0, 16)
    layer = LoraLayer(a, b, 0.5, magnitude=m).astype("int8").with_base(w, wb)
    assert layer.dtype == np.int8
    a64, b64 = factors64(layer)
    full = w + 0.5 * b64 @ a64
    g = m / np.linalg.norm(full, axis=1)
    x = rng.standard_normal((3, 20)).astype(np.float32)
    y0 = (x.astype(np.float64) @ w.T + wb).astype(np.float32)
    y = y0.copy()
    apply_lora_rows(LoraAdapter({KEY: layer}), *KEY, x, y, 20, 16)
    ref = g * (x.astype(np.float64) @ full.T) + wb
    assert_float32_close(y, ref)


# --- quantization ------------------------------------------------------------

def test_quantization_is_symmetric_to_nearest_with_one_scale_per_row_of_a_and_output_of_b():
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((8, 100)), rng.standard_normal((30, 8)) * 3
    layer = LoraLayer(a, b).astype("int8")
    assert layer.a.dtype == layer.b.dtype == np.int8
    assert layer.a_scale.shape == (8,) and layer.b_scale.shape == (30,)
    a32, b32 = a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(layer.a_scale, (np.abs(a32).max(1) / 127).astype(np.float32))
    np.testing.assert_array_equal(layer.b_scale, (np.abs(b32).max(1) / 127).astype(np.float32))
    for q, s, v in ((layer.a, layer.a_scale, a32), (layer.b, layer.b_scale, b32)):
        assert np.abs(q.astype(int)).max(axis=1).tolist() == [127] * q.shape[0]
        # to nearest: no other int8 value is closer to the float32 value
        err = np.abs(q * s.astype(np.float64)[:, None] - v)
        assert (err <= s.astype(np.float64)[:, None] / 2 * (1 + 1e-6)).all()
    assert LoraLayer(a, b).a_scale is None and LoraLayer(a, b).b_scale is None


def test_zero_and_subnormal_rows_and_columns():
    a = np.ones((3, 6), np.float32)
    a[1] = 0.0
    a[2] = np.float32(1e-44)  # subnormal: its scale rounds to zero in float32
    b = np.ones((4, 3), np.float32)
    b[2] = 0.0
    b[3] = np.float32(3e-39) * np.array([1, -1, 0.5])  # subnormal, representable scale
    layer = LoraLayer(a, b).astype("int8")
    assert layer.a_scale[1] == 0 and not layer.a[1].any()
    assert layer.a_scale[2] == 0 and not layer.a[2].any()
    assert layer.b_scale[2] == 0 and not layer.b[2].any()
    assert np.isfinite(layer.b_scale).all() and np.abs(layer.b[3].astype(int)).max() <= 127
    back = layer.astype(np.float32)
    assert np.isfinite(back.a).all() and np.isfinite(back.b).all()
    np.testing.assert_allclose(back.b[3], b[3], rtol=0, atol=3e-39 / 127)
    x = np.ones((2, 6), np.float32)
    y = np.zeros((2, 4), np.float32)
    apply_lora_rows(LoraAdapter({KEY: layer}), *KEY, x, y, 6, 4)
    assert np.isfinite(y).all()
    assert_float32_close(y, delta64(layer, x))


def test_a_rank_zero_layer_converts():
    layer = LoraLayer(np.zeros((0, 4)), np.zeros((5, 0))).astype("int8")
    assert layer.rank == 0 and layer.a_scale.shape == (0,) and layer.b_scale.shape == (5,)
    y = np.ones((2, 5), np.float32)
    apply_lora_rows(LoraAdapter({KEY: layer}), *KEY, np.ones((2, 4), np.float32), y, 4, 5)
    assert (y == 1).all()


def test_conversions_between_dtypes():
    rng = np.random.default_rng(7)
    f32 = LoraLayer(rng.standard_normal((4, 9)), rng.standard_normal((6, 4)), 0.5,
                    rng.standard_normal(6))
    q = f32.astype(np.int8)
    assert q.astype("int8") is q and q.bias.dtype == np.float32
    back = q.astype(np.float32)
    a64, b64 = factors64(q)
    np.testing.assert_array_equal(back.a, a64.astype(np.float32))
    np.testing.assert_array_equal(back.b, b64.astype(np.float32))
    assert back.a_scale is None and back.dtype == np.float32
    # from 16 bits: quantized from the exact float32 values of the 16-bit ones
    half = f32.astype(BF16)
    from lora_refs import int8_values
    q16 = half.astype(np.int8)
    np.testing.assert_array_equal(factors64(q16)[0],
                                  int8_values(half.a.astype(np.float64), 1))
    assert q.astype(BF16).dtype == BF16
    np.testing.assert_allclose(q.delta_weight(), 0.5 * b64 @ a64, rtol=1e-5, atol=1e-6)


def test_int8_layers_pickle_and_refuse_hostile_scales():
    rng = np.random.default_rng(8)
    layer = int8_layer(rng, 4, 10, 12, bias=True)
    back = pickle.loads(pickle.dumps(layer))
    for name in ("a", "b", "a_scale", "b_scale", "bias"):
        np.testing.assert_array_equal(getattr(back, name), getattr(layer, name))
    fn, args = layer.__reduce__()

    def with_scales(sa, sb):
        for arr in (sa, sb):
            arr.flags.writeable = False
        return fn(*args[:5], (sa, sb))

    sa, sb = layer.a_scale.copy(), layer.b_scale.copy()
    for bad in (np.nan, np.inf, -1.0):
        s2 = sb.copy()
        s2[3] = bad
        with pytest.raises(ValueError, match="finite and >= 0"):
            with_scales(sa.copy(), s2)
    with pytest.raises(ValueError, match=r"must have shape \(4,\)"):
        with_scales(np.ones(3, np.float32), sb.copy())
    with pytest.raises(TypeError, match="float32"):
        with_scales(sa.astype(np.float64), sb.copy())
    with pytest.raises(ValueError, match="come with scales"):
        fn(*args[:5])  # int8 factors without their scales


def test_other_dtypes_stay_refused_and_int8_rows_too():
    layer = int8_layer(np.random.default_rng(9), 2, 4, 4)
    for bad in (np.uint8, np.int16, "int4"):
        with pytest.raises(TypeError, match="float32, float16, bfloat16 or int8"):
            layer.astype(bad)
    y = np.zeros((1, 4), np.int8)
    with pytest.raises(TypeError):
        apply_lora_rows(LoraAdapter({KEY: layer}), *KEY, np.ones((1, 4), np.int8), y, 4, 4)
    assert not y.any()


# --- bytes, stores, files ----------------------------------------------------

def test_nbytes_count_what_is_held():
    rng = np.random.default_rng(10)
    rank, d_in, d_out = 16, 896, 4864
    f32 = LoraLayer(rng.standard_normal((rank, d_in)), rng.standard_normal((d_out, rank)),
                    bias=rng.standard_normal(d_out))
    q = f32.astype("int8")
    assert q.nbytes == rank * (d_in + d_out) + 4 * rank + 4 * d_out + 4 * d_out
    # a quarter of float32's factors, plus a float32 scale per row of A and per output
    plain = LoraLayer(f32.a, f32.b)
    assert plain.astype("int8").nbytes == plain.nbytes // 4 + 4 * (rank + d_out)
    other = LoraLayer(f32.a, f32.b, bias=rng.standard_normal(d_out))
    adapter = LoraAdapter({KEY: f32, (2, "q_proj"): other}).astype("int8")
    assert adapter.nbytes == 2 * q.nbytes and adapter.dtype == np.int8


def test_a_store_holds_int8_and_counts_its_bytes():
    rng = np.random.default_rng(11)
    adapters = {f"t{i}": LoraAdapter({KEY: LoraLayer(rng.standard_normal((8, 64)),
                                                     rng.standard_normal((64, 8)))})
                for i in range(6)}
    one = adapters["t0"].astype("int8").nbytes
    s = AdapterSet(capacity_bytes=3 * one, dtype="int8")
    assert s.dtype == np.int8
    for name, adapter in adapters.items():
        s.add(name, adapter)
    assert len(s) == 3 and s.stats()["nbytes"] == 3 * one
    assert all(s.get(name).dtype == np.int8 for name in s.names())
    x = rng.standard_normal((2, 64)).astype(np.float32)
    y = np.zeros((2, 64), np.float32)
    apply_lora_rows(s.bind(["t5", "t4"]), *KEY, x, y, 64, 64)
    for i, name in enumerate(["t5", "t4"]):
        assert_float32_close(y[i], delta64(s.get(name).layers[KEY], x[i:i + 1])[0])


def test_from_peft_and_save_peft(tmp_path):
    rng = np.random.default_rng(12)
    layers = {(l, m): LoraLayer(rng.standard_normal((8, 32)), rng.standard_normal((32, 8)), 2.0)
              for l in range(2) for m in ("q_proj", "v_proj")}
    LoraAdapter(layers).save_peft(tmp_path / "f32", architecture="llama")
    q = LoraAdapter.from_peft(tmp_path / "f32", dtype="int8")
    assert q.dtype == np.int8
    ref = LoraAdapter(layers).astype("int8")
    for key, layer in q.layers.items():
        np.testing.assert_array_equal(layer.a, ref.layers[key].a)
        np.testing.assert_array_equal(layer.b_scale, ref.layers[key].b_scale)
    # saved as PEFT files in the dequantized float32 values (PEFT has no int8 adapter)
    q.save_peft(tmp_path / "q", architecture="llama")
    back = LoraAdapter.from_peft(tmp_path / "q")
    assert back.dtype == np.float32
    for key, layer in back.layers.items():
        a64, b64 = factors64(q.layers[key])
        np.testing.assert_array_equal(layer.a, a64.astype(np.float32))
        np.testing.assert_array_equal(layer.b, b64.astype(np.float32))
        assert layer.scale == q.layers[key].scale


def test_a_file_with_non_finite_values_is_refused_in_int8(tmp_path):
    from lorahook.errors import LoraFormatError
    import json
    import struct

    layer = LoraLayer(np.ones((2, 4)), np.ones((4, 2)))
    LoraAdapter({(0, "q_proj"): layer}).save_peft(tmp_path, architecture="llama")
    path = tmp_path / "adapter_model.safetensors"
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k.endswith("lora_A.weight"))
    start = 8 + n + header[name]["data_offsets"][0]
    raw[start:start + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(raw))
    with pytest.raises((LoraFormatError, ValueError), match="finite"):
        LoraAdapter.from_peft(tmp_path, dtype="int8")


def test_blend_and_merge_use_the_dequantized_values():
    rng = np.random.default_rng(13)
    la, lb = int8_layer(rng, 3, 10, 8), int8_layer(rng, 5, 10, 8, 2.0)
    mixed = blend([(LoraAdapter({KEY: la}), 0.5), (LoraAdapter({KEY: lb}), 1.0)])
    a1, b1 = factors64(la)
    a2, b2 = factors64(lb)
    want = 0.5 * la.scale * b1 @ a1 + lb.scale * b2 @ a2
    np.testing.assert_allclose(mixed.layers[KEY].delta_weight(), want, rtol=1e-5, atol=1e-6)
    w = np.zeros((8, 10), np.float32)
    LoraAdapter({KEY: lb}).merge_into({KEY: w})
    np.testing.assert_allclose(w, lb.scale * b2 @ a2, rtol=1e-5, atol=1e-6)
