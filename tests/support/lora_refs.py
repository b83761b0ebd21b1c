"""Random LoRA layers and adapters with float64 references, for the blend and merge tests."""
import numpy as np
import pytest

from lorahook import LoraAdapter, LoraLayer

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


def int8_values(values, axis):
    """Symmetric round-to-nearest int8 of ``values`` with a float32 scale per slice along
    ``axis`` (the rule lorahook documents), dequantized in float64: the reference values
    an int8 layer or slot holds, computed here in numpy alone."""
    v = np.asarray(values, dtype=np.float32).astype(np.float64)
    scale = (np.abs(v).max(axis=axis, keepdims=True) / 127.0).astype(np.float32).astype(np.float64)
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint(v / safe), -127, 127) * scale
