"""``adapter_config.json``: which PEFT options lorahook can apply exactly, and the scales.

DoRA (``use_dora``) and ``modules_to_save`` are read (see ``lorahook.files.reader``).
Options that change the forward pass in a way lorahook cannot reproduce (aLoRA, layer replication, trainable tokens, target parameters,
``bias != "none"``, LoRA variants, base-weight-modifying initialisations such as PiSSA) are
refused with :class:`~lorahook.LoraFormatError` naming the option; unknown options set to
anything but an empty value produce a warning naming them.

The scale of a module is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``),
where ``r`` and ``lora_alpha`` may be overridden per module by ``rank_pattern`` /
``alpha_pattern``: the first key, in dict order, for which
``re.match(rf"(.*\\.)?({key})$", module_path)`` matches.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from ..errors import LoraFormatError
from .._values import finite_real
from .._values import is_int, short

__all__ = ["PeftLoraConfig", "CONFIG_NAME", "pattern_lookup", "check_scale", "finite_number"]

CONFIG_NAME = "adapter_config.json"

# Largest finite float32; scales beyond it would turn every update into inf.
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# Options that change the forward pass in ways an additive per-row update cannot reproduce.
_REFUSED_OPTIONS = {
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) activates the adapter only after invocation tokens",
    "layer_replication": "layer_replication builds a different stack of layers",
    "trainable_token_indices": "trainable_token_indices changes embedding rows",
    "target_parameters": "target_parameters adapts raw parameters (e.g. MoE experts), not linear projections",
    "use_qalora": "QA-LoRA (use_qalora) pools the input before lora_A",
    "use_bdlora": "BD-LoRA (use_bdlora) uses block-diagonal factors",
    "kasa_config": "KaSA (kasa_config) inserts a learned diagonal and truncates the base weight",
    "arrow_config": "Arrow (arrow_config) routes between several adapters per token",
    "monteclora_config": "MonteCLoRA (monteclora_config) samples the adapter weights",
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
    "use_dora", "modules_to_save",
}


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == "" or (isinstance(value, (list, dict, tuple)) and not value)


def finite_number(value: Any, what: str, where: str) -> float:
    """``value`` (a JSON number) as a finite float; :class:`LoraFormatError` naming ``where``."""
    return finite_real(value, f"{where}: {what}", type_error=LoraFormatError,
                       value_error=LoraFormatError)


def check_scale(scale: Any, what: str, where: str) -> float:
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


def pattern_lookup(patterns: Mapping[str, Any], name: str):
    """PEFT's rule: the first key, in dict order, with ``re.match(rf"(.*\\.)?({key})$", name)``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return key, value
    return None, None


class PeftLoraConfig:
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
            raise LoraFormatError(f"{where}: init_lora_weights must be a boolean or a string, found {short(init)}")
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
        if not is_int(r) or r <= 0:
            raise LoraFormatError(f"{where}: r must be a positive integer, found {r!r}")
        self.r = r
        self.lora_alpha = finite_number(raw.get("lora_alpha", 8), "lora_alpha", where)
        self.use_rslora = bool(raw.get("use_rslora", False))
        self.lora_bias = bool(raw.get("lora_bias", False))
        self.use_dora = bool(raw.get("use_dora", False))
        if self.use_dora and self.lora_bias:
            raise LoraFormatError(f"{where}: use_dora with lora_bias is not supported")
        self.modules_to_save = self._strings(raw, "modules_to_save")
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = [self.modules_to_save]
        self.rank_pattern = self._pattern(raw, "rank_pattern", integer=True)
        self.alpha_pattern = self._pattern(raw, "alpha_pattern", integer=False)

        self.target_modules = self._strings(raw, "target_modules")
        # exact paths are looked up once per module: a set, for adapters with hundreds of them
        self._target_set = frozenset(self.target_modules) if isinstance(self.target_modules, list) else frozenset()
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self._compile(self.target_modules, f"target_modules={short(self.target_modules)}")
        self.exclude_modules = self._strings(raw, "exclude_modules")
        if isinstance(self.exclude_modules, str):
            self._compile(self.exclude_modules, f"exclude_modules={short(self.exclude_modules)}")
        lt = raw.get("layers_to_transform")
        if lt is not None and not is_int(lt) and not (isinstance(lt, list) and all(is_int(i) for i in lt)):
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
                if not is_int(v) or v <= 0:
                    raise LoraFormatError(f"{self.where}: {key}[{k!r}] must be a positive integer, found {v!r}")
            else:
                finite_number(v, f"{key}[{k!r}]", self.where)
        return dict(value)

    def rank_and_scale(self, path: str) -> Tuple[int, float]:
        """The ``(r, scale)`` PEFT uses for the module at ``path`` (its name in the base model)."""
        _, r = pattern_lookup(self.rank_pattern, path)
        _, alpha = pattern_lookup(self.alpha_pattern, path)
        r = self.r if r is None else r
        alpha = self.lora_alpha if alpha is None else alpha
        try:
            scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        except OverflowError:
            raise LoraFormatError(
                f"{self.where}: module {path!r}: lora_alpha={short(alpha)} / r={short(r)} cannot be computed "
                f"(too large)"
            ) from None
        return r, check_scale(scale, f"module {path!r}: lora_alpha={short(alpha)} with r={short(r)}", self.where)

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
        if path in self._target_set:
            return None
        if not any(path.endswith("." + t) for t in tm):
            return f"target_modules={tm!r} does not select it"
        lt = self.layers_to_transform
        if lt is None or (isinstance(lt, list) and not lt):
            return None
        allowed = [lt] if is_int(lt) else lt
        if layer_idx not in allowed:
            return f"layers_to_transform={lt!r} does not include layer {layer_idx}"
        return None
