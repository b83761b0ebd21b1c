"""The Llama-style decoders: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text.

Every layer of these models has the same seven projections, with ``H`` =
``hidden_size``, ``h`` = ``head_dim``, ``Nq`` / ``Nkv`` = attention / key-value heads and
``I`` = ``intermediate_size``:

=================  =========  =========
module             d_in       d_out
=================  =========  =========
q_proj             H          Nq·h
k_proj, v_proj     H          Nkv·h
o_proj             Nq·h       H
gate_proj, up_proj H          I
down_proj          I          H
=================  =========  =========

The families differ in what their ``config.json`` may leave out. Each class applies its
own family's ``transformers`` rule (transformers 5) and nothing from another family:

* a field the family's config class derives when it is ``null``
  (``num_key_value_heads = num_attention_heads``, and for Llama and Mistral
  ``head_dim = hidden_size // num_attention_heads``) is derived the same way;
* ``head_dim`` absent from a Qwen2 file is ``hidden_size // num_attention_heads`` (Qwen2's
  attention falls back to it; its config class has no ``head_dim``), but an explicit
  ``null`` is refused (transformers would fail on it);
* a field whose transformers default is the value of one checkpoint (Mistral's
  ``num_key_value_heads = 8``, Qwen2's and Qwen3's ``32``, Qwen3's ``head_dim = 128``,
  Gemma's ``head_dim = 256`` and ``num_key_value_heads``) is required when absent:
  filling it in would validate adapters against some other model. The one exception is
  the ``text_config`` of a multimodal Gemma 3 file, which transformers writes without the
  fields equal to its defaults (see :class:`Gemma3TextConfig`).

An explicit ``head_dim`` always wins over ``hidden_size // num_attention_heads`` (Gemma,
Qwen3, Llama 3.2 and Mistral NeMo publish one that differs). The attention biases of
Qwen2 (and of ``attention_bias`` / ``mlp_bias`` elsewhere) do not change any shape.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional, Tuple

from .._values import describe
from ..errors import LoraValidationError
from .base import (
    nested_text_config,
    ModelGeometry,
    check_layer_index,
    check_module_type,
    check_mapping,
    check_model_level,
    decoder_model_shapes,
    model_level_fields,
    positive_int,
    read_json_config,
    required_positive_int,
)
from .paths import PathRules, decoder_model_paths

__all__ = [
    "LlamaConfig",
    "MistralConfig",
    "Qwen2Config",
    "Qwen3Config",
    "GemmaConfig",
    "Gemma2Config",
    "Gemma3TextConfig",
    "DECODER_MODULES",
    "DECODER_CLASSES",
]

#: The projections of every layer of a Llama-style decoder, in table order.
DECODER_MODULES: Tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
_INSIDE = {
    **{m: f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{m: f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")},
}

_ABSENT = object()


def _paths(family: str, layout: str, **extra: Any) -> PathRules:
    """``{Family}ForCausalLM``'s layout: ``model.layers.N.{self_attn,mlp}.X``, with
    ``model.embed_tokens``, ``lm_head`` and (sequence classifiers) ``score``."""
    layouts = {layout: "model.layers", **extra.pop("layouts", {})}
    return PathRules(family=family, layouts=layouts, modules=_INSIDE,
                     model=decoder_model_paths(layouts), **extra)


@dataclass(frozen=True)
class DecoderConfig(ModelGeometry):
    """Shared body of the Llama-style config classes (see the module docstring)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    #: model-level sizes (``lm_head``, ``embed_tokens``, ``score``): ``None`` when unknown
    vocab_size: Optional[int] = field(default=None, compare=False, repr=False)
    num_labels: Optional[int] = field(default=None, compare=False, repr=False)

    #: Family name in messages, the ``model_type`` values read, the path rules.
    FAMILY: ClassVar[str] = ""
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ()
    PATHS: ClassVar[PathRules]
    #: ``None`` in the constructor derives the field (the family's config class does too).
    DERIVES_HEAD_DIM: ClassVar[bool] = False
    DERIVES_KV_HEADS: ClassVar[bool] = False
    #: In a file: a ``null`` head_dim is derived (else refused); an absent one is derived.
    HEAD_DIM_NULL_DERIVED: ClassVar[bool] = False
    HEAD_DIM_ABSENT_DERIVED: ClassVar[bool] = False
    #: In a file: an absent num_key_value_heads is derived (else required; ``null`` is
    #: derived whenever DERIVES_KV_HEADS).
    KV_HEADS_ABSENT_DERIVED: ClassVar[bool] = False
    #: transformers' constant defaults, quoted when a file leaves the field out.
    TRANSFORMERS_DEFAULTS: ClassVar[Dict[str, int]] = {}

    def __post_init__(self) -> None:
        where = type(self).__name__
        check_model_level(self, where)
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name, where))
        H, Nq = self.hidden_size, self.num_attention_heads
        if self.head_dim is None:
            if not self.DERIVES_HEAD_DIM:
                raise LoraValidationError(
                    f"{where}: head_dim is required for {self.FAMILY}; its transformers config "
                    f"does not derive it from hidden_size / num_attention_heads"
                )
            if H // Nq == 0:
                raise LoraValidationError(
                    f"{where}: head_dim = hidden_size // num_attention_heads = {H} // {Nq} is 0"
                )
            object.__setattr__(self, "head_dim", H // Nq)
        else:
            object.__setattr__(self, "head_dim", positive_int(self.head_dim, "head_dim", where))
        if self.num_key_value_heads is None:
            if not self.DERIVES_KV_HEADS:
                raise LoraValidationError(
                    f"{where}: num_key_value_heads is required for {self.FAMILY}; its transformers "
                    f"config does not derive it from num_attention_heads"
                )
            object.__setattr__(self, "num_key_value_heads", Nq)
        else:
            object.__setattr__(self, "num_key_value_heads",
                               positive_int(self.num_key_value_heads, "num_key_value_heads", where))
        if Nq % self.num_key_value_heads != 0:
            raise LoraValidationError(
                f"{where}: num_attention_heads ({Nq}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )

    # ------------------------------------------------------------------ construction

    @classmethod
    def _text_fields(cls, config: Mapping, where: str) -> Tuple[Mapping, str]:
        """The mapping holding the text model's fields and the prefix for messages."""
        model_type = config.get("model_type")
        if model_type is not None and model_type not in cls.MODEL_TYPES:
            raise LoraValidationError(
                f"{where}: field 'model_type' must be {' or '.join(map(repr, cls.MODEL_TYPES))}, "
                f"found {describe(model_type)}"
            )
        return config, ""

    @classmethod
    def from_dict(cls, config: Mapping) -> "DecoderConfig":
        """Build from a parsed Hugging Face ``config.json`` (see the module docstring for
        what may be left out). Unknown fields are ignored."""
        where = f"{cls.FAMILY} config"
        check_mapping(config, f"{cls.__name__}.from_dict")
        text, prefix = cls._text_fields(config, where)
        values = {name: required_positive_int(text, name, prefix, where)
                  for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size")}
        values["head_dim"] = cls._optional(text, "head_dim", prefix, where,
                                           absent_ok=cls.HEAD_DIM_ABSENT_DERIVED,
                                           null_ok=cls.HEAD_DIM_NULL_DERIVED,
                                           rule="hidden_size // num_attention_heads")
        values["num_key_value_heads"] = cls._optional(text, "num_key_value_heads", prefix, where,
                                                      absent_ok=cls.KV_HEADS_ABSENT_DERIVED,
                                                      null_ok=cls.DERIVES_KV_HEADS,
                                                      rule="num_attention_heads")
        values.update(model_level_fields(text, prefix, where))
        return cls(**values)

    @classmethod
    def _optional(cls, text: Mapping, name: str, prefix: str, where: str, *,
                  absent_ok: bool, null_ok: bool, rule: str) -> Optional[int]:
        """A size the family may derive: ``None`` (derive it) or the checked value."""
        value = text.get(name, _ABSENT)
        if value is _ABSENT:
            if absent_ok:
                return None
            default = cls.TRANSFORMERS_DEFAULTS.get(name)
            why = (f"transformers' {cls.FAMILY} config would fill in {default}, the value of one "
                   f"checkpoint" if default is not None else "there is no rule to derive it")
            hint = f" (null means {rule})" if null_ok else ""
            raise LoraValidationError(
                f"{where}: required field '{prefix}{name}' is missing; {why}, and lorahook does "
                f"not guess model sizes{hint}"
            )
        if value is None:
            if null_ok:
                return None
            raise LoraValidationError(
                f"{where}: field '{prefix}{name}' must be a positive integer, found null "
                f"({cls.FAMILY} does not derive it from {rule})"
            )
        return positive_int(value, prefix + name, where)

    @classmethod
    def from_json(cls, path: "str | os.PathLike") -> "DecoderConfig":
        """Read a ``config.json`` file (or the ``config.json`` in a model directory)."""
        return cls.from_dict(read_json_config(path))

    def to_dict(self) -> dict:
        """Flat ``config.json`` fields that :meth:`from_dict` reads back to an equal config."""
        return {
            "model_type": self.MODEL_TYPES[0],
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            **({} if self.vocab_size is None else {"vocab_size": self.vocab_size}),
            **({} if self.num_labels is None else {"num_labels": self.num_labels}),
        }

    # ------------------------------------------------------------------ queries

    @property
    def num_layers(self) -> int:
        """``num_hidden_layers``."""
        return self.num_hidden_layers

    #: The projection names of every layer (a family with fused projections overrides them
    #: together with :meth:`_shapes` and :meth:`_unknown_hint`).
    MODULES: ClassVar[Tuple[str, ...]] = DECODER_MODULES

    def modules(self, layer_idx: int) -> Tuple[str, ...]:
        """The module names addressable on layer ``layer_idx`` (the same on every layer);
        for ``None``, the model-level modules (``lm_head``, ``embed_tokens``, ``score``)."""
        if layer_idx is None:
            return self._model_modules()
        check_layer_index(layer_idx, self.num_hidden_layers, None, type(self).__name__)
        return self.MODULES

    @property
    def known_modules(self) -> Tuple[str, ...]:
        return self.MODULES

    def _shapes(self) -> dict:
        """``module -> (d_in, d_out)`` of every layer."""
        H, I = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H),
        }

    @staticmethod
    def _unknown_hint(module: str) -> str:
        """Text added to the refusal of an unknown module (e.g. where a fused family put it)."""
        return ""

    def projection_shape(self, layer_idx: int, module: str) -> Tuple[int, int]:
        """``(d_in, d_out)`` of projection ``module`` on layer ``layer_idx`` (module docstring)."""
        if layer_idx is None:
            return self._model_shape(module)
        where = type(self).__name__
        module = check_module_type(module, layer_idx, where)
        layer_idx = check_layer_index(layer_idx, self.num_hidden_layers, module, where)
        try:
            return self._shapes()[module]
        except KeyError:
            raise LoraValidationError(
                f"{where}: layer {layer_idx}, module {module!r}: unknown module for "
                f"{self.FAMILY}{self._unknown_hint(module)}; known modules are "
                f"{', '.join(self.MODULES)}"
            ) from None

    def _model_shapes(self) -> dict:
        return decoder_model_shapes(self.hidden_size, self.vocab_size, self.num_labels)

    def describe(self) -> str:
        return (f"{self.FAMILY}, hidden {self.hidden_size}, {self.num_hidden_layers} layers, "
                f"{self.num_attention_heads} heads ({self.num_key_value_heads} key-value) of "
                f"{self.head_dim}, intermediate {self.intermediate_size}")


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Llama (``model_type`` ``llama``): ``head_dim`` and ``num_key_value_heads`` may be left
    out or ``null`` (``hidden_size // num_attention_heads``, ``num_attention_heads``)."""

    FAMILY: ClassVar[str] = "Llama"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("llama",)
    PATHS: ClassVar[PathRules] = _paths("Llama", "llama")
    DERIVES_HEAD_DIM: ClassVar[bool] = True
    DERIVES_KV_HEADS: ClassVar[bool] = True
    HEAD_DIM_NULL_DERIVED: ClassVar[bool] = True
    HEAD_DIM_ABSENT_DERIVED: ClassVar[bool] = True
    KV_HEADS_ABSENT_DERIVED: ClassVar[bool] = True


@dataclass(frozen=True)
class MistralConfig(DecoderConfig):
    """Mistral (``mistral``): ``head_dim`` may be left out or ``null``; ``num_key_value_heads``
    may be ``null`` but not absent (transformers would fill in 8)."""

    FAMILY: ClassVar[str] = "Mistral"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("mistral",)
    PATHS: ClassVar[PathRules] = _paths("Mistral", "mistral")
    DERIVES_HEAD_DIM: ClassVar[bool] = True
    DERIVES_KV_HEADS: ClassVar[bool] = True
    HEAD_DIM_NULL_DERIVED: ClassVar[bool] = True
    HEAD_DIM_ABSENT_DERIVED: ClassVar[bool] = True
    TRANSFORMERS_DEFAULTS: ClassVar[Dict[str, int]] = {"num_key_value_heads": 8}


@dataclass(frozen=True)
class Qwen2Config(DecoderConfig):
    """Qwen2 / Qwen2.5 (``qwen2``): ``head_dim`` may be absent (``hidden_size //
    num_attention_heads``); ``num_key_value_heads`` may be ``null`` but not absent
    (transformers would fill in 32)."""

    FAMILY: ClassVar[str] = "Qwen2"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("qwen2",)
    PATHS: ClassVar[PathRules] = _paths("Qwen2", "qwen2")
    DERIVES_HEAD_DIM: ClassVar[bool] = True
    DERIVES_KV_HEADS: ClassVar[bool] = True
    HEAD_DIM_ABSENT_DERIVED: ClassVar[bool] = True
    TRANSFORMERS_DEFAULTS: ClassVar[Dict[str, int]] = {"num_key_value_heads": 32}


@dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    """Qwen3 (``qwen3``): ``head_dim`` is required (transformers would fill in 128);
    ``num_key_value_heads`` may be ``null`` but not absent (transformers would fill in 32)."""

    FAMILY: ClassVar[str] = "Qwen3"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("qwen3",)
    PATHS: ClassVar[PathRules] = _paths("Qwen3", "qwen3")
    DERIVES_KV_HEADS: ClassVar[bool] = True
    TRANSFORMERS_DEFAULTS: ClassVar[Dict[str, int]] = {"num_key_value_heads": 32, "head_dim": 128}


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    """Gemma (``gemma``): ``head_dim`` and ``num_key_value_heads`` are required (transformers
    would fill in 256 and 16, the 7B values)."""

    FAMILY: ClassVar[str] = "Gemma"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("gemma",)
    PATHS: ClassVar[PathRules] = _paths("Gemma", "gemma")
    TRANSFORMERS_DEFAULTS: ClassVar[Dict[str, int]] = {"num_key_value_heads": 16, "head_dim": 256}


@dataclass(frozen=True)
class Gemma2Config(DecoderConfig):
    """Gemma 2 (``gemma2``): ``head_dim`` and ``num_key_value_heads`` are required
    (transformers would fill in 256 and 4, the 2B values)."""

    FAMILY: ClassVar[str] = "Gemma 2"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("gemma2",)
    PATHS: ClassVar[PathRules] = _paths("Gemma 2", "gemma2")
    TRANSFORMERS_DEFAULTS: ClassVar[Dict[str, int]] = {"num_key_value_heads": 4, "head_dim": 256}


@dataclass(frozen=True)
class Gemma3TextConfig(DecoderConfig):
    """The Gemma 3 text decoder: flat (``gemma3_text``, e.g. Gemma 3 1B) or nested under
    ``text_config`` of a multimodal ``gemma3`` file (4B and up).

    In the flat form ``head_dim`` and ``num_key_value_heads`` are required (transformers would
    fill in 256 and 4). The nested form is different: transformers (before version 5) wrote
    ``text_config`` without the fields equal to ``Gemma3TextConfig``'s defaults and fills
    them back in from those defaults when it reads the file -- the published Gemma 3 4B, 12B
    and 27B files have no ``head_dim`` (4B not even its head counts). There, an absent
    field takes that default (:attr:`NESTED_DEFAULTS`), exactly as transformers reads it.

    Paths: ``Gemma3ForCausalLM`` (layout ``gemma3``: ``model.layers``) and
    ``Gemma3ForConditionalGeneration`` (layout ``gemma3_multimodal``:
    ``model.language_model.layers``; adapters saved with transformers before 4.52 use
    ``language_model.model.layers``, which is read too). The vision tower is not addressed.
    """

    FAMILY: ClassVar[str] = "Gemma 3"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("gemma3_text", "gemma3")
    PATHS: ClassVar[PathRules] = _paths(
        "Gemma 3", "gemma3",
        layouts={"gemma3_multimodal": "model.language_model.layers"},
        read_roots=("language_model.model.layers",),
        model_read={"embed_tokens": ("language_model.model.embed_tokens",),
                    "lm_head": ("language_model.lm_head",)},
    )
    TRANSFORMERS_DEFAULTS: ClassVar[Dict[str, int]] = {"num_key_value_heads": 4, "head_dim": 256}
    #: Gemma3TextConfig's defaults, which a nested ``text_config`` leaves out (only there).
    NESTED_DEFAULTS: ClassVar[Dict[str, int]] = {
        "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "vocab_size": 262_208,
    }

    @classmethod
    def _text_fields(cls, config: Mapping, where: str) -> Tuple[Mapping, str]:
        model_type = config.get("model_type")
        nested = model_type == "gemma3" or (model_type is None and "text_config" in config)
        if not nested:
            return super()._text_fields(config, where)
        text = nested_text_config(
            config, where, "model_type 'gemma3' keeps the text model's fields under text_config; "
            "transformers would use the defaults of one checkpoint", ("gemma3_text",))
        # transformers wrote text_config without the fields equal to Gemma3TextConfig's
        # defaults and reads them back from those defaults; so does lorahook.
        return {**cls.NESTED_DEFAULTS, **text}, "text_config."


#: Every Llama-style config class, in the order messages list them.
DECODER_CLASSES = (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, GemmaConfig,
                   Gemma2Config, Gemma3TextConfig)
