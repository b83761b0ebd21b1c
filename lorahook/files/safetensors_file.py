"""Reading safetensors files: the header checked against the file, then float tensors.

The JSON header is parsed and every tensor's byte span (``dtype size * prod(shape)``),
overlaps and gaps are checked against the file size before any tensor is read, so no
allocation follows from sizes the file cannot back. Pickle files are never opened. F32,
F16 and BF16 tensors are widened to float32 by :func:`read_float32`: one buffer per read,
each value copied once from the file into it (transposed on request) by the compiled core
without the GIL, read with ``preadv`` rather than through a memory map, so that a file
truncated during a read is an error and not a crash.

The header and the tensors of one read come through one file descriptor
(:class:`SafetensorsFile`), so a file replaced between the two cannot mix two files.

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
import threading
from collections import OrderedDict
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from ._load import aligned_floats, read_plan

from .._values import short
from ..errors import LoraFormatError

__all__ = ["SafetensorsFile", "read_safetensors_header", "read_safetensors", "read_float32",
           "MAX_HEADER_BYTES", "SUPPORTED_DTYPES"]

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
# Up to this many dimensions, a refusal states the exact byte count a shape needs.
_EXACT_DIMS = 8

def _reject_duplicate_keys(pairs):
    """A JSON object as a dict; a key given twice (at any depth) is a ValueError naming it."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _span(shape, size: int, limit: int) -> Optional[int]:
    """``size * prod(shape)``, or ``None`` once it exceeds ``limit``.

    Stops as soon as the product passes ``limit``: a header may list millions of
    dimensions, and their full product would be an integer of millions of bits.
    """
    if 0 in shape:
        return 0
    total = size
    for d in shape:
        total *= d
        if total > limit:
            return None
    return total


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
    expected = _span(shape, size, data_len)
    if end - begin != expected:
        # the exact count where it is cheap to say, else only that it is too large
        needs = (f"{expected} bytes" if expected is not None
                 else f"{short(math.prod(shape) * size)} bytes" if len(shape) <= _EXACT_DIMS
                 else f"more than the {data_len} bytes of data")
        raise LoraFormatError(
            f"{where}: tensor {name!r}: {dtype} {short(tuple(shape))} needs {needs} but data_offsets "
            f"[{begin}, {end}] span {end - begin}"
        )
    if shape and max(shape) > _MAX_DIM:
        raise LoraFormatError(
            f"{where}: tensor {name!r}: shape {short(shape)} has a dimension larger than {_MAX_DIM}"
        )
    return {"dtype": dtype, "shape": tuple(shape), "data_offsets": (begin, end)}


def read_safetensors_header(
    path: os.PathLike,
) -> Tuple[Mapping[str, Mapping[str, Any]], Dict[str, str], int, int]:
    """Parse and validate a safetensors header without reading tensor data.

    Returns ``(tensors, metadata, data_start, file_size)`` where ``tensors`` maps each name to a
    mapping with ``dtype``, ``shape`` (tuple) and ``data_offsets`` (tuple) relative to ``data_start``
    (read-only mappings: the layouts of recent well-formed headers are kept and shared) and
    ``metadata`` is a new dict of the header's ``__metadata__`` strings.
    Everything is checked against the file size first: the header length, each tensor's byte span
    (``dtype size * prod(shape)``), overlaps and gaps. Raises :class:`LoraFormatError`.
    To read tensors too, use :class:`SafetensorsFile`: both through one descriptor.
    """
    with SafetensorsFile(path) as f:
        return f.header


def _read_header(f, where: str):
    """The checked header tuple of the open file ``f`` (see :func:`read_safetensors_header`)."""
    file_size = os.fstat(f.fileno()).st_size
    if file_size < 8:
        raise LoraFormatError(f"{where}: not a safetensors file: {file_size} bytes, expected at least 8")
    head = os.pread(f.fileno(), 8, 0)
    if len(head) != 8:
        raise LoraFormatError(f"{where}: the file changed size while it was being read")
    (header_len,) = struct.unpack("<Q", head)
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
    raw = os.pread(f.fileno(), header_len, 8)
    if len(raw) != header_len:
        raise LoraFormatError(f"{where}: the file changed size while it was being read")
    data_start = 8 + header_len
    data_len = file_size - data_start
    if header_len <= _LAYOUT_BYTES:
        tensors, metadata = _known_layout(raw, data_len, where)
    else:
        tensors, metadata = _layout(raw, data_len, where)
    return tensors, dict(metadata), data_start, file_size


def _layout(raw: bytes, data_len: int, where: str):
    """:func:`_checked_header` of a raw header, as read-only mappings."""
    tensors, metadata = _checked_header(raw, data_len, where)
    return (MappingProxyType({name: MappingProxyType(info) for name, info in tensors.items()}),
            MappingProxyType(metadata))


# Adapters of one model, rank and targets written by one tool have byte-identical headers:
# the layouts of the last few headers (up to _LAYOUT_BYTES each) are kept, each with what
# loads derived from it (a read plan, a config's scales), which goes when the layout goes.
# A header that is not well-formed is not kept: the checks that name the fault and the file
# run again.
_LAYOUT_BYTES = 1 << 20
_KEPT_LAYOUTS = 16
_DERIVED_PER_LAYOUT = 8


class _KeptLayout:
    __slots__ = ("tensors", "metadata", "derived")

    def __init__(self, tensors, metadata):
        self.tensors, self.metadata, self.derived = tensors, metadata, {}


_kept_by_header: "OrderedDict[tuple, _KeptLayout]" = OrderedDict()  # (raw, data_len) -> kept
_kept_by_id: Dict[int, _KeptLayout] = {}  # id(kept.tensors) -> kept (kept alive by both maps)
_kept_lock = threading.Lock()


def _known_layout(raw: bytes, data_len: int, where: str):
    """:func:`_layout`, kept for the last :data:`_KEPT_LAYOUTS` well-formed headers."""
    key = (raw, data_len)
    with _kept_lock:
        kept = _kept_by_header.get(key)
        if kept is not None:
            _kept_by_header.move_to_end(key)
            return kept.tensors, kept.metadata
    fast = _layout(raw, data_len, where)
    with _kept_lock:
        kept = _kept_by_header.get(key)
        if kept is None:  # (else another thread kept the same header first)
            kept = _kept_by_header[key] = _KeptLayout(*fast)
            _kept_by_id[id(kept.tensors)] = kept
            while len(_kept_by_header) > _KEPT_LAYOUTS:
                _, old = _kept_by_header.popitem(last=False)
                del _kept_by_id[id(old.tensors)]
    return kept.tensors, kept.metadata


def kept_derived(tensors, key, make):
    """``make()``, kept with ``tensors`` under ``key`` when they are a kept layout's.

    For the tensors mapping of a layout :func:`read_safetensors_header` keeps, the first
    result for each ``key`` (up to :data:`_DERIVED_PER_LAYOUT` of them) is kept and returned
    again until the layout itself is dropped; anything else is made every time.  ``make``
    must depend on nothing but the layout and ``key``; what it raises is not kept.
    """
    kept = _kept_by_id.get(id(tensors))
    if kept is None or kept.tensors is not tensors:
        return make()
    value = kept.derived.get(key)
    if value is None:
        value = make()
        with _kept_lock:
            if len(kept.derived) < _DERIVED_PER_LAYOUT:
                value = kept.derived.setdefault(key, value)
    return value


def _forget_layouts():
    """Drop every kept layout and what was derived from it."""
    with _kept_lock:
        _kept_by_header.clear()
        _kept_by_id.clear()


def _checked_header(raw: bytes, data_len: int, where: str) -> Tuple[Dict[str, dict], Dict[str, str]]:
    """``(tensors, metadata)`` of a raw header, checked entry by entry against ``data_len``.

    The one check of a header: raises :class:`LoraFormatError` naming what is wrong.
    """
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
    return tensors, metadata


# --------------------------------------------------------------------------- reading tensor data

# Bounce buffer for tensors that are transposed or widened on the way in: a few hundred KiB,
# so it stays in cache between the read and the conversion.
_SCRATCH_BYTES = 256 * 1024
# At most this many pieces, and about this many bytes, per vectored read: the bytes are checked
# and converted while they are still in cache.
_MAX_RUN = 512
_RUN_BYTES = 512 * 1024

_KINDS = {"F32": 0, "F16": 1, "BF16": 2}


def _numpy_advises_hugepages() -> bool:
    """Whether numpy advises huge pages for its large arrays (the read's buffer follows it)."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    getter = getattr(multiarray, "_get_madvise_hugepage", None)
    return bool(getter()) if getter is not None else False


_HUGEPAGES = _numpy_advises_hugepages()


def _plan(tensors, data_start: int, wanted: tuple, transposed: tuple):
    """What :func:`read_plan` is given to read ``wanted`` of a checked header.

    Returns ``(plan, names in file order, {name: (start, count, shape)}, total values)``;
    the plan is read-only.  Raises :class:`LoraFormatError` (without the file's name).
    """
    flip = set(transposed)
    order = []
    for name in wanted:
        info = tensors[name]
        kind = _KINDS.get(info["dtype"])
        if kind is None:
            raise LoraFormatError(
                f"tensor {name!r} has dtype {info['dtype']}; expected one of {', '.join(SUPPORTED_DTYPES)}"
            )
        shape = info["shape"]
        flipped = name in flip
        if flipped and len(shape) != 2:
            raise LoraFormatError(f"tensor {name!r} must be 2-D, found shape {shape}")
        order.append((info["data_offsets"][0], name, shape, kind, flipped))
    order.sort()
    # Sizes were checked against the file: the buffer is bounded by it.
    rows = []
    out: Dict[str, Tuple[int, int, tuple]] = {}
    start = 0
    for begin, name, shape, kind, flipped in order:
        count = math.prod(shape)
        rows.append((data_start + begin, count, start, shape[0] if flipped else count,
                     shape[1] if flipped else 1, kind, flipped))
        out[name] = (start, count, shape[::-1] if flipped else shape)
        start += count
    plan = np.array(rows, dtype=np.int64).reshape(len(rows), 7)
    plan.flags.writeable = False
    return plan, tuple(item[1] for item in order), out, start


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
    bounce buffer that stays in cache. The reading, converting and checking run in the compiled
    core without the GIL. Nothing is allocated before the header is validated against the file
    (:func:`read_safetensors_header`), so the buffer is at most twice the file's size. The header
    and the data are read through one descriptor (:class:`SafetensorsFile`); a ``header`` given
    (what :func:`read_safetensors_header` returned earlier) must still be the file's, else
    :class:`LoraFormatError`.

    With ``finite``, a tensor holding NaN or infinity is refused. Any failure raises
    :class:`LoraFormatError` and returns nothing: the arrays exist only once every tensor is read.
    Returns ``(arrays by name in the order asked, metadata)``; the metadata is the dict of
    ``header`` (a new one when the header is read here).
    """
    with SafetensorsFile(path) as f:
        if header is not None and (header[0], header[2:]) != (f.header[0], f.header[2:]):
            raise LoraFormatError(f"{path}: the file changed since its header was read")
        return f.read_float32(names, transposed=transposed, finite=finite)


class SafetensorsFile:
    """An open safetensors file: its header, checked when it is opened, and its tensors.

    ``SafetensorsFile(path)`` opens ``path`` once and checks its header through that
    descriptor (:attr:`header`, as :func:`read_safetensors_header` returns it); every
    :meth:`read_float32` reads through the same descriptor, so a file replaced on disk in
    between is never mixed in.  A context manager; :meth:`close` closes the descriptor.
    """

    __slots__ = ("path", "header", "_file")

    def __init__(self, path: os.PathLike):
        self.path = path
        self._file = open(path, "rb", buffering=0)
        try:
            self.header = _read_header(self._file, str(path))
        except BaseException:
            self._file.close()
            raise

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read_float32(self, names=None, *, transposed=(), finite: bool = False):
        """:func:`read_float32` through this file's descriptor, with its checked header."""
        path = self.path
        tensors, metadata, data_start, file_size = self.header
        wanted = tuple(tensors) if names is None else tuple(dict.fromkeys(names))
        flip = tuple(transposed)
        try:
            plan, order, out, start = kept_derived(tensors, ("plan", data_start, wanted, flip),
                                                   lambda: _plan(tensors, data_start, wanted, flip))
        except LoraFormatError as exc:
            raise LoraFormatError(f"{path}: {exc}") from None
        buffer = aligned_floats(start, _HUGEPAGES)
        bad = np.zeros(len(order), dtype=np.int64)
        fd = self._file.fileno()
        if os.fstat(fd).st_size != file_size:
            raise LoraFormatError(f"{path}: the file changed size while it was being read")
        status, detail = read_plan(fd, plan, buffer, bad, _SCRATCH_BYTES, _RUN_BYTES,
                                         _MAX_RUN)
        if status == 1:
            raise LoraFormatError(
                f"{path}: the file changed size while it was being read (it ended inside tensor "
                f"{order[detail]!r})"
            )
        if status == 2:
            raise LoraFormatError(f"{path}: reading failed: {os.strerror(detail)}")
        if finite and bad.any():
            culprits = {order[t]: int(bad[t]) for t in np.flatnonzero(bad)}
            name = next(n for n in wanted if n in culprits)
            raise LoraFormatError(f"{path}: tensor {name!r} has {culprits[name]} non-finite value(s)")
        buffer.flags.writeable = False
        arrays = {}
        for name in wanted:
            begin, count, shape = out[name]
            arrays[name] = buffer[begin:begin + count].reshape(shape)
        return arrays, metadata


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
