"""Model geometry: Qwen3.5 / BERT configs, projection shapes and adapter validation."""

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import lorahook
from lorahook import BertConfig, LoraValidationError, Qwen35Config
from lorahook.models import (
    BERT_MODULES,
    QWEN35_FULL_ATTENTION_MODULES,
    QWEN35_LINEAR_ATTENTION_MODULES,
    QWEN35_MLP_MODULES,
    QWEN35_MODULES,
    load_model_config,
)

CONFIGS = Path(__file__).parent.parent / "data" / "configs"

# Published geometry (issue table): hidden, layers, heads, kv heads, linear value heads,
# intermediate (None for MoE), tie_word_embeddings. head_dim 256, linear key heads 16,
# linear key/value head dims 128, conv kernel 4, full-attention interval 4 everywhere.
PUBLISHED = {
    "qwen3_5_0_8b": (1024, 24, 8, 2, 16, 3584, True),
    "qwen3_5_2b": (2048, 24, 8, 2, 16, 6144, True),
    "qwen3_5_4b": (2560, 32, 16, 4, 32, 9216, True),
    "qwen3_5_9b": (4096, 32, 16, 4, 32, 12288, False),
    "qwen3_5_27b": (5120, 64, 24, 4, 48, 17408, False),
    "qwen3_5_35b_a3b": (2048, 40, 16, 2, 32, None, False),
}


def load(name):
    return Qwen35Config.from_json(CONFIGS / f"{name}.json")


def raw(name):
    return json.loads((CONFIGS / f"{name}.json").read_text())


def flat(name):
    """The flat text-model form of a published nested config."""
    d = raw(name)
    text = dict(d["text_config"])
    text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return text


def small_kwargs(**over):
    kw = dict(
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        intermediate_size=96,
    )
    kw.update(over)
    return kw


def adapter_for(shape_by_key, rank=2, seed=0):
    rng = np.random.default_rng(seed)
    layers = {}
    for key, (d_in, d_out) in shape_by_key.items():
        a = rng.standard_normal((rank, d_in)).astype(np.float32)
        b = rng.standard_normal((d_out, rank)).astype(np.float32)
        layers[key] = lorahook.LoraLayer(a, b)
    return lorahook.LoraAdapter(layers)


# --------------------------------------------------------------------------- module names


def test_module_name_tuples_match_the_spec():
    assert QWEN35_FULL_ATTENTION_MODULES == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert QWEN35_LINEAR_ATTENTION_MODULES == (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    assert QWEN35_MLP_MODULES == ("gate_proj", "up_proj", "down_proj")
    assert QWEN35_MODULES == (
        QWEN35_FULL_ATTENTION_MODULES + QWEN35_LINEAR_ATTENTION_MODULES + QWEN35_MLP_MODULES)
    assert BERT_MODULES == (
        "query", "key", "value", "attn_output", "ffn_intermediate", "ffn_output")


# --------------------------------------------------------------------------- published configs


def test_0_8b_projection_table():
    c = load("qwen3_5_0_8b")
    full, lin = 3, 0
    expected = {
        (full, "q_proj"): (1024, 4096),
        (full, "k_proj"): (1024, 512),
        (full, "v_proj"): (1024, 512),
        (full, "o_proj"): (2048, 1024),
        (lin, "in_proj_qkv"): (1024, 6144),
        (lin, "in_proj_z"): (1024, 2048),
        (lin, "in_proj_b"): (1024, 16),
        (lin, "in_proj_a"): (1024, 16),
        (lin, "out_proj"): (2048, 1024),
        (lin, "gate_proj"): (1024, 3584),
        (lin, "up_proj"): (1024, 3584),
        (lin, "down_proj"): (3584, 1024),
        (full, "gate_proj"): (1024, 3584),
        (full, "down_proj"): (3584, 1024),
    }
    for (layer, module), shape in expected.items():
        got = c.projection_shape(layer, module)
        assert got == shape, (layer, module)
        assert type(got) is tuple and all(type(v) is int for v in got)
    assert c.full_attention_layers == (3, 7, 11, 15, 19, 23)
    assert [i for i in range(24) if c.is_full_attention(i)] == [3, 7, 11, 15, 19, 23]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_geometry(name):
    H, L, Nq, Nkv, Hv, I, tie = PUBLISHED[name]
    c = load(name)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.linear_num_value_heads) == (H, L, Nq, Nkv, Hv)
    assert (c.head_dim, c.linear_num_key_heads, c.linear_key_head_dim,
            c.linear_value_head_dim, c.linear_conv_kernel_dim) == (256, 16, 128, 128, 4)
    assert c.intermediate_size == I
    assert c.is_moe == (I is None)
    assert c.tie_word_embeddings is tie
    assert c.full_attention_layers == tuple(range(3, L, 4))
    assert c.linear_attention_layers == tuple(i for i in range(L) if (i + 1) % 4)

    for layer in range(L):
        if c.is_full_attention(layer):
            assert c.projection_shape(layer, "q_proj") == (H, 2 * Nq * 256)
            assert c.projection_shape(layer, "k_proj") == (H, Nkv * 256)
            assert c.projection_shape(layer, "v_proj") == (H, Nkv * 256)
            assert c.projection_shape(layer, "o_proj") == (Nq * 256, H)
        else:
            assert c.projection_shape(layer, "in_proj_qkv") == (H, 2 * 16 * 128 + Hv * 128)
            assert c.projection_shape(layer, "in_proj_z") == (H, Hv * 128)
            assert c.projection_shape(layer, "in_proj_b") == (H, Hv)
            assert c.projection_shape(layer, "in_proj_a") == (H, Hv)
            assert c.projection_shape(layer, "out_proj") == (Hv * 128, H)
        if I is not None:
            assert c.projection_shape(layer, "gate_proj") == (H, I)
            assert c.projection_shape(layer, "up_proj") == (H, I)
            assert c.projection_shape(layer, "down_proj") == (I, H)


def test_moe_published_config_fields():
    c = load("qwen3_5_35b_a3b")
    assert c.is_moe
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert c.intermediate_size is None
    assert c.known_modules == QWEN35_FULL_ATTENTION_MODULES + QWEN35_LINEAR_ATTENTION_MODULES


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_flat_and_nested_forms_agree(name):
    nested = load(name)
    assert Qwen35Config.from_dict(flat(name)) == nested
    assert load_model_config(flat(name)) == nested
    assert Qwen35Config.from_dict(nested.to_dict()) == nested


def test_from_json_accepts_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "qwen3_5_2b.json").read_text())
    assert Qwen35Config.from_json(tmp_path) == load("qwen3_5_2b")
    assert Qwen35Config.from_json(str(tmp_path / "config.json")) == load("qwen3_5_2b")
    assert load_model_config(tmp_path) == load("qwen3_5_2b")


def test_from_json_rejects_invalid_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(LoraValidationError, match="not valid JSON"):
        Qwen35Config.from_json(p)
    p.write_text("[1, 2]")
    with pytest.raises(LoraValidationError, match="JSON object"):
        Qwen35Config.from_json(p)


# --------------------------------------------------------------------------- nested form details


def test_top_level_tie_word_embeddings_wins():
    d = raw("qwen3_5_0_8b")
    d["text_config"]["tie_word_embeddings"] = False
    d["tie_word_embeddings"] = True
    assert Qwen35Config.from_dict(d).tie_word_embeddings is True
    d["text_config"]["tie_word_embeddings"] = True
    d["tie_word_embeddings"] = False
    assert Qwen35Config.from_dict(d).tie_word_embeddings is False
    del d["tie_word_embeddings"]
    assert Qwen35Config.from_dict(d).tie_word_embeddings is True
    del d["text_config"]["tie_word_embeddings"]
    assert Qwen35Config.from_dict(d).tie_word_embeddings is False


def test_nested_form_without_model_type_is_inferred():
    d = raw("qwen3_5_35b_a3b")
    del d["model_type"]
    assert Qwen35Config.from_dict(d) == load("qwen3_5_35b_a3b")
    del d["text_config"]["model_type"]
    assert Qwen35Config.from_dict(d) == load("qwen3_5_35b_a3b")
    f = flat("qwen3_5_9b")
    del f["model_type"]
    assert Qwen35Config.from_dict(f) == load("qwen3_5_9b")


def test_nested_form_requires_text_config():
    d = raw("qwen3_5_0_8b")
    del d["text_config"]
    with pytest.raises(LoraValidationError, match="'text_config'"):
        Qwen35Config.from_dict(d)
    d["text_config"] = [1, 2]
    with pytest.raises(LoraValidationError, match="'text_config'"):
        Qwen35Config.from_dict(d)


def test_mismatched_text_model_type_is_rejected():
    d = raw("qwen3_5_0_8b")
    d["text_config"]["model_type"] = "qwen3_5_moe_text"
    with pytest.raises(LoraValidationError, match="text_config.model_type"):
        Qwen35Config.from_dict(d)
    d["text_config"]["model_type"] = "llama"
    with pytest.raises(LoraValidationError, match="text_config.model_type"):
        Qwen35Config.from_dict(d)


def test_unsupported_model_type_is_rejected():
    d = flat("qwen3_5_0_8b")
    d["model_type"] = "qwen3_next"
    with pytest.raises(LoraValidationError, match="model_type.*qwen3_next"):
        Qwen35Config.from_dict(d)


def test_unknown_extra_fields_are_ignored():
    d = raw("qwen3_5_4b")
    d["some_future_field"] = {"x": 1}
    d["text_config"]["another_new_field"] = [1, 2, 3]
    d["text_config"]["attn_output_gate"] = "whatever"
    assert Qwen35Config.from_dict(d) == load("qwen3_5_4b")


def test_from_dict_rejects_non_mapping():
    with pytest.raises(TypeError, match="mapping"):
        Qwen35Config.from_dict([("hidden_size", 1)])


# --------------------------------------------------------------------------- layer types


def test_default_interval_is_4_when_layer_types_absent():
    d = flat("qwen3_5_0_8b")
    del d["layer_types"]
    del d["full_attention_interval"]
    c = Qwen35Config.from_dict(d)
    assert c.full_attention_interval == 4
    assert c.full_attention_layers == (3, 7, 11, 15, 19, 23)


def test_custom_interval():
    c = Qwen35Config(**small_kwargs(full_attention_interval=2))
    assert c.full_attention_layers == (1, 3, 5, 7)
    c = Qwen35Config(**small_kwargs(full_attention_interval=1))
    assert c.full_attention_layers == tuple(range(8))
    assert c.linear_attention_layers == ()


def test_explicit_layer_types_take_precedence_over_interval():
    types = ["full_attention"] + ["linear_attention"] * 7
    c = Qwen35Config(**small_kwargs(layer_types=types, full_attention_interval=4))
    assert c.full_attention_layers == (0,)
    assert c.layer_types == tuple(types)


def test_legacy_layer_type_names():
    types = ["attention", "mamba", "mamba", "attention", "full_attention",
             "linear_attention", "mamba", "attention"]
    c = Qwen35Config(**small_kwargs(layer_types=types))
    assert c.layer_types == (
        "full_attention", "linear_attention", "linear_attention", "full_attention",
        "full_attention", "linear_attention", "linear_attention", "full_attention")
    assert c.is_full_attention(0) and not c.is_full_attention(1)
    assert c.layer_type(3) == "full_attention"
    assert c.projection_shape(0, "q_proj") == (64, 2 * 4 * 16)
    assert c.projection_shape(1, "in_proj_qkv") == (64, 2 * 2 * 8 + 4 * 12)
    # And from a file.
    d = flat("qwen3_5_0_8b")
    d["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in d["layer_types"]]
    assert Qwen35Config.from_dict(d) == load("qwen3_5_0_8b")


def test_layer_types_wrong_length():
    with pytest.raises(LoraValidationError, match=r"'layer_types' has 7 entries.*8"):
        Qwen35Config(**small_kwargs(layer_types=["linear_attention"] * 7))
    d = raw("qwen3_5_0_8b")
    d["text_config"]["layer_types"] = d["text_config"]["layer_types"][:-1]
    with pytest.raises(LoraValidationError, match=r"text_config\.layer_types.*23 entries.*24"):
        Qwen35Config.from_dict(d)


@pytest.mark.parametrize("bad", ["sliding_attention", 3, None, "Full_Attention"])
def test_layer_types_bad_entry(bad):
    types = ["linear_attention"] * 8
    types[5] = bad
    with pytest.raises(LoraValidationError, match=r"layer_types\[5\]"):
        Qwen35Config(**small_kwargs(layer_types=types))


def test_layer_types_must_be_a_list():
    with pytest.raises(LoraValidationError, match="'layer_types' must be a list"):
        Qwen35Config(**small_kwargs(layer_types="linear_attention" * 8))


def test_layer_queries_out_of_range():
    c = Qwen35Config(**small_kwargs())
    for i in (-1, 8, 100):
        with pytest.raises(LoraValidationError, match=f"layer {i}.*out of range"):
            c.is_full_attention(i)
    with pytest.raises(TypeError):
        c.is_full_attention(1.0)


def test_modules_for_layer():
    c = load("qwen3_5_0_8b")
    assert c.modules_for_layer(3) == QWEN35_FULL_ATTENTION_MODULES + QWEN35_MLP_MODULES
    assert c.modules_for_layer(0) == QWEN35_LINEAR_ATTENTION_MODULES + QWEN35_MLP_MODULES
    m = load("qwen3_5_35b_a3b")
    assert m.modules_for_layer(3) == QWEN35_FULL_ATTENTION_MODULES
    assert m.modules_for_layer(0) == QWEN35_LINEAR_ATTENTION_MODULES


# --------------------------------------------------------------------------- field validation

REQUIRED_DENSE = [
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size",
]
REQUIRED_MOE = [f for f in REQUIRED_DENSE if f != "intermediate_size"] + [
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
]


@pytest.mark.parametrize("field", REQUIRED_DENSE)
def test_missing_required_field_nested(field):
    d = raw("qwen3_5_0_8b")
    del d["text_config"][field]
    with pytest.raises(LoraValidationError, match=rf"'text_config\.{field}' is missing"):
        Qwen35Config.from_dict(d)


@pytest.mark.parametrize("field", REQUIRED_DENSE)
def test_missing_required_field_flat(field):
    d = flat("qwen3_5_0_8b")
    del d[field]
    with pytest.raises(LoraValidationError, match=rf"'{field}' is missing"):
        Qwen35Config.from_dict(d)


@pytest.mark.parametrize("field", REQUIRED_MOE)
def test_missing_required_field_moe(field):
    d = raw("qwen3_5_35b_a3b")
    del d["text_config"][field]
    with pytest.raises(LoraValidationError, match=rf"'text_config\.{field}' is missing"):
        Qwen35Config.from_dict(d)


def test_null_required_field_is_missing():
    d = flat("qwen3_5_0_8b")
    d["head_dim"] = None
    with pytest.raises(LoraValidationError, match="'head_dim' is missing"):
        Qwen35Config.from_dict(d)


def test_head_dim_is_not_derived():
    # hidden_size // num_attention_heads would be 128 here; the real head_dim is 256.
    d = flat("qwen3_5_0_8b")
    del d["head_dim"]
    with pytest.raises(LoraValidationError, match="head_dim"):
        Qwen35Config.from_dict(d)
    kw = small_kwargs()
    del kw["head_dim"]
    with pytest.raises(TypeError):
        Qwen35Config(**kw)


def test_missing_field_in_constructor_names_it():
    with pytest.raises(LoraValidationError, match="'intermediate_size' is missing"):
        Qwen35Config(**small_kwargs(intermediate_size=None))


@pytest.mark.parametrize("field", REQUIRED_DENSE + ["full_attention_interval"])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_size(field, value):
    d = flat("qwen3_5_0_8b")
    d[field] = value
    with pytest.raises(LoraValidationError, match=rf"'{field}' must be a positive integer.*{value}"):
        Qwen35Config.from_dict(d)


@pytest.mark.parametrize("value", [True, "1024", 1024.0, [1024], {"v": 1}])
def test_wrong_type_for_an_int_field(value):
    d = raw("qwen3_5_0_8b")
    d["text_config"]["hidden_size"] = value
    with pytest.raises(LoraValidationError,
                       match=rf"'text_config\.hidden_size'.*{type(value).__name__}"):
        Qwen35Config.from_dict(d)


def test_numpy_integers_are_accepted_as_plain_ints():
    c = Qwen35Config(**small_kwargs(hidden_size=np.int64(64), head_dim=np.int32(16)))
    assert type(c.hidden_size) is int and type(c.head_dim) is int
    assert c == Qwen35Config(**small_kwargs())
    assert all(type(v) is int for v in c.projection_shape(3, "q_proj"))


def test_tie_word_embeddings_must_be_bool():
    d = raw("qwen3_5_0_8b")
    d["tie_word_embeddings"] = "yes"
    with pytest.raises(LoraValidationError, match="tie_word_embeddings"):
        Qwen35Config.from_dict(d)


def test_value_heads_must_be_a_multiple_of_key_heads():
    d = raw("qwen3_5_27b")
    d["text_config"]["linear_num_value_heads"] = 40
    with pytest.raises(LoraValidationError,
                       match=r"'text_config\.linear_num_value_heads' \(40\).*multiple.*"
                             r"linear_num_key_heads' \(16\)"):
        Qwen35Config.from_dict(d)
    with pytest.raises(LoraValidationError, match="linear_num_value_heads"):
        Qwen35Config(**small_kwargs(linear_num_key_heads=3, linear_num_value_heads=4))


def test_attention_heads_must_be_a_multiple_of_kv_heads():
    with pytest.raises(LoraValidationError, match="num_attention_heads.*num_key_value_heads"):
        Qwen35Config(**small_kwargs(num_attention_heads=6, num_key_value_heads=4))


def test_moe_field_consistency():
    d = raw("qwen3_5_35b_a3b")
    d["text_config"]["num_experts_per_tok"] = 300
    with pytest.raises(LoraValidationError, match="num_experts_per_tok.*num_experts"):
        Qwen35Config.from_dict(d)
    # A dense intermediate_size in a MoE file describes no layer and is ignored ...
    d = raw("qwen3_5_35b_a3b")
    d["text_config"]["intermediate_size"] = 5632
    assert Qwen35Config.from_dict(d).intermediate_size is None
    # ... but the constructor refuses an explicit contradiction.
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
               shared_expert_intermediate_size=8)
    with pytest.raises(LoraValidationError, match="intermediate_size"):
        Qwen35Config(**small_kwargs(**moe))
    with pytest.raises(LoraValidationError, match="num_experts"):
        Qwen35Config(**small_kwargs(moe_intermediate_size=8))
    c = Qwen35Config(**small_kwargs(intermediate_size=None, **moe))
    assert c.is_moe


def test_dense_file_ignores_moe_fields():
    d = raw("qwen3_5_9b")
    d["text_config"]["num_experts"] = 0
    d["text_config"]["moe_intermediate_size"] = 0
    assert Qwen35Config.from_dict(d) == load("qwen3_5_9b")


# --------------------------------------------------------------------------- projection errors


def test_attention_module_on_the_wrong_layer_type():
    c = load("qwen3_5_0_8b")
    with pytest.raises(LoraValidationError,
                       match=r"layer 0, module 'q_proj'.*full-attention.*layer 0 is a "
                             r"linear-attention"):
        c.projection_shape(0, "q_proj")
    with pytest.raises(LoraValidationError,
                       match=r"layer 3, module 'in_proj_b'.*linear-attention.*layer 3 is a "
                             r"full-attention"):
        c.projection_shape(3, "in_proj_b")


@pytest.mark.parametrize("layer", [-1, 24, 1000])
def test_layer_out_of_range(layer):
    c = load("qwen3_5_0_8b")
    with pytest.raises(LoraValidationError,
                       match=rf"layer {layer}, module 'gate_proj'.*out of range.*24 layers"):
        c.projection_shape(layer, "gate_proj")


@pytest.mark.parametrize("module", ["qproj", "Q_PROJ", "lm_head", "query", ""])
def test_unknown_module(module):
    c = load("qwen3_5_0_8b")
    with pytest.raises(LoraValidationError, match=rf"layer 3, module '{module}'.*unknown module"):
        c.projection_shape(3, module)


def test_bert_name_on_qwen_gets_a_hint():
    with pytest.raises(LoraValidationError, match="BERT module name"):
        load("qwen3_5_0_8b").projection_shape(0, "query")


def test_projection_shape_argument_types():
    c = load("qwen3_5_0_8b")
    with pytest.raises(TypeError, match="layer index"):
        c.projection_shape("3", "q_proj")
    with pytest.raises(TypeError, match="layer index"):
        c.projection_shape(True, "q_proj")
    with pytest.raises(TypeError, match="module name"):
        c.projection_shape(3, b"q_proj")
    assert c.projection_shape(np.int64(3), "q_proj") == (1024, 4096)


@pytest.mark.parametrize("module", QWEN35_MLP_MODULES)
@pytest.mark.parametrize("layer", [0, 3])
def test_moe_rejects_mlp_modules_saying_why(module, layer):
    c = load("qwen3_5_35b_a3b")
    with pytest.raises(LoraValidationError) as info:
        c.projection_shape(layer, module)
    msg = str(info.value)
    assert f"layer {layer}" in msg and repr(module) in msg
    assert "mixture-of-experts" in msg
    assert "not linear layers" in msg
    assert "shared-expert" in msg


def test_moe_attention_modules_work():
    c = load("qwen3_5_35b_a3b")
    assert c.projection_shape(3, "q_proj") == (2048, 8192)
    assert c.projection_shape(3, "k_proj") == (2048, 512)
    assert c.projection_shape(3, "o_proj") == (4096, 2048)
    assert c.projection_shape(0, "in_proj_qkv") == (2048, 4096 + 4096)
    assert c.projection_shape(0, "in_proj_b") == (2048, 32)
    assert c.projection_shape(0, "out_proj") == (4096, 2048)


# --------------------------------------------------------------------------- value semantics


def test_config_is_immutable_picklable_hashable():
    c = load("qwen3_5_27b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1
    c2 = pickle.loads(pickle.dumps(c))
    assert c2 == c and hash(c2) == hash(c)
    assert copy.deepcopy(c) == c
    assert c != load("qwen3_5_9b")
    assert len({c, c2, load("qwen3_5_9b")}) == 2
    assert isinstance(c.layer_types, tuple)


def test_repr_is_readable():
    r = repr(load("qwen3_5_27b"))
    assert r.startswith("Qwen35Config(")
    assert "hidden_size=5120" in r and "linear_num_value_heads=48" in r
    assert "full_attention_layers=[3, 7," in r
    assert "linear_attention" not in r  # not 64 layer names
    assert len(r) < 600
    m = repr(load("qwen3_5_35b_a3b"))
    assert "num_experts=256" in m and "intermediate_size=None" not in m
    assert repr(BertConfig(12, 768, 3072)) == (
        "BertConfig(num_hidden_layers=12, hidden_size=768, intermediate_size=3072)")


def test_equality_by_value_with_list_or_tuple_layer_types():
    types = ["linear_attention"] * 7 + ["full_attention"]
    a = Qwen35Config(**small_kwargs(layer_types=types))
    b = Qwen35Config(**small_kwargs(layer_types=tuple(types)))
    assert a == b and hash(a) == hash(b)


# --------------------------------------------------------------------------- BERT


def test_bert_from_json_and_numbers():
    b = BertConfig.from_json(CONFIGS / "bert_base_uncased.json")
    assert b == BertConfig(12, 768, 3072)
    assert b == BertConfig(num_hidden_layers=12, hidden_size=768, intermediate_size=3072)
    assert (b.num_hidden_layers, b.hidden_size, b.intermediate_size) == (12, 768, 3072)
    assert b.known_modules == BERT_MODULES
    assert BertConfig.from_dict(b.to_dict()) == b


def test_bert_projection_table():
    b = BertConfig(2, 32, 48)
    for layer in (0, 1):
        for m in ("query", "key", "value", "attn_output"):
            assert b.projection_shape(layer, m) == (32, 32)
        assert b.projection_shape(layer, "ffn_intermediate") == (32, 48)
        assert b.projection_shape(layer, "ffn_output") == (48, 32)
        assert b.modules_for_layer(layer) == BERT_MODULES


def test_bert_errors():
    b = BertConfig(2, 32, 48)
    with pytest.raises(LoraValidationError, match=r"layer 2, module 'query'.*out of range"):
        b.projection_shape(2, "query")
    with pytest.raises(LoraValidationError, match=r"layer 0, module 'q_proj'.*unknown.*Qwen3\.5"):
        b.projection_shape(0, "q_proj")
    with pytest.raises(LoraValidationError, match="'hidden_size' must be a positive integer"):
        BertConfig(2, 0, 48)
    with pytest.raises(LoraValidationError, match="'intermediate_size'.*float"):
        BertConfig(2, 32, 48.0)
    with pytest.raises(LoraValidationError, match="'num_hidden_layers'.*bool"):
        BertConfig(True, 32, 48)
    d = json.loads((CONFIGS / "bert_base_uncased.json").read_text())
    del d["intermediate_size"]
    with pytest.raises(LoraValidationError, match="'intermediate_size' is missing"):
        BertConfig.from_dict(d)
    d = json.loads((CONFIGS / "bert_base_uncased.json").read_text())
    d["model_type"] = "qwen3_5_text"
    with pytest.raises(LoraValidationError, match="model_type"):
        BertConfig.from_dict(d)


def test_bert_value_semantics():
    b = BertConfig(12, 768, 3072)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.hidden_size = 1
    assert pickle.loads(pickle.dumps(b)) == b
    assert hash(b) == hash(BertConfig(12, 768, 3072))
    assert b != BertConfig(12, 768, 3073)


# --------------------------------------------------------------------------- dispatch


def test_load_model_config_dispatch():
    assert isinstance(load_model_config(CONFIGS / "qwen3_5_0_8b.json"), Qwen35Config)
    assert isinstance(load_model_config(str(CONFIGS / "qwen3_5_35b_a3b.json")), Qwen35Config)
    assert load_model_config(CONFIGS / "bert_base_uncased.json") == BertConfig(12, 768, 3072)
    assert load_model_config({"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 4,
                              "intermediate_size": 8}) == BertConfig(1, 4, 8)
    c = load("qwen3_5_2b")
    assert load_model_config(c) is c
    with pytest.raises(LoraValidationError, match="'model_type' is missing"):
        load_model_config({"hidden_size": 4})
    with pytest.raises(LoraValidationError, match="unsupported model_type.*gpt2"):
        load_model_config({"model_type": "gpt2"})
    with pytest.raises(LoraValidationError, match="'hidden_size' is missing"):
        load_model_config({"model_type": "llama"})
    with pytest.raises(TypeError):
        load_model_config(42)


# --------------------------------------------------------------------------- adapters


def test_27b_in_proj_b_is_sized_by_value_heads():
    c = load("qwen3_5_27b")
    assert c.projection_shape(0, "in_proj_b") == (5120, 48)
    by_key_heads = adapter_for({(0, "in_proj_b"): (5120, 16)})
    with pytest.raises(LoraValidationError) as info:
        by_key_heads.validate_against(c)
    msg = str(info.value)
    assert "layer 0" in msg and "'in_proj_b'" in msg
    assert "(5120, 16)" in msg and "(5120, 48)" in msg
    by_value_heads = adapter_for({(0, "in_proj_b"): (5120, 48), (1, "in_proj_a"): (5120, 48)})
    assert by_value_heads.validate_against(c) is None


def test_validate_against_accepts_a_full_fitting_adapter():
    c = Qwen35Config(**small_kwargs())
    # Hand-computed from small_kwargs: H 64, 4 heads / 2 kv heads of 16, 2 key heads of 8,
    # 4 value heads of 12, intermediate 96; layers 3 and 7 are full attention.
    full = {"q_proj": (64, 2 * 4 * 16), "k_proj": (64, 2 * 16), "v_proj": (64, 2 * 16),
            "o_proj": (4 * 16, 64)}
    linear = {"in_proj_qkv": (64, 2 * 2 * 8 + 4 * 12), "in_proj_z": (64, 4 * 12),
              "in_proj_b": (64, 4), "in_proj_a": (64, 4), "out_proj": (4 * 12, 64)}
    mlp = {"gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
    shapes = {(layer, m): shape for layer in range(8)
              for m, shape in {**(full if layer in (3, 7) else linear), **mlp}.items()}
    for (layer, m), shape in shapes.items():
        assert c.projection_shape(layer, m) == shape, (layer, m)
    assert adapter_for(shapes).validate_against(c) is None
    # Over-complete ranks (above min(d_in, d_out)) are valid.
    assert adapter_for({(0, "in_proj_b"): (64, 4)}, rank=20).validate_against(c) is None


def test_first_misfit_in_sorted_order_is_reported():
    c = load("qwen3_5_0_8b")
    a = adapter_for({
        (7, "q_proj"): (1024, 999),
        (3, "k_proj"): (1024, 511),
        (3, "q_proj"): (1024, 4096),
    })
    with pytest.raises(LoraValidationError) as info:
        a.validate_against(c)
    msg = str(info.value)
    assert "layer 3" in msg and "'k_proj'" in msg and "(1024, 511)" in msg and "(1024, 512)" in msg


def test_adapter_on_wrong_layer_type_names_layer_and_module():
    a = adapter_for({(0, "q_proj"): (1024, 4096)})
    with pytest.raises(LoraValidationError) as info:
        a.validate_against(load("qwen3_5_0_8b"))
    msg = str(info.value)
    assert "layer 0" in msg and "'q_proj'" in msg and "linear-attention" in msg


def test_moe_model_rejects_an_mlp_adapter():
    a = adapter_for({(0, "gate_proj"): (2048, 512)})
    with pytest.raises(LoraValidationError, match="mixture-of-experts.*not linear layers"):
        a.validate_against(load("qwen3_5_35b_a3b"))
    ok = adapter_for({(3, "v_proj"): (2048, 512), (0, "in_proj_z"): (2048, 4096)})
    assert ok.validate_against(load("qwen3_5_35b_a3b")) is None


def test_adapter_layer_out_of_range():
    a = adapter_for({(24, "gate_proj"): (1024, 3584)})
    with pytest.raises(LoraValidationError, match="layer 24.*gate_proj.*out of range"):
        a.validate_against(load("qwen3_5_0_8b"))


def test_validate_modules_with_known_modules():
    a = adapter_for({(0, "gate_proj"): (2048, 512), (3, "q_proj"): (2048, 8192),
                     (3, "qproj"): (2048, 8192)})
    assert a.validate_modules(load("qwen3_5_35b_a3b").known_modules) == [
        (0, "gate_proj"), (3, "qproj")]
    assert a.validate_modules(load("qwen3_5_2b").known_modules) == [(3, "qproj")]


def test_bert_validation_dispatch():
    b = BertConfig(2, 32, 48)
    good = adapter_for({(0, "query"): (32, 32), (1, "ffn_intermediate"): (32, 48),
                        (1, "ffn_output"): (48, 32)})
    assert good.validate_against(b) is None
    assert good.validate_against_bert(2, 32, 48) is None
    bad = adapter_for({(1, "ffn_output"): (32, 48)})
    with pytest.raises(LoraValidationError) as info:
        bad.validate_against(b)
    msg = str(info.value)
    assert "layer 1" in msg and "'ffn_output'" in msg and "(32, 48)" in msg and "(48, 32)" in msg
    with pytest.raises(LoraValidationError):
        bad.validate_against_bert(2, 32, 48)
    with pytest.raises(LoraValidationError, match="out of range"):
        good.validate_against_bert(1, 32, 48)


def test_interval_takes_no_part_in_equality_once_layer_types_are_resolved():
    types = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    a = Qwen35Config(**small_kwargs(layer_types=types, full_attention_interval=3))
    b = Qwen35Config(**small_kwargs())
    assert a == b and hash(a) == hash(b)
    assert Qwen35Config(**small_kwargs(full_attention_interval=2)) != b
