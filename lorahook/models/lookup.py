"""The lookup by ``model_type`` and the union of the families' module-path rules.

:func:`load_model_config` picks the config class from a ``config.json``'s ``model_type``.
:func:`module_key` places a base-model module path with the rules of every family (an
adapter file does not say which family it was trained on); :func:`module_path` writes one
for the layout ``save_peft(architecture=...)`` names.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple

from .._values import describe
from ..errors import LoraFormatError, LoraValidationError
from .base import ModelGeometry, read_json_config
from .bert import BERT_PATHS, BertConfig
from .decoders import DECODER_CLASSES
from .paths import PEFT_PREFIX, PathRules
from .phi3 import Phi3Config
from .qwen35 import QWEN35_MODEL_TYPES, QWEN35_PATHS, Qwen35Config

__all__ = [
    "load_model_config",
    "config_class",
    "module_key",
    "place",
    "module_path",
    "families_placing",
    "ARCHITECTURES",
    "PATH_RULES",
    "MODEL_TYPES",
    "REFUSED_MOE_MODEL_TYPES",
]

#: Every family's path rules, in the order messages list them.
PATH_RULES: Tuple[PathRules, ...] = (
    (QWEN35_PATHS,) + tuple(cls.PATHS for cls in DECODER_CLASSES) + (Phi3Config.PATHS, BERT_PATHS)
)

#: ``save_peft(architecture=...)`` names: layout -> its family's rules.
ARCHITECTURES: Dict[str, PathRules] = {
    layout: rules for rules in PATH_RULES for layout in rules.layouts
}

#: ``model_type`` -> config class.
_CLASSES: Dict[str, type] = {
    **{t: Qwen35Config for t in QWEN35_MODEL_TYPES},
    **{t: cls for cls in DECODER_CLASSES for t in cls.MODEL_TYPES},
    "phi3": Phi3Config,
    "bert": BertConfig,
}
MODEL_TYPES: Tuple[str, ...] = tuple(_CLASSES)

#: Mixture-of-experts families: their experts are not linear layers lorahook addresses,
#: and the module names of their dense siblings do not describe them. Qwen3.5-MoE is the
#: one MoE model accepted (attention projections only, see ``Qwen35Config``).
REFUSED_MOE_MODEL_TYPES: Tuple[str, ...] = (
    "mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "qwen3_omni_moe",
    "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "olmoe", "granitemoe", "granitemoehybrid",
    "granitemoeshared", "phimoe", "llama4", "llama4_text", "gpt_oss", "minimax",
    "ernie4_5_moe", "glm4_moe", "glm4v_moe", "hunyuan_v1_moe", "switch_transformers",
    "nllb_moe", "gptsan-japanese", "jetmoe", "dots1", "bailing_moe", "aria", "aria_text",
)


def _check_rules_agree() -> None:
    """Two families that read the same path must place it on the same key."""
    seen: Dict[Tuple[str, str], str] = {}
    for rules in PATH_RULES:
        for root in rules.roots:
            for module, inside in rules.modules.items():
                other = seen.setdefault((root, inside), module)
                if other != module:  # pragma: no cover - a table edit gone wrong
                    raise AssertionError(f"path {root}.N.{inside} maps to both {other} and {module}")


_check_rules_agree()


def config_class(model_type: str) -> type:
    """The config class for ``model_type`` (``LoraValidationError`` when refused or unknown)."""
    cls = _CLASSES.get(model_type) if isinstance(model_type, str) else None
    if cls is not None:
        return cls
    if model_type in REFUSED_MOE_MODEL_TYPES:
        raise LoraValidationError(
            f"model_type {model_type!r} is a mixture-of-experts model, which lorahook does not "
            f"support: its experts are not linear layers lorahook addresses (the one MoE model "
            f"accepted is Qwen3.5-MoE, attention projections only)"
        )
    raise LoraValidationError(
        f"unsupported model_type {describe(model_type)}; expected one of "
        f"{', '.join(MODEL_TYPES)}"
    )


def load_model_config(path_or_dict: Any) -> ModelGeometry:
    """Build the right geometry for a model ``config.json``.

    Parameters
    ----------
    path_or_dict : mapping, str, os.PathLike or ModelGeometry
        A parsed config, a path to a ``config.json``, or a model directory
        containing one; an existing :class:`ModelGeometry` is returned
        unchanged.

    Returns
    -------
    ModelGeometry
        The family's config class (``model_type`` picks it, :data:`MODEL_TYPES`):
        :class:`~lorahook.LlamaConfig`, :class:`~lorahook.Qwen35Config`,
        :class:`~lorahook.BertConfig`, ...

    Raises
    ------
    LoraValidationError
        For a missing or unknown ``model_type``, a mixture-of-experts type
        other than Qwen3.5-MoE, or a field the family needs that is missing
        or not a positive integer, naming it.

    Examples
    --------
    >>> import lorahook
    >>> lorahook.load_model_config({"model_type": "llama", "hidden_size": 64,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128})
    LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_key_value_heads=4, head_dim=16)
    """
    if isinstance(path_or_dict, ModelGeometry):
        return path_or_dict
    if isinstance(path_or_dict, Mapping):
        config = path_or_dict
        source = "model config"
    else:
        config = read_json_config(path_or_dict)
        source = f"model config {os.fspath(path_or_dict)!r}"
    model_type = config.get("model_type")
    if model_type is None:
        raise LoraValidationError(
            f"{source}: required field 'model_type' is missing; expected one of "
            f"{', '.join(MODEL_TYPES)}"
        )
    try:
        cls = config_class(model_type)
    except LoraValidationError as exc:
        raise LoraValidationError(f"{source}: {exc}") from None
    return cls.from_dict(config)


# --------------------------------------------------------------------------- paths


def _strip(path: str) -> str:
    return path[len(PEFT_PREFIX):] if path.startswith(PEFT_PREFIX) else path


def place(path: str) -> Optional[Tuple[int, str]]:
    """``(layer_idx, module)`` for a base-model module path any family places, else ``None``.

    PEFT's ``base_model.model.`` prefix is ignored.
    """
    return _placed(path) if len(path) <= _KEPT_PATH_CHARS else _place(path)


def _place(path: str) -> Optional[Tuple[int, str]]:
    path = _strip(path)
    for rules in PATH_RULES:
        key = rules.place(path)
        if key is not None:
            return key
    return None


# The paths of a base model recur in every adapter for it: the places of recent ones are kept
# (paths of real models are far shorter than the limit; longer ones are placed again each time).
_KEPT_PATH_CHARS = 256
_placed = functools.lru_cache(maxsize=8192)(_place)


def families_placing(paths) -> Tuple[str, ...]:
    """The families whose rules place every one of ``paths`` (in :data:`PATH_RULES` order)."""
    paths = [_strip(p) for p in paths]
    return tuple(r.family for r in PATH_RULES if paths and all(r.place(p) is not None for p in paths))


def _unplaceable_reason(path: str) -> str:
    """Explain why a module path cannot be mapped to a lorahook projection."""
    parts = path.split(".")
    if "experts" in parts or "shared_expert" in parts or "shared_experts" in parts:
        return "it is a mixture-of-experts expert projection, which lorahook does not address"
    if parts[-1] == "gate" and "mlp" in parts:
        return "it is a mixture-of-experts router, which lorahook does not address"
    if any(p.startswith("visual") or p.startswith("vision") for p in parts):
        return "it belongs to a vision tower, which lorahook does not address"
    if any("embed" in p for p in parts):
        return "it is an embedding, which lorahook does not address"
    if "pooler" in parts:
        return "it is the BERT pooler, which lorahook does not address"
    if "lm_head" in parts or "classifier" in parts or "score" in parts:
        return "it is an output head, which lorahook does not address"
    for rules in PATH_RULES:
        near = rules.groups_under(path)
        if near is not None:
            group, names = near
            # the union of every family's modules under that group, for the message
            known: Dict[str, None] = {}
            for other in PATH_RULES:
                for module, inside in other.modules.items():
                    if inside.rsplit(".", 1)[0] == group:
                        known.setdefault(module, None)
            return (f"{parts[-1]!r} is not a {group} projection lorahook knows (expected one of "
                    f"{', '.join(known)})")
    layouts: Dict[str, list] = {}
    for rules in PATH_RULES:
        layouts.setdefault(rules.describe(), []).append(rules.family)
    return ("it is not a projection of any model family lorahook knows; their paths are "
            + "; ".join(f"{', '.join(fams)}: {text}" for text, fams in layouts.items()))


def module_key(path: str) -> Tuple[int, str]:
    """Map a module path in the base model to ``(layer_idx, module)``, by every family's rules.

    Accepts PEFT's ``base_model.model.`` prefix. Raises :class:`~lorahook.LoraFormatError`
    naming the path and saying why for a path no family places.
    """
    key = place(path)
    if key is not None:
        return key
    path = _strip(path)
    raise LoraFormatError(f"LoRA weights on module {path!r} cannot be placed: {_unplaceable_reason(path)}")


def module_path(layer_idx: int, module: str, architecture: str) -> str:
    """The module path of ``(layer_idx, module)`` in a base model of layout ``architecture``.

    ``architecture`` is one of :data:`ARCHITECTURES` (``ValueError`` otherwise); a module
    the family does not have raises :class:`~lorahook.LoraValidationError`.
    """
    rules = ARCHITECTURES.get(architecture) if isinstance(architecture, str) else None
    if rules is None:
        raise ValueError(
            f"architecture must be one of {', '.join(map(repr, ARCHITECTURES))}, got {architecture!r}"
        )
    return rules.path(layer_idx, module, architecture)
