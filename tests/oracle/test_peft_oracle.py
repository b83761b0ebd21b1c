"""Oracle: adapters saved by PEFT apply through lorahook with PEFT's own deltas, and back.

LoRA is attached with PEFT (random non-zero weights, ``init_lora_weights=False``) to every
supported projection of a tiny random Qwen3.5 model and of all-MiniLM-L6-v2, saved with
``save_pretrained`` and loaded with ``LoraAdapter.from_peft``. For every projection the delta
``apply_lora_rows`` adds must equal PEFT's (LoRA layer output minus base layer output, computed
by PEFT's module in float64) to a relative 1e-5. ``save_peft`` output must load into PEFT with no
missing or unexpected keys and give the same deltas again.
"""

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft.tuners.lora import Linear as PeftLoraLinear  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import lorahook  # noqa: E402
from lorahook import LoraAdapter, LoraFormatError, LoraLayer  # noqa: E402
from lorahook.files import read_safetensors_header  # noqa: E402
from lorahook.models import module_key  # noqa: E402

QWEN_MODULES = [
    "q_proj", "k_proj", "v_proj", "o_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    "gate_proj", "up_proj", "down_proj",
]
BERT_TARGET = (
    r".*encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
    r"|intermediate\.dense|output\.dense)"
)
ROWS = 5


def attach(model, seed=0, **config):
    """Attach LoRA with PEFT, randomising every LoRA weight (and lora_B bias)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(init_lora_weights=False, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return pm.eval()


def lora_modules(pm):
    """``{(layer_idx, module): peft Linear}`` for every LoRA layer in a PEFT model."""
    out = {}
    for name, mod in pm.named_modules():
        if isinstance(mod, PeftLoraLinear):
            key = module_key(name)
            assert key not in out
            out[key] = mod
    return out


def peft_delta64(mod, x):
    """PEFT's delta for rows ``x`` computed by PEFT's own module in float64."""
    m = copy.deepcopy(mod).double().eval()
    xt = torch.from_numpy(x.astype(np.float64))
    with torch.no_grad():
        return (m(xt) - m.base_layer(xt)).numpy()


def assert_deltas_match(adapter, pm, rng):
    """Every LoRA layer of ``pm`` and nothing else, with PEFT's delta to 1e-5."""
    mods = lora_modules(pm)
    assert set(mods) == set(adapter.layers)
    for key, mod in sorted(mods.items()):
        d_in, d_out = mod.in_features, mod.out_features
        x = rng.standard_normal((ROWS, d_in)).astype(np.float32)
        ref = peft_delta64(mod, x)
        out = np.zeros((ROWS, d_out), np.float32)
        lorahook.apply_lora_rows(adapter, key[0], key[1], x, out, d_in, d_out)
        err = np.abs(out - ref).max()
        scale = np.abs(ref).max()
        assert scale > 0, f"{key}: PEFT delta is zero; the test would prove nothing"
        assert err <= 1e-5 * scale, f"{key}: max error {err:.3g} vs max |delta| {scale:.3g}"


def recast_file(directory, dtype):
    """Rewrite a PEFT-saved adapter file with its tensors in ``dtype``."""
    path = directory / "adapter_model.safetensors"
    tensors = {k: v.to(dtype).contiguous() for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def round_lora_to(pm, dtype):
    """Round the LoRA weights to ``dtype``-representable values so the float32 PEFT model is exact."""
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(p.to(dtype).to(p.dtype))


def load_with_peft(base, directory):
    """PEFT loads ``directory`` onto ``base``; assert no missing or unexpected keys."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pm = peft.PeftModel.from_pretrained(base, str(directory))
    problems = [str(w.message) for w in record if "missing" in str(w.message) or "unexpected" in str(w.message)]
    assert problems == []
    result = pm.load_adapter(str(directory), adapter_name="check")
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    pm.delete_adapter("check")
    pm.set_adapter("default")
    return pm.eval()


@pytest.fixture
def rng():
    return np.random.default_rng(7)


QWEN_VARIANTS = {
    "plain": dict(r=4, lora_alpha=8),
    "rslora": dict(r=4, lora_alpha=6, use_rslora=True),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        rank_pattern={"q_proj": 6, r"layers\.[01]\.mlp\.down_proj": 2, "model.layers.3.linear_attn.in_proj_b": 1},
        alpha_pattern={"in_proj_qkv": 3, "model.layers.2.self_attn.o_proj": 20, "mlp.up_proj": 0.5},
    ),
    "lora_bias": dict(r=3, lora_alpha=5, lora_bias=True),
    "layers_to_transform": dict(r=2, lora_alpha=2, layers_to_transform=[0, 2]),
}


@pytest.mark.parametrize("variant", sorted(QWEN_VARIANTS))
def test_qwen_peft_saved_deltas(tmp_path, rng, tiny_qwen35, variant):
    pm = attach(tiny_qwen35(), target_modules=QWEN_MODULES, **QWEN_VARIANTS[variant])
    pm.save_pretrained(str(tmp_path / "ad"))
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    assert_deltas_match(adapter, pm, rng)
    expected = 4 * 3 + 3 * 5 + 1 * 4 if variant != "layers_to_transform" else 5 + 3 + 4 + 3
    assert adapter.num_adapted_layers == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_qwen_half_precision_files(tmp_path, rng, tiny_qwen35, dtype):
    tdtype = getattr(torch, dtype)
    pm = attach(tiny_qwen35(), target_modules=QWEN_MODULES, r=4, lora_alpha=8, lora_bias=True)
    round_lora_to(pm, tdtype)
    pm.save_pretrained(str(tmp_path / "ad"))
    recast_file(tmp_path / "ad", tdtype)
    header, _, _, _ = read_safetensors_header(tmp_path / "ad" / "adapter_model.safetensors")
    assert {v["dtype"] for v in header.values()} == {"BF16" if dtype == "bfloat16" else "F16"}
    assert_deltas_match(LoraAdapter.from_peft(tmp_path / "ad"), pm, rng)


def test_qwen_save_peft_roundtrip(tmp_path, rng, tiny_qwen35):
    pm = attach(tiny_qwen35(), target_modules=QWEN_MODULES, **QWEN_VARIANTS["patterns"])
    pm.save_pretrained(str(tmp_path / "ad"))
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    adapter.save_peft(tmp_path / "back", metadata={"base_model": "tiny"})
    reloaded = load_with_peft(tiny_qwen35(), tmp_path / "back")
    assert_deltas_match(adapter, reloaded, rng)


def test_qwen_in_memory_mixed_scales_roundtrip(tmp_path, rng, tiny_qwen35):
    """An adapter built in memory (mixed ranks, scales and biases) saved for a Qwen3.5 base."""
    model = tiny_qwen35()
    layers = {}
    for i, (name, mod) in enumerate(
        (n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ):
        key = module_key(name)
        rank = 1 + i % 5
        bias = rng.standard_normal(mod.out_features) if i % 3 == 0 else None
        layers[key] = LoraLayer(
            rng.standard_normal((rank, mod.in_features)),
            rng.standard_normal((mod.out_features, rank)),
            scale=float(rng.uniform(-2, 2)),
            bias=bias,
        )
    adapter = LoraAdapter(layers, name="mixed").scaled(0.5)
    adapter.save_peft(tmp_path / "mem", architecture="qwen3_5")
    reloaded = load_with_peft(model, tmp_path / "mem")
    assert_deltas_match(adapter, reloaded, rng)
    assert_deltas_match(LoraAdapter.from_peft(tmp_path / "mem"), reloaded, rng)


@pytest.mark.parametrize("variant", ["plain", "rslora_bias_patterns"])
def test_bert_peft_saved_deltas_and_roundtrip(tmp_path, rng, minilm, variant):
    config = dict(r=4, lora_alpha=8, target_modules=BERT_TARGET)
    if variant != "plain":
        config.update(use_rslora=True, lora_bias=True, rank_pattern={"query": 2}, alpha_pattern={"output.dense": 3})
    pm = attach(minilm(), **config)
    pm.save_pretrained(str(tmp_path / "ad"))
    adapter = LoraAdapter.from_peft(tmp_path / "ad")
    assert adapter.num_adapted_layers == 6 * 6
    assert_deltas_match(adapter, pm, rng)
    adapter.save_peft(tmp_path / "back")
    assert_deltas_match(adapter, load_with_peft(minilm(), tmp_path / "back"), rng)


def test_bert_architecture_save_and_pooler_refusal(tmp_path, rng, minilm):
    pm = attach(minilm(), r=2, lora_alpha=4, target_modules=["query", "dense"])
    pm.save_pretrained(str(tmp_path / "ad"))
    with pytest.raises(LoraFormatError, match="pooler"):
        LoraAdapter.from_peft(tmp_path / "ad")
    layers = {(i, m): LoraLayer(rng.standard_normal((3, 384 if m != "ffn_output" else 1536)),
                                rng.standard_normal((384 if m != "ffn_intermediate" else 1536, 3)), scale=0.7)
              for i in (0, 5) for m in ("value", "ffn_intermediate", "ffn_output")}
    adapter = LoraAdapter(layers)
    adapter.save_peft(tmp_path / "mem", architecture="bert")
    assert_deltas_match(adapter, load_with_peft(minilm(), tmp_path / "mem"), rng)
