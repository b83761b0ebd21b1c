"""Hostile adapter files: every bad file is a LoraFormatError (or LoraValidationError), nothing else.

Hand-made cases cover truncation, corrupt and enormous headers, header lengths past the end
of the file, terabyte tensors declared on tiny files, overlapping / out-of-range offsets,
unsupported dtypes, NaN/Inf, and broken or hostile ``adapter_config.json`` files.  The
nastiest run in a child process under an address-space limit so that a crash or a runaway
allocation fails the test instead of the run.  Hypothesis mutates the bytes of a valid file.
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

save_file = pytest.importorskip("safetensors.numpy").save_file

from lorahook import LoraAdapter, LoraFormatError, LoraValidationError  # noqa: E402

ALLOWED = (LoraFormatError, LoraValidationError)
PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"
A_KEY = f"{PREFIX}.lora_A.weight"
B_KEY = f"{PREFIX}.lora_B.weight"
R, D_IN, D_OUT = 2, 4, 3
TIME_LIMIT = 10.0  # seconds any single load may take
MEMORY_LIMIT = 1536 * 1024 * 1024


def config(**over):
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "target_modules": ["q_proj"],
           "bias": "none", "task_type": "CAUSAL_LM"}
    cfg.update(over)
    return cfg


def factors(seed=0):
    rng = np.random.default_rng(seed)
    return {A_KEY: rng.standard_normal((R, D_IN)).astype(np.float32),
            B_KEY: rng.standard_normal((D_OUT, R)).astype(np.float32)}


def write_valid_dir(path, tensors=None, cfg=None):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(factors() if tensors is None else tensors, str(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config() if cfg is None else cfg))
    return path


def st_bytes(header, data=b"", header_len=None, raw_header=None):
    """A safetensors file from a header (dict or raw bytes) and a data section."""
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    n = len(text) if header_len is None else header_len
    return struct.pack("<Q", n) + text + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def valid_header():
    return {A_KEY: entry("F32", [R, D_IN], 0, 4 * R * D_IN),
            B_KEY: entry("F32", [D_OUT, R], 4 * R * D_IN, 4 * R * (D_IN + D_OUT))}


VALID_DATA = bytes(np.arange(R * (D_IN + D_OUT), dtype=np.float32).tobytes())


def load_any(path):
    path = Path(path)
    if path.is_dir():
        return LoraAdapter.from_peft(path)
    return LoraAdapter.from_safetensors(path)


def assert_refused(path, allow_load=False):
    """Loading ``path`` raises only an allowed error, quickly; returns the adapter if it loads."""
    t0 = time.monotonic()
    try:
        adapter = load_any(path)
    except ALLOWED as exc:
        assert str(exc), "empty error message"
        adapter = None
    except Exception as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{type(exc).__name__} (not LoraFormatError) for {path}: {exc}"[:2000])
    elapsed = time.monotonic() - t0
    assert elapsed < TIME_LIMIT, f"load took {elapsed:.1f} s"
    if adapter is not None:
        assert allow_load, f"{path} loaded but should have been refused"
        check_usable(adapter)
    return adapter


def check_usable(adapter):
    """A loaded adapter applies finite deltas."""
    from lorahook import apply_lora_rows
    for (layer_idx, module), layer in adapter.layers.items():
        x = np.ones((3, layer.d_in), dtype=np.float32)
        y = np.zeros((3, layer.d_out), dtype=np.float32)
        apply_lora_rows(adapter, layer_idx, module, x, y, layer.d_in, layer.d_out)
        assert np.isfinite(y).all(), f"loaded adapter produces non-finite output for {layer_idx, module}"


def in_dir_and_bare(tmp_path, blob, cfg=None):
    """Write ``blob`` as a bare file and inside an adapter directory; return both paths."""
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes(blob)
    d = tmp_path / "adapter"
    d.mkdir(exist_ok=True)
    (d / "adapter_model.safetensors").write_bytes(blob)
    (d / "adapter_config.json").write_text(json.dumps(config() if cfg is None else cfg))
    return [bare, d]


# --------------------------------------------------------------------------- a valid baseline


def test_valid_dir_loads(tmp_path):
    d = write_valid_dir(tmp_path / "ok")
    adapter = LoraAdapter.from_peft(d)
    assert adapter.has_adapter(0, "q_proj")
    layer = adapter.layers[(0, "q_proj")]
    assert (layer.rank, layer.d_in, layer.d_out) == (R, D_IN, D_OUT)
    assert math.isclose(layer.scale, 2.0)
    np.testing.assert_array_equal(layer.a, factors()[A_KEY])
    check_usable(adapter)


def test_hand_built_file_loads(tmp_path):
    p = tmp_path / "hand.safetensors"
    p.write_bytes(st_bytes(valid_header(), VALID_DATA))
    adapter = LoraAdapter.from_safetensors(p)
    assert adapter.layers[(0, "q_proj")].rank == R


def test_symlinked_weights_and_config_keep_loading(tmp_path):
    """The Hugging Face cache stores files as symlinks into a blobs directory."""
    src = write_valid_dir(tmp_path / "blobs")
    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "adapter_model.safetensors").symlink_to(src / "adapter_model.safetensors")
    (snap / "adapter_config.json").symlink_to(os.path.relpath(src / "adapter_config.json", snap))
    adapter = LoraAdapter.from_peft(snap)
    np.testing.assert_array_equal(adapter.layers[(0, "q_proj")].b, factors()[B_KEY])
    link = tmp_path / "linked.safetensors"
    link.symlink_to(src / "adapter_model.safetensors")
    assert LoraAdapter.from_safetensors(link).has_adapter(0, "q_proj")
    dir_link = tmp_path / "dirlink"
    dir_link.symlink_to(snap, target_is_directory=True)
    assert LoraAdapter.from_peft(dir_link).has_adapter(0, "q_proj")


def test_broken_symlink_weights(tmp_path):
    d = write_valid_dir(tmp_path / "a")
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.safetensors").symlink_to(tmp_path / "nowhere")
    assert_refused(d)


def test_symlink_loop(tmp_path):
    d = write_valid_dir(tmp_path / "a")
    w = d / "adapter_model.safetensors"
    w.unlink()
    (d / "loop").symlink_to(w)
    w.symlink_to(d / "loop")
    assert_refused(d)


# --------------------------------------------------------------------------- safetensors bytes


def _truncations():
    full = st_bytes(valid_header(), VALID_DATA)
    return [full[:n] for n in range(len(full))]


def test_every_truncation_refused(tmp_path):
    for blob in _truncations():
        for p in in_dir_and_bare(tmp_path, blob):
            assert_refused(p)


def test_trailing_garbage_refused(tmp_path):
    for p in in_dir_and_bare(tmp_path, st_bytes(valid_header(), VALID_DATA + b"\0" * 4)):
        assert_refused(p)


HEADER_CASES = {
    "empty_file": b"",
    "seven_bytes": b"\x10\0\0\0\0\0\0",
    "zero_header": struct.pack("<Q", 0),
    "max_u64_header": struct.pack("<Q", 2**64 - 1) + b"{}",
    "2**63_header": struct.pack("<Q", 2**63) + b"{}",
    "terabyte_header": struct.pack("<Q", 2**40) + b"{}",
    "just_over_limit": struct.pack("<Q", 100 * 1024 * 1024 + 1) + b"{}",
    "header_past_eof": st_bytes(valid_header(), VALID_DATA, header_len=10_000),
    "header_one_past_eof": st_bytes(None, b"", raw_header=b"{}", header_len=3),
    "header_too_short": st_bytes(valid_header(), VALID_DATA, header_len=20),
    "not_json": st_bytes(None, VALID_DATA, raw_header=b"this is not json"),
    "invalid_utf8": st_bytes(None, b"", raw_header=b'{"\xff\xfe": 1}'),
    "json_list": st_bytes([1, 2, 3]),
    "json_string": st_bytes("tensor"),
    "json_null": st_bytes(None),
    "json_number": st_bytes(None, raw_header=b"1e999"),
    "nan_in_header": st_bytes(None, raw_header=b'{"x": NaN}'),
    "duplicate_keys": st_bytes(None, VALID_DATA, raw_header=(
        b'{"%s": %s, "%s": %s}' % (A_KEY.encode(), json.dumps(valid_header()[A_KEY]).encode(),
                                   A_KEY.encode(), json.dumps(valid_header()[B_KEY]).encode()))),
    "deep_nesting_lists": st_bytes(None, raw_header=b"[" * 100_000 + b"]" * 100_000),
    "deep_nesting_objects": st_bytes(None, raw_header=b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    "deep_nesting_in_entry": st_bytes(None, raw_header=b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "huge_int_in_header": st_bytes(None, raw_header=b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'),
    "empty_object": st_bytes({}),
    "metadata_only": st_bytes({"__metadata__": {"format": "pt"}}),
    "metadata_not_strings": st_bytes({"__metadata__": {"format": 1}, **valid_header()}, VALID_DATA),
    "metadata_list": st_bytes({"__metadata__": [1], **valid_header()}, VALID_DATA),
    "entry_not_object": st_bytes({A_KEY: [1, 2]}),
    "entry_missing_fields": st_bytes({A_KEY: {}}),
    "padding_spaces_ok_but_no_tensors": st_bytes(None, raw_header=b"{}" + b" " * 64),
    "nul_bytes_header": st_bytes(None, raw_header=b"\0" * 64),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_corrupt_headers(tmp_path, case):
    for p in in_dir_and_bare(tmp_path, HEADER_CASES[case]):
        assert_refused(p)


def _with(name, **changes):
    h = valid_header()
    h[name] = dict(h[name], **changes)
    return h


TB = 2**40
TENSOR_CASES = {
    # declared sizes the file cannot back
    "terabyte_shape_tiny_file": (_with(A_KEY, shape=[2**20, 2**20], data_offsets=[0, 4 * TB]), VALID_DATA),
    "terabyte_shape_small_span": (_with(A_KEY, shape=[2**20, 2**20]), VALID_DATA),
    "exabyte_shape": (_with(A_KEY, shape=[2**62, 2**62]), VALID_DATA),
    "zero_size_huge_dims": ({A_KEY: entry("F32", [0, 2**64], 0, 0),
                             B_KEY: entry("F32", [D_OUT, 0], 0, 0)}, b""),
    "zero_size_2**63_dim": ({A_KEY: entry("F32", [0, 2**63], 0, 0),
                             B_KEY: entry("F32", [2**63, 0], 0, 0)}, b""),
    "zero_size_2**40_dims": ({A_KEY: entry("F32", [0, 2**40], 0, 0),
                              B_KEY: entry("F32", [2**40, 0], 0, 0)}, b""),
    "many_dims": (_with(A_KEY, shape=[1] * 10_000 + [R, D_IN]), VALID_DATA),
    "negative_dim": (_with(A_KEY, shape=[-R, -D_IN]), VALID_DATA),
    "float_dim": (_with(A_KEY, shape=[2.0, 4.0]), VALID_DATA),
    "bool_dim": (_with(A_KEY, shape=[True, 4]), VALID_DATA),
    "string_dim": (_with(A_KEY, shape=["2", "4"]), VALID_DATA),
    "shape_not_list": (_with(A_KEY, shape=8), VALID_DATA),
    "1d_a": (_with(A_KEY, shape=[R * D_IN]), VALID_DATA),
    "3d_b": (_with(B_KEY, shape=[1, D_OUT, R]), VALID_DATA),
    "scalar_a": ({A_KEY: entry("F32", [], 0, 4), B_KEY: entry("F32", [D_OUT, 1], 4, 4 + 4 * D_OUT)},
                 bytes(4 + 4 * D_OUT)),
    # offsets
    "offsets_past_end": (_with(B_KEY, data_offsets=[32, 32 + 24 + 4 * TB]), VALID_DATA),
    "offsets_reversed": (_with(A_KEY, data_offsets=[32, 0]), VALID_DATA),
    "offsets_negative": (_with(A_KEY, data_offsets=[-32, 0]), VALID_DATA),
    "offsets_overlap": (_with(B_KEY, data_offsets=[16, 40]), VALID_DATA),
    "offsets_same": (_with(B_KEY, shape=[2, 4], data_offsets=[0, 32]), VALID_DATA),
    "offsets_gap": (_with(B_KEY, data_offsets=[36, 60]), VALID_DATA + bytes(4)),
    "offsets_three": (_with(A_KEY, data_offsets=[0, 16, 32]), VALID_DATA),
    "offsets_float": (_with(A_KEY, data_offsets=[0.0, 32.0]), VALID_DATA),
    "offsets_string": (_with(A_KEY, data_offsets=["0", "32"]), VALID_DATA),
    "offsets_huge": (_with(A_KEY, data_offsets=[2**64, 2**64 + 32]), VALID_DATA),
    "offsets_missing": ({A_KEY: {"dtype": "F32", "shape": [R, D_IN]}, B_KEY: valid_header()[B_KEY]}, VALID_DATA),
    # dtypes
    "dtype_f64": (_with(A_KEY, dtype="F64", shape=[R, D_IN // 2]), VALID_DATA),
    "dtype_i32": (_with(A_KEY, dtype="I32"), VALID_DATA),
    "dtype_u8": ({A_KEY: entry("U8", [R, D_IN], 0, R * D_IN),
                  B_KEY: entry("F32", [D_OUT, R], R * D_IN, R * D_IN + 4 * R * D_OUT)},
                 bytes(R * D_IN + 4 * R * D_OUT)),
    "dtype_bool": ({A_KEY: entry("BOOL", [R, D_IN], 0, R * D_IN),
                    B_KEY: entry("F32", [D_OUT, R], R * D_IN, R * D_IN + 4 * R * D_OUT)},
                   bytes(R * D_IN + 4 * R * D_OUT)),
    "dtype_f8": ({A_KEY: entry("F8_E4M3", [R, D_IN], 0, R * D_IN),
                  B_KEY: entry("F32", [D_OUT, R], R * D_IN, R * D_IN + 4 * R * D_OUT)},
                 bytes(R * D_IN + 4 * R * D_OUT)),
    "dtype_c64": (_with(A_KEY, dtype="C64", shape=[R, D_IN // 2]), VALID_DATA),
    "dtype_unknown": (_with(A_KEY, dtype="F31"), VALID_DATA),
    "dtype_lowercase": (_with(A_KEY, dtype="f32"), VALID_DATA),
    "dtype_null": (_with(A_KEY, dtype=None), VALID_DATA),
    "dtype_number": (_with(A_KEY, dtype=4), VALID_DATA),
    "dtype_list": (_with(A_KEY, dtype=["F32"]), VALID_DATA),
    # names
    "only_a": ({A_KEY: valid_header()[A_KEY]}, VALID_DATA[:32]),
    "only_b": ({B_KEY: entry("F32", [D_OUT, R], 0, 24)}, VALID_DATA[:24]),
    "not_lora": ({"model.layers.0.self_attn.q_proj.weight": entry("F32", [2, 4], 0, 32)}, VALID_DATA[:32]),
    "unknown_module": ({A_KEY.replace("q_proj", "qq_proj"): valid_header()[A_KEY],
                        B_KEY.replace("q_proj", "qq_proj"): valid_header()[B_KEY]}, VALID_DATA),
    "huge_layer_index": ({A_KEY.replace("layers.0", "layers." + "9" * 5000): valid_header()[A_KEY],
                          B_KEY.replace("layers.0", "layers." + "9" * 5000): valid_header()[B_KEY]},
                         VALID_DATA),
    "rank_mismatch": (_with(B_KEY, shape=[D_OUT - 1, R + 1]), VALID_DATA[:32] + bytes(4 * (D_OUT - 1) * (R + 1))),
    "empty_name": ({"": valid_header()[A_KEY]}, VALID_DATA[:32]),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_bad_tensors(tmp_path, case):
    header, data = TENSOR_CASES[case]
    for p in in_dir_and_bare(tmp_path, st_bytes(header, data)):
        assert_refused(p)


def _checked(raw, data_len):
    """What the header check says of one raw header: its layout, or ``None`` when refused."""
    from lorahook.files import safetensors_file as st_reader
    try:
        return st_reader._checked_header(raw, data_len, "h.safetensors")
    except LoraFormatError:
        return None


# Raw JSON values with objects that may give a key twice (keys drawn from two letters).
_RAW_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3)).map(json.dumps),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from("ab"), inner), max_size=3).map(
            lambda kv: "{" + ", ".join(f'"{k}": {v}' for k, v in kv) + "}")),
    max_leaves=6)


def _no_repeated_keys(raw):
    def pairs(items):
        if len({k for k, _ in items}) != len(items):
            raise ValueError("a key given twice")
        return items

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except ValueError:
        return False
    return True


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(["F32", "F16", "BF16", "I8", "U64"]),
                          st.lists(st.integers(0, 3), max_size=3),
                          st.one_of(st.none(), _RAW_JSON)),
                max_size=4),
       st.randoms(use_true_random=False), st.one_of(st.none(), _RAW_JSON), st.integers(-1, 1))
def test_the_header_check_accepts_exactly_the_well_formed_generated_layouts(tensors, rng, meta_extra,
                                                                           slack):
    # contiguous tensors listed in any order, with extra fields holding nested JSON
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U64": 8}
    fields, position = [], 0
    for i, (dtype, shape, extra) in enumerate(tensors):
        end = position + sizes[dtype] * math.prod(shape)
        text = f'"t{i}": {{"dtype": "{dtype}", "shape": {shape}, "data_offsets": [{position}, {end}]'
        fields.append(text + (f', "x": {extra}' if extra is not None else "") + "}")
        position = end
    rng.shuffle(fields)
    if meta_extra is not None:
        fields.append(f'"__metadata__": {{"format": "pt", "more": {meta_extra}}}')
    raw = "{" + ", ".join(fields) + "}"
    data_len = max(position + slack, 0)
    checked = _checked(raw.encode(), data_len)
    # every layout the generator means to be valid is accepted, and nothing else
    well_formed = (data_len == position and _no_repeated_keys(raw)
                   and (meta_extra is None or meta_extra.startswith('"')))
    assert (checked is not None) == well_formed


def test_many_dimensions_are_checked_without_huge_products(tmp_path):
    from lorahook.files.safetensors_file import read_safetensors_header
    f = tmp_path / "ones.safetensors"
    f.write_bytes(st_bytes({"t": entry("F32", [1] * 20, 0, 4)}, bytes(4)))
    tensors, _, _, _ = read_safetensors_header(f)
    assert tensors["t"]["shape"] == (1,) * 20
    wide = b'{"t": {"dtype": "F32", "shape": [' + b", ".join([b"2147483647"] * 20) + b'], "data_offsets": [0, 4]}}'
    f.write_bytes(st_bytes(None, bytes(4), raw_header=wide))
    with pytest.raises(LoraFormatError, match="needs more than the 4 bytes of data"):
        read_safetensors_header(f)
    # a million dimensions: an integer of 31 million bits if multiplied out; a child that
    # multiplied it would not answer in time
    many = b'{"t": {"dtype": "F32", "shape": [' + b", ".join([b"2147483647"] * 10**6) + b'], "data_offsets": [0, 4]}}'
    f.write_bytes(st_bytes(None, bytes(4), raw_header=many))
    assert run_in_child([f], timeout=60) == {str(f): "refused"}


@pytest.mark.parametrize("extra", ['{"a": 1, "a": 2}', '[{"a": 1, "a": 2}]', '{"b": {"a": 1, "a": 2}}'])
def test_a_key_given_twice_in_any_nested_object_is_refused(tmp_path, extra):
    from lorahook.files.safetensors_file import read_safetensors_header
    hdr = json.dumps(valid_header())
    raw = hdr[:-2] + f', "x": {extra}' + "}}"
    f = tmp_path / "dup.safetensors"
    f.write_bytes(st_bytes(None, VALID_DATA, raw_header=raw.encode()))
    assert json.loads(raw)  # valid JSON apart from the repeated key
    with pytest.raises(LoraFormatError, match="duplicate key 'a'"):
        read_safetensors_header(f)


@pytest.mark.parametrize("dtype,bad", [
    ("F32", np.float32("nan")), ("F32", np.float32("inf")), ("F32", np.float32("-inf")),
    ("F16", np.float16("inf")), ("F16", np.float16("nan")), ("BF16", None),
])
@pytest.mark.parametrize("which", [A_KEY, B_KEY])
def test_non_finite_values(tmp_path, dtype, bad, which):
    t = factors()
    if dtype == "BF16":
        bits = (t[which].view(np.uint32) >> 16).astype(np.uint16)
        bits.reshape(-1)[1] = 0x7FC1  # a bfloat16 NaN
        other = [k for k in t if k != which][0]
        obits = (t[other].view(np.uint32) >> 16).astype(np.uint16)
        hdr = {which: entry("BF16", list(t[which].shape), 0, bits.nbytes),
               other: entry("BF16", list(t[other].shape), bits.nbytes, bits.nbytes + obits.nbytes)}
        blob = st_bytes(hdr, bits.tobytes() + obits.tobytes())
        paths = in_dir_and_bare(tmp_path, blob)
    else:
        np_dtype = np.float32 if dtype == "F32" else np.float16
        t = {k: v.astype(np_dtype) for k, v in t.items()}
        t[which].reshape(-1)[-1] = bad
        paths = [write_valid_dir(tmp_path / "d", t)]
        paths.append(paths[0] / "adapter_model.safetensors")
    for p in paths:
        assert_refused(p)


def test_f16_factors_load_widened_and_apply(tmp_path):
    t = {k: v.astype(np.float16) for k, v in factors().items()}
    adapter = LoraAdapter.from_peft(write_valid_dir(tmp_path / "f16", t))
    np.testing.assert_array_equal(adapter.layers[(0, "q_proj")].a, t[A_KEY].astype(np.float32))
    np.testing.assert_array_equal(adapter.layers[(0, "q_proj")].b, t[B_KEY].astype(np.float32))
    check_usable(adapter)


# --------------------------------------------------------------------------- adapter_config.json


CONFIG_CASES = {
    "not_json": b"{r: 4",
    "empty": b"",
    "invalid_utf8": b'{"peft_type": "\xff"}',
    "list": b"[]",
    "null": b"null",
    "string": b'"LORA"',
    "deep_lists": b"[" * 100_000 + b"]" * 100_000,
    "deep_objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "deep_in_value": json.dumps(config())[:-1].encode() + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge_int_literal": json.dumps(config())[:-1].encode() + b', "r2": ' + b"9" * 100_000 + b"}",
}

CONFIG_OVERRIDES = {
    "peft_type_missing": {"peft_type": None},
    "peft_type_lowercase": {"peft_type": "lora"},
    "peft_type_ia3": {"peft_type": "IA3"},
    "peft_type_list": {"peft_type": ["LORA"]},
    "r_string": {"r": "2"},
    "r_float": {"r": 2.0},
    "r_bool": {"r": True},
    "r_zero": {"r": 0},
    "r_negative": {"r": -2},
    "r_huge": {"r": 10**300},
    "r_huge_rslora": {"r": 10**400, "use_rslora": True},
    "r_huge_float": {"r": 1e308},
    "r_mismatch": {"r": R + 1},
    "r_list": {"r": [R]},
    "alpha_string": {"lora_alpha": "4"},
    "alpha_null_list": {"lora_alpha": [None]},
    "alpha_bool": {"lora_alpha": True},
    "alpha_inf_literal": {"lora_alpha": float("inf")},
    "alpha_nan_literal": {"lora_alpha": float("nan")},
    "alpha_huge_int": {"lora_alpha": 10**400},
    "alpha_object": {"lora_alpha": {"v": 1}},
    "target_modules_int": {"target_modules": 5},
    "target_modules_mixed": {"target_modules": ["q_proj", 5]},
    "target_modules_bad_regex": {"target_modules": "(q_proj"},
    "target_modules_nomatch": {"target_modules": ["k_proj"]},
    "exclude_modules_bad_regex": {"exclude_modules": "(q_proj"},
    "exclude_modules_excludes": {"exclude_modules": ["q_proj"]},
    "rank_pattern_list": {"rank_pattern": [1]},
    "rank_pattern_bad_regex": {"rank_pattern": {"(": 2}},
    "rank_pattern_value_str": {"rank_pattern": {"q_proj": "2"}},
    "rank_pattern_value_zero": {"rank_pattern": {"q_proj": 0}},
    "rank_pattern_value_huge": {"rank_pattern": {"q_proj": 10**50}},
    "alpha_pattern_value_str": {"alpha_pattern": {"q_proj": "x"}},
    "alpha_pattern_bad_regex": {"alpha_pattern": {"[": 2}},
    "alpha_pattern_value_nan": {"alpha_pattern": {"q_proj": float("nan")}},
    "layers_to_transform_str": {"layers_to_transform": "0"},
    "layers_to_transform_excl": {"layers_to_transform": [5]},
    "layers_pattern_int": {"layers_pattern": 5},
    "use_dora": {"use_dora": True},
    "bias_all": {"bias": "all"},
    "bias_list": {"bias": ["none"]},
    "init_pissa": {"init_lora_weights": "pissa"},
    "modules_to_save": {"modules_to_save": 5},
    "lora_bias_without_tensor": {"lora_bias": True},
    "init_weights_list": {"init_lora_weights": ["pissa"]},
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_broken_config_bytes(tmp_path, case):
    d = write_valid_dir(tmp_path / "a")
    (d / "adapter_config.json").write_bytes(CONFIG_CASES[case])
    assert_refused(d)


@pytest.mark.parametrize("case", sorted(CONFIG_OVERRIDES))
def test_hostile_config_values(tmp_path, case):
    cfg = config(**CONFIG_OVERRIDES[case])
    cfg = {k: v for k, v in cfg.items() if v is not None or k != "peft_type"}
    d = write_valid_dir(tmp_path / "a", cfg=cfg)
    assert_refused(d)


@pytest.mark.parametrize("alpha", [1e30, 1e38, 1e39, 1e300, 1.7e308])
def test_huge_alpha_never_gives_non_finite_outputs(tmp_path, alpha):
    """A scale that overflows float32 must be refused, or at least never produce inf/NaN."""
    d = write_valid_dir(tmp_path / "a", cfg=config(lora_alpha=alpha))
    assert_refused(d, allow_load=True)


def test_only_pickle_weights(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(config()))
    # a pickle that would run code if it were ever unpickled
    (d / "adapter_model.bin").write_bytes(b"cos\nsystem\n(S'touch %s'\ntR." % str(tmp_path / "pwned").encode())
    assert_refused(d)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("layout", ["no_config", "no_weights", "config_is_dir", "weights_is_dir",
                                    "dir_is_file", "empty_dir", "weights_fifo"])
def test_broken_dir_layouts(tmp_path, layout):
    d = write_valid_dir(tmp_path / "a")
    if layout == "no_config":
        (d / "adapter_config.json").unlink()
    elif layout == "no_weights":
        (d / "adapter_model.safetensors").unlink()
    elif layout == "config_is_dir":
        (d / "adapter_config.json").unlink()
        (d / "adapter_config.json").mkdir()
    elif layout == "weights_is_dir":
        (d / "adapter_model.safetensors").unlink()
        (d / "adapter_model.safetensors").mkdir()
    elif layout == "dir_is_file":
        d = d / "adapter_model.safetensors"
        with pytest.raises(ALLOWED):
            LoraAdapter.from_peft(d)
        return
    elif layout == "empty_dir":
        for p in d.iterdir():
            p.unlink()
    else:
        (d / "adapter_model.safetensors").unlink()
        os.mkfifo(d / "adapter_model.safetensors")
    assert_refused(d)


def test_safetensors_loader_given_a_dir(tmp_path):
    d = write_valid_dir(tmp_path / "a")
    with pytest.raises(ALLOWED):
        LoraAdapter.from_safetensors(d)


# --------------------------------------------------------------------------- in a memory-limited child


CHILD = textwrap.dedent("""
    import os, resource, sys, json, traceback
    import numpy as np
    from lorahook import LoraAdapter, LoraFormatError, LoraValidationError
    results = {}
    for path in sys.argv[1:]:
        try:
            if os.path.isdir(path):
                LoraAdapter.from_peft(path)
            else:
                LoraAdapter.from_safetensors(path)
            results[path] = "loaded"
        except (LoraFormatError, LoraValidationError):
            results[path] = "refused"
        except BaseException as exc:
            results[path] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
    print(json.dumps(results))
""")


def _limit_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_in_child(paths, timeout=120):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, paths)], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_limit_memory, env=env,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, (
        f"child died with {proc.returncode} (a crash or a runaway allocation)\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


NASTIEST = ["max_u64_header", "terabyte_header", "just_over_limit", "header_past_eof",
            "deep_nesting_lists", "deep_nesting_objects", "huge_int_in_header"]
NASTIEST_TENSORS = ["terabyte_shape_tiny_file", "terabyte_shape_small_span", "exabyte_shape",
                    "zero_size_huge_dims", "zero_size_2**63_dim", "zero_size_2**40_dims",
                    "offsets_past_end", "offsets_huge", "many_dims"]


def test_nastiest_in_memory_limited_child(tmp_path):
    paths = []
    for i, name in enumerate(NASTIEST):
        (tmp_path / f"h{i}").mkdir()
        paths += in_dir_and_bare(tmp_path / f"h{i}", HEADER_CASES[name])
    for i, name in enumerate(NASTIEST_TENSORS):
        (tmp_path / f"t{i}").mkdir()
        paths += in_dir_and_bare(tmp_path / f"t{i}", st_bytes(*TENSOR_CASES[name]))
    for i, raw in enumerate([CONFIG_CASES["deep_lists"], CONFIG_CASES["deep_objects"],
                             CONFIG_CASES["huge_int_literal"]]):
        d = write_valid_dir(tmp_path / f"c{i}")
        (d / "adapter_config.json").write_bytes(raw)
        paths.append(d)
    results = run_in_child(paths)
    bad = {p: r for p, r in results.items() if r != "refused"}
    assert not bad, bad


def test_child_memory_limit_really_bites(tmp_path):
    """The limit is real: a child that allocates 4 GB dies or raises MemoryError."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    code = "import numpy as np\ntry:\n    a = np.ones(2**30, np.float32)\n    print('allocated')\nexcept MemoryError:\n    print('refused')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limit_memory, env=env,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert "allocated" not in proc.stdout


def test_random_mutations_in_memory_limited_child(tmp_path):
    """A few hundred seeded byte mutations of a valid file, loaded under the memory limit."""
    rng = np.random.default_rng(20240611)
    valid = bytearray(st_bytes(valid_header(), VALID_DATA))
    paths = []
    for i in range(300):
        blob = bytearray(valid)
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.integers(0, 4)
            pos = int(rng.integers(0, len(blob)))
            if kind == 0:
                blob[pos] = int(rng.integers(0, 256))
            elif kind == 1:
                del blob[pos:pos + int(rng.integers(1, 16))]
            elif kind == 2:
                blob[pos:pos] = bytes(rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8))
            else:
                digits = str(int(rng.choice([0, 1, 2**31, 2**32, 2**40, 2**63, 2**64, 10**20]))).encode()
                blob[pos:pos + len(digits)] = digits
        p = tmp_path / f"m{i}.safetensors"
        p.write_bytes(bytes(blob))
        paths.append(p)
    results = run_in_child(paths)
    bad = {p: r for p, r in results.items() if r not in ("refused", "loaded")}
    assert not bad, bad


# --------------------------------------------------------------------------- hypothesis mutations


VALID_BLOB = st_bytes(valid_header(), VALID_DATA)
HEADER_END = 8 + struct.unpack("<Q", VALID_BLOB[:8])[0]

mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, len(VALID_BLOB) - 1), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, len(VALID_BLOB) - 1), st.integers(1, 32)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID_BLOB)), st.binary(min_size=1, max_size=32)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID_BLOB) - 1), st.just(0)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1), st.just(0)),
    st.tuples(st.just("number"), st.integers(8, HEADER_END - 1),
              st.sampled_from([b"-1", b"0", b"1e400", b"NaN", b"18446744073709551616", b"9" * 30,
                               b"2147483648", b"[", b"]", b'"', b"{}", b"null", b"true"])),
)


def apply_mutations(blob, muts):
    blob = bytearray(blob)
    for kind, pos, arg in muts:
        if not blob:
            break
        pos = min(pos, len(blob) - 1) if kind not in ("length",) else pos
        if kind == "set":
            blob[pos] = arg
        elif kind == "delete":
            del blob[pos:pos + arg]
        elif kind == "insert":
            blob[pos:pos] = arg
        elif kind == "truncate":
            del blob[pos:]
        elif kind == "length":
            blob[:8] = struct.pack("<Q", pos)
        else:
            blob[pos:pos + len(arg)] = arg
    return bytes(blob)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(muts=st.lists(mutation, min_size=1, max_size=6))
def test_hypothesis_byte_mutations(muts):
    blob = apply_mutations(VALID_BLOB, muts)
    with tempfile.TemporaryDirectory() as tmp:
        for p in in_dir_and_bare(Path(tmp), blob):
            assert_refused(p, allow_load=True)


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
interesting_int = st.sampled_from([0, 1, 2, 3, 4, 8, 24, 32, 56, -1, 2**31, 2**32, 2**63, 2**64, 10**20])


@st.composite
def hostile_headers(draw):
    header = valid_header()
    for name in list(header):
        e = dict(header[name])
        if draw(st.booleans()):
            e["dtype"] = draw(st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "XX"])
                              | json_value)
        if draw(st.booleans()):
            e["shape"] = draw(st.lists(interesting_int, max_size=4) | json_value)
        if draw(st.booleans()):
            e["data_offsets"] = draw(st.lists(interesting_int, min_size=2, max_size=2) | json_value)
        header[name] = e if draw(st.integers(0, 9)) else draw(json_value)
    if draw(st.booleans()):
        header["__metadata__"] = draw(json_value)
    data_len = draw(st.sampled_from([0, 24, 32, 56, 60]))
    return header, data_len


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(case=hostile_headers())
def test_hypothesis_hostile_headers(case):
    header, data_len = case
    blob = st_bytes(None, raw_header=json.dumps(header, allow_nan=True).encode(),
                    data=VALID_DATA[:data_len] + bytes(max(0, data_len - len(VALID_DATA))))
    with tempfile.TemporaryDirectory() as tmp:
        for p in in_dir_and_bare(Path(tmp), blob):
            assert_refused(p, allow_load=True)


@st.composite
def hostile_configs(draw):
    cfg = config()
    keys = ["peft_type", "r", "lora_alpha", "target_modules", "exclude_modules", "rank_pattern",
            "alpha_pattern", "use_rslora", "layers_to_transform", "layers_pattern", "bias",
            "lora_bias", "init_lora_weights", "use_dora", "fan_in_fan_out"]
    for key in draw(st.lists(st.sampled_from(keys), max_size=4, unique=True)):
        cfg[key] = draw(json_value | interesting_int)
    return cfg


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(cfg=hostile_configs())
def test_hypothesis_hostile_configs(cfg):
    import warnings
    with tempfile.TemporaryDirectory() as tmp:
        d = write_valid_dir(Path(tmp) / "a", cfg=None)
        (d / "adapter_config.json").write_text(json.dumps(cfg, allow_nan=True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_refused(d, allow_load=True)
