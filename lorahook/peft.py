"""Reading and writing Hugging Face PEFT LoRA adapter files.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``. This module
turns one into a :class:`lorahook.LoraAdapter` with exactly the deltas PEFT applies, and writes an
adapter back in a form ``peft.PeftModel.from_pretrained`` loads onto the original base model.

Loading rules, in short:

* Only ``peft_type == "LORA"``. Options that change the forward pass in a way an additive per-row
  update cannot reproduce (DoRA, aLoRA, layer replication, trainable tokens, target parameters,
  ``bias != "none"``, LoRA variants, base-weight-modifying initialisations such as PiSSA) are refused
  with :class:`lorahook.LoraFormatError` naming the option. Unknown options that are set to anything
  but an empty value produce a warning naming them.
* The scale of a module is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), where
  ``r`` and ``lora_alpha`` may be overridden per module by ``rank_pattern`` / ``alpha_pattern``: the
  first key, in dict order, for which ``re.match(rf"(.*\\.)?({key})$", module_path)`` matches.
* Tensors are F32, F16 or BF16 and are widened to float32. The safetensors header is parsed and
  checked against the file size before any tensor is read; pickle files are never opened.
* Loading is all-or-nothing: the adapter is only built once every tensor has been checked.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .errors import LoraFormatError, LoraValidationError
from .geometry import (
    QWEN35_FULL_ATTENTION_MODULES,
    QWEN35_LINEAR_ATTENTION_MODULES,
    QWEN35_MLP_MODULES,
)

__all__ = ["load_peft", "load_safetensors", "save_peft", "ARCHITECTURES", "MAX_HEADER_BYTES"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")

#: Largest safetensors JSON header accepted, in bytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: Architectures accepted by :func:`save_peft` for adapters without stored module paths.
ARCHITECTURES = ("qwen3_5", "qwen3_5_multimodal", "bert")

_PEFT_PREFIX = "base_model.model."

# Bytes per element for every dtype the safetensors format defines (used to validate byte spans).
_DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
    "C64": 8,
}
_SUPPORTED_DTYPES = ("F32", "F16", "BF16")
# Largest dimension accepted in a tensor shape.
_MAX_DIM = 2**31 - 1
# Largest finite float32; scales beyond it would turn every update into inf.
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# --------------------------------------------------------------------------------------------
# Module paths
# --------------------------------------------------------------------------------------------

_QWEN_GROUPS = {
    "self_attn": QWEN35_FULL_ATTENTION_MODULES,
    "linear_attn": QWEN35_LINEAR_ATTENTION_MODULES,
    "mlp": QWEN35_MLP_MODULES,
}
_QWEN_MODULE_GROUP = {m: g for g, ms in _QWEN_GROUPS.items() for m in ms}
_QWEN_RE = re.compile(r"^model\.(?:language_model\.)?layers\.(\d{1,9})\.(self_attn|linear_attn|mlp)\.(\w+)$")

_BERT_SUFFIX = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_output",
    "intermediate.dense": "ffn_intermediate",
    "output.dense": "ffn_output",
}
_BERT_MODULE_SUFFIX = {m: s for s, m in _BERT_SUFFIX.items()}
_BERT_RE = re.compile(
    r"^(?:bert\.)?encoder\.layer\.(\d{1,9})\.("
    + "|".join(re.escape(s) for s in _BERT_SUFFIX)
    + r")$"
)


def _unplaceable_reason(path: str) -> str:
    """Explain why a module path cannot be mapped to a lorahook projection."""
    parts = path.split(".")
    if "experts" in parts or "shared_expert" in parts or "shared_experts" in parts:
        return "it is a mixture-of-experts expert projection, which lorahook does not address"
    if parts[-1] == "gate" and "mlp" in parts:
        return "it is a mixture-of-experts router, which lorahook does not address"
    if any(p.startswith("visual") or p.startswith("vision") for p in parts):
        return "it belongs to a vision tower, which lorahook does not address"
    if any("embed" in p for p in parts):
        return "it is an embedding, which lorahook does not address"
    if "pooler" in parts:
        return "it is the BERT pooler, which lorahook does not address"
    if "lm_head" in parts or "classifier" in parts or "score" in parts:
        return "it is an output head, which lorahook does not address"
    return (
        "it is not a Qwen3.5 projection (model[.language_model].layers.N.{self_attn,linear_attn,mlp}.X) "
        "nor a BERT encoder projection ([bert.]encoder.layer.N.{attention.self.query|key|value, "
        "attention.output.dense, intermediate.dense, output.dense})"
    )


def module_key(path: str) -> Tuple[int, str]:
    """Map a module path in the base model to ``(layer_idx, module)``.

    Accepts Qwen3.5 paths (``model.layers.N.self_attn.q_proj``, ``model.language_model.layers.N...``)
    and BERT encoder paths (``[bert.]encoder.layer.N.attention.self.query`` ...), optionally with
    PEFT's ``base_model.model.`` prefix. Raises :class:`LoraFormatError` for anything else.
    """
    if path.startswith(_PEFT_PREFIX):
        path = path[len(_PEFT_PREFIX):]
    m = _QWEN_RE.match(path)
    if m:
        layer, group, module = int(m.group(1)), m.group(2), m.group(3)
        if _QWEN_MODULE_GROUP.get(module) == group:
            return layer, module
        raise LoraFormatError(
            f"module path {path!r}: {module!r} is not a {group} projection lorahook knows "
            f"(expected one of {', '.join(_QWEN_GROUPS[group])})"
        )
    m = _BERT_RE.match(path)
    if m:
        return int(m.group(1)), _BERT_SUFFIX[m.group(2)]
    raise LoraFormatError(f"LoRA weights on module {path!r} cannot be placed: {_unplaceable_reason(path)}")


def module_path(layer_idx: int, module: str, architecture: str) -> str:
    """The module path of ``(layer_idx, module)`` in a base model of the given architecture.

    ``architecture`` is ``"qwen3_5"`` (``model.layers.N...``, the ``Qwen3_5ForCausalLM`` layout),
    ``"qwen3_5_multimodal"`` (``model.language_model.layers.N...``) or ``"bert"``
    (``encoder.layer.N...``, the ``BertModel`` layout).
    """
    if architecture in ("qwen3_5", "qwen3_5_multimodal"):
        group = _QWEN_MODULE_GROUP.get(module)
        if group is None:
            raise LoraValidationError(
                f"module {module!r} (layer {layer_idx}) is not a Qwen3.5 projection; expected one of "
                f"{', '.join(_QWEN_MODULE_GROUP)}"
            )
        root = "model.layers" if architecture == "qwen3_5" else "model.language_model.layers"
        return f"{root}.{layer_idx}.{group}.{module}"
    if architecture == "bert":
        suffix = _BERT_MODULE_SUFFIX.get(module)
        if suffix is None:
            raise LoraValidationError(
                f"module {module!r} (layer {layer_idx}) is not a BERT projection; expected one of "
                f"{', '.join(_BERT_MODULE_SUFFIX)}"
            )
        return f"encoder.layer.{layer_idx}.{suffix}"
    raise ValueError(f"architecture must be one of {', '.join(map(repr, ARCHITECTURES))}, got {architecture!r}")


# --------------------------------------------------------------------------------------------
# safetensors reading
# --------------------------------------------------------------------------------------------


def _reject_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_safetensors_header(path: os.PathLike) -> Tuple[Dict[str, dict], Dict[str, str], int, int]:
    """Parse and validate a safetensors header without reading tensor data.

    Returns ``(tensors, metadata, data_start, file_size)`` where ``tensors`` maps each name to a dict
    with ``dtype``, ``shape`` (tuple) and ``data_offsets`` (tuple) relative to ``data_start``.
    Everything is checked against the file size first: the header length, each tensor's byte span
    (``dtype size * prod(shape)``), overlaps and gaps. Raises :class:`LoraFormatError`.
    """
    path = Path(path)
    file_size = path.stat().st_size
    where = str(path)
    if file_size < 8:
        raise LoraFormatError(f"{where}: not a safetensors file: {file_size} bytes, expected at least 8")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise LoraFormatError(
                f"{where}: safetensors header declares {header_len} bytes, more than the limit of "
                f"{MAX_HEADER_BYTES}"
            )
        if 8 + header_len > file_size:
            raise LoraFormatError(
                f"{where}: safetensors header declares {header_len} bytes but the file has only "
                f"{file_size - 8} bytes after the length field"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LoraFormatError(f"{where}: safetensors header is not valid JSON: {exc!r}"[:500]) from None
    if not isinstance(header, dict):
        raise LoraFormatError(f"{where}: safetensors header must be a JSON object, found {type(header).__name__}")

    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise LoraFormatError(f"{where}: safetensors __metadata__ must map strings to strings")

    data_start = 8 + header_len
    data_len = file_size - data_start
    tensors: Dict[str, dict] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise LoraFormatError(f"{where}: tensor {name!r}: header entry must be an object, found {info!r}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPE_SIZES:
            raise LoraFormatError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise LoraFormatError(
                f"{where}: tensor {name!r}: shape must be a list of non-negative integers, found {_short(shape)}"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise LoraFormatError(
                f"{where}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                f"found {offsets!r}"
            )
        begin, end = offsets
        if end > data_len:
            raise LoraFormatError(
                f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] run past the end of the data "
                f"({data_len} bytes)"
            )
        expected = math.prod(shape) * _DTYPE_SIZES[dtype]
        if end - begin != expected:
            raise LoraFormatError(
                f"{where}: tensor {name!r}: {dtype} {_short(tuple(shape))} needs {_short(expected)} bytes but data_offsets "
                f"[{begin}, {end}] span {end - begin}"
            )
        if any(d > _MAX_DIM for d in shape):
            raise LoraFormatError(
                f"{where}: tensor {name!r}: shape {_short(shape)} has a dimension larger than {_MAX_DIM}"
            )
        tensors[name] = {"dtype": dtype, "shape": tuple(shape), "data_offsets": (begin, end)}

    position = 0
    for name, info in sorted(tensors.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, end = info["data_offsets"]
        if begin < position:
            raise LoraFormatError(f"{where}: tensor {name!r} overlaps the previous tensor's data")
        if begin > position:
            raise LoraFormatError(f"{where}: gap in the data before tensor {name!r} (bytes {position}..{begin})")
        position = end
    if position != data_len:
        raise LoraFormatError(
            f"{where}: tensor data covers {position} bytes but the file holds {data_len} bytes after the header"
        )
    return tensors, metadata, data_start, file_size


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return raw.view("<f4").astype(np.float32)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32)
    # BF16 is the upper half of an IEEE float32.
    widened = raw.view("<u2").astype(np.uint32) << np.uint32(16)
    return widened.view(np.float32)


def read_safetensors(
    path: os.PathLike, names=None, header: Optional[tuple] = None
) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Read float tensors from a safetensors file as float32 arrays.

    ``names`` restricts which tensors are read (all by default). Only F32, F16 and BF16 are
    supported; others raise :class:`LoraFormatError`. The header is validated first (see
    :func:`read_safetensors_header`), so no allocation follows from sizes the file cannot back;
    ``header`` is what that function already returned for ``path``, to avoid parsing it again.
    """
    if header is None:
        header = read_safetensors_header(path)
    tensors, metadata, data_start, file_size = header
    wanted = list(tensors) if names is None else list(names)
    for name in wanted:
        if tensors[name]["dtype"] not in _SUPPORTED_DTYPES:
            raise LoraFormatError(
                f"{path}: tensor {name!r} has dtype {tensors[name]['dtype']}; expected one of "
                f"{', '.join(_SUPPORTED_DTYPES)}"
            )
    out: Dict[str, np.ndarray] = {}
    if not wanted:
        return out, metadata
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != file_size:
            raise LoraFormatError(f"{path}: the file changed size while it was being read")
        if file_size == data_start:  # only empty tensors; nothing to map
            for name in wanted:
                out[name] = np.zeros(tensors[name]["shape"], dtype=np.float32)
            return out, metadata
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for name in wanted:
                info = tensors[name]
                begin, end = info["data_offsets"]
                raw = np.frombuffer(mm, dtype=np.uint8, count=end - begin, offset=data_start + begin)
                out[name] = _to_float32(raw, info["dtype"]).reshape(info["shape"])
                del raw  # release the buffer export before the map closes
    return out, metadata


# --------------------------------------------------------------------------------------------
# adapter_config.json
# --------------------------------------------------------------------------------------------

# Options that change the forward pass in ways an additive per-row update cannot reproduce.
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora) rescales the adapted weight by a learned magnitude vector",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) activates the adapter only after invocation tokens",
    "layer_replication": "layer_replication builds a different stack of layers",
    "trainable_token_indices": "trainable_token_indices changes embedding rows",
    "target_parameters": "target_parameters adapts raw parameters (e.g. MoE experts), not linear projections",
    "use_qalora": "QA-LoRA (use_qalora) pools the input before lora_A",
    "use_bdlora": "BD-LoRA (use_bdlora) uses block-diagonal factors",
    "kasa_config": "KaSA (kasa_config) inserts a learned diagonal and truncates the base weight",
    "arrow_config": "Arrow (arrow_config) routes between several adapters per token",
    "monteclora_config": "MonteCLoRA (monteclora_config) samples the adapter weights",
    "modules_to_save": "modules_to_save stores full replacement modules",
    "enable_lora": "enable_lora (merged QKV LoRA from early PEFT) splits the update per output block",
}

# init_lora_weights values under which PEFT rewrites the base weights when it loads the adapter.
_BASE_MODIFYING_INITS = ("pissa", "corda", "olora", "lora_ga", "loftq")

# Options that do not change inference (provenance, training or initialisation settings, targeting).
_KNOWN_OPTIONS = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout",
    "fan_in_fan_out", "bias", "use_rslora", "init_lora_weights", "layers_to_transform",
    "layers_pattern", "rank_pattern", "alpha_pattern", "megatron_config", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
    "runtime_config", "lora_bias", "ensure_weight_tying", "velora_config", "merge_weights",
}


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or (isinstance(value, (list, dict, tuple)) and not value)


def _number(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LoraFormatError(f"{where}: {what} must be a finite number, found {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise LoraFormatError(f"{where}: {what} must be a finite number, found {_short(value)}")
    return value


def _short(value: Any) -> str:
    """A bounded-length repr (never raises for huge integers)."""
    if isinstance(value, int) and value.bit_length() >= 1000:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"a {type(value).__name__} too large to show"
    return text if len(text) <= 200 else text[:200] + "..."


def _check_scale(scale: Any, what: str, where: str) -> float:
    """``scale`` as a float, refused when it is not finite or overflows float32."""
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise LoraFormatError(
            f"{where}: {what} gives a scale of {value!r}, which is not representable as a finite float32 "
            f"(largest {_FLOAT32_MAX!r})"
        )
    return value


def _pattern_lookup(patterns: Mapping[str, Any], name: str):
    """PEFT's rule: the first key, in dict order, with ``re.match(rf"(.*\\.)?({key})$", name)``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return key, value
    return None, None


class _Config:
    """The parts of a PEFT LoRA config that decide where and how strongly LoRA applies."""

    def __init__(self, raw: Any, where: str):
        if not isinstance(raw, dict):
            raise LoraFormatError(f"{where}: must be a JSON object, found {type(raw).__name__}")
        self.where = where
        peft_type = raw.get("peft_type")
        if peft_type != "LORA":
            raise LoraFormatError(f"{where}: peft_type must be 'LORA', found {peft_type!r}")

        for key, why in _REFUSED_OPTIONS.items():
            if not _is_empty(raw.get(key)):
                raise LoraFormatError(
                    f"{where}: {key}={raw[key]!r} is not supported: {why}, which an additive LoRA hook "
                    f"cannot reproduce"
                )
        bias = raw.get("bias", "none")
        if bias not in (None, "none"):
            raise LoraFormatError(
                f"{where}: bias={bias!r} is not supported (expected 'none'): the adapter changes the base "
                f"layers' biases, which are not stored as LoRA factors"
            )
        init = raw.get("init_lora_weights", True)
        if not isinstance(init, (bool, str)):
            raise LoraFormatError(f"{where}: init_lora_weights must be a boolean or a string, found {_short(init)}")
        if isinstance(init, str) and any(init.lower().startswith(p) for p in _BASE_MODIFYING_INITS):
            raise LoraFormatError(
                f"{where}: init_lora_weights={init!r} is not supported: PEFT rewrites the base model's weights "
                f"for this initialisation, so the adapter is not an additive update of the original model "
                f"(convert it to a plain LoRA adapter with PEFT's path_initial_model_for_weight_conversion)"
            )
        for key, value in raw.items():
            if key not in _KNOWN_OPTIONS and key not in _REFUSED_OPTIONS and not _is_empty(value):
                warnings.warn(
                    f"{where}: unknown option {key}={value!r} ignored; a newer PEFT may use it to change "
                    f"the adapter in a way lorahook does not reproduce",
                    UserWarning,
                    stacklevel=4,
                )
        if raw.get("fan_in_fan_out"):
            warnings.warn(
                f"{where}: fan_in_fan_out=True ignored: it has no effect on nn.Linear projections, where "
                f"lora_A is (r, in) and lora_B is (out, r)",
                UserWarning,
                stacklevel=4,
            )
        self.velora = not _is_empty(raw.get("velora_config"))
        if self.velora:
            warnings.warn(
                f"{where}: velora_config only changes training; its lora_velora_embed tensors are ignored",
                UserWarning,
                stacklevel=4,
            )

        r = raw.get("r", 8)
        if not _is_int(r) or r <= 0:
            raise LoraFormatError(f"{where}: r must be a positive integer, found {r!r}")
        self.r = r
        self.lora_alpha = _number(raw.get("lora_alpha", 8), "lora_alpha", where)
        self.use_rslora = bool(raw.get("use_rslora", False))
        self.lora_bias = bool(raw.get("lora_bias", False))
        self.rank_pattern = self._pattern(raw, "rank_pattern", integer=True)
        self.alpha_pattern = self._pattern(raw, "alpha_pattern", integer=False)

        self.target_modules = self._strings(raw, "target_modules")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self._compile(self.target_modules, f"target_modules={_short(self.target_modules)}")
        self.exclude_modules = self._strings(raw, "exclude_modules")
        if isinstance(self.exclude_modules, str):
            self._compile(self.exclude_modules, f"exclude_modules={_short(self.exclude_modules)}")
        lt = raw.get("layers_to_transform")
        if lt is not None and not _is_int(lt) and not (isinstance(lt, list) and all(_is_int(i) for i in lt)):
            raise LoraFormatError(f"{where}: layers_to_transform must be an integer or a list of integers, found {lt!r}")
        self.layers_to_transform = lt
        self.layers_pattern = self._strings(raw, "layers_pattern")
        self.base_model = raw.get("base_model_name_or_path")
        self.revision = raw.get("revision")

    def _strings(self, raw: dict, key: str):
        """``raw[key]`` when it is absent, a string or a list of strings; else refused."""
        value = raw.get(key)
        if value is not None and not isinstance(value, str) and not (
            isinstance(value, list) and all(isinstance(t, str) for t in value)
        ):
            raise LoraFormatError(f"{self.where}: {key} must be a string or a list of strings, found {value!r}")
        return value

    def _compile(self, pattern: str, what: str) -> None:
        """Refuse ``pattern`` (described in messages as ``what``) unless it is a valid regex."""
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise LoraFormatError(f"{self.where}: {what} is not a valid regular expression: {exc}") from None

    def _pattern(self, raw: dict, key: str, integer: bool) -> Dict[str, Any]:
        value = raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise LoraFormatError(f"{self.where}: {key} must be an object, found {value!r}")
        for k, v in value.items():
            self._compile(k, f"{key} key {k!r}")
            if integer:
                if not _is_int(v) or v <= 0:
                    raise LoraFormatError(f"{self.where}: {key}[{k!r}] must be a positive integer, found {v!r}")
            else:
                _number(v, f"{key}[{k!r}]", self.where)
        return dict(value)

    def rank_and_scale(self, path: str) -> Tuple[int, float]:
        """The ``(r, scale)`` PEFT uses for the module at ``path`` (its name in the base model)."""
        _, r = _pattern_lookup(self.rank_pattern, path)
        _, alpha = _pattern_lookup(self.alpha_pattern, path)
        r = self.r if r is None else r
        alpha = self.lora_alpha if alpha is None else alpha
        try:
            scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        except OverflowError:
            raise LoraFormatError(
                f"{self.where}: module {path!r}: lora_alpha={_short(alpha)} / r={_short(r)} cannot be computed "
                f"(too large)"
            ) from None
        return r, _check_scale(scale, f"module {path!r}: lora_alpha={_short(alpha)} with r={_short(r)}", self.where)

    def targets(self, path: str, layer_idx: int) -> Optional[str]:
        """``None`` when PEFT would place a LoRA layer on ``path``, else the reason it would not."""
        em = self.exclude_modules
        if em:
            if isinstance(em, str) and re.fullmatch(em, path):
                return f"exclude_modules={em!r} excludes it"
            if isinstance(em, list) and (path in em or any(path.endswith("." + e) for e in em)):
                return f"exclude_modules={em!r} excludes it"
        tm = self.target_modules
        if tm is None or tm == "all-linear":
            return None
        if isinstance(tm, str):
            return None if re.fullmatch(tm, path) else f"target_modules={tm!r} does not match it"
        if path in tm:
            return None
        if not any(path.endswith("." + t) for t in tm):
            return f"target_modules={tm!r} does not select it"
        lt = self.layers_to_transform
        if lt is None or (isinstance(lt, list) and not lt):
            return None
        allowed = [lt] if _is_int(lt) else lt
        if layer_idx not in allowed:
            return f"layers_to_transform={lt!r} does not include layer {layer_idx}"
        return None


# --------------------------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------------------------

_FACTOR_RE = re.compile(r"^(?P<path>.+?)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")


def _classify_non_factor(name: str) -> str:
    parts = name.split(".")
    if "lora_magnitude_vector" in parts:
        return "a DoRA magnitude vector (DoRA is not supported)"
    if "lora_embedding_A" in parts or "lora_embedding_B" in parts:
        return "an embedding LoRA factor (embedding LoRA is not supported)"
    if "modules_to_save" in parts or "original_module" in parts:
        return "a full-weight modules_to_save tensor (not supported)"
    if any(p.startswith("trainable_tokens") for p in parts):
        return "a trainable-tokens tensor (not supported)"
    if "lora_diag" in parts:
        return "a KaSA diagonal (KaSA is not supported)"
    if "base_layer" in parts or parts[-1] in ("weight", "bias"):
        return "a full base-model weight (as PEFT saves with save_embedding_layers); full-weight tensors are not supported"
    if any(p.startswith("lora_") for p in parts):
        return "a LoRA variant's tensor that lorahook does not know"
    return "not a LoRA factor (lora_A / lora_B); full-weight tensors are not supported"


def _parse_tensors(
    file_tensors: Mapping[str, dict], where: str, ignore_velora: bool
) -> Dict[Tuple[int, str], dict]:
    """Group tensor names into per-projection entries ``{key: {"path", "A", "B", "bias"}}``."""
    entries: Dict[Tuple[int, str], dict] = {}
    for name in sorted(file_tensors):
        m = _FACTOR_RE.match(name)
        if m is None:
            if ignore_velora and "lora_velora_embed" in name.split("."):
                continue
            raise LoraFormatError(f"{where}: tensor {name!r} is {_classify_non_factor(name)}")
        path, kind, adapter_name, param = m.group("path", "kind", "adapter", "param")
        if path.startswith(_PEFT_PREFIX):
            path = path[len(_PEFT_PREFIX):]
        if kind == "lora_A" and param == "bias":
            raise LoraFormatError(f"{where}: tensor {name!r}: lora_A has no bias in PEFT's LoRA")
        try:
            key = module_key(path)
        except LoraFormatError as exc:
            raise LoraFormatError(f"{where}: tensor {name!r}: {exc}") from None
        entry = entries.setdefault(key, {"path": path, "adapter": adapter_name})
        if entry["path"] != path or entry["adapter"] != adapter_name:
            first = entry["path"] + (f" (adapter {entry['adapter']!r})" if entry["adapter"] else "")
            second = path + (f" (adapter {adapter_name!r})" if adapter_name else "")
            raise LoraFormatError(
                f"{where}: duplicate weights for layer {key[0]} module {key[1]!r}: {first} and {second}"
            )
        slot = {"lora_A": "A", "lora_B": "B"}[kind] if param == "weight" else "bias"
        entry[slot] = name
    for key, entry in entries.items():
        for have, need in (("A", "B"), ("B", "A"), ("bias", "B")):
            if have in entry and need not in entry:
                missing = "lora_A.weight" if need == "A" else "lora_B.weight"
                raise LoraFormatError(
                    f"{where}: tensor {entry[have]!r} has no matching {missing} for module {entry['path']!r}"
                )
    return entries


def _check_factor_shapes(file_tensors: Mapping[str, dict], entry: dict, where: str) -> int:
    a_shape = file_tensors[entry["A"]]["shape"]
    b_shape = file_tensors[entry["B"]]["shape"]
    if len(b_shape) == 3:
        raise LoraFormatError(
            f"{where}: tensor {entry['B']!r} is 3-D {b_shape}: legacy merged-QKV lora_B is not supported"
        )
    for n, s in ((entry["A"], a_shape), (entry["B"], b_shape)):
        if len(s) != 2:
            raise LoraFormatError(f"{where}: tensor {n!r} must be 2-D, found shape {s}")
    if a_shape[0] != b_shape[1]:
        raise LoraFormatError(
            f"{where}: ranks disagree for module {entry['path']!r}: {entry['A']!r} is {a_shape} "
            f"(rank {a_shape[0]}) but {entry['B']!r} is {b_shape} (rank {b_shape[1]})"
        )
    if "bias" in entry:
        bias_shape = file_tensors[entry["bias"]]["shape"]
        if bias_shape != (b_shape[0],):
            raise LoraFormatError(
                f"{where}: tensor {entry['bias']!r} has shape {bias_shape}, expected ({b_shape[0]},)"
            )
    return a_shape[0]


def _build(
    weights_path: Path,
    header: tuple,
    entries: Mapping[Tuple[int, str], dict],
    scales: Mapping[Tuple[int, str], float],
    name: Optional[str],
    metadata: Dict[str, str],
):
    """The adapter from ``entries``, reading their tensors with the already parsed ``header``."""
    from .adapter import LoraAdapter, LoraLayer

    wanted = [n for e in entries.values() for n in (e["A"], e["B"], e.get("bias")) if n is not None]
    arrays, _ = read_safetensors(weights_path, wanted, header)
    for n in wanted:
        if not np.isfinite(arrays[n]).all():
            bad = int((~np.isfinite(arrays[n])).sum())
            raise LoraFormatError(f"{weights_path}: tensor {n!r} has {bad} non-finite value(s)")
    layers = {}
    paths = {}
    for key in sorted(entries):
        e = entries[key]
        bias = arrays[e["bias"]] if "bias" in e else None
        try:
            layers[key] = LoraLayer(arrays[e["A"]], arrays[e["B"]], scale=scales[key], bias=bias)
        except (ValueError, TypeError, OverflowError) as exc:
            raise LoraFormatError(f"{weights_path}: module {e['path']!r}: {exc}") from None
        paths[key] = e["path"]
    if not layers:
        raise LoraFormatError(f"{weights_path}: holds no LoRA weights")
    return LoraAdapter(layers, name=name, metadata=metadata, module_paths=paths)


def _file_metadata(metadata: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in metadata.items() if k != "format"}


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def load_peft(path: os.PathLike):
    """Load a PEFT LoRA adapter directory as a :class:`lorahook.LoraAdapter`.

    Reads ``adapter_config.json`` and ``adapter_model.safetensors`` (a pickle ``adapter_model.bin``
    is never opened; if it is the only weights file the load is refused). Keys may carry PEFT's
    ``base_model.model.`` prefix and an adapter-name segment (``lora_A.default.weight``). The
    original module paths are kept in ``adapter.module_paths`` so that :func:`save_peft` writes
    them back. ``adapter.metadata`` is the safetensors header metadata (without ``format``), with
    ``base_model`` / ``revision`` filled from the config when absent; ``adapter.name`` is the
    metadata's ``name`` or else the directory name.

    Raises :class:`lorahook.LoraFormatError` for anything lorahook cannot apply exactly as PEFT
    does; nothing is built unless every check passes.
    """
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"PEFT adapter directory {str(directory)!r} does not exist")
    if not directory.is_dir():
        raise LoraFormatError(
            f"{directory}: expected a PEFT adapter directory (with {CONFIG_NAME}); for a bare safetensors "
            f"file use LoraAdapter.from_safetensors"
        )
    config_path = directory / CONFIG_NAME
    weights_path = directory / WEIGHTS_NAME
    if not config_path.is_file():
        raise LoraFormatError(f"{directory}: no {CONFIG_NAME}; not a PEFT adapter directory")
    if not weights_path.is_file():
        pickles = [n for n in PICKLE_NAMES if (directory / n).exists()]
        if pickles:
            raise LoraFormatError(
                f"{directory}: only a pickle weights file ({pickles[0]}) is present; lorahook never unpickles "
                f"files. Convert it to {WEIGHTS_NAME} with PEFT (save_pretrained(safe_serialization=True))"
            )
        raise LoraFormatError(f"{directory}: no {WEIGHTS_NAME}")
    try:
        with open(config_path, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LoraFormatError(f"{config_path}: not valid JSON: {exc!r}"[:500]) from None
    config = _Config(raw, str(config_path))

    header = read_safetensors_header(weights_path)
    file_tensors, file_meta = header[:2]
    where = str(weights_path)
    entries = _parse_tensors(file_tensors, where, ignore_velora=config.velora)
    scales = {}
    for key, entry in entries.items():
        rank = _check_factor_shapes(file_tensors, entry, where)
        reason = config.targets(entry["path"], key[0])
        if reason is not None:
            raise LoraFormatError(
                f"{where}: LoRA weights for module {entry['path']!r}, but {reason}; PEFT would ignore them"
            )
        if "bias" in entry and not config.lora_bias:
            raise LoraFormatError(
                f"{where}: tensor {entry['bias']!r} is a lora_B bias but the config has lora_bias=false"
            )
        if config.lora_bias and "bias" not in entry:
            raise LoraFormatError(
                f"{where}: the config has lora_bias=true but module {entry['path']!r} has no lora_B bias tensor"
            )
        r, scale = config.rank_and_scale(entry["path"])
        if r != rank:
            raise LoraFormatError(
                f"{where}: module {entry['path']!r} has rank {rank} in its tensors but the config gives r={r}"
                f" (from r / rank_pattern)"
            )
        scales[key] = scale

    metadata = _file_metadata(file_meta)
    if config.base_model and "base_model" not in metadata and isinstance(config.base_model, str):
        metadata["base_model"] = config.base_model
    if config.revision and "revision" not in metadata and isinstance(config.revision, str):
        metadata["revision"] = config.revision
    name = metadata.get("name") or directory.resolve().name or None
    return _build(weights_path, header, entries, scales, name, metadata)


def load_safetensors(path: os.PathLike, alpha: Optional[float] = None):
    """Load a bare safetensors file of PEFT-named LoRA factors as a :class:`lorahook.LoraAdapter`.

    There is no config: every module gets ``scale = alpha / rank``, with ``alpha`` from the
    argument, else the header metadata ``lora_alpha`` (or ``alpha``), else the module's rank (scale
    1). ``lora_B`` bias tensors, if present, are used. Same tensor rules and refusals as
    :func:`load_peft`.
    """
    weights_path = Path(path)
    if not weights_path.exists():
        raise FileNotFoundError(f"safetensors file {str(weights_path)!r} does not exist")
    if weights_path.is_dir():
        raise LoraFormatError(f"{weights_path}: is a directory; for a PEFT adapter directory use LoraAdapter.from_peft")
    where = str(weights_path)
    header = read_safetensors_header(weights_path)
    file_tensors, file_meta = header[:2]
    if alpha is not None:
        alpha = _number(alpha, "alpha", where)
    else:
        for k in ("lora_alpha", "alpha"):
            if k in file_meta:
                try:
                    alpha = float(file_meta[k])
                except ValueError:
                    raise LoraFormatError(f"{where}: header metadata {k}={file_meta[k]!r} is not a number") from None
                if not math.isfinite(alpha):
                    raise LoraFormatError(f"{where}: header metadata {k}={file_meta[k]!r} is not finite")
                break
    entries = _parse_tensors(file_tensors, where, ignore_velora=False)
    scales = {}
    for key, entry in entries.items():
        rank = _check_factor_shapes(file_tensors, entry, where)
        if rank == 0:
            scales[key] = 1.0
        else:
            try:
                scale = (rank if alpha is None else alpha) / rank
            except OverflowError:
                scale = math.inf
            scales[key] = _check_scale(scale, f"module {entry['path']!r}: alpha={_short(alpha)} with rank {rank}", where)
    metadata = _file_metadata(file_meta)
    name = metadata.get("name") or weights_path.stem
    return _build(weights_path, header, entries, scales, name, metadata)


def _json_number(x: float):
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else float(x)


def save_peft(adapter, path: os.PathLike, architecture: Optional[str] = None, metadata: Optional[Mapping[str, str]] = None):
    """Write ``adapter`` as a PEFT adapter directory that ``peft.PeftModel.from_pretrained`` loads.

    Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (float32) under ``path``
    (created if needed). Module paths come from ``architecture`` when given (``"qwen3_5"``,
    ``"qwen3_5_multimodal"`` or ``"bert"``), else from ``adapter.module_paths`` (adapters loaded
    from PEFT files); a key with neither raises ``ValueError``. ``target_modules`` lists the exact
    module paths, so PEFT adapts exactly the written modules. The most common rank and alpha become
    ``r`` / ``lora_alpha``; other modules get ``rank_pattern`` / ``alpha_pattern`` entries anchored to
    their full path (``^`` + escaped path), so each entry matches that module only. When any layer
    has a bias, ``lora_bias`` is set and layers without one get a zero bias. Rank-0 layers apply
    nothing and are not written.

    ``metadata`` (str -> str, e.g. ``name``, ``base_model``, ``revision``) is merged over
    ``adapter.metadata`` (plus ``name`` from ``adapter.name``) and stored in the safetensors header; ``base_model`` also becomes the
    config's ``base_model_name_or_path``. Returns the directory path.
    """
    from safetensors.numpy import save_file

    if architecture is not None and architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(map(repr, ARCHITECTURES))}, got {architecture!r}")
    meta = dict(adapter.metadata)
    if adapter.name is not None:
        meta.setdefault("name", str(adapter.name))
    if metadata:
        meta.update(metadata)
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, found {k!r}: {v!r}")
    stored_paths = adapter.module_paths

    items: List[Tuple[str, Any]] = []
    seen: Dict[str, Tuple[int, str]] = {}
    for key in sorted(adapter.layers):
        layer = adapter.layers[key]
        if layer.rank == 0:
            continue
        if architecture is not None:
            mpath = module_path(key[0], key[1], architecture)
        elif key in stored_paths:
            mpath = stored_paths[key]
        else:
            raise ValueError(
                f"layer {key[0]} module {key[1]!r} has no stored module path; pass architecture= one of "
                f"{', '.join(map(repr, ARCHITECTURES))}"
            )
        if mpath in seen:
            raise ValueError(f"module path {mpath!r} would be written for both {seen[mpath]} and {key}")
        seen[mpath] = key
        items.append((mpath, layer))
    if not items:
        raise ValueError("adapter has no layer with rank > 0; PEFT cannot represent an empty adapter")

    # Defaults: the most common rank, then the most common alpha among layers of that rank
    # (ties go to the first in key order); everything else becomes a pattern entry.
    r = Counter(layer.rank for _, layer in items).most_common(1)[0][0]
    alphas = [float(layer.scale) * layer.rank for _, layer in items]
    lora_alpha = Counter(a for a, (_, layer) in zip(alphas, items) if layer.rank == r).most_common(1)[0][0]
    rank_pattern: Dict[str, int] = {}
    alpha_pattern: Dict[str, Any] = {}
    for (mpath, layer), alpha in zip(items, alphas):
        anchored = "^" + re.escape(mpath)
        if layer.rank != r:
            rank_pattern[anchored] = int(layer.rank)
        if alpha != lora_alpha:
            alpha_pattern[anchored] = _json_number(alpha)
    lora_bias = any(layer.bias is not None for _, layer in items)

    tensors: Dict[str, np.ndarray] = {}
    for mpath, layer in items:
        prefix = _PEFT_PREFIX + mpath
        tensors[prefix + ".lora_A.weight"] = np.ascontiguousarray(layer.a, dtype=np.float32)
        tensors[prefix + ".lora_B.weight"] = np.ascontiguousarray(layer.b, dtype=np.float32)
        if lora_bias:
            bias = layer.bias if layer.bias is not None else np.zeros(layer.d_out, dtype=np.float32)
            tensors[prefix + ".lora_B.bias"] = np.ascontiguousarray(bias, dtype=np.float32)

    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": meta.get("base_model"),
        "inference_mode": True,
        "r": int(r),
        "lora_alpha": _json_number(lora_alpha),
        "lora_dropout": 0.0,
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "lora_bias": lora_bias,
        "target_modules": [mpath for mpath, _ in items],
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    header_meta = {"format": "pt", **meta}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata=header_meta)
    with open(out / CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return out
