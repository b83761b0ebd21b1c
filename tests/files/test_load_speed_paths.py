"""How adapters are read from files: one copy per value, into one buffer per load.

What a loaded adapter keeps is compared with an independent read of the file's bytes (numpy on
the raw data section); the arrays are read-only views of one buffer that holds exactly
``nbytes``, made by that load and by nothing else; F16 is widened exactly for every one of the
65536 half bit patterns; the paths for tensors larger than the bounce buffer, for runs that are
split, and for a file that shrinks during a read are exercised with small limits.
"""
import errno
import json
import os
import pickle
import re
import struct
import tracemalloc
from types import MappingProxyType

import numpy as np
import pytest

safetensors = pytest.importorskip("safetensors")

from lorahook import LoraAdapter, LoraFormatError, LoraLayer  # noqa: E402
from lorahook.files import safetensors_file as st_reader  # noqa: E402
from lorahook.files.safetensors_file import (SafetensorsFile, read_float32,  # noqa: E402
                                         read_safetensors_header)
from peft_dirs import write_dir  # noqa: E402

PREFIX = "base_model.model."
# (module path, d_in, d_out, rank): square B (in_proj_a: 16 x 16 at rank 16), wide, tall
MODULES = [
    ("model.layers.0.linear_attn.in_proj_a", 64, 16, 16),
    ("model.layers.0.linear_attn.in_proj_qkv", 64, 160, 8),
    ("model.layers.0.mlp.down_proj", 96, 64, 4),
    ("model.layers.3.self_attn.q_proj", 64, 128, 8),
    ("model.layers.3.self_attn.v_proj", 64, 32, 1),
]
NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _bits(values, dtype):
    """float32 values as the raw little-endian bytes of ``dtype``."""
    if dtype == "F32":
        return values.astype("<f4")
    if dtype == "F16":
        return values.astype("<f2")
    return (values.astype("<f4").view("<u4") >> 16).astype("<u2")  # truncation: exact bf16 values


def write_adapter(directory, dtype="F32", bias=False, seed=0, modules=MODULES):
    """A PEFT directory with factors of ``modules`` in ``dtype``; returns the raw tensors written."""
    rng = np.random.default_rng(seed)
    raw = {}
    for path, d_in, d_out, rank in modules:
        raw[f"{PREFIX}{path}.lora_A.weight"] = _bits(rng.standard_normal((rank, d_in)), dtype)
        raw[f"{PREFIX}{path}.lora_B.weight"] = _bits(rng.standard_normal((d_out, rank)), dtype)
        if bias:
            raw[f"{PREFIX}{path}.lora_B.bias"] = _bits(rng.standard_normal(d_out), dtype)
    directory.mkdir(parents=True, exist_ok=True)
    specs = {k: safetensors.TensorSpec(dtype=NAMES[dtype], shape=list(v.shape), data_ptr=v.ctypes.data,
                                       data_len=v.nbytes)
             for k, v in raw.items()}
    safetensors.serialize_file(specs, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    ranks = {path: rank for path, _, _, rank in modules}
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": [p for p, *_ in modules],
              "rank_pattern": {f"^{p}$": r for p, r in ranks.items() if r != 8}, "lora_bias": bias}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return raw


def raw_header(path):
    """``(header without metadata, data start)`` of a safetensors file, parsed with nothing of lorahook."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    return header, 8 + n


def independent_read(path):
    """Every tensor of a safetensors file as float32, from its bytes with nothing of lorahook."""
    blob = path.read_bytes()
    header, start = raw_header(path)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        data = blob[start + begin:start + end]
        if info["dtype"] == "F32":
            arr = np.frombuffer(data, "<f4").astype(np.float64)
        elif info["dtype"] == "F16":
            arr = np.frombuffer(data, "<f2").astype(np.float64)
        else:
            arr = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        out[name] = arr.reshape(info["shape"])
    return out


def kept_arrays(adapter):
    return [arr for layer in adapter.layers.values() for arr in layer._arrays()]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_values_equal_an_independent_read(tmp_path, dtype, bias):
    write_adapter(tmp_path / "ad", dtype, bias=bias)
    check_against_independent_read(tmp_path / "ad", LoraAdapter.from_peft(tmp_path / "ad"), bias)


def check_against_independent_read(directory, adapter, bias, modules=MODULES):
    truth = independent_read(directory / "adapter_model.safetensors")
    assert adapter.num_adapted_layers == len(modules)
    for key, layer in adapter.layers.items():
        path = adapter.module_paths[key]
        a, b = truth[f"{PREFIX}{path}.lora_A.weight"], truth[f"{PREFIX}{path}.lora_B.weight"]
        np.testing.assert_array_equal(layer.a, a)
        np.testing.assert_array_equal(layer.b, b)
        np.testing.assert_array_equal(layer._bt, b.T)
        if bias and layer.rank:
            np.testing.assert_array_equal(layer.bias, truth[f"{PREFIX}{path}.lora_B.bias"])


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_one_buffer_per_load_holding_exactly_nbytes(tmp_path, dtype):
    write_adapter(tmp_path / "ad", dtype, bias=True)
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    arrays = kept_arrays(adapter)
    owners = {id(arr.base) for arr in arrays}
    assert len(owners) == 1, "every array a loaded adapter keeps is a view of one buffer"
    owner = arrays[0].base
    # the buffer holds memory of its own, on a cache-line boundary
    from lorahook.files import _load
    assert type(owner.base) is _load._AlignedBlock and owner.dtype == np.float32
    assert owner.ctypes.data % 64 == 0
    # the buffer holds the kept arrays and nothing else, without overlaps
    assert owner.nbytes == adapter.nbytes == sum(arr.nbytes for arr in arrays)
    spans = sorted((arr.ctypes.data, arr.ctypes.data + arr.nbytes) for arr in arrays if arr.size)
    assert all(end <= begin for (_, end), (begin, _) in zip(spans, spans[1:]))
    for arr in arrays + [owner]:
        assert arr.dtype == np.float32 and arr.flags.c_contiguous and not arr.flags.writeable
    for arr in arrays:
        with pytest.raises(ValueError):
            arr.flags.writeable = True
    # another load makes another buffer
    again = LoraAdapter.from_peft(tmp_path / "ad")
    assert not np.shares_memory(owner, kept_arrays(again)[0].base)


def test_loaded_arrays_do_not_alias_the_file(tmp_path):
    write_adapter(tmp_path / "ad")
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    before = [arr.copy() for arr in kept_arrays(adapter)]
    weights.write_bytes(b"\xff" * weights.stat().st_size)  # same size, every value a NaN
    weights.unlink()
    for arr, old in zip(kept_arrays(adapter), before):
        np.testing.assert_array_equal(arr, old)


def test_load_allocates_little_beyond_what_it_keeps(tmp_path):
    modules = [(f"model.layers.{i}.mlp.down_proj", 512, 256, 16) for i in range(8)]
    for dtype in ("F32", "BF16"):
        write_adapter(tmp_path / dtype, dtype, modules=modules)
        LoraAdapter.from_peft(tmp_path / dtype)  # imports and caches outside the measurement
        tracemalloc.start()
        try:
            adapter = LoraAdapter.from_peft(tmp_path / dtype)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # the buffer itself, a bounce buffer of a few hundred KiB and small objects
        assert peak <= 1.1 * adapter.nbytes + 1024 * 1024, (dtype, peak, adapter.nbytes)


def test_loaded_adapter_pickles_read_only(tmp_path):
    write_adapter(tmp_path / "ad", "BF16", bias=True)
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(adapter, protocol=protocol))
        for arr, old in zip(kept_arrays(back), kept_arrays(adapter)):
            np.testing.assert_array_equal(arr, old)
            assert not arr.flags.writeable


# --------------------------------------------------------------------------- F16 and BF16 widening

ALL_HALVES = np.arange(65536, dtype=np.uint16)


def test_every_finite_half_loads_exactly(tmp_path):
    halves = ALL_HALVES[np.isfinite(ALL_HALVES.view(np.float16))]  # 63488: +-0, subnormals, normals
    a_name = f"{PREFIX}model.layers.0.mlp.down_proj.lora_A.weight"
    b_name = f"{PREFIX}model.layers.0.mlp.down_proj.lora_B.weight"
    tensors = {a_name: halves.reshape(16, 3968), b_name: halves[::-1][: 1024 * 16].reshape(1024, 16).copy()}
    d = write_dir(tmp_path / "ad", {k: v.view(np.float16) for k, v in tensors.items()},
                  {"peft_type": "LORA", "r": 16, "lora_alpha": 16, "target_modules": ["down_proj"]})
    layer = LoraAdapter.from_peft(d).layers[(0, "down_proj")]
    for got, bits in ((layer.a, tensors[a_name]), (layer.b, tensors[b_name])):
        np.testing.assert_array_equal(got.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))


# Per dtype: bytes per value, struct format, non-finite words (+inf, -inf, quiet NaN, signalling
# NaN) and the largest finite magnitudes of both signs.
WORDS = {
    "F32": (4, "<I", (0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001), (0x7F7FFFFF, 0xFF7FFFFF)),
    "F16": (2, "<H", (0x7C00, 0xFC00, 0x7E00, 0x7C01), (0x7BFF, 0xFBFF)),
    "BF16": (2, "<H", (0x7F80, 0xFF80, 0x7FC0, 0x7F81), (0x7F7F, 0xFF7F)),
}
DOWN = [("model.layers.0.mlp.down_proj", 96, 80, 8)]
# positions on both sides of the 64-value blocks the fast check scans
POSITIONS = [0, 63, 64, 127, 500, 639]


def poke(weights, name, words, size, fmt):
    """Write ``words`` into tensor ``name`` of ``weights`` at :data:`POSITIONS` (offsets parsed by hand)."""
    header, start = raw_header(weights)
    blob = bytearray(weights.read_bytes())
    for i, at in enumerate(POSITIONS):
        offset = start + header[name]["data_offsets"][0] + size * at
        blob[offset:offset + size] = struct.pack(fmt, words[i % len(words)])
    weights.write_bytes(bytes(blob))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_non_finite_values_are_counted_and_refused_by_name(tmp_path, dtype, which):
    write_adapter(tmp_path / "ad", dtype, modules=DOWN)
    size, fmt, bad, _ = WORDS[dtype]
    name = f"{PREFIX}model.layers.0.mlp.down_proj.{which}.weight"
    poke(tmp_path / "ad" / "adapter_model.safetensors", name, bad, size, fmt)
    with pytest.raises(LoraFormatError, match=rf"tensor '{name}' has {len(POSITIONS)} non-finite value\(s\)"):
        LoraAdapter.from_peft(tmp_path / "ad")


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_the_largest_finite_values_load(tmp_path, dtype):
    write_adapter(tmp_path / "ad", dtype, modules=DOWN)
    size, fmt, _, largest = WORDS[dtype]
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    for which in ("lora_A", "lora_B"):
        poke(weights, f"{PREFIX}model.layers.0.mlp.down_proj.{which}.weight", largest, size, fmt)
    check_against_independent_read(tmp_path / "ad", LoraAdapter.from_peft(tmp_path / "ad"), False, DOWN)


# --------------------------------------------------------------------------- the read's own paths

# Odd shapes for the transposing tiles (4 x 4, blocks of 16 rows) and their edges.
ODD_MODULES = [
    ("model.layers.0.self_attn.q_proj", 7, 37, 5),      # B 37 x 5: neither dimension a multiple of 4
    ("model.layers.0.self_attn.k_proj", 3, 1, 1),       # B 1 x 1
    ("model.layers.0.self_attn.v_proj", 5, 16, 3),      # B 16 x 3: one block of 16 rows, 3 columns
    ("model.layers.1.self_attn.q_proj", 9, 33, 16),     # B 33 x 16: two blocks and a row
    ("model.layers.1.self_attn.k_proj", 70, 19, 17),    # B 19 x 17: a column beyond the tiles
]


@pytest.mark.parametrize("limits", [None, (200, 3, 1024), (64, 2, 96)], ids=["default", "small", "tiny"])
@pytest.mark.parametrize("modules", [MODULES, ODD_MODULES], ids=["qwen", "odd"])
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_every_read_path_gives_the_file_values(tmp_path, monkeypatch, dtype, modules, limits):
    # small: tensors larger than the bounce buffer, runs split after 3 pieces or 1 KiB;
    # tiny: every piece a few rows, the bounce buffer grown for the widest rows
    if limits is not None:
        for attr, value in zip(("_SCRATCH_BYTES", "_MAX_RUN", "_RUN_BYTES"), limits):
            monkeypatch.setattr(st_reader, attr, value)
    write_adapter(tmp_path / "ad", dtype, bias=True, modules=modules, seed=3)
    check_against_independent_read(tmp_path / "ad", LoraAdapter.from_peft(tmp_path / "ad"), True, modules)


def test_read_float32_transposes_and_keeps_order(tmp_path):
    write_adapter(tmp_path / "ad", "F32")
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    truth = independent_read(weights)
    names = sorted(truth, reverse=True)
    flip = [n for n in names if ".lora_B." in n]
    arrays, meta = read_float32(weights, names, transposed=flip, finite=True)
    assert list(arrays) == names and meta == {"format": "pt"}
    for name in names:
        want = truth[name].T if name in flip else truth[name]
        assert arrays[name].shape == want.shape and arrays[name].flags.c_contiguous
        np.testing.assert_array_equal(arrays[name], want)


def test_read_float32_refuses_transposing_a_1d_tensor(tmp_path):
    write_adapter(tmp_path / "ad", "F32", bias=True)
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    name = f"{PREFIX}model.layers.3.self_attn.q_proj.lora_B.bias"
    with pytest.raises(LoraFormatError, match="must be 2-D"):
        read_float32(weights, [name], transposed=[name])


def test_file_shorter_than_its_header_during_the_read(tmp_path):
    write_adapter(tmp_path / "ad", "F32")
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    with SafetensorsFile(weights) as opened:
        os.truncate(weights, weights.stat().st_size - 100)  # the open file itself shrinks
        with pytest.raises(LoraFormatError, match="changed size while it was being read"):
            opened.read_float32()


# --------------------------------------------------------------------------- LoraLayer._adopt

def _fresh(shape):
    arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    arr.flags.writeable = False
    return arr


def test_adopt_keeps_the_arrays_without_a_copy():
    a, bt, bias = _fresh((4, 8)), _fresh((4, 6)), _fresh((6,))
    layer = LoraLayer._adopt(a, bt, 0.5, bias)
    assert layer.a is a and layer._bt is bt and layer.bias is bias
    assert layer.b.shape == (6, 4) and np.shares_memory(layer.b, bt)
    assert (layer.rank, layer.d_in, layer.d_out, layer.scale) == (4, 8, 6, 0.5)


@pytest.mark.parametrize("case, error, match", [
    ("writable", ValueError, "read-only"),
    ("float64", TypeError, "float32"),
    ("big_endian", TypeError, "float32"),
    ("not_contiguous", ValueError, "C-contiguous"),
    ("1d", ValueError, "2-D"),
    ("ranks", ValueError, "ranks disagree"),
    ("d_out_0", ValueError, "d_in and d_out must be >= 1"),
    ("bias_length", ValueError, r"bias must have shape \(6,\)"),
    ("scale", ValueError, "finite"),
])
def test_adopt_refuses_what_a_layer_refuses(case, error, match):
    a, bt, bias, scale = _fresh((4, 8)), _fresh((4, 6)), None, 1.0
    if case == "writable":
        bt = bt.copy()
    elif case == "float64":
        a = a.astype(np.float64)
        a.flags.writeable = False
    elif case == "big_endian":
        a = a.astype(">f4")
        a.flags.writeable = False
    elif case == "not_contiguous":
        bt = _fresh((6, 4)).T
    elif case == "1d":
        a = _fresh((32,))
    elif case == "ranks":
        bt = _fresh((3, 6))
    elif case == "d_out_0":
        bt = _fresh((4, 0))
    elif case == "bias_length":
        bias = _fresh((5,))
    elif case == "scale":
        scale = float("nan")
    with pytest.raises(error, match=match):
        LoraLayer._adopt(a, bt, scale, bias)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rank_0_layers_beside_others_in_a_bare_file(tmp_path, dtype):
    from safetensors.numpy import save_file
    f = tmp_path / "bare.safetensors"
    save_file({f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((0, 8), dtype),
               f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((4, 0), dtype),
               f"{PREFIX}model.layers.1.self_attn.q_proj.lora_A.weight": np.full((2, 8), 0.5, dtype),
               f"{PREFIX}model.layers.1.self_attn.q_proj.lora_B.weight": np.arange(8, dtype=dtype).reshape(4, 2)},
              str(f))
    adapter = LoraAdapter.from_safetensors(f)
    assert adapter.layers[(0, "q_proj")].rank == 0 and adapter.layers[(0, "q_proj")].b.shape == (4, 0)
    np.testing.assert_array_equal(adapter.layers[(1, "q_proj")].b, np.arange(8).reshape(4, 2))
    assert adapter.nbytes == 4 * (2 * 8 + 4 * 2)


# --------------------------------------------------------------------------- the core's read plan

def _plan_row(**changes):
    row = {"offset": 0, "count": 4, "start": 0, "rows": 4, "cols": 1, "kind": 0, "flip": 0}
    row.update(changes)
    return list(row.values())


@pytest.mark.parametrize("changes", [
    dict(count=-1),
    dict(start=-1),
    dict(start=7),                      # 7 + 4 > 8 values
    dict(count=9, rows=9),
    dict(rows=3),                       # rows * cols != count
    dict(rows=2, cols=3, flip=1),
    dict(kind=3),
    dict(flip=2),
    dict(offset=-8),
    dict(count=2**62, rows=2**62),
    dict(offset=2**63 - 9),             # its end does not fit in an int64
    dict(offset=2**63 - 5, kind=1),
])
def test_read_plan_refuses_what_would_write_outside_the_buffer(tmp_path, changes):
    from lorahook.files import _load
    f = tmp_path / "data.bin"
    f.write_bytes(np.arange(64, dtype="<f4").tobytes())
    buffer = np.full(8, -1.0, dtype=np.float32)
    plan = np.array([_plan_row(**changes)], dtype=np.int64)
    with open(f, "rb") as fh, pytest.raises(ValueError, match="plan row 0 is not a tensor inside"):
        _load.read_plan(fh.fileno(), plan, buffer, np.zeros(1, np.int64), 256, 256, 4)
    assert (buffer == -1).all()


def test_read_plan_limits_and_shapes_are_checked(tmp_path):
    from lorahook.files import _load
    f = tmp_path / "data.bin"
    f.write_bytes(np.arange(64, dtype="<f4").tobytes())
    buffer = np.zeros(8, dtype=np.float32)
    plan = np.array([_plan_row()], dtype=np.int64)
    with open(f, "rb") as fh:
        for limits in ((256, 256, 0), (256, 256, 1025), (63, 256, 4), (256, 0, 4)):
            with pytest.raises(ValueError, match="limits out of range"):
                _load.read_plan(fh.fileno(), plan, buffer, np.zeros(1, np.int64), *limits)
        with pytest.raises(ValueError, match="7 columns"):
            _load.read_plan(fh.fileno(), plan[:, :6].copy(), buffer, np.zeros(1, np.int64), 256, 256, 4)
        with pytest.raises(ValueError, match="one entry per tensor"):
            _load.read_plan(fh.fileno(), plan, buffer, np.zeros(2, np.int64), 256, 256, 4)
        # a transposed tensor read from byte 8: (2, 3) in the file, (3, 2) in the buffer
        plan = np.array([[8, 6, 1, 2, 3, 0, 1]], dtype=np.int64)
        bad = np.zeros(1, np.int64)
        assert _load.read_plan(fh.fileno(), plan, buffer, bad, 64, 64, 1) == (0, 0)
        np.testing.assert_array_equal(buffer[1:7], np.arange(2, 8, dtype=np.float32).reshape(2, 3).T.ravel())
        assert buffer[0] == 0 and buffer[7] == 0 and bad[0] == 0
        # past the end of the file: the tensor the file ended in
        plan = np.array([[240, 8, 0, 8, 1, 0, 0]], dtype=np.int64)
        assert _load.read_plan(fh.fileno(), plan, buffer, bad, 64, 64, 1) == (1, 0)
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: every read fails
    try:
        status, err = _load.read_plan(fd, np.array([_plan_row()], np.int64), buffer, bad, 64, 64, 1)
    finally:
        os.close(fd)
    assert (status, err) == (2, errno.EISDIR)


@pytest.mark.parametrize("start", [0, 3, 16])
@pytest.mark.parametrize("rows", [1, 16, 17, 33, 48])
@pytest.mark.parametrize("cols", [1, 4, 5, 16, 17, 33])
@pytest.mark.parametrize("kind", [0, 1, 2])
def test_read_plan_transposes_at_any_alignment(tmp_path, start, rows, cols, kind):
    # start 0 and 16 with rows a multiple of 16: whole aligned lines, stored past the cache;
    # a file row of more than 64 bytes (17 float32 columns, 33 half ones) grows the bounce buffer
    from lorahook.files import _load
    values = np.random.default_rng(rows * cols + kind).standard_normal((rows, cols)).astype(np.float32)
    if kind == 0:
        raw, want = values.astype("<f4").tobytes(), values
    elif kind == 1:
        raw, want = values.astype("<f2").tobytes(), values.astype(np.float16).astype(np.float32)
    else:
        bits = (values.view(np.uint32) >> 16).astype("<u2")
        raw, want = bits.tobytes(), (bits.astype(np.uint32) << 16).view(np.float32)
    f = tmp_path / "t.bin"
    f.write_bytes(b"\0" * 8 + raw)
    buffer = _load.aligned_floats(start + rows * cols + 5, False)
    buffer[:] = -7
    bad = np.zeros(1, np.int64)
    plan = np.array([[8, rows * cols, start, rows, cols, kind, 1]], dtype=np.int64)
    with open(f, "rb") as fh:
        assert _load.read_plan(fh.fileno(), plan, buffer, bad, 64, 256, 3) == (0, 0)
    np.testing.assert_array_equal(buffer[start:start + rows * cols].reshape(cols, rows), want.T)
    assert (buffer[:start] == -7).all() and (buffer[start + rows * cols:] == -7).all() and bad[0] == 0


def test_aligned_floats():
    from lorahook.files import _load
    for n, hugepages in ((0, False), (1, True), (1000, False), (2**21, True)):
        arr = _load.aligned_floats(n, hugepages)
        assert arr.shape == (n,) and arr.dtype == np.float32 and arr.flags.writeable
        assert arr.ctypes.data % 64 == 0 and arr.nbytes == 4 * n
        arr[:] = 1.5
        assert arr.sum() == 1.5 * n
    for n in (-1, 2**61, 2**63 - 1):
        with pytest.raises(ValueError, match=r"n must be in 0\.\.2305843009213693951"):
            _load.aligned_floats(n, False)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        arr = _load.aligned_floats(1 << 20, False)
        assert tracemalloc.get_traced_memory()[0] - before >= 4 << 20
        numpy_domain = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
        traced = tracemalloc.take_snapshot().filter_traces([numpy_domain]).traces
        assert any(t.size == 4 << 20 for t in traced)
        del arr
        # the buffer's trace is gone and what is left is far below its size (NumPy itself may
        # keep a few KiB of its own, as 1.25 does, on first use of a code path)
        traced = tracemalloc.take_snapshot().filter_traces([numpy_domain]).traces
        assert not any(t.size == 4 << 20 for t in traced)
        assert tracemalloc.get_traced_memory()[0] - before < 64 << 10
    finally:
        tracemalloc.stop()


# --------------------------------------------------------------------------- layouts kept between loads

def test_adapters_of_one_layout_share_the_checked_layout_and_keep_their_own_values(tmp_path):
    write_adapter(tmp_path / "one", "F32", bias=True, seed=1)
    write_adapter(tmp_path / "two", "F32", bias=True, seed=2)
    one_w, two_w = (tmp_path / d / "adapter_model.safetensors" for d in ("one", "two"))
    h1, h2 = read_safetensors_header(one_w), read_safetensors_header(two_w)
    assert h1[0] is h2[0], "byte-identical headers share one checked layout"
    with pytest.raises(TypeError):
        h1[0]["x"] = {}
    name = next(iter(h1[0]))
    with pytest.raises(TypeError):
        h1[0][name]["dtype"] = "F16"
    one, two = LoraAdapter.from_peft(tmp_path / "one"), LoraAdapter.from_peft(tmp_path / "two")
    check_against_independent_read(tmp_path / "one", one, True)
    check_against_independent_read(tmp_path / "two", two, True)
    assert not np.array_equal(one.layers[(3, "q_proj")].a, two.layers[(3, "q_proj")].a)


def test_refusals_of_one_layout_name_each_file(tmp_path):
    from safetensors.numpy import save_file
    paths = []
    for d in ("first", "second"):
        f = tmp_path / f"{d}.safetensors"
        save_file({f"{PREFIX}model.layers.0.mlp.unknown_proj.lora_A.weight": np.ones((2, 4), np.float32),
                   f"{PREFIX}model.layers.0.mlp.unknown_proj.lora_B.weight": np.ones((4, 2), np.float32)},
                  str(f))
        paths.append(f)
    for f in paths + paths:
        with pytest.raises(LoraFormatError, match=rf"^{re.escape(str(f))}: tensor .*unknown_proj"):
            LoraAdapter.from_safetensors(f)


def test_a_malformed_header_is_refused_by_name_every_time(tmp_path):
    write_adapter(tmp_path / "ad", "F32")
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    blob = weights.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    bad = blob[8:8 + n].replace(b'"F32"', b'"F31"', 1)
    for i in range(3):
        f = tmp_path / f"bad{i}.safetensors"
        f.write_bytes(blob[:8] + bad + blob[8 + n:])
        with pytest.raises(LoraFormatError, match=rf"^{re.escape(str(f))}: tensor .*unknown dtype 'F31'"):
            read_safetensors_header(f)


def test_what_loads_keep_is_bounded_and_not_shared_with_callers(tmp_path):
    from lorahook.models import lookup

    write_adapter(tmp_path / "ad", "F32")
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    # the metadata each read returns is the caller's own: changing it changes no later read
    read_safetensors_header(weights)[1]["mine"] = "x"
    read_float32(weights)[1]["also mine"] = "y"
    assert read_safetensors_header(weights)[1] == read_float32(weights)[1] == {"format": "pt"}

    # module paths longer than any real model's are placed every time, never kept
    lookup._placed.cache_clear()
    long_path = "model.layers.0." + "x" * 10_000 + ".q_proj"
    assert lookup.place(long_path) is None and lookup.place(long_path) is None
    assert lookup._placed.cache_info().currsize == 0
    assert lookup.place("model.layers.3.self_attn.q_proj") == (3, "q_proj")
    assert lookup._placed.cache_info().currsize == 1


def test_reads_of_one_kept_layout_share_a_plan_and_refuse_by_file(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(5)
    values = []
    for i in range(2):
        t = {"x": rng.standard_normal((3, 5)).astype(np.float32), "n": np.arange(4, dtype=np.int8)}
        save_file(t, str(tmp_path / f"{i}.safetensors"))
        values.append(t)
    st_reader._forget_layouts()
    for i in range(2):
        f = tmp_path / f"{i}.safetensors"
        arrays, _ = st_reader.read_float32(f, ["x"], transposed=["x"])
        np.testing.assert_array_equal(arrays["x"], values[i]["x"].T)
        with pytest.raises(LoraFormatError, match=rf"^{re.escape(str(f))}: tensor 'n' has dtype I8"):
            st_reader.read_float32(f, ["x", "n"])
    (kept,) = st_reader._kept_by_header.values()
    assert list(kept.derived) == [("plan", raw_header(tmp_path / "0.safetensors")[1], ("x",), ("x",))]


def test_scales_of_one_layout_and_config_are_shared_and_refusals_name_each_file(tmp_path):
    st_reader._forget_layouts()

    def kept_scales():
        (kept,) = st_reader._kept_by_header.values()
        return [key for key in kept.derived if key[0] == "scales"]

    for seed, d in enumerate(("one", "two")):
        write_adapter(tmp_path / d, "F32", seed=seed)
    one, two = LoraAdapter.from_peft(tmp_path / "one"), LoraAdapter.from_peft(tmp_path / "two")
    assert len(kept_scales()) == 1
    (kept,) = st_reader._kept_by_header.values()
    assert ("entries", False, ()) in kept.derived  # the names grouped once for both
    check_against_independent_read(tmp_path / "one", one, False)
    check_against_independent_read(tmp_path / "two", two, False)
    ranks = {path: rank for path, _, _, rank in MODULES}
    for adapter in (one, two):
        for key, layer in adapter.layers.items():
            assert layer.scale == 16 / ranks[adapter.module_paths[key]]  # lora_alpha / r
    # the same tensors under another config: its own scales
    cfg = json.loads((tmp_path / "two" / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 4
    (tmp_path / "two" / "adapter_config.json").write_text(json.dumps(cfg))
    quarter = LoraAdapter.from_peft(tmp_path / "two")
    assert len(kept_scales()) == 2
    for key, layer in quarter.layers.items():
        assert layer.scale == pytest.approx(two.layers[key].scale / 4)
    # a config the tensors do not fit: refused naming each file, nothing kept
    for d in ("one", "two"):
        cfg = json.loads((tmp_path / d / "adapter_config.json").read_text())
        cfg["rank_pattern"] = {}
        (tmp_path / d / "adapter_config.json").write_text(json.dumps(cfg))
    for d in ("one", "two", "one"):
        weights = tmp_path / d / "adapter_model.safetensors"
        with pytest.raises(LoraFormatError, match=rf"^{re.escape(str(weights))}: module .* has rank \d+ in its tensors"):
            LoraAdapter.from_peft(tmp_path / d)
    assert len(kept_scales()) == 2


def test_a_header_too_large_to_keep_leaves_nothing_behind(tmp_path):
    st_reader._forget_layouts()
    tensors = {}
    for i in range(4):
        tensors[f"{PREFIX}model.layers.{i}.mlp.down_proj.lora_A.weight"] = np.ones((2, 8), np.float32)
        tensors[f"{PREFIX}model.layers.{i}.mlp.down_proj.lora_B.weight"] = np.ones((8, 2), np.float32)
    d = write_dir(tmp_path / "big", tensors,
                  {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["down_proj"]},
                  metadata={"pad": "p" * (st_reader._LAYOUT_BYTES + 10)})
    for _ in range(3):
        assert LoraAdapter.from_peft(d).num_adapted_layers == 4
    assert not st_reader._kept_by_header and not st_reader._kept_by_id


def test_a_callers_header_is_used_only_when_it_is_the_files_own(tmp_path):
    write_adapter(tmp_path / "ad", "F32")
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    tensors, metadata, start, size = read_safetensors_header(weights)
    st_reader._forget_layouts()
    mine = {name: dict(info) for name, info in tensors.items()}
    a_name = f"{PREFIX}model.layers.0.linear_attn.in_proj_a.lora_A.weight"
    b_name = f"{PREFIX}model.layers.0.linear_attn.in_proj_a.lora_B.weight"
    header = (MappingProxyType(mine), metadata, start, size)
    first, _ = st_reader.read_float32(weights, [a_name], header=header)
    np.testing.assert_array_equal(first[a_name], independent_read(weights)[a_name])
    mine[a_name] = dict(mine[b_name])  # the same name, now pointing at lora_B's bytes
    with pytest.raises(LoraFormatError, match="changed since its header was read"):
        st_reader.read_float32(weights, [a_name], header=header)
