"""Phi-3: a Llama-style decoder whose attention and MLP inputs are fused.

With ``H`` = ``hidden_size``, ``h`` = ``head_dim``, ``Nq`` / ``Nkv`` = attention /
key-value heads and ``I`` = ``intermediate_size``, every layer has:

==============  =============  ===============
module          d_in           d_out
==============  =============  ===============
qkv_proj        H              (Nq + 2·Nkv)·h
o_proj          Nq·h           H
gate_up_proj    H              2·I
down_proj       I              H
==============  =============  ===============

``num_key_value_heads`` absent or ``null`` is ``num_attention_heads`` (Phi-3's config
rule). ``head_dim`` absent is ``hidden_size // num_attention_heads`` (Phi-3's attention
falls back to it; its config class has no such field); a ``null`` one is refused.
Paths: ``model.layers.N.self_attn.{qkv_proj,o_proj}``, ``model.layers.N.mlp.{gate_up_proj,
down_proj}`` (``Phi3ForCausalLM``, layout ``phi3``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Tuple

from ..errors import LoraValidationError
from .base import check_layer_index, check_module_type
from .decoders import _DecoderConfig
from .paths import PathRules

__all__ = ["Phi3Config", "PHI3_MODULES"]

#: The projections of every Phi-3 layer.
PHI3_MODULES: Tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Phi3Config(_DecoderConfig):
    """Phi-3 (``model_type`` ``phi3``), e.g. Phi-3-mini, Phi-3-medium, Phi-3.5-mini, Phi-4-mini."""

    FAMILY: ClassVar[str] = "Phi-3"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("phi3",)
    PATHS: ClassVar[PathRules] = PathRules(
        family="Phi-3",
        layouts={"phi3": "model.layers"},
        modules={"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
                 "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"},
    )
    DERIVES_HEAD_DIM: ClassVar[bool] = True
    DERIVES_KV_HEADS: ClassVar[bool] = True
    HEAD_DIM_ABSENT_DERIVED: ClassVar[bool] = True
    KV_HEADS_ABSENT_DERIVED: ClassVar[bool] = True

    def modules(self, layer_idx: int) -> Tuple[str, ...]:
        check_layer_index(layer_idx, self.num_hidden_layers, None, "Phi3Config")
        return PHI3_MODULES

    @property
    def known_modules(self) -> Tuple[str, ...]:
        return PHI3_MODULES

    def projection_shape(self, layer_idx: int, module: str) -> Tuple[int, int]:
        """``(d_in, d_out)`` of projection ``module`` on layer ``layer_idx`` (module docstring)."""
        where = "Phi3Config"
        module = check_module_type(module, layer_idx, where)
        layer_idx = check_layer_index(layer_idx, self.num_hidden_layers, module, where)
        H, I, h = self.hidden_size, self.intermediate_size, self.head_dim
        Nq, Nkv = self.num_attention_heads, self.num_key_value_heads
        shapes = {
            "qkv_proj": (H, (Nq + 2 * Nkv) * h),
            "o_proj": (Nq * h, H),
            "gate_up_proj": (H, 2 * I),
            "down_proj": (I, H),
        }
        try:
            return shapes[module]
        except KeyError:
            hint = ""
            if module in ("q_proj", "k_proj", "v_proj"):
                hint = " (Phi-3 fuses them into qkv_proj)"
            elif module in ("gate_proj", "up_proj"):
                hint = " (Phi-3 fuses them into gate_up_proj)"
            raise LoraValidationError(
                f"{where}: layer {layer_idx}, module {module!r}: unknown module for Phi-3{hint}; "
                f"known modules are {', '.join(PHI3_MODULES)}"
            ) from None
