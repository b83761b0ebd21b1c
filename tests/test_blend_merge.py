"""blend, delta_weight, merge_into / unmerge_from against float64 numpy references."""
import math

import numpy as np
import pytest

from lorahook import LoraAdapter, LoraLayer, apply_lora_rows, blend

REL = 1e-5


def assert_close(got, ref):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    limit = REL * peak if peak > 0 else 1e-6
    assert err <= limit, f"max|got - ref| = {err:.3g} > {limit:.3g} (max|ref| = {peak:.3g})"


def rand_layer(rng, rank, d_in, d_out, scale=None, bias=False):
    a = rng.standard_normal((rank, d_in)).astype(np.float32)
    b = rng.standard_normal((d_out, rank)).astype(np.float32)
    bv = rng.standard_normal(d_out).astype(np.float32) if bias and rank > 0 else None
    if scale is None:
        scale = float(rng.uniform(0.25, 2.5))
    return LoraLayer(a, b, scale, bv)


def ref_delta_weight(layer):
    return layer.scale * (layer.b.astype(np.float64) @ layer.a.astype(np.float64))


def ref_bias(layer):
    if layer.bias is None:
        return np.zeros(layer.d_out)
    return layer.scale * layer.bias.astype(np.float64)


def ref_rows(layer, x):
    """``scale * (B @ (A @ x_i) + bias)`` per row, float64."""
    x = x.astype(np.float64)
    return x @ ref_delta_weight(layer).T + ref_bias(layer)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def three(rng):
    """Three adapters: shared keys, keys held by only some, different ranks, a bias."""
    a1 = LoraAdapter({
        (0, "q_proj"): rand_layer(rng, 4, 32, 48),
        (0, "v_proj"): rand_layer(rng, 2, 32, 16),
        (1, "down_proj"): rand_layer(rng, 8, 64, 32, bias=True),
    }, name="one")
    a2 = LoraAdapter({
        (0, "q_proj"): rand_layer(rng, 6, 32, 48),
        (1, "down_proj"): rand_layer(rng, 3, 64, 32),
        (2, "o_proj"): rand_layer(rng, 5, 40, 32),
    }, name="two")
    a3 = LoraAdapter({
        (0, "q_proj"): rand_layer(rng, 1, 32, 48, bias=True),
        (1, "down_proj"): rand_layer(rng, 0, 64, 32),
    }, name="three")
    return a1, a2, a3


# --------------------------------------------------------------------------- blend


def test_blend_delta_is_weighted_sum(three, rng):
    weights = [0.7, -1.25, 2.0]
    blended = blend(list(zip(three, weights)))
    keys = set().union(*(set(a.layers) for a in three))
    assert set(blended.layers) == keys
    for key in keys:
        ref_w = np.zeros_like(ref_delta_weight(next(a.layers[key] for a in three if key in a.layers)))
        ref_b = np.zeros(ref_w.shape[0])
        ranks = 0
        for adapter, wt in zip(three, weights):
            layer = adapter.layers.get(key)
            if layer is None:
                continue
            ref_w += wt * ref_delta_weight(layer)
            ref_b += wt * ref_bias(layer)
            ranks += layer.rank
        got = blended.layers[key]
        assert got.rank == ranks, "blended rank is the sum of the ranks it combines"
        assert got.scale == 1.0
        assert_close(blended.delta_weight(*key), ref_w)
        if np.any(ref_b):
            assert_close(got.bias * got.scale, ref_b)
        else:
            assert got.bias is None

        # And through the hook: rows of the blended adapter equal the weighted sum of rows.
        x = rng.standard_normal((5, got.d_in)).astype(np.float32)
        base = rng.standard_normal((5, got.d_out)).astype(np.float32)
        out = base.copy()
        apply_lora_rows(blended, key[0], key[1], x, out, got.d_in, got.d_out)
        ref = base.astype(np.float64) + x.astype(np.float64) @ ref_w.T + ref_b
        assert_close(out, ref)
        assert_close(out.astype(np.float64) - base, ref - base)


def test_blend_carries_over_keys_held_by_one_adapter(three):
    blended = blend([(three[1], 0.5)])
    layer = three[1].layers[(2, "o_proj")]
    assert_close(blended.delta_weight(2, "o_proj"), 0.5 * ref_delta_weight(layer))
    assert blended.layers[(2, "o_proj")].rank == layer.rank


def test_blend_single_weight_one_is_identity(three):
    blended = blend([(three[0], 1.0)])
    for key, layer in three[0].layers.items():
        assert_close(blended.delta_weight(*key), ref_delta_weight(layer))
        assert_close(blended.layers[key].bias * blended.layers[key].scale
                     if blended.layers[key].bias is not None else np.zeros(layer.d_out),
                     ref_bias(layer))


def test_blend_opposite_weights_cancel(three):
    blended = blend([(three[0], 1.0), (three[0], -1.0)])
    for key in three[0].layers:
        got = blended.delta_weight(*key)
        scale = float(np.max(np.abs(ref_delta_weight(three[0].layers[key]))))
        assert float(np.max(np.abs(got))) <= REL * scale


def test_blend_zero_weight(three):
    blended = blend([(three[0], 0.0), (three[1], 1.0)])
    key = (0, "v_proj")  # only in three[0]
    assert float(np.max(np.abs(blended.delta_weight(*key)))) == 0.0


def test_blend_result_pickles(three):
    import pickle
    blended = blend([(a, 1.0) for a in three])
    again = pickle.loads(pickle.dumps(blended))
    for key in blended.layers:
        assert np.array_equal(again.delta_weight(*key), blended.delta_weight(*key))


def test_blend_refuses_empty():
    with pytest.raises(ValueError, match="at least one"):
        blend([])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_blend_refuses_non_finite_weight(three, bad):
    with pytest.raises(ValueError, match="finite"):
        blend([(three[0], 1.0), (three[1], bad)])


def test_blend_refuses_mismatched_shapes(rng):
    a = LoraAdapter({(0, "q_proj"): rand_layer(rng, 2, 16, 32)})
    b = LoraAdapter({(0, "q_proj"): rand_layer(rng, 2, 16, 24)})
    with pytest.raises(ValueError, match=r"q_proj.*\(16, 32\).*\(16, 24\)"):
        blend([(a, 1.0), (b, 1.0)])


def test_blend_refuses_non_adapters(three):
    with pytest.raises(TypeError, match="item 0: expected a LoraAdapter, got object"):
        blend([(object(), 1.0)])
    with pytest.raises(TypeError, match=r"item 0 must be an \(adapter, weight\) pair"):
        blend([three[0]])


# --------------------------------------------------------------------------- delta_weight


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
