"""PEFT adapter files: config rules, reading (through safetensors) and writing.

``safetensors`` checks and reads tensor files; ``peft_config`` holds the rules of
``adapter_config.json`` (refused options, scales, rank and alpha patterns); ``reader``
turns a PEFT directory or a bare safetensors file into plain data (:class:`AdapterData`);
``writer`` writes any adapter-like object back as a PEFT directory. Nothing here builds a
``LoraAdapter`` or knows BLAS: ``lorahook.adapter`` calls in, never the other way round.
"""
from .peft_config import CONFIG_NAME, PeftLoraConfig
from .reader import PICKLE_NAMES, WEIGHTS_NAME, AdapterData, LayerData, read_peft, read_safetensors_adapter
from .safetensors_file import (MAX_HEADER_BYTES, SafetensorsFile, read_float32, read_safetensors,
                          read_safetensors_header)
from .writer import write_peft

__all__ = [
    "read_peft", "read_safetensors_adapter", "write_peft", "AdapterData", "LayerData",
    "read_safetensors", "read_safetensors_header", "read_float32", "SafetensorsFile", "PeftLoraConfig",
    "CONFIG_NAME", "WEIGHTS_NAME", "PICKLE_NAMES", "MAX_HEADER_BYTES",
]
