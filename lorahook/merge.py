"""Adapter deltas merged into base weights, in place, all or nothing.

:meth:`LoraAdapter.merge_into <lorahook.LoraAdapter.merge_into>` and
``unmerge_from`` run :func:`merge_layers`: every target is read from the
caller's mappings once and checked (type, shape, writability, no two targets
sharing memory) before the first write, and everything that allocates
happens before it too.  This module knows layers and arrays, never files or
the adapter store.
"""
import numpy as np

from ._values import key_order
from .layer import float_factors
from .layer import SavedModule

__all__ = ["merge_layers", "refuse_variants"]


def refuse_variants(parts, what):
    """``ValueError`` unless every part of ``parts`` (key -> layer or saved module) is plain LoRA."""
    for key in sorted(parts, key=key_order):
        part = parts[key]
        kind = ("a saved module (modules_to_save)" if isinstance(part, SavedModule)
                else "an embedding LoRA layer" if part.is_embedding
                else "a DoRA layer" if part.is_dora else None)
        if kind is not None:
            raise ValueError(f"{what} takes plain LoRA layers; key {key!r} is {kind}")


def merge_layers(layers, weights, biases, sign):
    """Add (``sign`` +1) or subtract (-1) every layer's delta into ``weights[key]`` in place.

    ``layers`` maps keys to plain LoRA layers; ``weights`` (and ``biases``
    for layers with a bias) map the same keys to float32 targets.
    """
    targets = _targets(layers, weights, biases)
    if not targets:
        return
    # Everything that allocates happens before the first write: one scratch
    # buffer that holds each delta in turn, the float32 factors of 16-bit
    # layers, the scaled biases.  Targets are updated as plain ndarrays (a
    # subclass's __array_ufunc__ cannot stop a merge halfway).
    scratch = np.empty(max(t[2].size for t in targets), dtype=np.float32)
    work = []
    for _, layer, w, bv in targets:
        a, bt, bias = float_factors(layer)  # float32 values of 16-bit and int8 factors
        scale = np.float32(layer.scale)
        work.append((w.view(np.ndarray), bt.T, a, scale,
                     None if bv is None else (bv.view(np.ndarray), bias * scale)))
    update = np.add if sign > 0 else np.subtract
    for w, b, a, scale, bias in work:
        delta = scratch[:w.size].reshape(w.shape)
        np.matmul(b, a, out=delta)
        delta *= scale
        update(w, delta, out=w)
        if bias is not None:
            update(bias[0], bias[1], out=bias[0])


def _targets(layers, weights, biases):
    """Every target array, read once from the mappings and checked before any write.

    Returns ``[(key, layer, weight, bias_or_None)]`` in sorted key order.
    """
    missing = [k for k in sorted(layers, key=key_order) if k not in weights]
    if missing:
        raise KeyError(f"weights has no entry for adapter keys {missing}")
    targets = []
    for key in sorted(layers, key=key_order):
        layer = layers[key]
        w = weights[key]
        _check_target(w, f"weights[{key!r}]", (layer.d_out, layer.d_in))
        bv = None
        if layer.bias is not None:
            if biases is None or key not in biases:
                raise KeyError(f"layer {key!r} has a lora_bias: biases must hold a base bias for it")
            bv = biases[key]
            _check_target(bv, f"biases[{key!r}]", (layer.d_out,))
        targets.append((key, layer, w, bv))
    _refuse_aliases([(f"weights[{key!r}]", w) for key, _, w, _ in targets]
                    + [(f"biases[{key!r}]", bv) for key, _, _, bv in targets if bv is not None])
    return targets


def _check_target(arr, what, shape):
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32:
        raise TypeError(f"{what} must be a float32 ndarray, got "
                        f"{type(arr).__name__} {getattr(arr, 'dtype', '')}")
    if arr.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {arr.shape}")
    if not arr.flags.writeable:
        raise ValueError(f"{what} must be writable, got a read-only array")


def _byte_span(arr):
    """``(first, end)`` addresses of the bytes a non-empty array spans."""
    lo = hi = arr.__array_interface__["data"][0]
    for n, stride in zip(arr.shape, arr.strides):
        step = (n - 1) * stride
        lo, hi = (lo + step, hi) if step < 0 else (lo, hi + step)
    return lo, hi + arr.itemsize


def _refuse_aliases(named):
    """``ValueError`` when two of the ``(what, array)`` targets share memory."""
    spans = sorted((_byte_span(arr), i) for i, (_, arr) in enumerate(named) if arr.size)
    reach = None  # the highest end of the spans seen so far
    for j, ((lo, hi), i) in enumerate(spans):
        if reach is not None and lo < reach:
            # some earlier byte range overlaps: check those exactly
            for (_, hi_k), k in spans[:j]:
                if hi_k > lo and np.shares_memory(named[k][1], named[i][1]):
                    raise ValueError(f"{named[k][0]} and {named[i][0]} share memory: each "
                                     f"target must be its own array, got the same memory twice")
        reach = hi if reach is None else max(reach, hi)
