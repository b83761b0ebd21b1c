"""lorahook: LoRA adapters applied inside CPU inference, row by row, in place."""
try:
    from ._rows import DEBUG_BUILD
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith(__name__ + "._"):
        raise
    # a checkout that was never compiled: say so instead of a bare missing module
    import os as _os

    raise ImportError(
        f"lorahook's compiled core ({exc.name}) is not built: this imported the source tree at "
        f"{_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))!r}, which holds the "
        "Cython sources only.  Either install lorahook (`pip install .`, or "
        "`pip install '.[test]'`) and run `pytest` or import it from another directory, or "
        "build it in place (`pip install -e .`, or `python setup.py build_ext --inplace`)."
    ) from exc
from .adapter import LoraAdapter, SavedModule
from .blend import blend
from .layer import LoraLayer
from .errors import LoraCapacityError, LoraFormatError, LoraValidationError
from .models import (
    BertConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    ModelGeometry,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen35Config,
    load_model_config,
)
from .hook import LoraHook, NoopLoraHook, apply_lora_embedding, apply_lora_rows
from .adapter_set import AdapterSet
from .bound import BoundBatch, BoundSequences
from . import threads

# lorahook 0.2.0 kept SavedModule in lorahook.saved_module, and its pickles name
# lorahook.saved_module._saved_from_pickle: that path goes on naming the module
# that holds it now (an alias, not a module of its own).
import sys as _sys

from . import layer as _layer

_sys.modules.setdefault(__name__ + ".saved_module", _layer)
saved_module = _layer
del _sys, _layer

__version__ = "0.2.0"

__all__ = [
    # the hook contract
    "LoraHook", "NoopLoraHook", "apply_lora_rows", "apply_lora_embedding",
    # adapters
    "LoraLayer", "LoraAdapter", "SavedModule", "blend",
    "LoraValidationError", "LoraFormatError", "LoraCapacityError",
    # model geometry
    "ModelGeometry", "load_model_config", "Qwen35Config", "BertConfig", "LlamaConfig",
    "MistralConfig", "Qwen2Config", "Qwen3Config", "GemmaConfig", "Gemma2Config",
    "Gemma3TextConfig", "Phi3Config",
    # many adapters
    "AdapterSet", "BoundBatch", "BoundSequences",
    "threads", "DEBUG_BUILD",
]
