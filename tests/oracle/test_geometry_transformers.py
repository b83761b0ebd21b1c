"""Oracle: projection shapes against real ``nn.Linear`` layers built by ``transformers``.

Small randomly sized Qwen3.5 models (dense and MoE, flat text config and nested
multimodal config) and BERT encoders are instantiated with random weights (nothing is
downloaded); for every layer and module, ``projection_shape`` must equal the
``(in_features, out_features)`` of the corresponding ``nn.Linear``, and every
addressable ``nn.Linear`` must be covered.
"""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import lorahook  # noqa: E402
from lorahook.models import (  # noqa: E402
    BERT_MODULES,
    QWEN35_FULL_ATTENTION_MODULES,
    QWEN35_LINEAR_ATTENTION_MODULES,
    QWEN35_MLP_MODULES,
    BertConfig,
    Qwen35Config,
    load_model_config,
)

SEEDS = [0, 1, 2, 3]
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=1,
    spatial_merge_size=1,
    num_position_embeddings=16,
)

_QWEN_LINEAR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|linear_attn|mlp)\.([a-z_]+)$"
)


def random_text_config(seed, moe):
    """A tiny random Qwen3.5 text config dict (fields as in a config.json)."""
    rng = np.random.default_rng(seed)
    kv_heads = int(rng.integers(1, 3))
    key_heads = int(rng.integers(1, 3))
    layers = int(rng.integers(2, 7))
    d = dict(
        vocab_size=64,
        hidden_size=int(rng.integers(2, 6)) * 8,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads * int(rng.integers(1, 4)),
        num_key_value_heads=kv_heads,
        head_dim=int(rng.choice([4, 8, 12])),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * int(rng.integers(1, 4)),
        linear_key_head_dim=int(rng.choice([4, 8])),
        linear_value_head_dim=int(rng.choice([4, 6, 8])),
        linear_conv_kernel_dim=int(rng.integers(2, 5)),
        tie_word_embeddings=bool(rng.integers(0, 2)),
    )
    if seed % 2:
        # Explicit, irregular layer types.
        types = ["full_attention" if rng.random() < 0.4 else "linear_attention"
                 for _ in range(layers)]
        types[0] = "linear_attention"
        types[-1] = "full_attention"
        d["layer_types"] = types
    else:
        # Layer types from the interval.
        d["full_attention_interval"] = int(rng.integers(1, 4))
    if moe:
        d.update(
            num_experts=int(rng.integers(2, 5)),
            num_experts_per_tok=1,
            moe_intermediate_size=int(rng.integers(1, 4)) * 8,
            shared_expert_intermediate_size=int(rng.integers(1, 4)) * 8,
        )
    else:
        d["intermediate_size"] = int(rng.integers(1, 8)) * 8
    return d


def linears_by_key(model):
    """{(layer, module): (in_features, out_features)} for the decoder's projections.

    Only the text decoder's attention / linear-attention / MLP projections are
    collected (not the vision tower, the lm_head, or the MoE block's shared expert,
    whose projections sit one level deeper, under ``mlp.shared_expert``). The MoE
    block's scalar ``mlp.shared_expert_gate`` (hidden -> 1) is the one nn.Linear
    directly under ``mlp`` that no module name addresses; it is skipped here.
    """
    found = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or "visual" in name:
            continue
        m = _QWEN_LINEAR.search(name)
        if m is None:
            continue
        if m.group(2) == "mlp" and m.group(3) == "shared_expert_gate":
            continue
        key = (int(m.group(1)), m.group(3))
        assert key not in found, f"two nn.Linear for {key}: {name}"
        found[key] = (mod.in_features, mod.out_features)
    return found


def check_against_model(config, model, moe):
    found = linears_by_key(model)
    expected_keys = set()
    for layer in range(config.num_hidden_layers):
        for module in config.modules_for_layer(layer):
            expected_keys.add((layer, module))
            assert config.projection_shape(layer, module) == found[(layer, module)], (
                layer, module)
        # Modules of the other layer type do not exist on this layer, and are rejected.
        other = (QWEN35_LINEAR_ATTENTION_MODULES if config.is_full_attention(layer)
                 else QWEN35_FULL_ATTENTION_MODULES)
        for module in other:
            assert (layer, module) not in found
            with pytest.raises(lorahook.LoraValidationError):
                config.projection_shape(layer, module)
        if moe:
            for module in QWEN35_MLP_MODULES:
                with pytest.raises(lorahook.LoraValidationError, match="mixture-of-experts"):
                    config.projection_shape(layer, module)
    # Every addressable nn.Linear is covered by the table.
    assert set(found) == expected_keys


def check_layer_types(config, hf_text_config):
    assert list(config.layer_types) == list(hf_text_config.layer_types)
    for layer in range(config.num_hidden_layers):
        assert config.is_full_attention(layer) == (
            hf_text_config.layer_types[layer] == "full_attention")


#: moe -> (nested model_type, prefix of the transformers class names); the flat text form
#: is model_type + "_text".
FAMILIES = {False: ("qwen3_5", "Qwen3_5"), True: ("qwen3_5_moe", "Qwen3_5Moe")}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("seed", SEEDS)
def test_flat_text_config(seed, moe):
    model_type, prefix = FAMILIES[moe]
    d = random_text_config(seed, moe=moe)
    torch.manual_seed(seed)
    hf = getattr(transformers, f"{prefix}TextConfig")(**d)
    model = getattr(transformers, f"{prefix}ForCausalLM")(hf)
    ours = Qwen35Config.from_dict({"model_type": model_type + "_text", **d})
    assert ours.is_moe is moe and (ours.intermediate_size is None) is moe
    check_layer_types(ours, hf)
    check_against_model(ours, model, moe=moe)
    if moe:
        # The MoE block's experts are not nn.Linear; the shared expert's are, under
        # names (mlp.shared_expert.gate_proj ...) that the module names do not address.
        for layer in range(ours.num_hidden_layers):
            mlp = model.model.layers[layer].mlp
            assert not isinstance(mlp.experts, torch.nn.Linear)
            assert isinstance(mlp.shared_expert.gate_proj, torch.nn.Linear)
    # transformers' own serialization reads back to the same geometry.
    assert Qwen35Config.from_dict(hf.to_dict()) == ours
    assert load_model_config(hf.to_dict()) == ours


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("seed", SEEDS)
def test_nested_config(seed, moe):
    model_type, prefix = FAMILIES[moe]
    d = random_text_config(seed, moe=moe)
    tie = d.pop("tie_word_embeddings")
    vision = dict(TINY_VISION, out_hidden_size=d["hidden_size"])
    torch.manual_seed(seed)
    hf = getattr(transformers, f"{prefix}Config")(text_config=d, vision_config=vision,
                                                  tie_word_embeddings=tie)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(hf)
    ours = Qwen35Config.from_dict({"model_type": model_type, "text_config": d,
                                   "tie_word_embeddings": tie})
    assert ours.tie_word_embeddings is tie
    check_layer_types(ours, hf.text_config)
    check_against_model(ours, model, moe=moe)
    assert Qwen35Config.from_dict(hf.to_dict()) == ours
    # The flat form of the same text model gives the same geometry.
    assert Qwen35Config.from_dict({"model_type": model_type + "_text",
                                   "tie_word_embeddings": tie, **d}) == ours


def test_adapter_fitted_to_a_real_model_validates():
    """An adapter shaped from the real nn.Linear layers passes validate_against."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    d = random_text_config(1, moe=False)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**d))
    ours = Qwen35Config.from_dict({"model_type": "qwen3_5_text", **d})
    rng = np.random.default_rng(0)
    layers = {}
    for key, (d_in, d_out) in linears_by_key(model).items():
        layers[key] = lorahook.LoraLayer(
            rng.standard_normal((2, d_in)).astype(np.float32),
            rng.standard_normal((d_out, 2)).astype(np.float32))
    adapter = lorahook.LoraAdapter(layers)
    assert adapter.validate_against(ours) is None
    assert adapter.validate_modules(ours.known_modules) == []


_BERT_PATHS = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_output": "attention.output.dense",
    "ffn_intermediate": "intermediate.dense",
    "ffn_output": "output.dense",
}


@pytest.mark.parametrize("seed", SEEDS)
def test_bert_model(seed):
    from transformers import BertConfig as HFBertConfig
    from transformers import BertModel

    rng = np.random.default_rng(seed)
    heads = int(rng.integers(1, 4))
    hf = HFBertConfig(
        vocab_size=50,
        hidden_size=heads * int(rng.integers(2, 6)) * 2,
        num_hidden_layers=int(rng.integers(1, 4)),
        num_attention_heads=heads,
        intermediate_size=int(rng.integers(1, 6)) * 8,
        max_position_embeddings=16,
    )
    torch.manual_seed(seed)
    model = BertModel(hf)
    ours = BertConfig.from_dict(hf.to_dict())
    assert ours == BertConfig(hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size)
    assert load_model_config(hf.to_dict()) == ours
    modules = dict(model.named_modules())
    for layer in range(hf.num_hidden_layers):
        for module in BERT_MODULES:
            lin = modules[f"encoder.layer.{layer}.{_BERT_PATHS[module]}"]
            assert isinstance(lin, torch.nn.Linear)
            assert ours.projection_shape(layer, module) == (lin.in_features, lin.out_features)
    with pytest.raises(lorahook.LoraValidationError, match="out of range"):
        ours.projection_shape(hf.num_hidden_layers, "query")


PUBLISHED = ["qwen3_5_0_8b", "qwen3_5_2b", "qwen3_5_4b", "qwen3_5_9b", "qwen3_5_27b",
             "qwen3_5_35b_a3b"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_against_transformers_on_meta_device(name):
    """The shipped config.json files, built full size by transformers without memory."""
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "data" / "configs" / f"{name}.json"
    raw = json.loads(path.read_text())
    hf_config = transformers.AutoConfig.for_model(**raw)
    text_config = hf_config.get_text_config()
    moe = raw["model_type"] == "qwen3_5_moe"
    model_cls = (transformers.Qwen3_5MoeForCausalLM if moe
                 else transformers.Qwen3_5ForCausalLM)
    with torch.device("meta"):
        model = model_cls(text_config)
    ours = Qwen35Config.from_json(path)
    check_layer_types(ours, text_config)
    check_against_model(ours, model, moe=moe)
