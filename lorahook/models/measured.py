"""A geometry read from a model's real layers, for models no config class describes."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Dict, Tuple

from .._values import describe, is_int
from ..errors import LoraValidationError
from .base import ModelGeometry, check_layer_index, check_module_type

__all__ = ["MeasuredGeometry"]


class MeasuredGeometry(ModelGeometry):
    """``(layer_idx, module) -> (d_in, d_out)`` as measured, e.g. from ``nn.Linear`` layers.

    ``num_layers`` is one more than the highest layer index seen (layers without any
    measured projection have no modules). ``name`` says where the shapes came from, for
    messages. Immutable; compared by value.
    """

    __slots__ = ("_shapes", "_num_layers", "_by_layer", "_model_level", "name")

    def __init__(self, shapes: Mapping, name: str = "measured geometry"):
        checked: Dict[Tuple[int, str], Tuple[int, int]] = {}
        for key, shape in dict(shapes).items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise TypeError(f"{name}: keys must be (layer_idx, module) tuples, found {describe(key)}")
            layer_idx, module = key
            if layer_idx is not None and (not is_int(layer_idx) or layer_idx < 0):
                raise TypeError(f"{name}: layer index in key {key!r} must be an int >= 0 or None")
            if not isinstance(module, str) or not module:
                raise TypeError(f"{name}: module in key {key!r} must be a non-empty str")
            shape = tuple(shape)
            if len(shape) != 2 or not all(is_int(d) and d > 0 for d in shape):
                raise ValueError(f"{name}: shape for {key!r} must be (d_in, d_out) positive ints, "
                                 f"found {shape!r}")
            checked[(None if layer_idx is None else int(layer_idx), module)] = (
                int(shape[0]), int(shape[1]))
        if not checked:
            raise LoraValidationError(f"{name}: no projections were measured")
        by_layer: Dict[int, list] = {}
        for layer_idx, module in checked:
            by_layer.setdefault(layer_idx, []).append(module)
        model_level = tuple(by_layer.pop(None, ()))
        object.__setattr__(self, "_shapes", MappingProxyType(checked))
        object.__setattr__(self, "_num_layers", max(by_layer) + 1 if by_layer else 0)
        object.__setattr__(self, "_model_level", model_level)
        object.__setattr__(self, "_by_layer", {i: tuple(ms) for i, ms in by_layer.items()})
        object.__setattr__(self, "name", name)

    def __setattr__(self, name, value):
        raise AttributeError("MeasuredGeometry is immutable")

    def __reduce__(self):
        return (MeasuredGeometry, (dict(self._shapes), self.name))

    def __eq__(self, other):
        if not isinstance(other, MeasuredGeometry):
            return NotImplemented
        return dict(self._shapes) == dict(other._shapes)

    def __hash__(self):
        return hash(frozenset(self._shapes.items()))

    @property
    def shapes(self) -> Mapping:
        """Read-only mapping ``(layer_idx, module) -> (d_in, d_out)``."""
        return self._shapes

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def _model_shapes(self) -> dict:
        return {m: self._shapes[(None, m)] for m in self._model_level}

    def modules(self, layer_idx: int) -> Tuple[str, ...]:
        if layer_idx is None:
            return self._model_level
        layer_idx = check_layer_index(layer_idx, self._num_layers, None, self.name)
        return self._by_layer.get(layer_idx, ())

    def projection_shape(self, layer_idx: int, module: str) -> Tuple[int, int]:
        if layer_idx is None:
            return self._model_shape(module)
        module = check_module_type(module, layer_idx, self.name)
        layer_idx = check_layer_index(layer_idx, self._num_layers, module, self.name)
        shape = self._shapes.get((layer_idx, module))
        if shape is None:
            have = self._by_layer.get(layer_idx, ())
            raise LoraValidationError(
                f"{self.name}: layer {layer_idx}, module {module!r}: no such projection; layer "
                f"{layer_idx} has " + (", ".join(have) if have else "no mapped projections")
            )
        return shape

    def describe(self) -> str:
        return f"{self.name}: {len(self._shapes)} projections on {self._num_layers} layers"

    def __repr__(self):
        return f"MeasuredGeometry({self.name!r}, {len(self._shapes)} projections, {self._num_layers} layers)"
