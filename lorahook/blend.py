"""Adapters blended exactly into one: ``delta = sum(weight_i * delta_i)`` for every key."""
import numpy as np

from ._values import finite_scale
from ._values import key_order
from .adapter import LoraAdapter
from .layer import LoraLayer, float_factors
from .merge import refuse_variants

__all__ = ["blend"]


def blend(weighted):
    """Blend adapters exactly: ``delta = sum(weight_i * delta_i)`` for every key.

    ``weighted`` is a sequence of ``(adapter, weight)``.  For a key held by
    several adapters the blended ``A`` stacks their ``A``s and ``B``
    concatenates their ``B``s with ``weight * scale`` folded in (rank = the sum
    of ranks, scale 1); a key held by only some adapters is carried over,
    multiplied by its weight.  Biases combine the same way.
    """
    items = list(weighted)
    if not items:
        raise ValueError("blend needs at least one (adapter, weight) pair, got none")
    parts = {}
    for i, item in enumerate(items):
        try:
            adapter, weight = item
        except (TypeError, ValueError):
            raise TypeError(f"blend item {i} must be an (adapter, weight) pair, got {item!r}") from None
        if not isinstance(adapter, LoraAdapter):
            raise TypeError(f"blend item {i}: expected a LoraAdapter, got {type(adapter).__name__}")
        refuse_variants({**adapter.layers, **adapter.saved_modules}, f"blend (item {i})")
        weight = finite_scale(weight, f"weight of blend item {i}")
        for key, layer in adapter.layers.items():
            parts.setdefault(key, []).append((i, layer, weight))
    layers, paths = {}, {}
    for key in sorted(parts, key=key_order):
        entries = parts[key]
        shapes = {(l.d_in, l.d_out) for _, l, _ in entries}
        if len(shapes) > 1:
            detail = ", ".join(f"item {i}: (d_in, d_out) = {(l.d_in, l.d_out)}" for i, l, _ in entries)
            raise ValueError(f"cannot blend key {key!r}: shapes differ ({detail})")
        factors = [float_factors(l) for _, l, _ in entries]  # float32 values of any dtype
        a = np.concatenate([f[0] for f in factors], axis=0)
        b = np.concatenate([f[1].T.astype(np.float64) * (w * l.scale)
                            for f, (_, l, w) in zip(factors, entries)], axis=1)
        biases = [(l.bias, w * l.scale) for _, l, w in entries if l.bias is not None]
        bias = None
        if biases and a.shape[0] > 0:
            bias = sum(bv.astype(np.float64) * s for bv, s in biases)
        layers[key] = LoraLayer(a, b, 1.0, bias)
        for i, _, _ in entries:
            path = items[i][0].module_paths.get(key)
            if path is not None:
                paths.setdefault(key, path)
    return LoraAdapter(layers, module_paths=paths)
