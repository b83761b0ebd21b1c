"""int8 adapters against PEFT's float32 ones (guide: Many adapters, int8).

PEFT's own random adapters on projections of real shapes (Qwen2.5-0.5B's
attention and MLP), loaded with ``from_peft(dtype="int8")`` and applied
through ``lorahook.torch``: the delta must be within the bound the guide
states of PEFT's float32 delta.  And greedy tokens with an int8 adapter must
agree with the float32 adapter's for the share of prompts the guide states,
on a small Llama whose logits are well separated.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lorahook  # noqa: E402
from lorahook.torch import attach  # noqa: E402

pytestmark = pytest.mark.oracle

#: the guide's bound: max |delta_int8 - delta_peft| <= BOUND * max |delta_peft|, per projection
BOUND = 0.015
#: the guide's share of prompts whose 8 greedy tokens are the same with int8 and float32
SHARE = 0.8

SHAPES = {"q_proj": (896, 896), "k_proj": (896, 128), "up_proj": (896, 4864),
          "down_proj": (4864, 896)}


class _Layers(torch.nn.Module):
    """One decoder layer's projections (Llama's paths), real shapes, no attention."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        layer = self.model.layers[0]
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        for name, (d_in, d_out) in SHAPES.items():
            parent = layer.self_attn if name in ("q_proj", "k_proj") else layer.mlp
            setattr(parent, name, torch.nn.Linear(d_in, d_out, bias=False))


def _path(name):
    return f"model.layers.0.{'self_attn' if name in ('q_proj', 'k_proj') else 'mlp'}.{name}"


@pytest.mark.parametrize("rank", [8, 64])
def test_the_delta_is_within_the_stated_bound_of_peft_float32(tmp_path, rank):
    torch.manual_seed(rank)
    base = _Layers().eval()
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        init_lora_weights=False, r=rank, lora_alpha=2 * rank, target_modules=list(SHAPES)))
    model.save_pretrained(tmp_path)
    model.eval()
    adapter = lorahook.LoraAdapter.from_peft(tmp_path, dtype="int8")
    assert adapter.dtype == np.int8 and len(adapter.layers) == len(SHAPES)
    mods = {name: base.get_submodule(_path(name)) for name in SHAPES}
    peft_mods = {name: model.get_submodule("base_model.model." + _path(name)) for name in SHAPES}
    with attach(base, adapter):
        for name, (d_in, _) in SHAPES.items():
            x = torch.randn(16, d_in)
            with torch.inference_mode():
                want = peft_mods[name](x).double()  # PEFT's float32 layer: base + delta
                got = mods[name](x).double()        # the base layer with lorahook's int8 hook
                delta = want - x.double() @ mods[name].weight.double().T
            err = float((got - want).abs().max())
            assert err <= BOUND * float(delta.abs().max()), (name, err / float(delta.abs().max()))


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3)  # logits far apart: greedy decoding is well conditioned
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def test_greedy_tokens_agree_with_float32_for_the_stated_share(tmp_path):
    base = _llama()
    torch.manual_seed(1)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        init_lora_weights=False, r=16, lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    model.save_pretrained(tmp_path)
    adapters = lorahook.AdapterSet()
    adapters.add("f32", lorahook.LoraAdapter.from_peft(tmp_path))
    adapters.add("int8", lorahook.LoraAdapter.from_peft(tmp_path, dtype="int8"))
    attached = attach(base, adapters)
    torch.manual_seed(5)
    ids = torch.randint(1, 256, (64, 8))
    out = {}
    with torch.inference_mode():
        for name in ("f32", "int8", None):
            with attached.sequences([name] * len(ids)):
                out[name] = base.generate(input_ids=ids, max_new_tokens=8, do_sample=False,
                                          pad_token_id=0)[:, 8:]
    # the adapter matters: float32's tokens differ from the base model's on most prompts
    assert float((out["f32"] != out[None]).any(1).float().mean()) >= 0.9
    share = float((out["f32"] == out["int8"]).all(1).float().mean())
    assert share >= SHARE, share
