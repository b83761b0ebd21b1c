"""Model families beyond Qwen3.5 and BERT: config classes, path rules, files and the CLI.

Shapes are checked against tables computed by hand from each checkpoint's published
sizes (never against lorahook's own arithmetic); the oracle tests compare with real
``nn.Linear`` layers built by transformers.
"""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lorahook
import lorahook.torch  # needs no torch until a model is attached
from lorahook import (
    AdapterSet,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    LoraAdapter,
    LoraFormatError,
    LoraLayer,
    LoraValidationError,
    MistralConfig,
    ModelGeometry,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    load_model_config,
)
from lorahook.models import (
    ARCHITECTURES,
    MeasuredGeometry,
    families_placing,
    module_key,
    module_path,
)

CONFIGS = Path(__file__).parent.parent / "data" / "configs"

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def llama_style(q, kv, o_in, hidden, inter):
    """A hand-written table: q (H, q), k/v (H, kv), o (o_in, H), MLP H <-> I."""
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (o_in, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


# (file, class, layers, table) -- every number worked out by hand from the published sizes
# (hidden, heads, key-value heads, head_dim, intermediate) of the checkpoint.
PUBLISHED = [
    # Llama 3.2 1B: 2048, 32 x 64, 8 kv, 8192
    ("llama_3_2_1b", LlamaConfig, 16, llama_style(2048, 512, 2048, 2048, 8192)),
    # Llama 3.1 8B: 4096, 32 heads, 8 kv, head_dim 4096/32 = 128, 14336
    ("llama_3_1_8b", LlamaConfig, 32, llama_style(4096, 1024, 4096, 4096, 14336)),
    # Mistral 7B v0.3: 4096, 32 heads, 8 kv, 128, 14336
    ("mistral_7b_v0_3", MistralConfig, 32, llama_style(4096, 1024, 4096, 4096, 14336)),
    # Qwen2.5 0.5B: 896, 14 heads x 64, 2 kv, 4864
    ("qwen2_5_0_5b", Qwen2Config, 24, llama_style(896, 128, 896, 896, 4864)),
    # Qwen2.5 7B: 3584, 28 x 128, 4 kv, 18944
    ("qwen2_5_7b", Qwen2Config, 28, llama_style(3584, 512, 3584, 3584, 18944)),
    # Qwen3 0.6B: 1024, 16 x 128 (not 1024/16 = 64), 8 kv, 3072
    ("qwen3_0_6b", Qwen3Config, 28, llama_style(2048, 1024, 2048, 1024, 3072)),
    # Qwen3 8B: 4096, 32 x 128, 8 kv, 12288
    ("qwen3_8b", Qwen3Config, 36, llama_style(4096, 1024, 4096, 4096, 12288)),
    # Gemma 2 2B: 2304, 8 x 256, 4 kv, 9216
    ("gemma_2_2b", Gemma2Config, 26, llama_style(2048, 1024, 2048, 2304, 9216)),
    # Gemma 3 1B: 1152, 4 x 256, 1 kv, 6912
    ("gemma_3_1b", Gemma3TextConfig, 26, llama_style(1024, 256, 1024, 1152, 6912)),
    # Gemma 3 4B (nested, sparse): 2560, 8 x 256, 4 kv, 10240
    ("gemma_3_4b", Gemma3TextConfig, 34, llama_style(2048, 1024, 2048, 2560, 10240)),
    # Gemma 3 12B (nested, sparse): 3840, 16 x 256, 8 kv, 15360
    ("gemma_3_12b", Gemma3TextConfig, 48, llama_style(4096, 2048, 4096, 3840, 15360)),
    # Phi-3 mini 4k: 3072, 32 x 96, 32 kv, 8192: qkv (32 + 2*32) * 96 = 9216, gate_up 16384
    ("phi_3_mini_4k", Phi3Config, 32, {"qkv_proj": (3072, 9216), "o_proj": (3072, 3072),
                                       "gate_up_proj": (3072, 16384), "down_proj": (8192, 3072)}),
]


@pytest.mark.parametrize("name, cls, layers, table", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_configs(name, cls, layers, table):
    path = CONFIGS / f"{name}.json"
    config = load_model_config(path)
    assert type(config) is cls and isinstance(config, ModelGeometry)
    assert cls.from_json(path) == config
    assert config.num_layers == layers
    for layer_idx in (0, layers // 2, layers - 1):
        assert set(config.modules(layer_idx)) == set(table)
        for module, shape in table.items():
            assert config.projection_shape(layer_idx, module) == shape, (name, layer_idx, module)
    with pytest.raises(LoraValidationError, match=rf"layer {layers}, module 'q_proj'.*out of range"):
        config.projection_shape(layers, "q_proj")
    # the config reads back from its own flat dict and survives pickling
    assert cls.from_dict(config.to_dict()) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert hash(config) == hash(cls.from_dict(config.to_dict()))


def test_moe_families_refused_by_name():
    with pytest.raises(LoraValidationError, match="'qwen3_moe' is a mixture-of-experts") as info:
        load_model_config(CONFIGS / "qwen3_30b_a3b.json")
    assert "qwen3_30b_a3b.json" in str(info.value)
    for model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "llama4", "gpt_oss"):
        with pytest.raises(LoraValidationError, match=f"'{model_type}' is a mixture-of-experts"):
            load_model_config({"model_type": model_type, "hidden_size": 64})
    # the one MoE model accepted
    assert load_model_config(CONFIGS / "qwen3_5_35b_a3b.json").is_moe


def test_unknown_model_type_refused_by_name():
    with pytest.raises(LoraValidationError, match=r"unsupported model_type str \('gpt2'\)"):
        load_model_config({"model_type": "gpt2"})
    with pytest.raises(LoraValidationError, match="'model_type' is missing"):
        load_model_config({"hidden_size": 8})


def base(model_type, **over):
    d = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 8, "intermediate_size": 96}
    d.update(over)
    return {k: v for k, v in d.items() if v is not ...}


# What each family's transformers config does with a head_dim / num_key_value_heads that a
# file leaves out ("absent") or writes as null: a number (the derived value) or the words of
# the error. 64 // 8 = 8 is hidden_size // num_attention_heads.
RULES = [
    # family, field, absent, null
    ("llama", "head_dim", 8, 8),
    ("llama", "num_key_value_heads", 8, 8),
    ("mistral", "head_dim", 8, 8),
    ("mistral", "num_key_value_heads", "would fill in 8", 8),
    ("qwen2", "head_dim", 8, "found null"),
    ("qwen2", "num_key_value_heads", "would fill in 32", 8),
    ("qwen3", "head_dim", "would fill in 128", "found null"),
    ("qwen3", "num_key_value_heads", "would fill in 32", 8),
    ("gemma", "head_dim", "would fill in 256", "found null"),
    ("gemma", "num_key_value_heads", "would fill in 16", "found null"),
    ("gemma2", "head_dim", "would fill in 256", "found null"),
    ("gemma2", "num_key_value_heads", "would fill in 4", "found null"),
    ("gemma3_text", "head_dim", "would fill in 256", "found null"),
    ("gemma3_text", "num_key_value_heads", "would fill in 4", "found null"),
    ("phi3", "head_dim", 8, "found null"),
    ("phi3", "num_key_value_heads", 8, 8),
]


@pytest.mark.parametrize("model_type, field, absent, null", RULES)
def test_left_out_fields_follow_the_familys_rule(model_type, field, absent, null):
    other = "num_key_value_heads" if field == "head_dim" else "head_dim"
    complete = base(model_type, **{other: 4 if other == "num_key_value_heads" else 16})
    for case, expected in (("absent", absent), ("null", null)):
        d = dict(complete)
        if case == "null":
            d[field] = None
        if isinstance(expected, int):
            assert getattr(load_model_config(d), field) == expected, (case, d)
        else:
            with pytest.raises(LoraValidationError, match=expected) as info:
                load_model_config(d)
            assert field in str(info.value)


def test_explicit_head_dim_wins():
    # 64 / 8 = 8, but the file says 32: q_proj is 8 x 32 = 256 wide, o_proj reads 256
    c = load_model_config(base("llama", head_dim=32, num_key_value_heads=2))
    assert c.projection_shape(0, "q_proj") == (64, 256)
    assert c.projection_shape(0, "k_proj") == (64, 64)
    assert c.projection_shape(1, "o_proj") == (256, 64)


def test_required_sizes_and_grouped_query_heads():
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"):
        with pytest.raises(LoraValidationError, match="'intermediate_size' is missing"):
            load_model_config(base(model_type, intermediate_size=..., head_dim=8, num_key_value_heads=4))
        with pytest.raises(LoraValidationError, match="multiple of num_key_value_heads"):
            load_model_config(base(model_type, head_dim=8, num_key_value_heads=3))
        with pytest.raises(LoraValidationError, match="'hidden_size' must be a positive integer"):
            load_model_config(base(model_type, hidden_size=64.0, head_dim=8, num_key_value_heads=4))
    with pytest.raises(LoraValidationError, match="'model_type' must be 'llama'"):
        LlamaConfig.from_dict(base("mistral"))
    with pytest.raises(LoraValidationError, match="head_dim is required for Gemma"):
        GemmaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=8, intermediate_size=8,
                    num_key_value_heads=8)
    with pytest.raises(TypeError):
        LlamaConfig.from_dict([("model_type", "llama")])


def test_gemma3_nested():
    text = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24}
    c = load_model_config({"model_type": "gemma3", "text_config": text, "vision_config": {}})
    assert c == Gemma3TextConfig.from_dict(text)
    assert c.projection_shape(2, "q_proj") == (64, 96)
    assert c.projection_shape(2, "v_proj") == (64, 48)
    # a sparse text_config takes Gemma3TextConfig's defaults: 8 heads, 4 kv, head_dim 256
    sparse = load_model_config({"model_type": "gemma3", "text_config": {"hidden_size": 64,
                                "intermediate_size": 96, "num_hidden_layers": 3}})
    assert sparse.projection_shape(0, "q_proj") == (64, 2048)
    assert sparse.projection_shape(0, "k_proj") == (64, 1024)
    with pytest.raises(LoraValidationError, match="'text_config' is missing"):
        load_model_config({"model_type": "gemma3"})
    with pytest.raises(LoraValidationError, match="text_config.model_type' must be 'gemma3_text'"):
        load_model_config({"model_type": "gemma3", "text_config": {**text, "model_type": "siglip"}})
    with pytest.raises(LoraValidationError, match="'text_config.head_dim' must be a positive integer, found null"):
        load_model_config({"model_type": "gemma3", "text_config": {**text, "head_dim": None}})


def test_module_errors():
    c = load_model_config(CONFIGS / "llama_3_2_1b.json")
    with pytest.raises(LoraValidationError, match=r"layer 3, module 'qkv_proj': unknown module for Llama"):
        c.projection_shape(3, "qkv_proj")
    with pytest.raises(TypeError, match="layer index must be an int"):
        c.projection_shape("3", "q_proj")
    with pytest.raises(TypeError, match="module name must be a str"):
        c.projection_shape(3, None)
    with pytest.raises(LoraValidationError, match="layer -1.*out of range"):
        c.projection_shape(-1, "q_proj")
    phi = load_model_config(CONFIGS / "phi_3_mini_4k.json")
    with pytest.raises(LoraValidationError, match="fuses them into qkv_proj"):
        phi.projection_shape(0, "k_proj")
    with pytest.raises(LoraValidationError, match="fuses them into gate_up_proj"):
        phi.projection_shape(0, "up_proj")


# --------------------------------------------------------------------------- path rules

# (architecture, layer, module, the path PEFT uses for it in that model) -- written by hand
PATHS = [
    ("llama", 3, "q_proj", "model.layers.3.self_attn.q_proj"),
    ("mistral", 0, "down_proj", "model.layers.0.mlp.down_proj"),
    ("qwen2", 11, "k_proj", "model.layers.11.self_attn.k_proj"),
    ("qwen3", 2, "o_proj", "model.layers.2.self_attn.o_proj"),
    ("gemma", 1, "up_proj", "model.layers.1.mlp.up_proj"),
    ("gemma2", 5, "gate_proj", "model.layers.5.mlp.gate_proj"),
    ("gemma3", 7, "v_proj", "model.layers.7.self_attn.v_proj"),
    ("gemma3_multimodal", 7, "v_proj", "model.language_model.layers.7.self_attn.v_proj"),
    ("phi3", 4, "qkv_proj", "model.layers.4.self_attn.qkv_proj"),
    ("phi3", 4, "gate_up_proj", "model.layers.4.mlp.gate_up_proj"),
    ("qwen3_5", 2, "in_proj_qkv", "model.layers.2.linear_attn.in_proj_qkv"),
    ("qwen3_5_multimodal", 3, "q_proj", "model.language_model.layers.3.self_attn.q_proj"),
    ("bert", 1, "attn_output", "encoder.layer.1.attention.output.dense"),
]


@pytest.mark.parametrize("architecture, layer, module, path", PATHS)
def test_paths_both_ways(architecture, layer, module, path):
    assert module_path(layer, module, architecture) == path
    assert module_key(path) == (layer, module)
    assert module_key("base_model.model." + path) == (layer, module)
    assert lorahook.torch.default_mapping(path) == (layer, module)


def test_path_refusals():
    assert module_key("language_model.model.layers.2.mlp.down_proj") == (2, "down_proj")  # old Gemma 3
    assert module_key("bert.encoder.layer.0.intermediate.dense") == (0, "ffn_intermediate")
    with pytest.raises(LoraFormatError, match="'qkv' is not a self_attn projection"):
        module_key("model.layers.0.self_attn.qkv")
    with pytest.raises(LoraFormatError, match="vision tower"):
        module_key("model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj")
    with pytest.raises(LoraFormatError, match="not a projection of any model family"):
        module_key("transformer.h.0.attn.c_attn")
    assert lorahook.torch.default_mapping("model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj") is None
    with pytest.raises(ValueError, match="architecture must be one of"):
        module_path(0, "q_proj", "gpt2")
    with pytest.raises(LoraValidationError, match="'q_proj' .* is not a Phi-3 projection"):
        module_path(0, "q_proj", "phi3")
    with pytest.raises(LoraValidationError, match="is not a Llama projection"):
        module_path(0, "qkv_proj", "llama")
    assert set(ARCHITECTURES) >= {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
                                  "gemma3_multimodal", "phi3", "qwen3_5", "qwen3_5_multimodal", "bert"}


def test_families_placing():
    assert families_placing(["model.layers.0.self_attn.qkv_proj"]) == ("Phi-3",)
    both = families_placing(["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"])
    assert {"Qwen3.5", "Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma 2", "Gemma 3"} == set(both)
    assert families_placing(["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_proj"]) == ()


# --------------------------------------------------------------------------- adapters


def layer(rng, rank, d_in, d_out, bias=False):
    return LoraLayer(rng.standard_normal((rank, d_in)), rng.standard_normal((d_out, rank)),
                     scale=0.5, bias=rng.standard_normal(d_out) if bias else None)


def phi3_adapter(rng, d_out_qkv=9216):
    return LoraAdapter({
        (0, "qkv_proj"): layer(rng, 4, 3072, d_out_qkv),
        (0, "gate_up_proj"): layer(rng, 2, 3072, 16384),
        (31, "down_proj"): layer(rng, 4, 8192, 3072),
        (31, "o_proj"): layer(rng, 8, 3072, 3072),
    }, name="phi")


def test_validate_phi3_and_misfit_message():
    rng = np.random.default_rng(0)
    phi = load_model_config(CONFIGS / "phi_3_mini_4k.json")
    assert phi3_adapter(rng).validate_against(phi) is None
    with pytest.raises(LoraValidationError) as info:
        phi3_adapter(rng, d_out_qkv=3072).validate_against(phi)
    text = str(info.value)
    assert "layer 0" in text and "'qkv_proj'" in text and "(3072, 3072)" in text and "(3072, 9216)" in text
    llama = load_model_config(CONFIGS / "llama_3_1_8b.json")
    with pytest.raises(LoraValidationError, match="layer 0 module 'gate_up_proj'.*unknown module for Llama"):
        phi3_adapter(rng).validate_against(llama)
    with pytest.raises(TypeError, match="lorahook.ModelGeometry"):
        phi3_adapter(rng).validate_against({"model_type": "phi3"})


def test_adapter_set_guards_any_family():
    rng = np.random.default_rng(1)
    aset = AdapterSet(model=load_model_config(CONFIGS / "phi_3_mini_4k.json"))
    aset.add("ok", phi3_adapter(rng))
    with pytest.raises(LoraValidationError, match="qkv_proj"):
        aset.add("bad", phi3_adapter(rng, d_out_qkv=1024))
    assert aset.names() == ["ok"]
    tiny = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
                       num_key_value_heads=2)
    aset = AdapterSet(model=tiny)
    aset.add("k", LoraAdapter({(1, "k_proj"): layer(rng, 2, 16, 8)}))
    with pytest.raises(LoraValidationError, match=r"\(16, 16\).*\(16, 8\)"):
        aset.add("k2", LoraAdapter({(1, "k_proj"): layer(rng, 2, 16, 16)}))


@pytest.mark.parametrize("architecture, expected_paths", [
    ("phi3", {(0, "qkv_proj"): "model.layers.0.self_attn.qkv_proj",
              (0, "gate_up_proj"): "model.layers.0.mlp.gate_up_proj",
              (31, "down_proj"): "model.layers.31.mlp.down_proj",
              (31, "o_proj"): "model.layers.31.self_attn.o_proj"}),
])
def test_save_and_load_phi3(tmp_path, architecture, expected_paths):
    rng = np.random.default_rng(2)
    ad = phi3_adapter(rng)
    ad.save_peft(tmp_path / "ad", architecture=architecture)
    with open(tmp_path / "ad" / "adapter_config.json") as f:
        assert sorted(json.load(f)["target_modules"]) == sorted(expected_paths.values())
    back = LoraAdapter.from_peft(tmp_path / "ad")
    assert dict(back.module_paths) == expected_paths
    for key, lay in ad.layers.items():
        np.testing.assert_array_equal(back.layers[key].a, lay.a)
        np.testing.assert_array_equal(back.layers[key].b, lay.b)
        assert back.layers[key].scale == pytest.approx(lay.scale, rel=1e-12)
    back.validate_against(load_model_config(CONFIGS / "phi_3_mini_4k.json"))


def test_save_gemma3_multimodal_layout(tmp_path):
    rng = np.random.default_rng(3)
    ad = LoraAdapter({(5, "q_proj"): layer(rng, 2, 2560, 2048), (33, "down_proj"): layer(rng, 2, 10240, 2560)})
    ad.save_peft(tmp_path / "g", architecture="gemma3_multimodal")
    back = LoraAdapter.from_peft(tmp_path / "g")
    assert back.module_paths[(5, "q_proj")] == "model.language_model.layers.5.self_attn.q_proj"
    back.validate_against(load_model_config(CONFIGS / "gemma_3_4b.json"))


def test_measured_geometry():
    g = MeasuredGeometry({(0, "q"): (4, 8), (2, "q"): (4, 8), (2, "o"): (8, 4)}, name="toy")
    assert isinstance(g, ModelGeometry)
    assert g.num_layers == 3 and g.modules(1) == () and set(g.modules(2)) == {"q", "o"}
    assert g.projection_shape(2, "o") == (8, 4)
    with pytest.raises(LoraValidationError, match="toy: layer 1, module 'q': no such projection"):
        g.projection_shape(1, "q")
    with pytest.raises(LoraValidationError, match="out of range"):
        g.projection_shape(3, "q")
    assert pickle.loads(pickle.dumps(g)) == g
    with pytest.raises(LoraValidationError, match="no projections"):
        MeasuredGeometry({})
    with pytest.raises(ValueError, match="positive ints"):
        MeasuredGeometry({(0, "q"): (0, 3)})


# --------------------------------------------------------------------------- command line


def run(*args):
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    # from this folder, so the child imports the installed lorahook, not the source tree
    proc = subprocess.run([sys.executable, "-m", "lorahook"] + [str(a) for a in args],
                          capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_validate_and_info(tmp_path):
    rng = np.random.default_rng(4)
    phi3_adapter(rng).save_peft(tmp_path / "phi", architecture="phi3")
    phi3_adapter(rng, d_out_qkv=3072).save_peft(tmp_path / "phi_bad", architecture="phi3")
    LoraAdapter({(15, "k_proj"): layer(rng, 4, 2048, 512), (0, "down_proj"): layer(rng, 4, 8192, 2048)}
                ).save_peft(tmp_path / "llama", architecture="llama")
    code, out, err = run("validate", tmp_path / "phi", "--model", CONFIGS / "phi_3_mini_4k.json")
    assert code == 0, err
    assert out.startswith("fits:") and "Phi-3" in out
    code, out, err = run("validate", tmp_path / "llama", "--model", CONFIGS / "llama_3_2_1b.json")
    assert code == 0, err
    assert "Llama, hidden 2048, 16 layers" in out
    code, out, err = run("validate", tmp_path / "phi_bad", "--model", CONFIGS / "phi_3_mini_4k.json")
    assert code == 1 and "qkv_proj" in err and "Traceback" not in err
    code, out, err = run("validate", tmp_path / "llama", "--model", CONFIGS / "llama_3_1_8b.json")
    assert code == 1 and "(8192, 2048)" in err and "(14336, 4096)" in err
    code, out, err = run("validate", tmp_path / "llama", "--model", CONFIGS / "qwen3_30b_a3b.json")
    assert code == 2 and "'qwen3_moe'" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    code, out, err = run("validate", tmp_path / "llama", "--model", tmp_path / "gpt2.json")
    assert code == 2 and "'gpt2'" in err
    code, out, err = run("info", tmp_path / "phi")
    assert code == 0, err
    assert "families    Phi-3" in out and "qkv_proj" in out and "gate_up_proj" in out
