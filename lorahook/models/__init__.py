"""Model families: one config class, projection table and set of module-path rules each.

``qwen35`` (Qwen3.5), ``decoders`` (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2,
Gemma 3), ``phi3`` (Phi-3), ``bert`` (BERT); ``base`` holds :class:`ModelGeometry`, the
type they share; ``paths`` the path-rule mechanism; ``lookup`` the choice by
``model_type`` and the union of the path rules; ``measured`` a geometry read from real
layers (what ``lorahook.torch.geometry_of`` returns).
"""
from .base import EMBEDDING_MODULES, ModelGeometry, read_json_config
from .bert import BERT_MODULES, BERT_PATHS, BertConfig
from .decoders import (
    DECODER_MODULES,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from .lookup import (
    ARCHITECTURES,
    MODEL_TYPES,
    PATH_RULES,
    REFUSED_MOE_MODEL_TYPES,
    config_class,
    families_placing,
    load_model_config,
    module_key,
    module_path,
    place,
)
from .measured import MeasuredGeometry
from .paths import PEFT_PREFIX, PathRules
from .phi3 import PHI3_MODULES, Phi3Config
from .qwen35 import (
    FULL_ATTENTION,
    LEGACY_LAYER_TYPE_NAMES,
    LINEAR_ATTENTION,
    QWEN35_FULL_ATTENTION_MODULES,
    QWEN35_LINEAR_ATTENTION_MODULES,
    QWEN35_MLP_MODULES,
    QWEN35_MODULES,
    QWEN35_PATHS,
    Qwen35Config,
)

__all__ = [
    "EMBEDDING_MODULES",
    "ModelGeometry", "MeasuredGeometry", "read_json_config",
    "Qwen35Config", "BertConfig", "LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config",
    "GemmaConfig", "Gemma2Config", "Gemma3TextConfig", "Phi3Config",
    "load_model_config", "config_class", "module_key", "module_path", "place", "families_placing",
    "ARCHITECTURES", "MODEL_TYPES", "PATH_RULES", "REFUSED_MOE_MODEL_TYPES", "PathRules", "PEFT_PREFIX",
    "QWEN35_FULL_ATTENTION_MODULES", "QWEN35_LINEAR_ATTENTION_MODULES", "QWEN35_MLP_MODULES",
    "QWEN35_MODULES", "QWEN35_PATHS", "BERT_MODULES", "BERT_PATHS", "DECODER_MODULES", "PHI3_MODULES",
    "FULL_ATTENTION", "LINEAR_ATTENTION", "LEGACY_LAYER_TYPE_NAMES",
]
