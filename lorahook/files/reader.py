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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from ..errors import LoraFormatError
from ..models import EMBEDDING_MODULES, PEFT_PREFIX, module_key, place
from .peft_config import CONFIG_NAME, PeftLoraConfig, check_scale, finite_number
from .._values import short
from .safetensors_file import SafetensorsFile, kept_derived

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
    magnitude: Optional[np.ndarray] = None   # DoRA's lora_magnitude_vector, (d_out,)
    embedding: bool = False                  # lora_embedding_A / lora_embedding_B


class SavedData(NamedTuple):
    """A module saved whole (``modules_to_save``): ``weight`` as in the file (a linear's
    ``(d_out, d_in)`` or an embedding's ``(num_embeddings, embedding_dim)``), ``bias`` or ``None``."""

    weight: np.ndarray
    bias: Optional[np.ndarray]
    embedding: bool
    path: str


@dataclass
class AdapterData:
    """What an adapter file holds: ``layers`` maps ``(layer_idx, module)`` to
    :class:`LayerData`; ``source`` is the weights file, for messages."""

    layers: Dict[Tuple[int, str], LayerData]
    name: Optional[str]
    metadata: Dict[str, str] = field(default_factory=dict)
    source: str = ""
    saved: Dict[Tuple[int, str], SavedData] = field(default_factory=dict)

    @property
    def module_paths(self) -> Dict[Tuple[int, str], str]:
        out = {key: layer.path for key, layer in self.layers.items()}
        out.update((key, item.path) for key, item in self.saved.items())
        return out


# --------------------------------------------------------------------------- tensor names

_FACTOR_RE = re.compile(r"^(?P<path>.+?)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")
# embedding factors and DoRA magnitudes: no ".weight" (PEFT keeps them as parameters)
_VECTOR_RE = re.compile(r"^(?P<path>.+?)\.(?P<kind>lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                        r"(?:\.(?P<adapter>[^.]+))?$")
_SAVED_RE = re.compile(r"^(?P<path>.+?)(?:\.modules_to_save\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$")
_SLOTS = {("lora_A", "weight"): "A", ("lora_B", "weight"): "B", ("lora_B", "bias"): "bias",
          ("lora_embedding_A", None): "A", ("lora_embedding_B", None): "B",
          ("lora_magnitude_vector", None): "M"}


def _saved_target(path: str, modules_to_save) -> bool:
    """PEFT's rule for ``modules_to_save``: the path is an entry or ends with ``.`` + an entry."""
    return any(path == m or path.endswith("." + m) for m in modules_to_save or ())


def _classify_non_factor(name: str) -> str:
    parts = name.split(".")
    if "modules_to_save" in parts or "original_module" in parts:
        return "a full-weight modules_to_save tensor of a module the config's modules_to_save does not list"
    if any(p.startswith("trainable_tokens") for p in parts):
        return "a trainable-tokens tensor (not supported)"
    if "lora_diag" in parts:
        return "a KaSA diagonal (KaSA is not supported)"
    if "base_layer" in parts or parts[-1] in ("weight", "bias"):
        return "a full base-model weight (as PEFT saves with save_embedding_layers); full-weight tensors are not supported"
    if any(p.startswith("lora_") for p in parts):
        return "a LoRA variant's tensor that lorahook does not know"
    return "not a LoRA factor (lora_A / lora_B); full-weight tensors are not supported"


class Parsed(NamedTuple):
    """A file's tensor names, grouped: ``lora`` maps a key to ``{"path", "A", "B", "bias",
    "M", "embedding"}``, ``saved`` a key to ``{"path", "weight", "bias"}`` (modules saved
    whole), and ``ignored`` lists the base weights PEFT saves beside embedding LoRA."""

    lora: Mapping[Tuple[int, str], Mapping]
    saved: Mapping[Tuple[int, str], Mapping]
    ignored: Tuple[str, ...]


def _parse_tensors(
    file_tensors: Mapping[str, dict], where: str, ignore_velora: bool, modules_to_save=None
) -> Parsed:
    """Group tensor names into :class:`Parsed` entries (read-only)."""
    entries: Dict[Tuple[int, str], dict] = {}
    saved_entries: Dict[Tuple[int, str], dict] = {}
    ignored = []
    keys: Dict[str, Tuple[int, str]] = {}  # lora_A and lora_B of a module share its path
    match = _FACTOR_RE.match
    for name in sorted(file_tensors):
        m = match(name)
        if m is not None:
            path, kind, adapter_name, param = m.groups()
        else:
            m = _VECTOR_RE.match(name)
            if m is not None:
                path, kind, adapter_name = m.groups()
                param = None
        if m is None:
            if ignore_velora and "lora_velora_embed" in name.split("."):
                continue
            saved = _SAVED_RE.match(name)
            spath = saved and saved.group("path")
            if spath and spath.startswith(PEFT_PREFIX):
                spath = spath[len(PEFT_PREFIX):]
            if saved and _saved_target(spath, modules_to_save):
                _add_saved(saved_entries, spath, saved.group("param"), name, where)
                continue
            if (saved and spath.endswith(".base_layer") and saved.group("param") == "weight"
                    and place(spath[: -len(".base_layer")]) is not None
                    and place(spath[: -len(".base_layer")])[0] is None):
                # PEFT saves the base embedding / lm_head beside their LoRA (save_embedding_layers)
                ignored.append(name)
                continue
            raise LoraFormatError(f"{where}: tensor {name!r} is {_classify_non_factor(name)}")
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
            entry = entries[key] = {"path": path, "adapter": adapter_name,
                                    "embedding": kind.startswith("lora_embedding")}
        elif kind != "lora_magnitude_vector" and entry["embedding"] != kind.startswith("lora_embedding"):
            raise LoraFormatError(
                f"{where}: module {path!r} has both linear (lora_A / lora_B) and embedding "
                f"(lora_embedding_A / lora_embedding_B) factors")
        elif entry["path"] != path or entry["adapter"] != adapter_name:
            first = entry["path"] + (f" (adapter {entry['adapter']!r})" if entry["adapter"] else "")
            second = path + (f" (adapter {adapter_name!r})" if adapter_name else "")
            raise LoraFormatError(
                f"{where}: duplicate weights for layer {key[0]} module {key[1]!r}: {first} and {second}"
            )
        slot = _SLOTS[(kind, param)]
        if slot in entry:  # the same tensor under two names (with and without the PEFT prefix)
            raise LoraFormatError(
                f"{where}: duplicate weights for layer {key[0]} module {key[1]!r}: tensors "
                f"{entry[slot]!r} and {name!r}"
            )
        entry[slot] = name
    for key, entry in entries.items():
        for have, need in (("A", "B"), ("B", "A"), ("bias", "B"), ("M", "A")):
            if have in entry and need not in entry:
                missing = (("lora_embedding_A" if need == "A" else "lora_embedding_B")
                           if entry["embedding"] else
                           "lora_A.weight" if need == "A" else "lora_B.weight")
                raise LoraFormatError(
                    f"{where}: tensor {entry[have]!r} has no matching {missing} for module {entry['path']!r}"
                )
    return Parsed(MappingProxyType({k: MappingProxyType(e) for k, e in entries.items()}),
                  MappingProxyType({k: MappingProxyType(e) for k, e in saved_entries.items()}),
                  tuple(ignored))


def _add_saved(entries: dict, path: str, param: str, name: str, where: str) -> None:
    """Record a ``modules_to_save`` tensor (``weight`` / ``bias`` of a module saved whole)."""
    try:
        key = module_key(path)
    except LoraFormatError as exc:
        raise LoraFormatError(f"{where}: tensor {name!r} of modules_to_save: {exc}") from None
    entry = entries.setdefault(key, {"path": path})
    if entry["path"] != path or param in entry:
        raise LoraFormatError(f"{where}: duplicate modules_to_save tensors for {key}: {name!r}")
    entry[param] = name


def _entries(file_tensors: Mapping[str, dict], where: str, ignore_velora: bool,
             modules_to_save=None) -> Parsed:
    """:func:`_parse_tensors`, kept with a kept layout (a refusal is not kept)."""
    saved = tuple(modules_to_save or ())
    return kept_derived(file_tensors, ("entries", ignore_velora, saved),
                        lambda: _parse_tensors(file_tensors, where, ignore_velora, saved))


def _warn_ignored(parsed: Parsed, where: str) -> None:
    if parsed.ignored:
        warnings.warn(
            f"{where}: the base weights PEFT saved beside the LoRA of an embedding or lm_head "
            f"({', '.join(parsed.ignored)}) are not applied: lorahook adds the LoRA to the "
            f"model's own module (a model whose vocabulary was resized must be resized and "
            f"loaded with those weights itself)", UserWarning, stacklevel=4)


def _check_saved(file_tensors: Mapping[str, dict], key, entry, where: str) -> None:
    """A ``modules_to_save`` module must be a linear (2-D weight, optional bias) or an embedding."""
    if "weight" not in entry:
        raise LoraFormatError(f"{where}: modules_to_save module {entry['path']!r} has no weight tensor")
    shape = file_tensors[entry["weight"]]["shape"]
    embedding = key[1] in EMBEDDING_MODULES
    if len(shape) != 2 or min(shape) < 1:
        raise LoraFormatError(
            f"{where}: modules_to_save module {entry['path']!r} has a weight of shape {shape}: only "
            f"linear and embedding modules (2-D weights) can be saved whole, not a norm, a "
            f"convolution or another kind of module")
    if "bias" in entry:
        if embedding:
            raise LoraFormatError(f"{where}: modules_to_save embedding {entry['path']!r} has a bias tensor")
        if file_tensors[entry["bias"]]["shape"] != (shape[0],):
            raise LoraFormatError(
                f"{where}: tensor {entry['bias']!r} has shape {file_tensors[entry['bias']]['shape']}, "
                f"expected ({shape[0]},)")


def _check_factor_shapes(file_tensors: Mapping[str, dict], entry: dict, where: str) -> int:
    a_shape = file_tensors[entry["A"]]["shape"]
    b_shape = file_tensors[entry["B"]]["shape"]
    if len(a_shape) in (3, 4, 5) and not entry.get("embedding"):
        raise LoraFormatError(
            f"{where}: tensor {entry['A']!r} is {len(a_shape)}-D {a_shape}: LoRA on a convolution "
            f"is not supported (lorahook adapts linear and embedding modules)")
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
    if "M" in entry:
        m_shape = file_tensors[entry["M"]]["shape"]
        if m_shape != (b_shape[0],):
            raise LoraFormatError(
                f"{where}: tensor {entry['M']!r} has shape {m_shape}, expected ({b_shape[0]},): "
                f"one magnitude per output of module {entry['path']!r}")
    return a_shape[0]


def _collect(
    weights: SafetensorsFile,
    parsed: Parsed,
    scales: Mapping[Tuple[int, str], float],
    name: Optional[str],
    metadata: Dict[str, str],
) -> AdapterData:
    """Read the tensors of ``parsed`` from the open ``weights`` into plain data.

    One read (:meth:`SafetensorsFile.read_float32`, through the descriptor the header came
    from): every value is copied once from the file into the array a layer keeps, ``lora_B``
    transposed on the way (the ``B^T`` layout the kernels use), and refused if it is not finite.
    """
    weights_path = weights.path
    entries, saved = parsed.lora, parsed.saved
    if not entries and not saved:
        raise LoraFormatError(f"{weights_path}: holds no LoRA weights")
    wanted = [n for e in entries.values() for n in (e["A"], e["B"], e.get("bias"), e.get("M"))
              if n is not None]
    wanted += [n for e in saved.values() for n in (e["weight"], e.get("bias")) if n is not None]
    arrays, _ = weights.read_float32(wanted, transposed=[e["B"] for e in entries.values()],
                                     finite=True)
    layers = {}
    for key in entries:
        e = entries[key]
        bias = arrays[e["bias"]] if "bias" in e else None
        layers[key] = LayerData(arrays[e["A"]], arrays[e["B"]].T, scales[key], bias, e["path"],
                                arrays[e["M"]] if "M" in e else None, bool(e["embedding"]))
    kept = {key: SavedData(arrays[e["weight"]], arrays[e["bias"]] if "bias" in e else None,
                           key[1] in EMBEDDING_MODULES, e["path"]) for key, e in saved.items()}
    return AdapterData(layers, name=name, metadata=metadata, source=str(weights_path), saved=kept)


def _checked_scales(file_tensors, parsed: Parsed, config: PeftLoraConfig, where: str) -> Dict[Tuple[int, str], float]:
    """Each entry's scale, once its shapes, rank and bias agree with the config (else raises)."""
    scales = {}
    entries = parsed.lora
    for key, entry in parsed.saved.items():
        _check_saved(file_tensors, key, entry, where)
    for key, entry in entries.items():
        rank = _check_factor_shapes(file_tensors, entry, where)
        if entry["embedding"] and config.use_dora:
            raise LoraFormatError(
                f"{where}: module {entry['path']!r}: DoRA on an embedding (use_dora with "
                f"lora_embedding_A / lora_embedding_B) is not supported")
        if config.use_dora != ("M" in entry):
            raise LoraFormatError(
                f"{where}: module {entry['path']!r} " + (
                    "has no lora_magnitude_vector but the config has use_dora=true"
                    if config.use_dora else
                    f"has a lora_magnitude_vector ({entry['M']!r}) but the config has use_dora=false"))
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
        parsed = _entries(file_tensors, where, config.velora, config.modules_to_save)
        _warn_ignored(parsed, where)
        def checked_scales():
            return MappingProxyType(_checked_scales(file_tensors, parsed, config, where))

        # one layout under one config has one set of scales: kept with the layout (small configs)
        scales = (kept_derived(file_tensors, ("scales", raw_config), checked_scales)
                  if len(raw_config) <= _KEPT_CONFIG_BYTES else checked_scales())

        metadata = _file_metadata(file_meta)
        if config.base_model and "base_model" not in metadata and isinstance(config.base_model, str):
            metadata["base_model"] = config.base_model
        if config.revision and "revision" not in metadata and isinstance(config.revision, str):
            metadata["revision"] = config.revision
        name = metadata.get("name") or directory.resolve().name or None
        return _collect(weights, parsed, scales, name, metadata)


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
        parsed = _entries(file_tensors, where, False)
        _warn_ignored(parsed, where)
        scales = {}
        for key, entry in parsed.lora.items():
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
        return _collect(weights, parsed, scales, name, metadata)
