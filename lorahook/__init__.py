"""lorahook: LoRA adapters applied inside CPU inference, row by row, in place."""
from ._rows import DEBUG_BUILD
from .adapter import LoraAdapter, LoraLayer, blend
from .errors import LoraFormatError, LoraValidationError
from .geometry import BertConfig, Qwen35Config
from .hook import LoraHook, NoopLoraHook, apply_lora_rows
from .serving import AdapterSet, BoundBatch, BoundSequences
from . import threads

__version__ = "0.1.0"

__all__ = [
    "LoraHook",
    "NoopLoraHook",
    "apply_lora_rows",
    "LoraLayer",
    "LoraAdapter",
    "blend",
    "LoraValidationError",
    "LoraFormatError",
    "Qwen35Config",
    "BertConfig",
    "AdapterSet",
    "BoundBatch",
    "BoundSequences",
    "threads",
    "DEBUG_BUILD",
]
