"""Reading safetensors files: the header checked against the file, then float tensors.

The JSON header is parsed and every tensor's byte span (``dtype size * prod(shape)``),
overlaps and gaps are checked against the file size before any tensor is read, so no
allocation follows from sizes the file cannot back. Pickle files are never opened. F32,
F16 and BF16 tensors are widened to float32 by :func:`read_float32`: one buffer per read,
each value copied once from the file into it (transposed on request), read with the open
file rather than a memory map, so that a file truncated during a read is an error and not
a crash.

The ``safetensors`` package checks headers as strictly (it refuses every hostile header of
the test suite except zero-sized tensors with dimensions beyond 2**31 - 1), but its readers
copy each tensor into an array of its own in the file's layout: one more copy and transpose
for ``lora_B``, and one allocation per tensor, which costs several times the file read on
its own when the allocator has to fault in fresh pages. The offsets needed to read straight
into place are not exposed by ``safe_open``, so the header is parsed here.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .. import _rows

from ..errors import LoraFormatError

__all__ = ["read_safetensors_header", "read_safetensors", "read_float32", "MAX_HEADER_BYTES",
           "SUPPORTED_DTYPES"]

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
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _checked_entry(name: str, info: Any, where: str, data_len: int) -> dict:
    """One tensor's header entry, checked: ``{"dtype", "shape" (tuple), "data_offsets" (tuple)}``."""
    if type(info) is not dict:
        raise LoraFormatError(f"{where}: tensor {name!r}: header entry must be an object, found {info!r}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    size = _DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if size is None:
        raise LoraFormatError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}")
    # JSON gives int (never bool) for an integer: ``type(d) is int`` refuses true / false.
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise LoraFormatError(
            f"{where}: tensor {name!r}: shape must be a list of non-negative integers, found {short(shape)}"
        )
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or type(offsets[0]) is not int
        or type(offsets[1]) is not int
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
    expected = math.prod(shape) * size
    if end - begin != expected:
        raise LoraFormatError(
            f"{where}: tensor {name!r}: {dtype} {short(tuple(shape))} needs {short(expected)} bytes but data_offsets "
            f"[{begin}, {end}] span {end - begin}"
        )
    if shape and max(shape) > _MAX_DIM:
        raise LoraFormatError(
            f"{where}: tensor {name!r}: shape {short(shape)} has a dimension larger than {_MAX_DIM}"
        )
    return {"dtype": dtype, "shape": tuple(shape), "data_offsets": (begin, end)}


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
        tensors[name] = _checked_entry(name, info, where, data_len)

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


# --------------------------------------------------------------------------- reading tensor data

# Bounce buffer for tensors that are transposed or widened on the way in: a few hundred KiB,
# so it stays in cache between the read and the conversion.
_SCRATCH_BYTES = 256 * 1024

_HALF_KINDS = {"F16": "float16", "BF16": "bfloat16"}


def _convert(src: np.ndarray, dst: np.ndarray, dtype: str, flip: bool) -> None:
    """File rows ``src`` (raw bytes viewed with the file's element size) into float32 ``dst``.

    ``flip``: ``src`` is ``(rows, cols)`` and ``dst`` its transpose.  F16 / BF16 are widened
    by the core's conversions (exact, NaN and infinity kept for the finiteness check).
    """
    if dtype == "F32":
        values = src.view("<f4")
    elif not flip and dst.flags.c_contiguous:
        _rows._half_widen(src.view(np.uint16), _HALF_KINDS[dtype], out=dst)
        return
    else:
        values = _rows._half_widen(src.view(np.uint16), _HALF_KINDS[dtype])
    np.copyto(dst, values.reshape(dst.shape[::-1]).T if flip else values.reshape(dst.shape))


def read_float32(
    path: os.PathLike,
    names=None,
    *,
    transposed=(),
    header: Optional[tuple] = None,
    finite: bool = False,
) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Read F32 / F16 / BF16 tensors as read-only float32 arrays, each value copied once.

    ``names`` (all tensors by default) are read in file order into one float32 buffer of exactly
    the bytes they need, which every returned array is a view of (so the arrays together hold
    nothing more than their own ``nbytes``). A name in ``transposed`` must be a 2-D tensor and is
    returned as its transpose, C-contiguous: ``(cols, rows)``. F32 data goes straight from the file
    into that buffer; tensors that are transposed or widened from F16 / BF16 pass through a small
    bounce buffer that stays in cache. Nothing is allocated before the header is validated against
    the file (:func:`read_safetensors_header`; ``header`` is what it already returned for ``path``),
    so the buffer is at most twice the file's size.

    With ``finite``, a tensor holding NaN or infinity is refused. Any failure raises
    :class:`LoraFormatError` and returns nothing: the arrays exist only once every tensor is read.
    """
    if header is None:
        header = read_safetensors_header(path)
    tensors, metadata, data_start, file_size = header
    wanted = list(tensors) if names is None else list(dict.fromkeys(names))
    flip = set(transposed)
    for name in wanted:
        info = tensors[name]
        if info["dtype"] not in SUPPORTED_DTYPES:
            raise LoraFormatError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}; expected one of "
                f"{', '.join(SUPPORTED_DTYPES)}"
            )
        if name in flip and len(info["shape"]) != 2:
            raise LoraFormatError(f"{path}: tensor {name!r} must be 2-D, found shape {info['shape']}")
    order = sorted(wanted, key=lambda n: tensors[n]["data_offsets"])
    counts = [math.prod(tensors[n]["shape"]) for n in order]
    # Sizes were checked against the file: the buffer is bounded by it.
    buffer = np.empty(sum(counts), dtype=np.float32)
    out: Dict[str, np.ndarray] = {}
    spans: Dict[str, Tuple[int, int]] = {}
    start = 0
    for name, count in zip(order, counts):
        shape = tensors[name]["shape"]
        out[name] = buffer[start:start + count].reshape(shape[::-1] if name in flip else shape)
        spans[name] = (start, start + count)
        start += count

    reader = _Reader(path, file_size, buffer, spans)
    with reader:
        # Runs of tensors that follow each other in the file, read with one system call each.
        run, run_end, run_bytes = [], None, 0
        for name, count in zip(order, counts):
            info = tensors[name]
            begin, end = info["data_offsets"]
            nbytes = end - begin
            direct = info["dtype"] == "F32" and name not in flip
            fits = direct or nbytes <= _SCRATCH_BYTES
            if run and (begin != run_end or len(run) >= _MAX_RUN or not fits
                        or (not direct and reader.bounce_used + nbytes > _SCRATCH_BYTES)
                        or run_bytes + nbytes > _RUN_BYTES):
                reader.read_run(run, data_start, out, finite)
                run, run_bytes = [], 0
            if fits:
                run.append((name, info, name in flip, None if direct else reader.reserve(nbytes)))
                run_end, run_bytes = end, run_bytes + nbytes
            else:
                reader.read_in_rows(name, info, data_start, out[name], name in flip, finite)
        if run:
            reader.read_run(run, data_start, out, finite)
    for name in wanted:
        if name in reader.refused:
            raise LoraFormatError(f"{path}: tensor {name!r} has {reader.refused[name]} non-finite value(s)")
    buffer.flags.writeable = False
    for arr in out.values():
        arr.flags.writeable = False
    return {name: out[name] for name in wanted}, metadata


# At most this many tensors, and about this many bytes, per vectored read: the bytes are checked
# and converted while they are still in cache.
_MAX_RUN = 512
_RUN_BYTES = 512 * 1024


class _Reader:
    """The file side of :func:`read_float32`: vectored reads, the bounce buffer, conversions."""

    def __init__(self, path, file_size, buffer, spans):
        self.path, self.file_size = path, file_size
        self.buffer, self.spans = buffer, spans  # spans: name -> [begin, end) in buffer
        self.bounce = np.empty(_SCRATCH_BYTES, dtype=np.uint8)
        self.bounce_used = 0
        self.refused: Dict[str, int] = {}

    def __enter__(self):
        self.file = open(self.path, "rb", buffering=0)
        if os.fstat(self.file.fileno()).st_size != self.file_size:
            self.file.close()
            raise LoraFormatError(f"{self.path}: the file changed size while it was being read")
        return self

    def __exit__(self, *exc):
        self.file.close()

    def reserve(self, nbytes):
        view = self.bounce[self.bounce_used:self.bounce_used + nbytes]
        self.bounce_used += nbytes
        return view

    def _fill(self, targets, offset):
        """Fill the byte views ``targets`` from ``offset`` on, or refuse a file that got shorter."""
        fd = self.file.fileno()
        pending = [memoryview(t).cast("B") for t in targets if t.nbytes]
        done = 0
        os.lseek(fd, offset, os.SEEK_SET)
        while pending:
            got = os.readv(fd, pending[:_MAX_RUN]) if _HAVE_READV else self.file.readinto(pending[0])
            if not got:
                raise LoraFormatError(
                    f"{self.path}: the file changed size while it was being read (found {done} bytes "
                    f"at offset {offset}, expected more)"
                )
            done += got
            while pending and got >= len(pending[0]):
                got -= len(pending.pop(0))
            if got:
                pending[0] = pending[0][got:]

    def read_run(self, run, data_start, out, finite):
        """Tensors that follow each other in the file (and in the buffer): one read, one check."""
        self._fill([out[name] if raw is None else raw for name, _, _, raw in run],
                   data_start + run[0][1]["data_offsets"][0])
        for name, info, flip, raw in run:
            if raw is not None:  # through the bounce buffer
                rows = info["shape"][0] if info["shape"] else 1
                self._convert_rows(raw, info, out[name], flip, 0, rows)
        self.bounce_used = 0
        if finite:
            # The run's arrays are adjacent in the buffer: check them in one pass, then find
            # the culprits only if something is not finite.
            begin, stop = self.spans[run[0][0]][0], self.spans[run[-1][0]][1]
            if not np.isfinite(self.buffer[begin:stop]).all():
                for name, *_ in run:
                    self._check_finite(name, out[name])

    def read_in_rows(self, name, info, data_start, dst, flip, finite):
        """A tensor larger than the bounce buffer: whole rows of the file's layout at a time."""
        shape = info["shape"]
        rows = shape[0] if shape else 1
        row_bytes = (info["data_offsets"][1] - info["data_offsets"][0]) // rows
        step = max(1, _SCRATCH_BYTES // row_bytes)
        if self.bounce.nbytes < row_bytes:
            self.bounce = np.empty(row_bytes, dtype=np.uint8)
        offset = data_start + info["data_offsets"][0]
        for first in range(0, rows, step):
            n = min(step, rows - first)
            raw = self.bounce[: n * row_bytes]
            self._fill([raw], offset + first * row_bytes)
            self._convert_rows(raw, info, dst, flip, first, n)
        if finite:
            self._check_finite(name, dst)

    def _check_finite(self, name, arr):
        bad = arr.size - np.count_nonzero(np.isfinite(arr))
        if bad:
            self.refused[name] = int(bad)

    def _convert_rows(self, raw, info, dst, flip, first, n):
        """Rows ``first : first + n`` of the file's tensor, bytes ``raw``, into float32 ``dst``."""
        dtype = info["dtype"]
        src = raw.view(f"<u{_DTYPE_SIZES[dtype]}")
        if flip:
            _convert(src, dst[:, first:first + n], dtype, True)
            return
        flat = dst.reshape(-1)
        per_row = flat.size // (info["shape"][0] if info["shape"] else 1) if flat.size else 0
        _convert(src, flat[first * per_row:(first + n) * per_row], dtype, False)


_HAVE_READV = hasattr(os, "readv")


def read_safetensors(
    path: os.PathLike, names=None, header: Optional[tuple] = None
) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Read float tensors from a safetensors file as float32 arrays (read-only).

    ``names`` restricts which tensors are read (all by default). Only F32, F16 and BF16 are
    supported; others raise :class:`LoraFormatError`. The header is validated first (see
    :func:`read_safetensors_header`), so no allocation follows from sizes the file cannot back;
    ``header`` is what that function already returned for ``path``, to avoid parsing it again.
    See :func:`read_float32` for transposed reads and the finiteness check.
    """
    return read_float32(path, names, header=header)
