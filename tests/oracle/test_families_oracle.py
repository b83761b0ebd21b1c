"""Oracle: the Llama, Mistral, Qwen2, Qwen3, Gemma (1-3) and Phi-3 families against transformers and PEFT.

For a tiny random model of each family, built with transformers' own config class
(grouped-query attention, explicit head dims, attention biases where the family has them):

* ``load_model_config`` of ``model.config`` (as a dict and as a saved ``config.json``) gives
  every real ``nn.Linear``'s ``(in_features, out_features)``, and ``geometry_of(model)`` equals
  them;
* an adapter PEFT saves (``init_lora_weights=False``; rank/alpha patterns; rsLoRA) loads with
  ``from_peft``, fits the config, and adds PEFT's own per-layer deltas (float64) to 1e-5;
* ``lorahook.torch.attach`` gives the PEFT model's logits (float64 reference, float32 bound);
* ``save_peft(architecture=...)`` loads back into ``peft.PeftModel.from_pretrained`` with no
  missing or unexpected keys and the same logits.

The published configs shipped as test data are also instantiated on the ``meta`` device (no
memory) and every mapped linear's shape compared with ``projection_shape``.
"""

import copy
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft.tuners.lora import Linear as PeftLoraLinear  # noqa: E402

import lorahook  # noqa: E402
from lorahook import LoraAdapter, LoraValidationError, load_model_config  # noqa: E402
from lorahook.models import module_key  # noqa: E402
from lorahook.torch import attach, default_mapping, geometry_of  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "data" / "configs"
REL = 1e-5
COMMON = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]

# family -> (transformers config class, model class, sizes, save_peft architecture, targets).
# Every size differs from every other so that a swapped dimension cannot pass.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=48, intermediate_size=40, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=12, attention_bias=True, mlp_bias=True), "llama", LLAMA_MODULES),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=32, intermediate_size=56, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=10), "mistral", LLAMA_MODULES),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",  # q/k/v biases; head_dim 48 / 6 = 8
              dict(hidden_size=48, intermediate_size=40, num_attention_heads=6, num_key_value_heads=3),
              "qwen2", LLAMA_MODULES),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=20), "qwen3", LLAMA_MODULES),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=12), "gemma", LLAMA_MODULES),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(hidden_size=24, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=14, sliding_window=4), "gemma2", LLAMA_MODULES),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=18, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
                    "gemma3", LLAMA_MODULES),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=48, intermediate_size=40, num_attention_heads=6, num_key_value_heads=2),
             "phi3", PHI3_MODULES),
}

VARIANTS = {
    "plain": dict(r=4, lora_alpha=8),
    "rslora": dict(r=4, lora_alpha=6, use_rslora=True),
    "patterns": dict(r=4, lora_alpha=8,
                     rank_pattern={r"layers\.1\..*o_proj": 2, "down_proj": 6},
                     alpha_pattern={"model.layers.0.mlp.down_proj": 3, r".*\.1\.self_attn\..*": 20}),
}


def build(family, seed=0):
    config_cls, model_cls, sizes, _, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **sizes})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, model_cls)(config)
    # transformers initialises some biases / norms to exact zeros or ones; randomise them so
    # that the check sees every parameter
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.float().eval()


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = build(family)
        return copy.deepcopy(cache[family])

    return get


def linears(model):
    """``{path: (in, out)}`` of the decoder's ``nn.Linear`` layers (not the output head)."""
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_geometry_equals_the_real_linears(family, models, tmp_path):
    model = models(family)
    config = load_model_config(model.config.to_dict())
    model.config.to_json_file(str(tmp_path / "config.json"))
    assert load_model_config(tmp_path) == config
    assert load_model_config(tmp_path / "config.json") == config
    found = linears(model)
    targets = FAMILIES[family][4]
    assert len(found) == config.num_layers * len(targets)
    for path, shape in found.items():
        key = default_mapping(path)
        assert key is not None, path
        assert config.projection_shape(*key) == shape, (path, key)
    assert sorted(config.modules(0)) == sorted(targets)
    with pytest.raises(LoraValidationError, match="out of range"):
        config.projection_shape(config.num_layers, targets[0])
    with pytest.raises(LoraValidationError, match="unknown module"):
        config.projection_shape(0, "in_proj_qkv")
    measured = geometry_of(model)
    assert measured.num_layers == config.num_layers
    layers = {k: s for k, s in measured.shapes.items() if k[0] is not None}
    assert layers == {default_mapping(p): s for p, s in found.items()}
    # the model-level modules measured (lm_head, embed_tokens) are the config's
    assert {"lm_head", "embed_tokens"} <= set(measured.modules(None))
    for module in measured.modules(None):
        assert measured.projection_shape(None, module) == config.projection_shape(None, module)


def test_gemma3_multimodal(tmp_path):
    text = dict(FAMILIES["gemma3_text"][2], vocab_size=64, num_hidden_layers=2, max_position_embeddings=64)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Gemma3ForConditionalGeneration(config).eval()
    geometry = load_model_config(config.to_dict())
    assert isinstance(geometry, lorahook.Gemma3TextConfig)
    decoder = {p: s for p, s in linears(model).items() if ".language_model." in p}
    assert len(decoder) == 2 * 7
    for path, shape in linears(model).items():
        key = default_mapping(path)
        if ".language_model." in path:
            assert path.startswith("model.language_model.layers.")
            assert geometry.projection_shape(*key) == shape
        else:  # the vision tower and the projector are not addressed
            assert key is None, path
    # PEFT on the multimodal model, read back and written for its layout
    pm = peft_model(model, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)", r=2, lora_alpha=4)
    pm.save_pretrained(str(tmp_path / "ad"))
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    adapter.validate_against(geometry)
    assert adapter.module_paths[(1, "v_proj")] == "model.language_model.layers.1.self_attn.v_proj"
    assert_deltas_match(adapter, pm)


# --------------------------------------------------------------------------- PEFT


def peft_model(model, **config):
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return pm.eval()


def assert_deltas_match(adapter, pm, rows=5):
    """Every LoRA layer of ``pm`` and nothing else, with PEFT's float64 delta to 1e-5."""
    rng = np.random.default_rng(5)
    mods = {module_key(n): m for n, m in pm.named_modules() if isinstance(m, PeftLoraLinear)}
    assert set(mods) == set(adapter.layers)
    for key, mod in sorted(mods.items()):
        x = rng.standard_normal((rows, mod.in_features)).astype(np.float32)
        m = copy.deepcopy(mod).double().eval()
        with torch.no_grad():
            xt = torch.from_numpy(x.astype(np.float64))
            ref = (m(xt) - m.base_layer(xt)).numpy()
        out = np.zeros((rows, mod.out_features), np.float32)
        lorahook.apply_lora_rows(adapter, key[0], key[1], x, out, mod.in_features, mod.out_features)
        peak = np.abs(ref).max()
        assert peak > 0
        assert np.abs(out - ref).max() <= REL * peak, key


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def compare_logits(got, ref64, peft32):
    ref = ref64.double().numpy()
    floor = float(np.abs(peft32.double().numpy() - ref).max())
    peak = float(np.abs(ref).max())
    err = float(np.abs(got.double().numpy() - ref).max())
    assert err <= max(REL * peak, 2.0 * floor), (err, floor, peak)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_saved_adapters(family, variant, models, tmp_path):
    base = models(family)
    targets = FAMILIES[family][4]
    pm = peft_model(copy.deepcopy(base), target_modules=targets, **VARIANTS[variant])
    pm.save_pretrained(str(tmp_path / "ad"))
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    config = load_model_config(base.config.to_dict())
    adapter.validate_against(config)
    adapter.validate_against(geometry_of(base))
    assert adapter.num_adapted_layers == config.num_layers * len(targets)
    assert_deltas_match(adapter, pm)
    if variant != "patterns":
        return

    # the whole model: lorahook's hooks on the base equal the PEFT model
    ids = torch.tensor([[3, 9, 4, 17, 30, 5]])
    pm64 = copy.deepcopy(pm).double()
    ref64, peft32 = logits(pm64, ids), logits(pm, ids)
    hooked = copy.deepcopy(base)
    with torch.inference_mode(), attach(hooked, adapter):
        got = logits(hooked, ids)
    compare_logits(got, ref64, peft32)
    assert float((got - logits(base, ids)).abs().max()) > 1e-3  # the adapter changes something

    # save_peft for the family's layout loads into PEFT with the same result
    adapter.save_peft(tmp_path / "back", architecture=FAMILIES[family][3])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "back")).eval()
    assert not [w for w in record if "missing" in str(w.message) or "unexpected" in str(w.message)]
    assert_deltas_match(adapter, reloaded)
    compare_logits(logits(reloaded, ids), ref64, peft32)


def test_geometry_of_refuses_a_misfit(models):
    model = models("phi3")
    geometry = geometry_of(model)
    rng = np.random.default_rng(0)
    bad = LoraAdapter({(1, "qkv_proj"): lorahook.LoraLayer(rng.standard_normal((2, 48)),
                                                           rng.standard_normal((48, 2)))})
    with pytest.raises(LoraValidationError, match=r"layer 1 module 'qkv_proj'.*\(48, 48\).*\(48, 80\)"):
        bad.validate_against(geometry)


# --------------------------------------------------------------------------- published configs


PUBLISHED = ["llama_3_2_1b", "llama_3_1_8b", "mistral_7b_v0_3", "qwen2_5_0_5b", "qwen2_5_7b", "qwen3_0_6b",
             "qwen3_8b", "gemma_2_2b", "gemma_3_1b", "gemma_3_4b", "phi_3_mini_4k"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_on_meta_device(name):
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    raw = {k: v for k, v in raw.items() if k != "auto_map"}
    config = transformers.AutoConfig.for_model(**raw)
    if raw["model_type"] == "gemma3":
        model_cls = transformers.Gemma3ForConditionalGeneration
    else:
        model_cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_cls(config)
    geometry = load_model_config(CONFIGS / f"{name}.json")
    found = 0
    for path, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            key = default_mapping(path)
            if key is not None:
                assert geometry.projection_shape(*key) == (mod.in_features, mod.out_features), path
                found += 1
    # every layer's projections, and the lm_head (a model-level module, layer_idx None)
    assert found == geometry.num_layers * len(geometry.modules(0)) + 1
