"""Writing an adapter as a PEFT directory that ``peft.PeftModel.from_pretrained`` loads."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..models import ARCHITECTURES, PEFT_PREFIX, module_path
from .peft_config import CONFIG_NAME
from .reader import WEIGHTS_NAME

__all__ = ["write_peft"]


def _json_number(x: float):
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else float(x)


def write_peft(adapter, path: os.PathLike, architecture: Optional[str] = None,
               metadata: Optional[Mapping[str, str]] = None) -> Path:
    """Write ``adapter`` as a PEFT adapter directory that ``peft.PeftModel.from_pretrained`` loads.

    Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (in the layers' dtype:
    F32, F16 or BF16) under ``path``
    (created if needed). ``adapter`` is anything with the read-only face of a
    :class:`lorahook.LoraAdapter`: ``layers`` (``(layer_idx, module)`` -> an object with ``a``,
    ``b``, ``scale``, ``bias``, ``rank``, ``d_out``), ``module_paths``, ``name`` and ``metadata``.
    Module paths come from ``architecture`` when given (a layout of
    ``lorahook.models.ARCHITECTURES``: ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``,
    ``"gemma"``, ``"gemma2"``, ``"gemma3"``, ``"gemma3_multimodal"``, ``"phi3"``,
    ``"qwen3_5"``, ``"qwen3_5_multimodal"``, ``"bert"``), else from ``adapter.module_paths``
    (adapters loaded from PEFT files); a key with neither raises ``ValueError``. ``target_modules`` lists the exact
    module paths, so PEFT adapts exactly the written modules. The most common rank and alpha become
    ``r`` / ``lora_alpha``; other modules get ``rank_pattern`` / ``alpha_pattern`` entries anchored to
    their full path (``^`` + escaped path), so each entry matches that module only. When any layer
    has a bias, ``lora_bias`` is set and layers without one get a zero bias. Rank-0 layers apply
    nothing and are not written.

    ``metadata`` (str -> str, e.g. ``name``, ``base_model``, ``revision``) is merged over
    ``adapter.metadata`` (plus ``name`` from ``adapter.name``) and stored in the safetensors header; ``base_model`` also becomes the
    config's ``base_model_name_or_path``. Returns the directory path.
    """
    from safetensors.numpy import save_file

    if architecture is not None and architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(map(repr, ARCHITECTURES))}, got {architecture!r}")
    meta = dict(adapter.metadata)
    if adapter.name is not None:
        meta.setdefault("name", str(adapter.name))
    if metadata:
        meta.update(metadata)
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, found {k!r}: {v!r}")
    stored_paths = adapter.module_paths

    items: List[Tuple[str, Any]] = []
    saved: List[Tuple[str, Any]] = []
    seen: Dict[str, Tuple[int, str]] = {}
    saved_modules = getattr(adapter, "saved_modules", {})
    parts = {**adapter.layers, **saved_modules}
    order = lambda k: (k[0] is None, -1 if k[0] is None else k[0], k[1])  # noqa: E731
    for key in sorted(parts, key=order):
        layer = parts[key]
        if key not in saved_modules and layer.rank == 0:
            continue
        if architecture is not None:
            mpath = module_path(key[0], key[1], architecture)
        elif key in stored_paths:
            mpath = stored_paths[key]
        else:
            raise ValueError(
                f"layer {key[0]} module {key[1]!r} has no stored module path; pass architecture= one of "
                f"{', '.join(map(repr, ARCHITECTURES))}"
            )
        if mpath in seen:
            raise ValueError(f"module path {mpath!r} would be written for both {seen[mpath]} and {key}")
        seen[mpath] = key
        (saved if key in saved_modules else items).append((mpath, layer))
    if not items:
        raise ValueError("adapter has no layer with rank > 0; PEFT cannot represent an empty adapter")
    dora = {getattr(layer, "is_dora", False) for _, layer in items}
    if len(dora) > 1:
        raise ValueError("PEFT's use_dora holds for every layer of an adapter: this adapter mixes "
                         "DoRA and plain layers")
    use_dora = dora.pop()

    # Defaults: the most common rank, then the most common alpha among layers of that rank
    # (ties go to the first in key order); everything else becomes a pattern entry.
    r = Counter(layer.rank for _, layer in items).most_common(1)[0][0]
    alphas = [float(layer.scale) * layer.rank for _, layer in items]
    lora_alpha = Counter(a for a, (_, layer) in zip(alphas, items) if layer.rank == r).most_common(1)[0][0]
    rank_pattern: Dict[str, int] = {}
    alpha_pattern: Dict[str, Any] = {}
    for (mpath, layer), alpha in zip(items, alphas):
        anchored = "^" + re.escape(mpath)
        if layer.rank != r:
            rank_pattern[anchored] = int(layer.rank)
        if alpha != lora_alpha:
            alpha_pattern[anchored] = _json_number(alpha)
    lora_bias = any(layer.bias is not None for _, layer in items)

    tensors: Dict[str, np.ndarray] = {}
    for mpath, layer in items:
        prefix = PEFT_PREFIX + mpath
        if layer.dtype == np.int8:  # PEFT has no int8 adapter: the dequantized float32 values
            layer = layer.astype(np.float32)
        # the layer's own dtype: float32, float16 or (ml_dtypes) bfloat16
        dtype = layer.a.dtype
        if getattr(layer, "is_embedding", False):
            tensors[prefix + ".lora_embedding_A"] = np.ascontiguousarray(layer.a)
            tensors[prefix + ".lora_embedding_B"] = np.ascontiguousarray(layer.b)
            continue
        tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(layer.a)
        tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(layer.b)
        if use_dora:
            tensors[prefix + ".lora_magnitude_vector"] = np.ascontiguousarray(layer.magnitude)
        if lora_bias:
            bias = layer.bias if layer.bias is not None else np.zeros(layer.d_out, dtype=np.float32)
            tensors[prefix + ".lora_B.bias"] = np.ascontiguousarray(bias).astype(dtype)

    for mpath, module in saved:  # PEFT's modules_to_save: the module's own tensor names
        tensors[PEFT_PREFIX + mpath + ".weight"] = np.ascontiguousarray(module.weight)
        if module.bias is not None:
            tensors[PEFT_PREFIX + mpath + ".bias"] = np.ascontiguousarray(module.bias)

    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": meta.get("base_model"),
        "inference_mode": True,
        "r": int(r),
        "lora_alpha": _json_number(lora_alpha),
        "lora_dropout": 0.0,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "lora_bias": lora_bias,
        "target_modules": [mpath for mpath, _ in items],
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": [mpath for mpath, _ in saved] or None,
        "use_dora": use_dora,
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    header_meta = {"format": "pt", **meta}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata=header_meta)
    with open(out / CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return out
