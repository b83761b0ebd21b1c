"""What every model geometry offers, and the checks the config classes share.

:class:`ModelGeometry` is the one type the rest of lorahook asks for when it needs a
model's shapes: ``LoraAdapter.validate_against``, ``AdapterSet(model=...)``,
``lorahook validate --model`` and ``lorahook.torch.geometry_of``. A geometry knows how
many layers the model has, which projections each layer has, and the ``(d_in, d_out)``
of each. The helpers below turn the values of a ``config.json`` into checked sizes, with
messages that name the field, what was expected and what was found.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Mapping
from typing import Any, Tuple

from .._values import describe, is_int
from ..errors import LoraValidationError

__all__ = ["ModelGeometry", "read_json_config", "EMBEDDING_MODULES", "model_level_fields"]

#: Model-level modules (``layer_idx=None``) that are embeddings, not linears.
EMBEDDING_MODULES = frozenset({"embed_tokens", "word_embeddings"})


class ModelGeometry(abc.ABC):
    """The shapes of the linear projections an adapter may target on one model.

    Subclasses define :attr:`num_layers`, :meth:`modules` and :meth:`projection_shape`.
    ``projection_shape`` raises :class:`~lorahook.LoraValidationError` naming the layer and
    the module for a layer out of range or a module the layer does not have, and
    ``TypeError`` for an index that is not an int or a module name that is not a str.
    """

    @property
    @abc.abstractmethod
    def num_layers(self) -> int:
        """The number of layers (decoder or encoder blocks)."""

    @abc.abstractmethod
    def modules(self, layer_idx: int) -> Tuple[str, ...]:
        """The projection names addressable on layer ``layer_idx``."""

    @abc.abstractmethod
    def projection_shape(self, layer_idx: int, module: str) -> Tuple[int, int]:
        """``(d_in, d_out)`` of projection ``module`` on layer ``layer_idx``."""

    # --- model-level modules (layer_idx None): lm_head, embeddings, a classification head

    def _model_shapes(self) -> Mapping:
        """``module -> (d_in, d_out)`` of the model-level modules, or a str saying what is missing."""
        return {}

    def _model_modules(self) -> Tuple[str, ...]:
        return tuple(self._model_shapes())

    def _model_shape(self, module: Any) -> Tuple[int, int]:
        """``projection_shape(None, module)``: embeddings are ``(num_embeddings, embedding_dim)``."""
        where = type(self).__name__
        module = check_module_type(module, None, where)
        shapes = self._model_shapes()
        shape = shapes.get(module)
        if shape is None:
            raise LoraValidationError(
                f"{where}: model-level module {module!r} (layer_idx None): unknown; the model-level "
                f"modules are {', '.join(shapes) or 'none'}")
        if isinstance(shape, str):
            raise LoraValidationError(f"{where}: model-level module {module!r}: {shape}")
        return shape

    def modules_for_layer(self, layer_idx: int) -> Tuple[str, ...]:
        """:meth:`modules` under the name earlier versions used."""
        return self.modules(layer_idx)

    def projections(self):
        """Every ``(layer_idx, module, d_in, d_out)`` of the model, in layer order (a new list)."""
        return [(layer_idx, module) + tuple(self.projection_shape(layer_idx, module))
                for layer_idx in range(self.num_layers) for module in self.modules(layer_idx)]

    @property
    def known_modules(self) -> Tuple[str, ...]:
        """Every module name addressable on some layer, in first-seen order."""
        seen: dict = {}
        for i in range(self.num_layers):
            for module in self.modules(i):
                seen.setdefault(module, None)
        return tuple(seen)

    def describe(self) -> str:
        """A one-line human summary (used by ``lorahook validate``)."""
        return f"{type(self).__name__}, {self.num_layers} layers"


# --------------------------------------------------------------------------- helpers


def positive_int(value: Any, field: str, where: str) -> int:
    """``value`` as a plain ``int`` if it is an integer > 0, else raise.

    ``bool`` is refused even though it is an ``int`` subclass, and so are floats with
    integral values (``1024.0``): a size written as anything but an integer is a sign
    of a damaged or hand-edited file.
    """
    if not is_int(value):
        raise LoraValidationError(
            f"{where}: field '{field}' must be a positive integer, found {describe(value)}"
        )
    value = int(value)
    if value <= 0:
        raise LoraValidationError(
            f"{where}: field '{field}' must be a positive integer, found {value}"
        )
    return value


def required_positive_int(values: Mapping, name: str, prefix: str, where: str) -> int:
    """``values[name]`` as a positive ``int``; a missing or ``None`` entry is an error."""
    value = values.get(name)
    if value is None:
        raise LoraValidationError(
            f"{where}: required field '{prefix}{name}' is missing; lorahook does not guess "
            f"model sizes"
        )
    return positive_int(value, prefix + name, where)


def model_level_fields(values: Mapping, prefix: str, where: str) -> dict:
    """``vocab_size`` (``None`` when absent) and ``num_labels`` from a ``config.json``.

    ``num_labels`` is the field of that name, else the length of ``id2label``, else 2:
    transformers' own default, which it leaves out of the files it writes.
    """
    vocab = values.get("vocab_size")
    labels = values.get("num_labels")
    if labels is None and isinstance(values.get("id2label"), Mapping):
        labels = len(values["id2label"]) or None
    return {
        "vocab_size": None if vocab is None else positive_int(vocab, prefix + "vocab_size", where),
        "num_labels": 2 if labels is None else positive_int(labels, prefix + "num_labels", where),
    }


def check_model_level(obj: Any, where: str) -> None:
    """Check a config's optional ``vocab_size`` / ``num_labels`` (``None`` or a positive int)."""
    for name in ("vocab_size", "num_labels"):
        value = getattr(obj, name)
        if value is not None:
            object.__setattr__(obj, name, positive_int(value, name, where))


def decoder_model_shapes(hidden: int, vocab: Any, labels: Any) -> dict:
    """A decoder's model-level modules: ``lm_head``, ``embed_tokens``, the ``score`` head."""
    no_vocab = "the config has no vocab_size"
    return {
        "lm_head": no_vocab if vocab is None else (hidden, vocab),
        "embed_tokens": no_vocab if vocab is None else (vocab, hidden),
        "score": "the config has no num_labels" if labels is None else (hidden, labels),
    }


def nested_text_config(config: Mapping, where: str, note: str, text_types: Tuple[str, ...]) -> Mapping:
    """The ``text_config`` object of a multimodal config, which keeps the text model's fields.

    Refused when it is missing (``note`` says why the field is required), not
    an object, or has a ``model_type`` outside ``text_types``.
    """
    text = config.get("text_config")
    if text is None:
        raise LoraValidationError(f"{where}: required field 'text_config' is missing ({note})")
    if not isinstance(text, Mapping):
        raise LoraValidationError(
            f"{where}: field 'text_config' must be an object, found {describe(text)}")
    text_type = text.get("model_type")
    if text_type is not None and text_type not in text_types:
        expected = repr(text_types[0]) if len(text_types) == 1 else "one of " + ", ".join(text_types)
        raise LoraValidationError(
            f"{where}: field 'text_config.model_type' must be {expected}, found "
            f"{describe(text_type)}")
    return text


def check_bool(value: Any, field: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise LoraValidationError(
            f"{where}: field '{field}' must be true or false, found {describe(value)}"
        )
    return value


def check_layer_index(layer_idx: Any, num_layers: int, module: Any, where: str) -> int:
    """``layer_idx`` as an int in ``range(num_layers)``; ``TypeError`` / ``LoraValidationError``."""
    if not is_int(layer_idx):
        raise TypeError(
            f"{where}: layer index must be an int, found {describe(layer_idx)}"
            + ("" if module is None else f" (module {module!r})")
        )
    layer_idx = int(layer_idx)
    if not 0 <= layer_idx < num_layers:
        subject = f"layer {layer_idx}" if module is None else f"layer {layer_idx}, module {module!r}"
        raise LoraValidationError(
            f"{where}: {subject}: layer index out of range; "
            f"the model has {num_layers} layers (0..{num_layers - 1})"
        )
    return layer_idx


def check_module_type(module: Any, layer_idx: Any, where: str) -> str:
    if not isinstance(module, str):
        raise TypeError(
            f"{where}: module name must be a str, found {describe(module)} (layer {layer_idx})"
        )
    return module


def check_mapping(config: Any, where: str) -> Mapping:
    if not isinstance(config, Mapping):
        raise TypeError(f"{where}: expected a mapping (a parsed config.json), found {describe(config)}")
    return config


def read_json_config(path: Any) -> dict:
    """Read a ``config.json`` (or the ``config.json`` inside a model directory)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"config path must be a str or os.PathLike, found {describe(path)}")
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise LoraValidationError(f"model config {path!r} is not UTF-8 text: {exc}") from None
    except ValueError as exc:
        raise LoraValidationError(f"model config {path!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise LoraValidationError(f"model config {path!r} is not a config: its JSON is nested "
                                  f"too deeply to read") from None
    if not isinstance(data, dict):
        raise LoraValidationError(
            f"model config {path!r}: expected a JSON object at the top level, "
            f"found {type(data).__name__}"
        )
    return data
