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

from .decoders import DecoderConfig
from .paths import PathRules, decoder_model_paths

__all__ = ["Phi3Config", "PHI3_MODULES"]

#: The projections of every Phi-3 layer.
PHI3_MODULES: Tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Phi3Config(DecoderConfig):
    """Phi-3 (``model_type`` ``phi3``), e.g. Phi-3-mini, Phi-3-medium, Phi-3.5-mini, Phi-4-mini."""

    FAMILY: ClassVar[str] = "Phi-3"
    MODEL_TYPES: ClassVar[Tuple[str, ...]] = ("phi3",)
    PATHS: ClassVar[PathRules] = PathRules(
        family="Phi-3",
        layouts={"phi3": "model.layers"},
        modules={"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
                 "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"},
        model=decoder_model_paths({"phi3": "model.layers"}),
    )
    DERIVES_HEAD_DIM: ClassVar[bool] = True
    DERIVES_KV_HEADS: ClassVar[bool] = True
    HEAD_DIM_ABSENT_DERIVED: ClassVar[bool] = True
    KV_HEADS_ABSENT_DERIVED: ClassVar[bool] = True

    MODULES: ClassVar[Tuple[str, ...]] = PHI3_MODULES

    def _shapes(self) -> dict:
        H, I, h = self.hidden_size, self.intermediate_size, self.head_dim
        Nq, Nkv = self.num_attention_heads, self.num_key_value_heads
        return {
            "qkv_proj": (H, (Nq + 2 * Nkv) * h),
            "o_proj": (Nq * h, H),
            "gate_up_proj": (H, 2 * I),
            "down_proj": (I, H),
        }

    @staticmethod
    def _unknown_hint(module: str) -> str:
        if module in ("q_proj", "k_proj", "v_proj"):
            return " (Phi-3 fuses them into qkv_proj)"
        if module in ("gate_proj", "up_proj"):
            return " (Phi-3 fuses them into gate_up_proj)"
        return ""
