"""PEFT adapter files: loading, scales, refusals and saving, without torch.

Adapter directories are written by hand with ``safetensors.numpy`` and ``json`` in PEFT's layout.
"""

import json
import os
import math
import re
import struct
import warnings

import numpy as np
import pytest
from safetensors.numpy import save_file

from lorahook import LoraAdapter, LoraFormatError, LoraLayer, LoraValidationError
from lorahook.files import read_safetensors, read_safetensors_header, write_peft
from peft_dirs import write_dir

PREFIX = "base_model.model."
Q3 = "model.layers.3.self_attn.q_proj"
V3 = "model.layers.3.self_attn.v_proj"
QKV0 = "model.layers.0.linear_attn.in_proj_qkv"
DOWN0 = "model.layers.0.mlp.down_proj"


def factors(rng, rank, d_in, d_out, dtype=np.float32):
    return (rng.standard_normal((rank, d_in)).astype(dtype), rng.standard_normal((d_out, rank)).astype(dtype))


def base_config(**over):
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.05,
        "bias": "none",
        "use_rslora": False,
        "init_lora_weights": True,
        "target_modules": ["q_proj", "v_proj", "in_proj_qkv", "down_proj"],
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": "tiny/qwen",
        "peft_version": "0.21.2",
    }
    cfg.update(over)
    return cfg


def pair(tensors, path, a, b, bias=None, segment=""):
    tensors[f"{PREFIX}{path}.lora_A{segment}.weight"] = a
    tensors[f"{PREFIX}{path}.lora_B{segment}.weight"] = b
    if bias is not None:
        tensors[f"{PREFIX}{path}.lora_B{segment}.bias"] = bias


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def standard(tmp_path, rng):
    """A valid adapter on four Qwen3.5 projections, rank 4, alpha 8."""
    tensors = {}
    shapes = {Q3: (32, 64), V3: (32, 16), QKV0: (32, 64), DOWN0: (48, 32)}
    for p, (d_in, d_out) in shapes.items():
        pair(tensors, p, *factors(rng, 4, d_in, d_out))
    return tensors, shapes


# ----------------------------------------------------------------------------- loading


def test_load_standard(tmp_path, standard):
    tensors, shapes = standard
    d = write_dir(tmp_path / "ad", tensors, base_config(), {"format": "pt", "name": "mine", "revision": "abc"})
    ad = LoraAdapter.from_peft(d)
    assert set(ad.layers) == {(3, "q_proj"), (3, "v_proj"), (0, "in_proj_qkv"), (0, "down_proj")}
    for p, (d_in, d_out) in shapes.items():
        key = (int(p.split(".")[2]), p.split(".")[-1])
        layer = ad.layers[key]
        assert (layer.rank, layer.d_in, layer.d_out) == (4, d_in, d_out)
        assert layer.scale == pytest.approx(2.0)
        np.testing.assert_array_equal(layer.a, tensors[f"{PREFIX}{p}.lora_A.weight"])
        np.testing.assert_array_equal(layer.b, tensors[f"{PREFIX}{p}.lora_B.weight"])
        assert layer.bias is None
        assert ad.module_paths[key] == p
    assert ad.name == "mine"
    assert ad.metadata == {"name": "mine", "revision": "abc", "base_model": "tiny/qwen"}


def test_name_defaults_to_directory(tmp_path, standard):
    d = write_dir(tmp_path / "my-adapter", standard[0], base_config())
    assert LoraAdapter.from_peft(d).name == "my-adapter"


def test_prefix_and_adapter_segment_optional(tmp_path, rng):
    a, b = factors(rng, 4, 32, 64)
    tensors = {f"{Q3}.lora_A.default.weight": a, f"{Q3}.lora_B.default.weight": b}
    ad = LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))
    np.testing.assert_array_equal(ad.layers[(3, "q_proj")].a, a)
    assert ad.module_paths[(3, "q_proj")] == Q3


def test_multimodal_and_bert_paths(tmp_path, rng):
    tensors = {}
    mm = "model.language_model.layers.7.mlp.gate_proj"
    pair(tensors, mm, *factors(rng, 4, 8, 12))
    ad = LoraAdapter.from_peft(write_dir(tmp_path / "q", tensors, base_config(target_modules=["gate_proj"])))
    assert ad.module_paths[(7, "gate_proj")] == mm

    tensors = {}
    bert = {
        "encoder.layer.0.attention.self.query": "query",
        "encoder.layer.0.attention.self.key": "key",
        "encoder.layer.1.attention.self.value": "value",
        "bert.encoder.layer.2.attention.output.dense": "attn_output",
        "bert.encoder.layer.2.intermediate.dense": "ffn_intermediate",
        "bert.encoder.layer.3.output.dense": "ffn_output",
    }
    for p in bert:
        pair(tensors, p, *factors(rng, 4, 8, 8))
    cfg = base_config(target_modules=["query", "key", "value", "dense"])
    ad = LoraAdapter.from_peft(write_dir(tmp_path / "b", tensors, cfg))
    got = {ad.module_paths[k]: k[1] for k in ad.layers}
    assert got == bert
    assert (2, "attn_output") in ad.layers and (3, "ffn_output") in ad.layers


def test_rslora_scale(tmp_path, standard):
    d = write_dir(tmp_path / "ad", standard[0], base_config(use_rslora=True, lora_alpha=6))
    ad = LoraAdapter.from_peft(d)
    assert ad.layers[(3, "q_proj")].scale == pytest.approx(6 / math.sqrt(4))


def test_rank_and_alpha_patterns_first_match_wins(tmp_path, rng):
    tensors = {}
    pair(tensors, Q3, *factors(rng, 8, 32, 64))
    pair(tensors, V3, *factors(rng, 4, 32, 16))
    pair(tensors, QKV0, *factors(rng, 2, 32, 64))
    pair(tensors, "model.layers.13.self_attn.q_proj", *factors(rng, 4, 32, 64))
    cfg = base_config(
        # "layers.3.self_attn.q_proj" must match layer 3 only, not layer 13 (the dot anchors it).
        rank_pattern={"layers.3.self_attn.q_proj": 8, "in_proj_qkv": 2},
        # dict order decides: "q_proj" comes first and wins over the more specific key.
        alpha_pattern={"q_proj": 16, r"model\.layers\.3\.self_attn\.q_proj": 100, "v_proj": 1.5},
    )
    ad = LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, cfg))
    assert ad.layers[(3, "q_proj")].scale == pytest.approx(16 / 8)
    assert ad.layers[(13, "q_proj")].scale == pytest.approx(16 / 4)
    assert ad.layers[(3, "v_proj")].scale == pytest.approx(1.5 / 4)
    assert ad.layers[(0, "in_proj_qkv")].scale == pytest.approx(8 / 2)


def test_rank_pattern_regex_partial_component_does_not_match(tmp_path, rng):
    tensors = {}
    pair(tensors, Q3, *factors(rng, 4, 32, 64))
    # "_proj" is not a whole dotted component, so PEFT's rule does not match it.
    cfg = base_config(rank_pattern={"_proj": 2})
    ad = LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, cfg))
    assert ad.layers[(3, "q_proj")].rank == 4


def test_rank_mismatch_with_config(tmp_path, rng):
    tensors = {}
    pair(tensors, Q3, *factors(rng, 8, 32, 64))
    with pytest.raises(LoraFormatError, match=r"rank 8 .* r=4"):
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))


def test_lora_bias(tmp_path, rng):
    tensors = {}
    bias = rng.standard_normal(64).astype(np.float32)
    pair(tensors, Q3, *factors(rng, 4, 32, 64), bias=bias)
    ad = LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config(lora_bias=True)))
    np.testing.assert_array_equal(ad.layers[(3, "q_proj")].bias, bias)


def test_lora_bias_inconsistent(tmp_path, rng):
    tensors = {}
    pair(tensors, Q3, *factors(rng, 4, 32, 64), bias=np.zeros(64, np.float32))
    with pytest.raises(LoraFormatError, match="lora_bias=false"):
        LoraAdapter.from_peft(write_dir(tmp_path / "a", tensors, base_config()))
    tensors = {}
    pair(tensors, Q3, *factors(rng, 4, 32, 64))
    with pytest.raises(LoraFormatError, match="lora_bias=true.*no lora_B bias"):
        LoraAdapter.from_peft(write_dir(tmp_path / "b", tensors, base_config(lora_bias=True)))


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_tensors(tmp_path, rng, dtype):
    a, b = factors(rng, 4, 32, 64)
    if dtype == "F16":
        a16, b16 = a.astype(np.float16), b.astype(np.float16)
        expect_a, expect_b = a16.astype(np.float32), b16.astype(np.float32)
        tensors = {}
        pair(tensors, Q3, a16, b16)
        d = write_dir(tmp_path / "ad", tensors, base_config())
    else:
        # Truncate float32 to its top 16 bits: that is exactly a BF16 value.
        def to_bf16(x):
            return (x.view(np.uint32) >> 16).astype(np.uint16)

        def from_bf16(u):
            return (u.astype(np.uint32) << 16).view(np.float32)

        a16, b16 = to_bf16(a), to_bf16(b)
        expect_a, expect_b = from_bf16(a16), from_bf16(b16)
        d = tmp_path / "ad"
        d.mkdir()
        write_raw_safetensors(
            d / "adapter_model.safetensors",
            [(f"{PREFIX}{Q3}.lora_A.weight", "BF16", a16), (f"{PREFIX}{Q3}.lora_B.weight", "BF16", b16)],
        )
        (d / "adapter_config.json").write_text(json.dumps(base_config()))
    layer = LoraAdapter.from_peft(d).layers[(3, "q_proj")]
    assert layer.a.dtype == np.float32
    np.testing.assert_array_equal(layer.a, expect_a)
    np.testing.assert_array_equal(layer.b, expect_b)


def test_bf16_matches_ml_dtypes_if_available(tmp_path, rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = rng.standard_normal((4, 32)).astype(ml_dtypes.bfloat16)
    d = tmp_path / "ad"
    d.mkdir()
    write_raw_safetensors(
        d / "adapter_model.safetensors",
        [
            (f"{PREFIX}{Q3}.lora_A.weight", "BF16", values.view(np.uint16)),
            (f"{PREFIX}{Q3}.lora_B.weight", "BF16", np.zeros((64, 4), np.uint16)),
        ],
    )
    (d / "adapter_config.json").write_text(json.dumps(base_config()))
    np.testing.assert_array_equal(LoraAdapter.from_peft(d).layers[(3, "q_proj")].a, values.astype(np.float32))


def test_fan_in_fan_out_warns_and_loads(tmp_path, standard):
    d = write_dir(tmp_path / "ad", standard[0], base_config(fan_in_fan_out=True))
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        ad = LoraAdapter.from_peft(d)
    assert ad.num_adapted_layers == 4


def test_unknown_option_warns_by_name(tmp_path, standard):
    d = write_dir(tmp_path / "ad", standard[0], base_config(shiny_new_option={"x": 1}, empty_new_option=None))
    with pytest.warns(UserWarning, match="shiny_new_option") as record:
        LoraAdapter.from_peft(d)
    assert not any("empty_new_option" in str(w.message) for w in record)


def test_training_only_options_accepted_silently(tmp_path, standard):
    cfg = base_config(
        lora_dropout=0.1, init_lora_weights="gaussian", inference_mode=False, layers_pattern="layers",
        megatron_core="megatron.core", loftq_config={}, qalora_group_size=16, ensure_weight_tying=False,
        eva_config=None, corda_config=None, exclude_modules=None,
    )
    d = write_dir(tmp_path / "ad", standard[0], cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LoraAdapter.from_peft(d)


def test_bin_ignored_when_safetensors_present(tmp_path, standard):
    d = write_dir(tmp_path / "ad", standard[0], base_config())
    (d / "adapter_model.bin").write_bytes(b"\x80\x04 this would be a pickle")
    assert LoraAdapter.from_peft(d).num_adapted_layers == 4


def test_metadata_name_base_model_roundtrip(tmp_path, standard):
    d = write_dir(tmp_path / "ad", standard[0], base_config(), {"format": "pt", "base_model": "Qwen/X"})
    assert LoraAdapter.from_peft(d).metadata["base_model"] == "Qwen/X"


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("use_dora", True, "use_dora"),
        ("alora_invocation_tokens", [1, 2], "alora_invocation_tokens"),
        ("layer_replication", [[0, 2], [1, 3]], "layer_replication"),
        ("trainable_token_indices", [5], "trainable_token_indices"),
        ("target_parameters", ["mlp.experts.down_proj"], "target_parameters"),
        ("bias", "all", "bias='all'"),
        ("bias", "lora_only", "bias='lora_only'"),
        ("use_qalora", True, "use_qalora"),
        ("use_bdlora", {"nblocks": 2}, "use_bdlora"),
        ("kasa_config", {"beta": 1}, "kasa_config"),
        ("arrow_config", {"top_k": 2}, "arrow_config"),
        ("monteclora_config", {"num_samples": 2}, "monteclora_config"),
        ("modules_to_save", 5, "modules_to_save"),
        ("init_lora_weights", "pissa", "init_lora_weights='pissa'"),
        ("init_lora_weights", "pissa_niter_4", "pissa_niter_4"),
        ("init_lora_weights", "olora", "olora"),
        ("init_lora_weights", "corda", "corda"),
        ("init_lora_weights", "loftq", "loftq"),
        ("init_lora_weights", "lora_ga", "lora_ga"),
    ],
)
def test_refused_options(tmp_path, standard, option, value, words):
    d = write_dir(tmp_path / "ad", standard[0], base_config(**{option: value}))
    with pytest.raises(LoraFormatError, match=words.replace("[", r"\[")):
        LoraAdapter.from_peft(d)


@pytest.mark.parametrize("peft_type", ["LOHA", "lora", None, "IA3"])
def test_unknown_peft_type(tmp_path, standard, peft_type):
    d = write_dir(tmp_path / "ad", standard[0], base_config(peft_type=peft_type))
    with pytest.raises(LoraFormatError, match="peft_type"):
        LoraAdapter.from_peft(d)


@pytest.mark.parametrize(
    "extra_name, extra_shape, words",
    [
        # a magnitude without use_dora, a magnitude in a form PEFT does not save, half an
        # embedding LoRA, a saved module the config does not list
        (f"{PREFIX}{Q3}.lora_magnitude_vector", (64,), "use_dora=false"),
        (f"{PREFIX}{Q3}.lora_magnitude_vector.default.weight", (64,), "not supported"),
        (f"{PREFIX}model.embed_tokens.lora_embedding_A", (4, 100), "no matching lora_embedding_B"),
        (f"{PREFIX}lm_head.modules_to_save.default.weight", (100, 32), "modules_to_save"),
        (f"{PREFIX}lm_head.weight", (100, 32), "full-weight"),
        (f"{PREFIX}model.embed_tokens.trainable_tokens_delta", (2, 32), "trainable-tokens"),
    ],
)
def test_refused_tensors(tmp_path, standard, extra_name, extra_shape, words):
    tensors = dict(standard[0])
    tensors[extra_name] = np.zeros(extra_shape, np.float32)
    with pytest.raises(LoraFormatError, match=words) as info:
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))
    assert extra_name in str(info.value)


@pytest.mark.parametrize(
    "path, words",
    [
        ("model.layers.1.mlp.experts.0.down_proj", "mixture-of-experts"),
        ("model.layers.1.mlp.shared_expert.gate_proj", "mixture-of-experts"),
        ("model.visual.blocks.0.attn.qkv", "vision tower"),
        ("bert.pooler.dense", "pooler"),
        ("model.layers.1.self_attn.in_proj_z", "not a self_attn projection"),
        ("transformer.h.0.attn.c_attn", "not a projection of any model family"),
    ],
)
def test_unplaceable_modules_named(tmp_path, rng, path, words):
    tensors = {}
    pair(tensors, path, *factors(rng, 4, 8, 8))
    cfg = base_config(target_modules=None)
    with pytest.raises(LoraFormatError, match=words) as info:
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, cfg))
    assert path in str(info.value)


def test_a_without_b_and_b_without_a(tmp_path, rng):
    a, b = factors(rng, 4, 32, 64)
    with pytest.raises(LoraFormatError, match="no matching lora_B.weight"):
        LoraAdapter.from_peft(write_dir(tmp_path / "a", {f"{PREFIX}{Q3}.lora_A.weight": a}, base_config()))
    with pytest.raises(LoraFormatError, match="no matching lora_A.weight"):
        LoraAdapter.from_peft(write_dir(tmp_path / "b", {f"{PREFIX}{Q3}.lora_B.weight": b}, base_config()))


def test_ranks_disagree(tmp_path, rng):
    tensors = {f"{PREFIX}{Q3}.lora_A.weight": factors(rng, 4, 32, 64)[0],
               f"{PREFIX}{Q3}.lora_B.weight": factors(rng, 3, 32, 64)[1]}
    with pytest.raises(LoraFormatError, match="ranks disagree"):
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))


def test_legacy_3d_lora_b(tmp_path, rng):
    tensors = {f"{PREFIX}{Q3}.lora_A.weight": np.zeros((4, 32), np.float32),
               f"{PREFIX}{Q3}.lora_B.weight": np.zeros((64, 4, 1), np.float32)}
    with pytest.raises(LoraFormatError, match="3-D"):
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))


def test_duplicate_keys(tmp_path, rng):
    tensors = {}
    pair(tensors, Q3, *factors(rng, 4, 32, 64))
    pair(tensors, "model.language_model.layers.3.self_attn.q_proj", *factors(rng, 4, 32, 64))
    with pytest.raises(LoraFormatError, match="duplicate weights for layer 3 module 'q_proj'"):
        LoraAdapter.from_peft(write_dir(tmp_path / "a", tensors, base_config()))
    tensors = {}
    pair(tensors, Q3, *factors(rng, 4, 32, 64), segment=".one")
    pair(tensors, Q3, *factors(rng, 4, 32, 64), segment=".two")
    with pytest.raises(LoraFormatError, match="duplicate weights"):
        LoraAdapter.from_peft(write_dir(tmp_path / "b", tensors, base_config()))
    # one factor under two names, with and without PEFT's prefix
    tensors = {}
    pair(tensors, Q3, *factors(rng, 4, 32, 64))
    tensors[f"{Q3}.lora_A.weight"] = tensors[f"{PREFIX}{Q3}.lora_A.weight"]
    with pytest.raises(LoraFormatError, match="duplicate weights for layer 3 module 'q_proj': tensors"):
        LoraAdapter.from_peft(write_dir(tmp_path / "c", tensors, base_config()))


@pytest.mark.parametrize("a_shape, b_shape", [((4, 0), (64, 4)), ((4, 32), (0, 4))])
def test_a_factor_with_no_inputs_or_outputs(tmp_path, a_shape, b_shape):
    tensors = {f"{PREFIX}{Q3}.lora_A.weight": np.ones(a_shape, np.float32),
               f"{PREFIX}{Q3}.lora_B.weight": np.ones(b_shape, np.float32)}
    with pytest.raises(LoraFormatError, match=re.escape(f"'{PREFIX}{Q3}.lora_A.weight' is {a_shape} and ") +
                       r".*d_in \(columns of lora_A\) and d_out \(rows of lora_B\) must be >= 1"):
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(tmp_path, rng, bad):
    a, b = factors(rng, 4, 32, 64)
    b[3, 1] = bad
    tensors = {}
    pair(tensors, Q3, a, b)
    with pytest.raises(LoraFormatError, match=r"lora_B\.weight.*non-finite"):
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))


def test_unsupported_dtype(tmp_path, rng):
    tensors = {f"{PREFIX}{Q3}.lora_A.weight": np.zeros((4, 32), np.float64),
               f"{PREFIX}{Q3}.lora_B.weight": np.zeros((64, 4), np.float32)}
    with pytest.raises(LoraFormatError, match="dtype F64"):
        LoraAdapter.from_peft(write_dir(tmp_path / "ad", tensors, base_config()))


def test_pickle_only_refused(tmp_path):
    d = tmp_path / "ad"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(base_config()))
    (d / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(LoraFormatError, match="never unpickles"):
        LoraAdapter.from_peft(d)


def test_missing_files(tmp_path, standard):
    with pytest.raises(FileNotFoundError):
        LoraAdapter.from_peft(tmp_path / "nope")
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(LoraFormatError, match="adapter_config.json"):
        LoraAdapter.from_peft(d)
    (d / "adapter_config.json").write_text(json.dumps(base_config()))
    with pytest.raises(LoraFormatError, match="adapter_model.safetensors"):
        LoraAdapter.from_peft(d)
    (d / "adapter_config.json").write_text("{not json")
    save_file(standard[0], str(d / "adapter_model.safetensors"))
    with pytest.raises(LoraFormatError, match="not valid JSON"):
        LoraAdapter.from_peft(d)


def test_targeting_mismatch_refused(tmp_path, standard):
    d = write_dir(tmp_path / "a", standard[0], base_config(target_modules=["q_proj", "v_proj", "in_proj_qkv"]))
    with pytest.raises(LoraFormatError, match="down_proj.*target_modules"):
        LoraAdapter.from_peft(d)
    d = write_dir(tmp_path / "b", standard[0], base_config(layers_to_transform=[3]))
    with pytest.raises(LoraFormatError, match="layers_to_transform"):
        LoraAdapter.from_peft(d)
    d = write_dir(tmp_path / "c", standard[0], base_config(target_modules=r".*\.(q|v)_proj"))
    with pytest.raises(LoraFormatError, match="does not match"):
        LoraAdapter.from_peft(d)


@pytest.mark.parametrize("over, words", [
    ({"r": 0}, "r must be a positive integer"),
    ({"r": "4"}, "r must be a positive integer"),
    ({"lora_alpha": "x"}, "lora_alpha must be a real number"),
    ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\]"),
    ({"alpha_pattern": {"(": 2}}, "alpha_pattern key '\\(' is not a valid regular expression"),
])
def test_config_value_errors(tmp_path, standard, over, words):
    d = write_dir(tmp_path / "ad", standard[0], base_config(**over))
    with pytest.raises(LoraFormatError, match=words):
        LoraAdapter.from_peft(d)


# ----------------------------------------------------------------------------- hostile files


def write_raw_safetensors(path, entries, header_override=None, trailing=b""):
    """Write a safetensors file byte by byte; entries are (name, dtype, ndarray)."""
    header, chunks, offset = {}, [], 0
    for name, dtype, arr in entries:
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if header_override is not None:
        header = header_override(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(chunks) + trailing)


def hostile(tmp_path, **kw):
    d = tmp_path / "ad"
    d.mkdir(exist_ok=True)
    entries = [
        (f"{PREFIX}{Q3}.lora_A.weight", "F32", np.ones((4, 32), np.float32)),
        (f"{PREFIX}{Q3}.lora_B.weight", "F32", np.ones((64, 4), np.float32)),
    ]
    write_raw_safetensors(d / "adapter_model.safetensors", entries, **kw)
    (d / "adapter_config.json").write_text(json.dumps(base_config()))
    return d


@pytest.mark.parametrize("declared, words", [
    (lambda size: size * 10, "but the file has only"),
    (lambda size: 2**62, "more than the limit"),
])
def test_header_length_field_refused(tmp_path, declared, words):
    d = hostile(tmp_path)
    f = d / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", declared(len(data))) + data[8:])
    with pytest.raises(LoraFormatError, match=words):
        LoraAdapter.from_peft(d)


def test_truncated_file(tmp_path):
    d = hostile(tmp_path)
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-16])
    with pytest.raises(LoraFormatError, match="run past the end"):
        LoraAdapter.from_peft(d)


def test_too_short_file(tmp_path):
    d = hostile(tmp_path)
    (d / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(LoraFormatError, match="at least 8"):
        LoraAdapter.from_peft(d)


def test_declared_shape_larger_than_span(tmp_path):
    def grow(h):
        h[f"{PREFIX}{Q3}.lora_B.weight"]["shape"] = [2**40, 2**20]
        return h

    with pytest.raises(LoraFormatError, match=r"needs \d+ bytes"):
        LoraAdapter.from_peft(hostile(tmp_path, header_override=grow))


def test_overlapping_tensors(tmp_path):
    def overlap(h):
        h[f"{PREFIX}{Q3}.lora_B.weight"]["data_offsets"] = [0, 1024]
        h[f"{PREFIX}{Q3}.lora_A.weight"]["data_offsets"] = [0, 512]
        return h

    with pytest.raises(LoraFormatError, match="overlaps|gap|covers"):
        LoraAdapter.from_peft(hostile(tmp_path, header_override=overlap))


def test_trailing_bytes(tmp_path):
    with pytest.raises(LoraFormatError, match="covers"):
        LoraAdapter.from_peft(hostile(tmp_path, trailing=b"\0" * 8))


def test_header_not_json_and_bad_entries(tmp_path):
    d = hostile(tmp_path)
    f = d / "adapter_model.safetensors"
    f.write_bytes(struct.pack("<Q", 5) + b"{abc}")
    with pytest.raises(LoraFormatError, match="not valid JSON"):
        LoraAdapter.from_peft(d)
    for override, words in [
        (lambda h: {**h, "__metadata__": {"a": 1}}, "__metadata__"),
        (lambda h: {k: {**v, "dtype": "F128"} for k, v in h.items()}, "unknown dtype"),
        (lambda h: {k: {**v, "shape": [-1, 4]} for k, v in h.items()}, "shape must be"),
        (lambda h: {k: {**v, "data_offsets": [5]} for k, v in h.items()}, "data_offsets must be"),
        (lambda h: [1, 2], "JSON object"),
    ]:
        with pytest.raises(LoraFormatError, match=words):
            LoraAdapter.from_peft(hostile(tmp_path, header_override=override))


def test_duplicate_header_keys(tmp_path):
    d = tmp_path / "ad"
    d.mkdir()
    raw = b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    (d / "adapter_config.json").write_text(json.dumps(base_config()))
    with pytest.raises(LoraFormatError, match="duplicate key"):
        LoraAdapter.from_peft(d)


def test_header_helper_reports_metadata(tmp_path, standard):
    d = write_dir(tmp_path / "ad", standard[0], base_config(), {"format": "pt", "k": "v"})
    tensors, meta, start, size = read_safetensors_header(d / "adapter_model.safetensors")
    assert meta == {"format": "pt", "k": "v"} and len(tensors) == 8 and start < size


def test_file_truncated_after_its_header_was_read(tmp_path, standard):
    f = write_dir(tmp_path / "ad", standard[0], base_config()) / "adapter_model.safetensors"
    header = read_safetensors_header(f)
    f.write_bytes(f.read_bytes()[:-16])
    with pytest.raises(LoraFormatError, match="run past the end of the data|changed"):
        read_safetensors(f, header=header)


def test_a_file_replaced_after_its_header_was_read_is_refused_or_never_mixed(tmp_path, standard):
    from lorahook.files import SafetensorsFile
    first = write_dir(tmp_path / "one", standard[0], base_config()) / "adapter_model.safetensors"
    fewer = dict(list(standard[0].items())[:-2])  # one projection less: another layout
    other = write_dir(tmp_path / "two", fewer, base_config()) / "adapter_model.safetensors"
    expect = standard[0]  # the arrays written into the first file
    header = read_safetensors_header(first)
    with SafetensorsFile(first) as opened:
        os.replace(other, first)  # another layout under the same name
        got, _ = opened.read_float32()  # header and data through the descriptor opened first
    assert got.keys() == expect.keys()
    assert all(np.array_equal(got[k], np.asarray(expect[k], np.float32)) for k in expect)
    with pytest.raises(LoraFormatError, match="changed since its header was read"):
        read_safetensors(first, header=header)


# ----------------------------------------------------------------------------- bare safetensors


def test_from_safetensors_alpha_sources(tmp_path, rng):
    tensors = {}
    pair(tensors, Q3, *factors(rng, 4, 32, 64))
    f = tmp_path / "bare.safetensors"
    save_file(tensors, str(f))
    assert LoraAdapter.from_safetensors(f).layers[(3, "q_proj")].scale == 1.0
    assert LoraAdapter.from_safetensors(f, alpha=2).layers[(3, "q_proj")].scale == pytest.approx(0.5)
    save_file(tensors, str(f), metadata={"lora_alpha": "12"})
    ad = LoraAdapter.from_safetensors(f)
    assert ad.layers[(3, "q_proj")].scale == pytest.approx(3.0)
    assert ad.name == "bare"
    save_file(tensors, str(f), metadata={"lora_alpha": "many"})
    with pytest.raises(LoraFormatError, match="lora_alpha='many'"):
        LoraAdapter.from_safetensors(f)


def test_from_safetensors_refuses_like_peft(tmp_path, rng):
    f = tmp_path / "bare.safetensors"
    save_file({f"{PREFIX}{Q3}.lora_A.weight": np.zeros((4, 32), np.float32)}, str(f))
    with pytest.raises(LoraFormatError, match="no matching lora_B"):
        LoraAdapter.from_safetensors(f)
    with pytest.raises(LoraFormatError, match="from_peft"):
        LoraAdapter.from_safetensors(tmp_path)


# ----------------------------------------------------------------------------- saving


def make_adapter(rng, with_bias=False):
    layers = {
        (3, "q_proj"): LoraLayer(*factors(rng, 4, 32, 64), scale=2.0),
        (3, "v_proj"): LoraLayer(*factors(rng, 4, 32, 16), scale=0.75),
        (0, "in_proj_qkv"): LoraLayer(*factors(rng, 8, 32, 64), scale=2.0),
        (0, "in_proj_b"): LoraLayer(*factors(rng, 2, 32, 4), scale=2.0,
                                    bias=rng.standard_normal(4) if with_bias else None),
    }
    return LoraAdapter(layers, name="made", metadata={"base_model": "tiny/qwen", "revision": "r1"})


def assert_same_layers(x, y):
    assert set(x.layers) == set(y.layers)
    for k in x.layers:
        lx, ly = x.layers[k], y.layers[k]
        np.testing.assert_array_equal(lx.a, ly.a)
        np.testing.assert_array_equal(lx.b, ly.b)
        assert lx.scale == pytest.approx(ly.scale, rel=1e-12)
        bx = lx.bias if lx.bias is not None else np.zeros(lx.d_out, np.float32)
        by = ly.bias if ly.bias is not None else np.zeros(ly.d_out, np.float32)
        np.testing.assert_array_equal(bx, by)


@pytest.mark.parametrize("architecture, root", [
    ("qwen3_5", "model.layers"), ("qwen3_5_multimodal", "model.language_model.layers")])
def test_save_roundtrip_qwen(tmp_path, rng, architecture, root):
    ad = make_adapter(rng, with_bias=True)
    ad.save_peft(tmp_path / "out", architecture=architecture, metadata={"note": "hi"})
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["lora_bias"] is True
    assert f"{root}.3.self_attn.q_proj" in cfg["target_modules"]
    assert cfg["base_model_name_or_path"] == "tiny/qwen"
    back = LoraAdapter.from_peft(tmp_path / "out")
    assert_same_layers(ad, back)
    assert back.module_paths[(0, "in_proj_qkv")] == f"{root}.0.linear_attn.in_proj_qkv"
    assert back.metadata == {"name": "made", "base_model": "tiny/qwen", "revision": "r1", "note": "hi"}
    assert back.name == "made"
    # Loaded adapters write their stored paths back without an architecture.
    back.save_peft(tmp_path / "again")
    assert_same_layers(ad, LoraAdapter.from_peft(tmp_path / "again"))


def test_save_patterns_are_anchored(tmp_path, rng):
    ad = make_adapter(rng)
    write_peft(ad, tmp_path / "out", architecture="qwen3_5")
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["rank_pattern"] == {r"^model\.layers\.0\.linear_attn\.in_proj_qkv": 8,
                                   r"^model\.layers\.0\.linear_attn\.in_proj_b": 2}
    assert cfg["alpha_pattern"] == {r"^model\.layers\.3\.self_attn\.v_proj": 3,
                                    r"^model\.layers\.0\.linear_attn\.in_proj_qkv": 16,
                                    r"^model\.layers\.0\.linear_attn\.in_proj_b": 4}
    import re
    for key in cfg["rank_pattern"]:
        assert re.match(rf"(.*\.)?({key})$", key[1:].replace("\\", ""))
        assert not re.match(rf"(.*\.)?({key})$", "model.language_model." + key[1:].replace("\\", ""))
        assert not re.match(rf"(.*\.)?({key})$", "x.model.layers.10.linear_attn.in_proj_qkv")


def test_save_bert(tmp_path, rng):
    layers = {(i, m): LoraLayer(*factors(rng, 2, 8, 8), scale=1.5) for i in range(2)
              for m in ("query", "key", "value", "attn_output", "ffn_intermediate", "ffn_output")}
    ad = LoraAdapter(layers)
    ad.save_peft(tmp_path / "b", architecture="bert")
    back = LoraAdapter.from_peft(tmp_path / "b")
    assert_same_layers(ad, back)
    assert back.module_paths[(1, "ffn_output")] == "encoder.layer.1.output.dense"
    assert back.module_paths[(1, "attn_output")] == "encoder.layer.1.attention.output.dense"


def test_save_errors(tmp_path, rng):
    ad = make_adapter(rng)
    with pytest.raises(ValueError, match="architecture="):
        ad.save_peft(tmp_path / "x")
    with pytest.raises(ValueError, match="architecture must be one of"):
        ad.save_peft(tmp_path / "x", architecture="gpt2")
    with pytest.raises(LoraValidationError, match="not a BERT projection"):
        ad.save_peft(tmp_path / "x", architecture="bert")
    empty = LoraAdapter({(0, "q_proj"): LoraLayer(np.zeros((0, 4)), np.zeros((4, 0)))})
    with pytest.raises(ValueError, match="rank > 0"):
        empty.save_peft(tmp_path / "x", architecture="qwen3_5")
    with pytest.raises(TypeError, match="str to str"):
        ad.save_peft(tmp_path / "x", architecture="qwen3_5", metadata={"n": 1})


def test_scaled_adapter_roundtrip(tmp_path, rng):
    ad = make_adapter(rng).scaled(-0.3)
    ad.save_peft(tmp_path / "s", architecture="qwen3_5")
    assert_same_layers(ad, LoraAdapter.from_peft(tmp_path / "s"))
