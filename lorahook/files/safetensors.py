"""Reading safetensors files: the header checked against the file, then float tensors.

The JSON header is parsed and every tensor's byte span (``dtype size * prod(shape)``),
overlaps and gaps are checked against the file size before any tensor is read, so no
allocation follows from sizes the file cannot back. Pickle files are never opened. F32,
F16 and BF16 tensors are widened to float32.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..errors import LoraFormatError

__all__ = ["read_safetensors_header", "read_safetensors", "MAX_HEADER_BYTES", "SUPPORTED_DTYPES"]

#: Largest safetensors JSON header accepted, in bytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# Bytes per element for every dtype the safetensors format defines (used to validate byte spans).
_DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
    "C64": 8,
}
SUPPORTED_DTYPES = ("F32", "F16", "BF16")
# Largest dimension accepted in a tensor shape.
_MAX_DIM = 2**31 - 1
# Largest finite float32; scales beyond it would turn every update into inf.

def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def short(value: Any) -> str:
    """A bounded-length repr (never raises for huge integers)."""
    if isinstance(value, int) and value.bit_length() >= 1000:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"a {type(value).__name__} too large to show"
    return text if len(text) <= 200 else text[:200] + "..."


def _reject_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


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
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise LoraFormatError(
                f"{where}: tensor {name!r}: shape must be a list of non-negative integers, found {short(shape)}"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o) for o in offsets)
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
                f"{where}: tensor {name!r}: {dtype} {short(tuple(shape))} needs {short(expected)} bytes but data_offsets "
                f"[{begin}, {end}] span {end - begin}"
            )
        if any(d > _MAX_DIM for d in shape):
            raise LoraFormatError(
                f"{where}: tensor {name!r}: shape {short(shape)} has a dimension larger than {_MAX_DIM}"
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
        if tensors[name]["dtype"] not in SUPPORTED_DTYPES:
            raise LoraFormatError(
                f"{path}: tensor {name!r} has dtype {tensors[name]['dtype']}; expected one of "
                f"{', '.join(SUPPORTED_DTYPES)}"
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
