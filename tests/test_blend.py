"""lorahook.blend: adapters blended exactly, against float64 numpy references."""
import math

import numpy as np
import pytest

from lorahook import LoraAdapter, apply_lora_rows, blend
from lora_refs import REL, assert_close, rand_layer, ref_bias, ref_delta_weight
from lora_refs import rng, three  # noqa: F401  (fixtures)


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
