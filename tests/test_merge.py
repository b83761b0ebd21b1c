"""lorahook.merge through LoraAdapter: delta_weight, merge_into / unmerge_from against float64."""
import numpy as np
import pytest

from lorahook import LoraAdapter, apply_lora_rows, blend
from lora_refs import assert_close, rand_layer, ref_bias, ref_delta_weight, ref_rows
from lora_refs import rng, three  # noqa: F401  (fixtures)


def test_delta_weight(three):
    for adapter in three:
        for key, layer in adapter.layers.items():
            got = adapter.delta_weight(*key)
            assert got.dtype == np.float32
            assert got.shape == (layer.d_out, layer.d_in)
            assert_close(got, ref_delta_weight(layer))


def test_delta_weight_unknown_key(three):
    with pytest.raises(KeyError, match="k_proj"):
        three[0].delta_weight(0, "k_proj")


# --------------------------------------------------------------------------- merge / unmerge


def base_weights(rng, adapter):
    weights, biases = {}, {}
    for key, layer in adapter.layers.items():
        weights[key] = rng.standard_normal((layer.d_out, layer.d_in)).astype(np.float32)
        biases[key] = rng.standard_normal(layer.d_out).astype(np.float32)
    return weights, biases


def test_merge_into_matches_reference(three, rng):
    adapter = three[0]
    weights, biases = base_weights(rng, adapter)
    original = {k: v.astype(np.float64) for k, v in weights.items()}
    original_b = {k: v.astype(np.float64) for k, v in biases.items()}
    adapter.merge_into(weights, biases)
    for key, layer in adapter.layers.items():
        assert weights[key].dtype == np.float32
        assert_close(weights[key], original[key] + ref_delta_weight(layer))
        assert_close(biases[key], original_b[key] + ref_bias(layer))


def test_merged_projection_equals_hook(three, rng):
    """Running the merged base projection gives the unmerged hook's output."""
    adapter = three[0]
    weights, biases = base_weights(rng, adapter)
    merged = {k: v.copy() for k, v in weights.items()}
    merged_b = {k: v.copy() for k, v in biases.items()}
    adapter.merge_into(merged, merged_b)
    for key, layer in adapter.layers.items():
        x = rng.standard_normal((7, layer.d_in)).astype(np.float32)
        hooked = x @ weights[key].T + biases[key]
        apply_lora_rows(adapter, key[0], key[1], x, hooked, layer.d_in, layer.d_out)
        via_merge = x @ merged[key].T + merged_b[key]
        ref = (x.astype(np.float64) @ weights[key].astype(np.float64).T
               + biases[key].astype(np.float64) + ref_rows(layer, x))
        assert_close(hooked, ref)
        assert_close(via_merge, ref)


def test_unmerge_restores(three, rng):
    for adapter in three:
        weights, biases = base_weights(rng, adapter)
        original = {k: v.copy() for k, v in weights.items()}
        original_b = {k: v.copy() for k, v in biases.items()}
        adapter.merge_into(weights, biases)
        adapter.unmerge_from(weights, biases)
        for key in adapter.layers:
            assert_close(weights[key], original[key])
            assert_close(biases[key], original_b[key])


def test_unmerge_alone_subtracts(three, rng):
    adapter = three[1]
    weights, _ = base_weights(rng, adapter)
    original = {k: v.astype(np.float64) for k, v in weights.items()}
    adapter.unmerge_from(weights)
    for key, layer in adapter.layers.items():
        assert_close(weights[key], original[key] - ref_delta_weight(layer))


def test_merge_blended_equals_sequential_merges(three, rng):
    blended = blend([(three[0], 0.5), (three[1], 2.0)])
    weights, biases = base_weights(rng, blended)
    seq_w = {k: v.astype(np.float64) for k, v in weights.items()}
    seq_b = {k: v.astype(np.float64) for k, v in biases.items()}
    for adapter, wt in ((three[0], 0.5), (three[1], 2.0)):
        for key, layer in adapter.layers.items():
            seq_w[key] += wt * ref_delta_weight(layer)
            seq_b[key] += wt * ref_bias(layer)
    blended.merge_into(weights, biases)
    for key in blended.layers:
        assert_close(weights[key], seq_w[key])
        assert_close(biases[key], seq_b[key])


def test_merge_extra_weights_are_left_alone(three, rng):
    adapter = three[1]
    weights, _ = base_weights(rng, adapter)
    extra = rng.standard_normal((8, 8)).astype(np.float32)
    weights[(9, "k_proj")] = extra
    keep = extra.copy()
    adapter.merge_into(weights)
    assert np.array_equal(weights[(9, "k_proj")], keep)


def _untouched(weights, snapshot):
    return all(np.array_equal(weights[k], snapshot[k]) for k in snapshot)


def _read_only(w):
    w = w.copy()
    w.flags.writeable = False
    return w


@pytest.mark.parametrize("op", ["merge_into", "unmerge_from"])
@pytest.mark.parametrize("spoil, exc, match", [
    pytest.param(None, KeyError, "o_proj", id="missing"),
    pytest.param(lambda w: np.zeros((3, 3), np.float32), ValueError, r"shape.*\(32, 40\)",
                 id="wrong_shape"),
    pytest.param(lambda w: np.zeros(w.shape[::-1], np.float32), ValueError, r"\(32, 40\)",
                 id="transposed"),
    pytest.param(lambda w: w.astype(np.float64), TypeError, "float32", id="float64"),
    pytest.param(_read_only, ValueError, "writable", id="read_only"),
])
def test_refused_merge_touches_nothing(three, rng, op, spoil, exc, match):
    """The last key in sorted order, (2, "o_proj") of shape (32, 40), is spoiled: the
    earlier keys must not have been written."""
    adapter = three[1]
    weights, _ = base_weights(rng, adapter)
    last = sorted(adapter.layers)[-1]
    if spoil is None:
        del weights[last]
    else:
        weights[last] = spoil(weights[last])
    snapshot = {k: v.copy() for k, v in weights.items()}
    with pytest.raises(exc, match=match):
        getattr(adapter, op)(weights)
    assert _untouched(weights, snapshot)


def test_merge_bias_adapter_needs_biases(three, rng):
    adapter = three[0]  # (1, "down_proj") has a lora_bias
    weights, _ = base_weights(rng, adapter)
    snapshot = {k: v.copy() for k, v in weights.items()}
    with pytest.raises(KeyError, match="bias"):
        adapter.merge_into(weights)
    assert _untouched(weights, snapshot)


def test_merge_bad_bias_touches_nothing(three, rng):
    adapter = three[0]
    weights, biases = base_weights(rng, adapter)
    biases[(1, "down_proj")] = np.zeros(5, np.float32)
    snapshot = {k: v.copy() for k, v in weights.items()}
    with pytest.raises(ValueError, match="bias"):
        adapter.merge_into(weights, biases)
    assert _untouched(weights, snapshot)


def test_merge_rank_zero_is_a_no_op(rng):
    adapter = LoraAdapter({(0, "q_proj"): rand_layer(rng, 0, 8, 8)})
    weights = {(0, "q_proj"): rng.standard_normal((8, 8)).astype(np.float32)}
    keep = weights[(0, "q_proj")].copy()
    adapter.merge_into(weights)
    assert np.array_equal(weights[(0, "q_proj")], keep)


def test_merge_scaled_adapter(three, rng):
    adapter = three[1].scaled(-0.3)
    weights, _ = base_weights(rng, adapter)
    original = {k: v.astype(np.float64) for k, v in weights.items()}
    adapter.merge_into(weights)
    for key, layer in three[1].layers.items():
        assert_close(weights[key], original[key] - 0.3 * ref_delta_weight(layer))
