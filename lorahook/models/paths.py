"""Module-path rules: where a family's projections live in its Hugging Face model.

A PEFT adapter names each adapted module by its path in the base model
(``model.layers.3.self_attn.q_proj``); lorahook names it ``(layer_idx, module)``. One
:class:`PathRules` per family says how the two correspond: the *layer roots* (the path of
the list of layers, ``model.layers``, ``model.language_model.layers``,
``encoder.layer`` ...) and, per module name, its path inside a layer
(``q_proj`` -> ``self_attn.q_proj``). A path is ``{root}.{layer_idx}.{inside}``.

Reading (``LoraAdapter.from_peft``, ``lorahook.torch``) accepts every root a family lists;
writing (``save_peft(architecture=...)``) uses the root of the named layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from ..errors import LoraValidationError

__all__ = ["PathRules", "PEFT_PREFIX", "decoder_model_paths"]

#: The prefix PEFT puts before a base-model path in its tensor names.
PEFT_PREFIX = "base_model.model."


def decoder_model_paths(layouts: Mapping[str, str]) -> Dict[str, Dict[str, str]]:
    """A decoder's model-level paths per layout: the embeddings beside the layers
    (``model.layers`` -> ``model.embed_tokens``), ``lm_head`` and the ``score`` head on top."""
    out: Dict[str, Dict[str, str]] = {"lm_head": {}, "embed_tokens": {}, "score": {}}
    for layout, root in layouts.items():
        out["embed_tokens"][layout] = root[: -len("layers")] + "embed_tokens"
        out["lm_head"][layout] = "lm_head"
        out["score"][layout] = "score"
    return out


@dataclass(frozen=True)
class PathRules:
    """The module paths of one model family.

    ``layouts`` maps a layout name (accepted by ``save_peft(architecture=...)``) to the
    layer root written for it; ``read_roots`` lists further roots accepted when reading
    (older layouts of the same model); ``modules`` maps each module name to its path
    inside a layer.
    """

    family: str
    layouts: Mapping[str, str]
    modules: Mapping[str, str]
    read_roots: Tuple[str, ...] = ()
    #: model-level modules (``layer_idx`` ``None``): module -> {layout: path written}
    model: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: further model-level paths accepted when reading: module -> paths
    model_read: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    _pattern: "re.Pattern" = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        roots = self.roots
        inside = sorted(self.modules.values(), key=len, reverse=True)
        pattern = re.compile(
            r"^(?:" + "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True)) + r")"
            r"\.(\d{1,9})\.(" + "|".join(re.escape(s) for s in inside) + r")$"
        )
        object.__setattr__(self, "_pattern", pattern)
        object.__setattr__(self, "_by_inside", {s: m for m, s in self.modules.items()})
        by_path = {}
        for module, per_layout in self.model.items():
            for p in tuple(per_layout.values()) + tuple(self.model_read.get(module, ())):
                by_path[p] = module
        object.__setattr__(self, "_model_by_path", by_path)

    @property
    def roots(self) -> Tuple[str, ...]:
        """Every layer root accepted when reading: the layouts' roots, then ``read_roots``."""
        out: Dict[str, None] = dict.fromkeys(self.layouts.values())
        out.update(dict.fromkeys(self.read_roots))
        return tuple(out)

    def place(self, path: str) -> Optional[Tuple[int, str]]:
        """``(layer_idx, module)`` for a base-model module path, or ``None``."""
        module = self._model_by_path.get(path)
        if module is not None:
            return None, module
        m = self._pattern.match(path)
        if m is None:
            return None
        return int(m.group(1)), self._by_inside[m.group(2)]

    def groups_under(self, path: str) -> Optional[Tuple[str, Tuple[str, ...]]]:
        """For ``{root}.N.{group}.X`` with an unknown ``X``: ``(group, the modules under it)``.

        Used to say what a near-miss path should have been; ``None`` when the path does
        not start with one of this family's roots and a layer index.
        """
        for root in self.roots:
            m = re.match(re.escape(root) + r"\.\d{1,9}\.(.+)\.[^.]+$", path)
            if m is not None:
                group = m.group(1)
                names = tuple(mod for mod, s in self.modules.items() if s.rsplit(".", 1)[0] == group)
                if names:
                    return group, names
        return None

    def path(self, layer_idx: int, module: str, layout: str) -> str:
        """The module path of ``(layer_idx, module)`` in the layout ``layout``."""
        if layer_idx is None:
            path = self.model.get(module, {}).get(layout)
            if path is None:
                raise LoraValidationError(
                    f"model-level module {module!r} is not a {self.family} module of layout "
                    f"{layout!r}; expected one of {', '.join(m for m, p in self.model.items() if layout in p)}")
            return path
        inside = self.modules.get(module)
        if inside is None:
            raise LoraValidationError(
                f"module {module!r} (layer {layer_idx}) is not a {self.family} projection; "
                f"expected one of {', '.join(self.modules)}"
            )
        return f"{self.layouts[layout]}.{layer_idx}.{inside}"

    def describe(self) -> str:
        """``root.N.{group, ...}.X`` summary for error messages."""
        groups = dict.fromkeys(s.rsplit(".", 1)[0] for s in self.modules.values())
        roots = self.roots[0] if len(self.roots) == 1 else f"({' | '.join(self.roots)})"
        return f"{roots}.N.{{{', '.join(groups)}}}.X"
