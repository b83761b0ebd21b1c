"""Reading PEFT adapter files into plain data.

A PEFT adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``.
:func:`read_peft` returns an :class:`AdapterData` holding, per ``(layer_idx, module)``, the
float32 factors, the scale PEFT applies, the optional ``lora_B`` bias and the module's
path in the base model, plus the adapter's name and metadata. ``LoraAdapter.from_peft``
builds the adapter from it; this module never imports the adapter classes.

Keys may carry PEFT's ``base_model.model.`` prefix and an adapter-name segment
(``lora_A.default.weight``); module paths are placed with the rules of every model family
lorahook knows (``lorahook.models.module_key``). Reading is all-or-nothing: every tensor
is checked before any data is returned.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from ..errors import LoraFormatError
from ..models import PEFT_PREFIX, module_key
from .peft_config import CONFIG_NAME, PeftLoraConfig, check_scale, finite_number
from .safetensors import SafetensorsFile, kept_derived, short

__all__ = ["read_peft", "read_safetensors_adapter", "AdapterData", "LayerData",
           "WEIGHTS_NAME", "PICKLE_NAMES"]

WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")


class LayerData(NamedTuple):
    """One projection's update as read: ``a`` ``(rank, d_in)``, ``b`` ``(d_out, rank)``,
    ``bias`` ``(d_out,)`` or ``None``, the scale, and the module path.

    The arrays are read-only float32 views of one buffer made by the read, holding finite values:
    ``a`` and ``bias`` C-contiguous, ``b`` the transpose of a C-contiguous ``B^T`` ``(rank, d_out)``
    (so ``b.T`` is the layout the kernels keep).  Their shapes are checked (ranks agree, ``d_in``
    and ``d_out`` at least 1, dimensions below 2**31, a bias of ``d_out``) and the scale is a
    finite float32 value: a layer keeps them as they are."""

    a: np.ndarray
    b: np.ndarray
    scale: float
    bias: Optional[np.ndarray]
    path: str


@dataclass
class AdapterData:
    """What an adapter file holds: ``layers`` maps ``(layer_idx, module)`` to
    :class:`LayerData`; ``source`` is the weights file, for messages."""

    layers: Dict[Tuple[int, str], LayerData]
    name: Optional[str]
    metadata: Dict[str, str] = field(default_factory=dict)
    source: str = ""

    @property
    def module_paths(self) -> Dict[Tuple[int, str], str]:
        return {key: layer.path for key, layer in self.layers.items()}


# --------------------------------------------------------------------------- tensor names

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
    keys: Dict[str, Tuple[int, str]] = {}  # lora_A and lora_B of a module share its path
    match = _FACTOR_RE.match
    for name in sorted(file_tensors):
        m = match(name)
        if m is None:
            if ignore_velora and "lora_velora_embed" in name.split("."):
                continue
            raise LoraFormatError(f"{where}: tensor {name!r} is {_classify_non_factor(name)}")
        path, kind, adapter_name, param = m.groups()
        if path.startswith(PEFT_PREFIX):
            path = path[len(PEFT_PREFIX):]
        if kind == "lora_A" and param == "bias":
            raise LoraFormatError(f"{where}: tensor {name!r}: lora_A has no bias in PEFT's LoRA")
        key = keys.get(path)
        if key is None:
            try:
                key = keys[path] = module_key(path)
            except LoraFormatError as exc:
                raise LoraFormatError(f"{where}: tensor {name!r}: {exc}") from None
        entry = entries.get(key)
        if entry is None:
            entry = entries[key] = {"path": path, "adapter": adapter_name}
        elif entry["path"] != path or entry["adapter"] != adapter_name:
            first = entry["path"] + (f" (adapter {entry['adapter']!r})" if entry["adapter"] else "")
            second = path + (f" (adapter {adapter_name!r})" if adapter_name else "")
            raise LoraFormatError(
                f"{where}: duplicate weights for layer {key[0]} module {key[1]!r}: {first} and {second}"
            )
        slot = "bias" if param == "bias" else "A" if kind == "lora_A" else "B"
        if slot in entry:  # the same tensor under two names (with and without the PEFT prefix)
            raise LoraFormatError(
                f"{where}: duplicate weights for layer {key[0]} module {key[1]!r}: tensors "
                f"{entry[slot]!r} and {name!r}"
            )
        entry[slot] = name
    for key, entry in entries.items():
        for have, need in (("A", "B"), ("B", "A"), ("bias", "B")):
            if have in entry and need not in entry:
                missing = "lora_A.weight" if need == "A" else "lora_B.weight"
                raise LoraFormatError(
                    f"{where}: tensor {entry[have]!r} has no matching {missing} for module {entry['path']!r}"
                )
    return entries


def _entries(file_tensors: Mapping[str, dict], where: str, ignore_velora: bool):
    """:func:`_parse_tensors`, read-only, kept with a kept layout (a refusal is not kept)."""
    return kept_derived(file_tensors, ("entries", ignore_velora), lambda: MappingProxyType(
        {key: MappingProxyType(entry) for key, entry in _parse_tensors(file_tensors, where, ignore_velora).items()}))


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
    if a_shape[1] == 0 or b_shape[0] == 0:
        raise LoraFormatError(
            f"{where}: module {entry['path']!r}: {entry['A']!r} is {a_shape} and {entry['B']!r} is "
            f"{b_shape}: d_in (columns of lora_A) and d_out (rows of lora_B) must be >= 1"
        )
    if "bias" in entry:
        bias_shape = file_tensors[entry["bias"]]["shape"]
        if bias_shape != (b_shape[0],):
            raise LoraFormatError(
                f"{where}: tensor {entry['bias']!r} has shape {bias_shape}, expected ({b_shape[0]},)"
            )
    return a_shape[0]


def _collect(
    weights: SafetensorsFile,
    entries: Mapping[Tuple[int, str], dict],
    scales: Mapping[Tuple[int, str], float],
    name: Optional[str],
    metadata: Dict[str, str],
) -> AdapterData:
    """Read the tensors of ``entries`` from the open ``weights`` into plain data.

    One read (:meth:`SafetensorsFile.read_float32`, through the descriptor the header came
    from): every value is copied once from the file into the array a layer keeps, ``lora_B``
    transposed on the way (the ``B^T`` layout the kernels use), and refused if it is not finite.
    """
    weights_path = weights.path
    if not entries:
        raise LoraFormatError(f"{weights_path}: holds no LoRA weights")
    wanted = [n for e in entries.values() for n in (e["A"], e["B"], e.get("bias")) if n is not None]
    arrays, _ = weights.read_float32(wanted, transposed=[e["B"] for e in entries.values()],
                                     finite=True)
    layers = {}
    for key in sorted(entries):
        e = entries[key]
        bias = arrays[e["bias"]] if "bias" in e else None
        layers[key] = LayerData(arrays[e["A"]], arrays[e["B"]].T, scales[key], bias, e["path"])
    return AdapterData(layers, name=name, metadata=metadata, source=str(weights_path))


def _checked_scales(file_tensors, entries, config: PeftLoraConfig, where: str) -> Dict[Tuple[int, str], float]:
    """Each entry's scale, once its shapes, rank and bias agree with the config (else raises)."""
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
    return scales


_KEPT_CONFIG_BYTES = 1 << 16


def _file_metadata(metadata: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in metadata.items() if k != "format"}


# --------------------------------------------------------------------------- reading

def read_peft(path: os.PathLike) -> AdapterData:
    """Read a PEFT LoRA adapter directory (what ``LoraAdapter.from_peft`` builds from).

    Reads ``adapter_config.json`` and ``adapter_model.safetensors`` (a pickle ``adapter_model.bin``
    is never opened; if it is the only weights file the read is refused). Each layer keeps its
    module path, so that ``save_peft`` writes it back. The metadata is the safetensors header
    metadata (without ``format``), with ``base_model`` / ``revision`` filled from the config when
    absent; the name is the metadata's ``name`` or else the directory name.

    Raises :class:`lorahook.LoraFormatError` for anything lorahook cannot apply exactly as PEFT
    does; nothing is returned unless every check passes.
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
            raw_config = f.read()
        raw = json.loads(raw_config.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LoraFormatError(f"{config_path}: not valid JSON: {exc!r}"[:500]) from None
    config = PeftLoraConfig(raw, str(config_path))

    with SafetensorsFile(weights_path) as weights:  # header and data: one descriptor
        header = weights.header
        file_tensors, file_meta = header[:2]
        where = str(weights_path)
        entries = _entries(file_tensors, where, config.velora)
        def checked_scales():
            return MappingProxyType(_checked_scales(file_tensors, entries, config, where))

        # one layout under one config has one set of scales: kept with the layout (small configs)
        scales = (kept_derived(file_tensors, ("scales", raw_config), checked_scales)
                  if len(raw_config) <= _KEPT_CONFIG_BYTES else checked_scales())

        metadata = _file_metadata(file_meta)
        if config.base_model and "base_model" not in metadata and isinstance(config.base_model, str):
            metadata["base_model"] = config.base_model
        if config.revision and "revision" not in metadata and isinstance(config.revision, str):
            metadata["revision"] = config.revision
        name = metadata.get("name") or directory.resolve().name or None
        return _collect(weights, entries, scales, name, metadata)


def read_safetensors_adapter(path: os.PathLike, alpha: Optional[float] = None) -> AdapterData:
    """Read a bare safetensors file of PEFT-named LoRA factors (``LoraAdapter.from_safetensors``).

    There is no config: every module gets ``scale = alpha / rank``, with ``alpha`` from the
    argument, else the header metadata ``lora_alpha`` (or ``alpha``), else the module's rank (scale
    1). ``lora_B`` bias tensors, if present, are used. Same tensor rules and refusals as
    :func:`read_peft`.
    """
    weights_path = Path(path)
    if not weights_path.exists():
        raise FileNotFoundError(f"safetensors file {str(weights_path)!r} does not exist")
    if weights_path.is_dir():
        raise LoraFormatError(f"{weights_path}: is a directory; for a PEFT adapter directory use LoraAdapter.from_peft")
    where = str(weights_path)
    with SafetensorsFile(weights_path) as weights:  # header and data: one descriptor
        header = weights.header
        file_tensors, file_meta = header[:2]
        if alpha is not None:
            alpha = finite_number(alpha, "alpha", where)
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
        entries = _entries(file_tensors, where, False)
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
                scales[key] = check_scale(scale, f"module {entry['path']!r}: alpha={short(alpha)} with rank {rank}", where)
        metadata = _file_metadata(file_meta)
        name = metadata.get("name") or weights_path.stem
        return _collect(weights, entries, scales, name, metadata)
