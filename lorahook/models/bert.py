"""BERT encoders: geometry and module paths.

:class:`BertConfig` holds the three sizes that fix every projection of a BERT encoder;
:data:`BERT_PATHS` places them: ``[bert.]encoder.layer.N.attention.self.query`` ->
``(N, "query")``, ``attention.output.dense`` -> ``attn_output``, ``intermediate.dense``
-> ``ffn_intermediate``, ``output.dense`` -> ``ffn_output``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Tuple

from .._values import describe
from ..errors import LoraValidationError
from .base import (
    ModelGeometry,
    check_layer_index,
    check_mapping,
    check_model_level,
    check_module_type,
    model_level_fields,
    positive_int,
    read_json_config,
    required_positive_int,
)
from .paths import PathRules

__all__ = ["BertConfig", "BERT_MODULES", "BERT_PATHS"]

#: Projections of a BERT encoder layer.
BERT_MODULES: Tuple[str, ...] = (
    "query",
    "key",
    "value",
    "attn_output",
    "ffn_intermediate",
    "ffn_output",
)

#: ``BertModel`` (layout ``bert``: ``encoder.layer.N``) and the task models that wrap it
#: as ``bert`` (``BertForSequenceClassification`` ...: ``bert.encoder.layer.N``).
BERT_PATHS = PathRules(
    family="BERT",
    layouts={"bert": "encoder.layer", "bert_classifier": "bert.encoder.layer"},
    model={"word_embeddings": {"bert": "embeddings.word_embeddings",
                               "bert_classifier": "bert.embeddings.word_embeddings"},
           "classifier": {"bert_classifier": "classifier"}},
    modules={
        "query": "attention.self.query",
        "key": "attention.self.key",
        "value": "attention.self.value",
        "attn_output": "attention.output.dense",
        "ffn_intermediate": "intermediate.dense",
        "ffn_output": "output.dense",
    },
)


@dataclass(frozen=True)
class BertConfig(ModelGeometry):
    """Geometry of a BERT encoder.

    Projections (``H`` = ``hidden_size``, ``I`` = ``intermediate_size``): ``query``,
    ``key``, ``value``, ``attn_output`` are H→H, ``ffn_intermediate`` H→I, ``ffn_output``
    I→H, on every layer. Immutable, hashable, picklable, compared by value.
    """

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    #: model-level sizes (``word_embeddings``, the ``classifier`` head): ``None`` when unknown
    vocab_size: Optional[int] = field(default=None, compare=False, repr=False)
    num_labels: Optional[int] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_model_level(self, "BertConfig")
        for name in ("num_hidden_layers", "hidden_size", "intermediate_size"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name, "BertConfig"))

    @classmethod
    def from_dict(cls, config: Mapping) -> "BertConfig":
        """Build from a parsed BERT ``config.json`` (``model_type`` ``bert`` or absent).

        ``num_hidden_layers``, ``hidden_size`` and ``intermediate_size`` are required;
        other fields are ignored.
        """
        check_mapping(config, "BertConfig.from_dict")
        where = "BERT config"
        model_type = config.get("model_type")
        if model_type is not None and model_type != "bert":
            raise LoraValidationError(
                f"{where}: field 'model_type' must be 'bert', found {describe(model_type)}"
            )
        return cls(
            **{
                name: required_positive_int(config, name, "", where)
                for name in ("num_hidden_layers", "hidden_size", "intermediate_size")
            },
            **model_level_fields(config, "", where),
        )

    @classmethod
    def from_json(cls, path: "str | os.PathLike") -> "BertConfig":
        """Read a BERT ``config.json`` file (or the one in a model directory)."""
        return cls.from_dict(read_json_config(path))

    def to_dict(self) -> dict:
        """The ``config.json`` fields that :meth:`from_dict` reads back."""
        return {
            "model_type": "bert",
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            **({} if self.vocab_size is None else {"vocab_size": self.vocab_size}),
            **({} if self.num_labels is None else {"num_labels": self.num_labels}),
        }

    @property
    def known_modules(self) -> Tuple[str, ...]:
        """Every module name an adapter may target on a BERT encoder."""
        return BERT_MODULES

    @property
    def num_layers(self) -> int:
        """``num_hidden_layers``."""
        return self.num_hidden_layers

    def modules(self, layer_idx: int) -> Tuple[str, ...]:
        """The module names addressable on layer ``layer_idx`` (the same on every layer);
        for ``None`` the model-level modules (``word_embeddings``, ``classifier``)."""
        if layer_idx is None:
            return self._model_modules()
        check_layer_index(layer_idx, self.num_hidden_layers, None, "BertConfig")
        return BERT_MODULES

    def _model_shapes(self) -> dict:
        H, V, L = self.hidden_size, self.vocab_size, self.num_labels
        return {
            "word_embeddings": "the config has no vocab_size" if V is None else (V, H),
            "classifier": "the config has no num_labels" if L is None else (H, L),
        }


    def describe(self) -> str:
        return (f"BERT, hidden {self.hidden_size}, intermediate {self.intermediate_size}, "
                f"{self.num_hidden_layers} layers")

    def projection_shape(self, layer_idx: int, module: str) -> Tuple[int, int]:
        """``(d_in, d_out)`` of projection ``module`` on layer ``layer_idx``.

        Raises :class:`~lorahook.LoraValidationError` for a layer index out of range or
        an unknown module; ``TypeError`` for arguments of the wrong type.
        """
        if layer_idx is None:
            return self._model_shape(module)
        where = "BertConfig"
        module = check_module_type(module, layer_idx, where)
        layer_idx = check_layer_index(layer_idx, self.num_hidden_layers, module, where)
        H, I = self.hidden_size, self.intermediate_size
        if module in ("query", "key", "value", "attn_output"):
            return (H, H)
        if module == "ffn_intermediate":
            return (H, I)
        if module == "ffn_output":
            return (I, H)
        hint = (" (that is a decoder module name, as in Qwen3.5, Llama or Phi-3)"
                if module.endswith("_proj") else "")
        raise LoraValidationError(
            f"{where}: layer {layer_idx}, module {module!r}: unknown module for BERT{hint}; "
            f"known modules are {', '.join(BERT_MODULES)}"
        )

