"""Qwen3.5: the hybrid decoder's geometry and module paths.

:class:`Qwen35Config` describes the Qwen3.5 hybrid decoder (dense and mixture-of-experts),
read from a Hugging Face ``config.json`` in either the flat text form (``model_type``
``qwen3_5_text`` / ``qwen3_5_moe_text``) or the nested multimodal form (``qwen3_5`` /
``qwen3_5_moe``, text fields under ``text_config``). :data:`QWEN35_PATHS` places its
projections: ``model.layers.N.{self_attn,linear_attn,mlp}.X`` (``Qwen3_5ForCausalLM``)
and ``model.language_model.layers.N...`` (the multimodal model).

Required fields and defaults
----------------------------
Every field that determines a projection shape is *required*: ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
the five ``linear_*`` fields, ``intermediate_size`` (dense models) and ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``
(MoE models). The ``transformers`` configuration classes give each of these a default
taken from one particular checkpoint (for instance ``head_dim=256`` and
``linear_num_value_heads=32``, the 9B values, or 35B-A3B values for MoE); filling a
missing size that way would validate adapters against a model that is not the one being
served, so a missing size is an error here instead.

``head_dim`` in particular is *not* derived. The ``transformers`` attention module falls
back to ``hidden_size // num_attention_heads`` only when its config object lacks the
attribute, which never happens, because the config class itself defaults ``head_dim`` to
256. The two possible "defaults" disagree (e.g. 1024 // 8 = 128 for the 0.8B model whose
real ``head_dim`` is 256), so neither is guessed.

Only two things have defaults, both as in ``transformers`` and the specification:
``layer_types`` (derived from ``full_attention_interval``, which defaults to 4) and
``tie_word_embeddings`` (``False``; it does not affect any projection shape). Unknown
extra fields are ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from .._values import describe
from ..errors import LoraValidationError
from .base import (
    nested_text_config,
    ModelGeometry,
    check_bool,
    check_layer_index,
    check_model_level,
    decoder_model_shapes,
    model_level_fields,
    check_mapping,
    check_module_type,
    positive_int,
    read_json_config,
    required_positive_int,
)
from .bert import BERT_MODULES
from .paths import PathRules, decoder_model_paths

__all__ = [
    "Qwen35Config",
    "QWEN35_PATHS",
    "QWEN35_FULL_ATTENTION_MODULES",
    "QWEN35_LINEAR_ATTENTION_MODULES",
    "QWEN35_MLP_MODULES",
    "QWEN35_MODULES",
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "LEGACY_LAYER_TYPE_NAMES",
    "QWEN35_MODEL_TYPES",
]

#: Projections of a Qwen3.5 full (gated softmax) attention layer.
QWEN35_FULL_ATTENTION_MODULES: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
#: Projections of a Qwen3.5 linear-attention (Gated DeltaNet) layer.
QWEN35_LINEAR_ATTENTION_MODULES: Tuple[str, ...] = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
)
#: Projections of the dense MLP present on every layer of a dense Qwen3.5 model.
QWEN35_MLP_MODULES: Tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
#: Every Qwen3.5 module name, in table order.
QWEN35_MODULES: Tuple[str, ...] = (
    QWEN35_FULL_ATTENTION_MODULES + QWEN35_LINEAR_ATTENTION_MODULES + QWEN35_MLP_MODULES
)
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
#: Older layer-type spellings and the names they mean.
LEGACY_LAYER_TYPE_NAMES = {"attention": FULL_ATTENTION, "mamba": LINEAR_ATTENTION}

_DENSE_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
_MOE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
_FLAT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
_NESTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
QWEN35_MODEL_TYPES = _FLAT_MODEL_TYPES + _NESTED_MODEL_TYPES

#: Where the projections live: ``Qwen3_5ForCausalLM`` (layout ``qwen3_5``) and the
#: multimodal ``Qwen3_5ForConditionalGeneration`` (layout ``qwen3_5_multimodal``).
QWEN35_PATHS = PathRules(
    family="Qwen3.5",
    layouts={"qwen3_5": "model.layers", "qwen3_5_multimodal": "model.language_model.layers"},
    modules={
        **{m: f"self_attn.{m}" for m in QWEN35_FULL_ATTENTION_MODULES},
        **{m: f"linear_attn.{m}" for m in QWEN35_LINEAR_ATTENTION_MODULES},
        **{m: f"mlp.{m}" for m in QWEN35_MLP_MODULES},
    },
    model=decoder_model_paths({"qwen3_5": "model.layers",
                               "qwen3_5_multimodal": "model.language_model.layers"}),
)

_ATTENTION_MODULES = {
    FULL_ATTENTION: QWEN35_FULL_ATTENTION_MODULES,
    LINEAR_ATTENTION: QWEN35_LINEAR_ATTENTION_MODULES,
}
_LAYER_TYPE_DESCRIPTION = {
    FULL_ATTENTION: "full-attention",
    LINEAR_ATTENTION: "linear-attention (Gated DeltaNet)",
}

# Shape-determining fields, in constructor order.
_QWEN35_CORE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
_QWEN35_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def _normalize_layer_types(
    layer_types: Any, num_hidden_layers: int, field: str, where: str
) -> Tuple[str, ...]:
    """Validate an explicit ``layer_types`` list and map legacy names to current ones."""
    if isinstance(layer_types, (str, bytes)) or not isinstance(layer_types, (list, tuple)):
        raise LoraValidationError(
            f"{where}: field '{field}' must be a list of layer type names, "
            f"found {describe(layer_types)}"
        )
    if len(layer_types) != num_hidden_layers:
        raise LoraValidationError(
            f"{where}: field '{field}' has {len(layer_types)} entries, expected "
            f"num_hidden_layers = {num_hidden_layers}"
        )
    normalized = []
    for i, name in enumerate(layer_types):
        if isinstance(name, str):
            name = LEGACY_LAYER_TYPE_NAMES.get(name, name)
        if name not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise LoraValidationError(
                f"{where}: field '{field}[{i}]' must be one of 'full_attention', "
                f"'linear_attention' (or the legacy 'attention', 'mamba'), "
                f"found {describe(layer_types[i])}"
            )
        normalized.append(name)
    return tuple(normalized)


def _interval_layer_types(num_hidden_layers: int, interval: int) -> Tuple[str, ...]:
    """Layer ``i`` is full attention when ``(i + 1) % interval == 0``."""
    return tuple(
        FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
        for i in range(num_hidden_layers)
    )


def _validated_qwen35_fields(
    values: Mapping, prefix: str, where: str, is_moe: Optional[bool] = None
) -> dict:
    """Check and normalize the constructor arguments of :class:`Qwen35Config`.

    ``values`` holds every constructor argument (``None`` for "not given"). ``prefix``
    is prepended to field names in messages (``"text_config."`` for the nested form).
    ``is_moe`` says whether the model is a mixture of experts; ``None`` infers it from
    whether ``num_experts`` is given. Returns a new dict of normalized values.
    """
    out: dict = {}

    def required(name: str) -> int:
        return required_positive_int(values, name, prefix, where)

    for name in _QWEN35_CORE_FIELDS:
        out[name] = required(name)

    if out["num_attention_heads"] % out["num_key_value_heads"] != 0:
        raise LoraValidationError(
            f"{where}: field '{prefix}num_attention_heads' ({out['num_attention_heads']}) "
            f"must be a multiple of '{prefix}num_key_value_heads' "
            f"({out['num_key_value_heads']})"
        )
    if out["linear_num_value_heads"] % out["linear_num_key_heads"] != 0:
        raise LoraValidationError(
            f"{where}: field '{prefix}linear_num_value_heads' "
            f"({out['linear_num_value_heads']}) must be a multiple of "
            f"'{prefix}linear_num_key_heads' ({out['linear_num_key_heads']})"
        )

    if is_moe is None:
        is_moe = values.get("num_experts") is not None
    if is_moe:
        for name in _QWEN35_MOE_FIELDS:
            out[name] = required(name)
        if out["num_experts_per_tok"] > out["num_experts"]:
            raise LoraValidationError(
                f"{where}: field '{prefix}num_experts_per_tok' ({out['num_experts_per_tok']}) "
                f"must not exceed '{prefix}num_experts' ({out['num_experts']})"
            )
        if values.get("intermediate_size") is not None:
            raise LoraValidationError(
                f"{where}: field '{prefix}intermediate_size' must be None for a "
                f"mixture-of-experts model (it has no dense MLP), found "
                f"{describe(values['intermediate_size'])}"
            )
        out["intermediate_size"] = None
    else:
        for name in _QWEN35_MOE_FIELDS:
            if values.get(name) is not None:
                raise LoraValidationError(
                    f"{where}: field '{prefix}{name}' is set but '{prefix}num_experts' is "
                    f"not; a mixture-of-experts model needs num_experts"
                )
            out[name] = None
        out["intermediate_size"] = required("intermediate_size")

    interval = values.get("full_attention_interval")
    out["full_attention_interval"] = (
        4 if interval is None else positive_int(interval, prefix + "full_attention_interval", where)
    )
    layer_types = values.get("layer_types")
    if layer_types is None:
        out["layer_types"] = _interval_layer_types(
            out["num_hidden_layers"], out["full_attention_interval"]
        )
    else:
        out["layer_types"] = _normalize_layer_types(
            layer_types, out["num_hidden_layers"], prefix + "layer_types", where
        )

    tie = values.get("tie_word_embeddings")
    out["tie_word_embeddings"] = False if tie is None else check_bool(tie, "tie_word_embeddings", where)
    return out


# --------------------------------------------------------------------------- Qwen3.5


@dataclass(frozen=True, repr=False)
class Qwen35Config(ModelGeometry):
    """Geometry of a Qwen3.5 text decoder (dense or mixture-of-experts).

    Build one with :meth:`from_dict` / :meth:`from_json` from a Hugging Face
    ``config.json``, or directly with keyword arguments named as in that file. Passing
    ``num_experts`` makes a mixture-of-experts model (which then needs
    ``num_experts_per_tok``, ``moe_intermediate_size`` and
    ``shared_expert_intermediate_size`` and must not have ``intermediate_size``);
    otherwise ``intermediate_size`` is required.

    ``layer_types`` may be given explicitly (legacy names ``attention`` and ``mamba``
    are accepted and stored as ``full_attention`` / ``linear_attention``); when it is
    omitted, layer ``i`` is full attention when ``(i + 1) % full_attention_interval ==
    0``. An explicit ``layer_types`` takes precedence over ``full_attention_interval``,
    which only serves to derive ``layer_types`` and so takes no part in equality or
    hashing: two configs with the same resolved ``layer_types`` are equal.

    Instances are immutable, hashable, picklable and compare by value. Invalid values
    raise :class:`~lorahook.LoraValidationError` naming the field.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None
    full_attention_interval: int = field(default=4, compare=False)
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    shared_expert_intermediate_size: Optional[int] = None
    tie_word_embeddings: bool = False
    #: model-level sizes (``lm_head``, ``embed_tokens``, ``score``): ``None`` when unknown
    vocab_size: Optional[int] = field(default=None, compare=False, repr=False)
    num_labels: Optional[int] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_model_level(self, "Qwen35Config")
        values = {name: getattr(self, name) for name in self.__dataclass_fields__
                  if name not in ("vocab_size", "num_labels")}
        for name, value in _validated_qwen35_fields(values, "", "Qwen35Config").items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, config: Mapping) -> "Qwen35Config":
        """Build from a parsed Hugging Face ``config.json``.

        Accepts the flat text form (``model_type`` ``qwen3_5_text`` or
        ``qwen3_5_moe_text``) and the nested multimodal form (``qwen3_5`` or
        ``qwen3_5_moe``, text fields under ``text_config``; a top-level
        ``tie_word_embeddings`` overrides the one in ``text_config``). Without a
        ``model_type`` the form is inferred: nested when ``text_config`` is present,
        mixture-of-experts when ``num_experts`` is present. Unknown fields are ignored.
        """
        check_mapping(config, "Qwen35Config.from_dict")
        where = "Qwen3.5 config"
        model_type = config.get("model_type")
        if model_type is not None and model_type not in QWEN35_MODEL_TYPES:
            raise LoraValidationError(
                f"{where}: field 'model_type' must be one of {', '.join(QWEN35_MODEL_TYPES)}, "
                f"found {describe(model_type)}"
            )

        nested = model_type in _NESTED_MODEL_TYPES or (
            model_type is None and "text_config" in config
        )
        if nested:
            text = nested_text_config(
                config, where, f"model_type {model_type!r} keeps the text model's fields under "
                f"text_config", _FLAT_MODEL_TYPES)
            prefix = "text_config."
            text_model_type = text.get("model_type")
            if model_type is not None and text_model_type is not None:
                if text_model_type != model_type + "_text":
                    raise LoraValidationError(
                        f"{where}: field 'text_config.model_type' is {text_model_type!r}, "
                        f"which does not match model_type {model_type!r} (expected "
                        f"{model_type + '_text'!r})"
                    )
            kind = model_type if model_type is not None else text_model_type
        else:
            text = config
            prefix = ""
            kind = model_type

        if kind is None:
            is_moe = text.get("num_experts") is not None
        else:
            is_moe = kind in _MOE_MODEL_TYPES

        values = {name: text.get(name) for name in _QWEN35_CORE_FIELDS}
        values["layer_types"] = text.get("layer_types")
        values["full_attention_interval"] = text.get("full_attention_interval")
        if is_moe:
            for name in _QWEN35_MOE_FIELDS:
                values[name] = text.get(name)
            # A dense ``intermediate_size`` in a MoE file describes no layer; ignore it.
        else:
            values["intermediate_size"] = text.get("intermediate_size")
            # MoE fields in a dense file describe no layer; ignore them.

        tie = config.get("tie_word_embeddings") if nested else None
        if tie is None:
            tie = text.get("tie_word_embeddings")
        values["tie_word_embeddings"] = tie

        normalized = _validated_qwen35_fields(values, prefix, where, is_moe)
        # the model-level sizes: the text model's, else the top level's (multimodal files)
        sizes = model_level_fields({**config, **text} if nested else text, prefix, where)
        return cls(**normalized, **sizes)

    @classmethod
    def from_json(cls, path: "str | os.PathLike") -> "Qwen35Config":
        """Read a ``config.json`` file (or the ``config.json`` in a model directory)."""
        return cls.from_dict(read_json_config(path))

    def to_dict(self) -> dict:
        """The flat text-model ``config.json`` fields (``qwen3_5_text`` or
        ``qwen3_5_moe_text``) that :meth:`from_dict` reads back to an equal config."""
        out: dict = {"model_type": "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text"}
        for name in _QWEN35_CORE_FIELDS:
            out[name] = getattr(self, name)
        if self.is_moe:
            for name in _QWEN35_MOE_FIELDS:
                out[name] = getattr(self, name)
        else:
            out["intermediate_size"] = self.intermediate_size
        out["full_attention_interval"] = self.full_attention_interval
        out["layer_types"] = list(self.layer_types)
        out["tie_word_embeddings"] = self.tie_word_embeddings
        for name in ("vocab_size", "num_labels"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    # ------------------------------------------------------------------ queries

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of every layer is a mixture of experts."""
        return self.num_experts is not None

    @property
    def known_modules(self) -> Tuple[str, ...]:
        """Every module name an adapter may target on this model (any layer type).

        MLP names are absent on a mixture-of-experts model.
        """
        if self.is_moe:
            return QWEN35_FULL_ATTENTION_MODULES + QWEN35_LINEAR_ATTENTION_MODULES
        return QWEN35_MODULES

    @property
    def full_attention_layers(self) -> Tuple[int, ...]:
        """Indices of the full-attention layers, ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> Tuple[int, ...]:
        """Indices of the linear-attention (Gated DeltaNet) layers, ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def layer_type(self, layer_idx: int) -> str:
        """``'full_attention'`` or ``'linear_attention'`` for layer ``layer_idx``.

        Raises :class:`~lorahook.LoraValidationError` for an index out of range.
        """
        i = check_layer_index(layer_idx, self.num_hidden_layers, None, "Qwen35Config")
        return self.layer_types[i]

    def is_full_attention(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a full-attention layer (else linear attention)."""
        return self.layer_type(layer_idx) == FULL_ATTENTION

    @property
    def num_layers(self) -> int:
        """``num_hidden_layers``."""
        return self.num_hidden_layers

    def modules(self, layer_idx: int) -> Tuple[str, ...]:
        """The module names addressable on layer ``layer_idx``; for ``None`` the model-level
        modules (``lm_head``, ``embed_tokens``, ``score``)."""
        if layer_idx is None:
            return self._model_modules()
        attention = _ATTENTION_MODULES[self.layer_type(layer_idx)]
        return attention if self.is_moe else attention + QWEN35_MLP_MODULES


    def _model_shapes(self) -> dict:
        return decoder_model_shapes(self.hidden_size, self.vocab_size, self.num_labels)

    def describe(self) -> str:
        kinds: dict = {}
        for t in self.layer_types:
            kinds[t] = kinds.get(t, 0) + 1
        mix = ", ".join(f"{k} x{v}" for k, v in kinds.items())
        moe = f", {self.num_experts} experts" if self.is_moe else ""
        return f"Qwen3.5, hidden {self.hidden_size}, {self.num_hidden_layers} layers ({mix}){moe}"

    def projection_shape(self, layer_idx: int, module: str) -> Tuple[int, int]:
        """``(d_in, d_out)`` of projection ``module`` on layer ``layer_idx``.

        Raises :class:`~lorahook.LoraValidationError` (naming the layer and module and
        saying why) for a layer index out of range, an unknown module, an attention
        module on the other layer type, or an MLP module on a mixture-of-experts model;
        ``TypeError`` for an index that is not an int or a module that is not a str.
        """
        if layer_idx is None:
            return self._model_shape(module)
        where = "Qwen35Config"
        module = check_module_type(module, layer_idx, where)
        layer_idx = check_layer_index(layer_idx, self.num_hidden_layers, module, where)
        head = f"{where}: layer {layer_idx}, module {module!r}"

        if module not in QWEN35_MODULES:
            hint = " (that is a BERT module name)" if module in BERT_MODULES else ""
            raise LoraValidationError(
                f"{head}: unknown module for Qwen3.5{hint}; known modules are "
                f"{', '.join(self.known_modules)}"
            )

        H = self.hidden_size
        if module in QWEN35_MLP_MODULES:
            if self.is_moe:
                raise LoraValidationError(
                    f"{head}: this is a mixture-of-experts model ({self.num_experts} experts), "
                    f"which has no dense MLP; its experts are not linear layers, and the "
                    f"shared-expert projections are not addressed by the module names "
                    f"{', '.join(QWEN35_MLP_MODULES)}"
                )
            I = self.intermediate_size
            return (I, H) if module == "down_proj" else (H, I)

        layer_type = self.layer_types[layer_idx]
        wanted = FULL_ATTENTION if module in QWEN35_FULL_ATTENTION_MODULES else LINEAR_ATTENTION
        if layer_type != wanted:
            raise LoraValidationError(
                f"{head}: {module} is a {_LAYER_TYPE_DESCRIPTION[wanted]} projection, but "
                f"layer {layer_idx} is a {_LAYER_TYPE_DESCRIPTION[layer_type]} layer, whose "
                f"attention modules are {', '.join(_ATTENTION_MODULES[layer_type])}"
            )

        h = self.head_dim
        if module == "q_proj":
            # Query and output gate, interleaved per head.
            return (H, 2 * self.num_attention_heads * h)
        if module in ("k_proj", "v_proj"):
            return (H, self.num_key_value_heads * h)
        if module == "o_proj":
            return (self.num_attention_heads * h, H)

        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        if module == "in_proj_qkv":
            return (H, 2 * key_dim + value_dim)
        if module == "in_proj_z":
            return (H, value_dim)
        if module in ("in_proj_b", "in_proj_a"):
            # One scalar per *value* head (never per key head).
            return (H, self.linear_num_value_heads)
        # out_proj
        return (value_dim, H)

    def __repr__(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in _QWEN35_CORE_FIELDS]
        if self.is_moe:
            parts += [f"{name}={getattr(self, name)}" for name in _QWEN35_MOE_FIELDS]
        else:
            parts.append(f"intermediate_size={self.intermediate_size}")
        parts.append(f"full_attention_layers={list(self.full_attention_layers)}")
        parts.append(f"tie_word_embeddings={self.tie_word_embeddings}")
        return f"Qwen35Config({', '.join(parts)})"

