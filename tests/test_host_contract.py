"""The host contract's loose ends: pickling, zero-row widths, overlapping buffers, all-or-nothing merges.

Every accepted result is checked against a float64 numpy reference; every
refusal is checked to have written nothing.
"""
import pickle

import numpy as np
import pytest

from lorahook import AdapterSet, apply_lora_rows, LoraAdapter, LoraLayer
from lorahook._core import plans as _kernels
from testing_core import core as _testing


def _layer(rng, d_in, d_out, rank=4, scale=0.5, bias=False):
    return LoraLayer(rng.standard_normal((rank, d_in)), rng.standard_normal((d_out, rank)), scale,
                     rng.standard_normal(d_out) if bias else None)


def _delta64(layer, x):
    d = (x.astype(np.float64) @ layer.a.T.astype(np.float64)) @ layer.b.T.astype(np.float64)
    if layer.bias is not None:
        d = d + layer.bias
    return layer.scale * d


def _assert_close(got, ref):
    assert np.max(np.abs(got - ref)) <= 1e-5 * max(np.max(np.abs(ref)), 1e-30)


# --------------------------------------------------------------------------- pickling


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("bias", [False, True])
def test_unpickled_adapters_are_read_only_with_the_same_values(protocol, bias):
    rng = np.random.default_rng(protocol)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 12, 20, bias=bias),
                           (3, "down_proj"): _layer(rng, 20, 12, rank=2, bias=bias)},
                          name="n", metadata={"k": "v"})
    back = pickle.loads(pickle.dumps(adapter, protocol=protocol))
    assert back.name == "n" and back.metadata == {"k": "v"} and back.keys() == adapter.keys()
    for key, layer in back.layers.items():
        orig = adapter.layers[key]
        for name in ("a", "b", "bias"):
            got, want = getattr(layer, name), getattr(orig, name)
            if want is None:
                assert got is None
                continue
            assert not got.flags.writeable, (protocol, key, name)
            with pytest.raises(ValueError, match="read-only"):
                got[(0,) * got.ndim] = 0
            np.testing.assert_array_equal(got, want)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    y = np.zeros((5, 20), np.float32)
    apply_lora_rows(back, 0, "q_proj", x, y, 12, 20)
    _assert_close(y, _delta64(adapter.layers[(0, "q_proj")], x))


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip_keeps_every_array_contiguous(protocol):
    rng = np.random.default_rng(7)
    back = pickle.loads(pickle.dumps(LoraAdapter({(0, "q_proj"): _layer(rng, 8, 6, bias=True)}),
                                     protocol=protocol))
    layer = back.layers[(0, "q_proj")]
    for arr in (layer.a, layer.b, layer.bias):
        assert arr.flags.c_contiguous or arr.flags.f_contiguous


def test_protocol_5_out_of_band_buffers_are_kept_without_a_copy():
    rng = np.random.default_rng(8)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 64, 48, rank=8, bias=True)})
    buffers = []
    data = pickle.dumps(adapter, protocol=5, buffer_callback=buffers.append)
    raw = [bytes(b.raw()) for b in buffers]  # read-only memory, as Ray's object store hands out
    assert len(raw) == 3  # a, B^T, bias: each array travels out of band
    back = pickle.loads(data, buffers=raw)
    layer = back.layers[(0, "q_proj")]
    held = {id(r) for r in raw}
    for arr in (layer.a, layer.b, layer.bias):
        base = arr
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        assert id(base) in held or (isinstance(base, memoryview) and id(base.obj) in held)
        assert not arr.flags.writeable
    x = rng.standard_normal((3, 64)).astype(np.float32)
    y = np.zeros((3, 48), np.float32)
    apply_lora_rows(back, 0, "q_proj", x, y, 64, 48)
    _assert_close(y, _delta64(adapter.layers[(0, "q_proj")], x))


def test_nbytes_counts_each_value_once():
    rng = np.random.default_rng(9)
    layers = {(0, "q_proj"): _layer(rng, 100, 60, rank=16, bias=True),
              (1, "v_proj"): _layer(rng, 100, 20, rank=8)}
    adapter = LoraAdapter(layers)
    exact = 4 * (16 * (100 + 60) + 60 + 8 * (100 + 20))
    assert adapter.nbytes == exact and isinstance(adapter.nbytes, int)
    assert adapter.scaled(2.0).nbytes == exact  # shared arrays, counted once per adapter


# --------------------------------------------------------------------------- zero-row calls


@pytest.mark.parametrize("shape", ["1d", "2d"])
def test_zero_row_calls_check_the_widths(shape):
    rng = np.random.default_rng(10)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 8, 6)})
    s = AdapterSet()
    s.add("a", adapter)
    for hook in (adapter, s.bind([]), s.bind_sequences(["a", None])):
        def buf(width):
            return np.zeros(0, np.float32) if shape == "1d" else np.zeros((0, width), np.float32)
        if hook is adapter or hook.is_active(0, "q_proj"):
            with pytest.raises(ValueError, match=r"\(d_in, d_out\) = \(8, 6\).*\(8, 7\)"):
                apply_lora_rows(hook, 0, "q_proj", buf(8), buf(7), 8, 7)
        apply_lora_rows(hook, 0, "q_proj", buf(8), buf(6), 8, 6)  # right widths: accepted


# --------------------------------------------------------------------------- overlapping buffers


def _overlapping(n_rows, width):
    backing = np.arange(2 * n_rows * width, dtype=np.float32)
    return backing, backing[: n_rows * width], backing[width: (n_rows + 1) * width]


def test_overlap_is_refused_on_every_entry_point_with_nothing_written():
    rng = np.random.default_rng(11)
    layer = _layer(rng, 6, 6)
    adapter = LoraAdapter({(0, "q_proj"): layer})
    s = AdapterSet()
    s.add("a", adapter)
    n = 4
    calls = {
        "apply_lora_rows": lambda x, y: apply_lora_rows(adapter, 0, "q_proj", x, y, 6, 6),
        "bound batch": lambda x, y: apply_lora_rows(s.bind(["a"] * n), 0, "q_proj", x, y, 6, 6),
        "bound sequences": lambda x, y: apply_lora_rows(s.bind_sequences(["a", None]), 0,
                                                        "q_proj", x, y, 6, 6),
        "apply_layer": lambda x, y: _kernels.apply_layer(layer._kernel, x, y, n),
        "apply_groups": lambda x, y: _testing.apply_groups([(layer._kernel, 1.0, None, None)],
                                                        x, y, n, 6, 6),
        "GroupPlan.apply": lambda x, y: _kernels.GroupPlan([(layer._kernel, 1.0, None, None)],
                                                        n, 6, 6).apply(x, y),
        "LoraAdapter.apply": lambda x, y: adapter.apply(0, "q_proj", x[:6], x[3:9]),
    }
    for name, call in calls.items():
        backing, x, y = _overlapping(n, 6)
        before = backing.copy()
        with pytest.raises(ValueError, match="overlap"):
            call(x, y)
        assert np.array_equal(backing, before), name
        # the same buffer as input and output, too
        backing2 = np.arange(n * 6, dtype=np.float32)
        before2 = backing2.copy()
        with pytest.raises(ValueError, match="overlap"):
            call(backing2, backing2)
        assert np.array_equal(backing2, before2), name


# --------------------------------------------------------------------------- merging


def _weights(rng, adapter):
    return {key: rng.standard_normal((layer.d_out, layer.d_in)).astype(np.float32)
            for key, layer in adapter.layers.items()}


def test_merge_into_updates_in_place_never_through_the_mapping():
    rng = np.random.default_rng(12)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 8, 6), (1, "k_proj"): _layer(rng, 8, 4)})
    weights = _weights(rng, adapter)
    originals = {k: w.copy() for k, w in weights.items()}

    class NoAssignment(dict):
        def __setitem__(self, key, value):
            raise TypeError("this mapping refuses assignment")

    frozen = NoAssignment(weights)
    adapter.merge_into(frozen)
    for key, layer in adapter.layers.items():
        assert frozen[key] is weights[key]
        ref = originals[key].astype(np.float64) + layer.scale * (
            layer.b.astype(np.float64) @ layer.a.astype(np.float64))
        _assert_close(weights[key], ref)
    adapter.unmerge_from(frozen)
    for key in weights:
        np.testing.assert_allclose(weights[key], originals[key], atol=1e-5)


def _unchanged(weights, originals):
    return all(np.array_equal(weights[k], originals[k]) for k in originals)


def test_merge_into_refuses_the_same_array_under_two_keys_and_changes_nothing():
    rng = np.random.default_rng(13)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 8, 6), (1, "q_proj"): _layer(rng, 8, 6)})
    shared = rng.standard_normal((6, 8)).astype(np.float32)
    before = shared.copy()
    with pytest.raises(ValueError, match="share memory"):
        adapter.merge_into({(0, "q_proj"): shared, (1, "q_proj"): shared})
    assert np.array_equal(shared, before)
    # overlapping views of one buffer are refused as well
    big = rng.standard_normal((7, 8)).astype(np.float32)
    big_before = big.copy()
    with pytest.raises(ValueError, match="share memory"):
        adapter.unmerge_from({(0, "q_proj"): big[:6], (1, "q_proj"): big[1:]})
    assert np.array_equal(big, big_before)


def test_merge_into_accepts_disjoint_views_of_one_buffer():
    rng = np.random.default_rng(14)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 8, 6), (1, "q_proj"): _layer(rng, 8, 6)})
    fused = rng.standard_normal((12, 8)).astype(np.float32)
    before = fused.astype(np.float64)
    adapter.merge_into({(0, "q_proj"): fused[:6], (1, "q_proj"): fused[6:]})
    for i, key in enumerate([(0, "q_proj"), (1, "q_proj")]):
        layer = adapter.layers[key]
        ref = before[6 * i: 6 * i + 6] + layer.scale * (
            layer.b.astype(np.float64) @ layer.a.astype(np.float64))
        _assert_close(fused[6 * i: 6 * i + 6], ref)


def test_merge_into_with_a_read_only_weight_changes_nothing():
    rng = np.random.default_rng(15)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 8, 6), (2, "q_proj"): _layer(rng, 8, 6)})
    weights = _weights(rng, adapter)
    weights[(2, "q_proj")].flags.writeable = False
    originals = {k: w.copy() for k, w in weights.items()}
    with pytest.raises(ValueError, match=r"weights\[\(2, 'q_proj'\)\] must be writable"):
        adapter.merge_into(weights)
    assert _unchanged(weights, originals)


def test_merge_into_with_an_aliased_bias_changes_nothing():
    rng = np.random.default_rng(16)
    adapter = LoraAdapter({(0, "q_proj"): _layer(rng, 8, 6, bias=True),
                           (1, "q_proj"): _layer(rng, 8, 6, bias=True)})
    weights = _weights(rng, adapter)
    bias = rng.standard_normal(6).astype(np.float32)
    originals = {k: w.copy() for k, w in weights.items()}
    bias_before = bias.copy()
    with pytest.raises(ValueError, match="share memory"):
        adapter.merge_into(weights, {(0, "q_proj"): bias, (1, "q_proj"): bias})
    assert _unchanged(weights, originals) and np.array_equal(bias, bias_before)


def test_unpickling_checks_what_a_hostile_pickle_could_send():
    from lorahook.layer import _layer_from_pickle
    a = np.ones((2, 8), np.float32)
    bt = np.ones((2, 6), np.float32)
    with pytest.raises(ValueError, match="ranks disagree"):
        _layer_from_pickle(a, np.ones((3, 6), np.float32), 1.0, None)
    with pytest.raises(TypeError, match="float32"):
        _layer_from_pickle(a, bt.astype(np.float16), 1.0, None)  # one dtype for a, bt, bias
    with pytest.raises(ValueError, match="bias must have shape"):
        _layer_from_pickle(a, bt, 1.0, np.ones(5, np.float32))
    with pytest.raises(ValueError, match="finite"):
        _layer_from_pickle(a, bt, float("inf"), None)
    layer = _layer_from_pickle(a, bt, 2.0, None)
    assert not layer.a.flags.writeable and layer.b.shape == (6, 2)


def test_a_layer_pickled_under_its_old_module_path_still_loads():
    # lorahook 0.1.0 kept LoraLayer in lorahook.adapter: its pickles name
    # lorahook.adapter._layer_from_pickle, which must keep rebuilding layers
    import pickle
    from lorahook import LoraLayer
    layer = LoraLayer(np.ones((2, 8), np.float32), np.full((6, 2), 0.5, np.float32), 3.0)
    data = pickle.dumps(layer, protocol=4)
    assert b"lorahook.layer" in data
    old = data.replace(b"\x8c\x0elorahook.layer", b"\x8c\x10lorahook.adapter")
    assert old != data and b"lorahook.layer" not in old
    back = pickle.loads(old)
    assert back.scale == 3.0 and np.array_equal(back.b, layer.b)
