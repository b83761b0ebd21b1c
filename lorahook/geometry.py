"""Model geometry for LoRA validation (work in progress)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Qwen35Config:
    """Geometry of a Qwen3.5 text model."""

    hidden_size: int
    num_hidden_layers: int


@dataclass(frozen=True)
class BertConfig:
    """Geometry of a BERT encoder."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
