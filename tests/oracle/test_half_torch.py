"""lorahook.torch on bfloat16 and float16 models (README: Half precision): no copies, no model.float().

A half-precision ``nn.Linear`` through ``attach``: each output must be within
one unit in the last place of the model's dtype of the float64 result (the
base output, as the model computed it, plus the float64 delta).  A bfloat16
model generates with per-sequence adapters; its first-step logits are checked
against PEFT's bfloat16 mixed batch to bfloat16 accuracy.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import lorahook  # noqa: E402
from small_models import small_qwen35_model  # noqa: E402
from lorahook.torch import attach  # noqa: E402

pytestmark = pytest.mark.oracle

DTYPES = [torch.bfloat16, torch.float16]
MAPPING = {"layers.0.self_attn.q_proj": (0, "q_proj")}


class _Block(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].self_attn = torch.nn.Module()
        self.layers[0].self_attn.q_proj = linear


def _ulp(ref, dtype):
    r = torch.from_numpy(np.abs(ref)).to(dtype)
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    return (up.double() - r.double()).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (3, 50)])
def test_a_half_linear_is_within_one_ulp(dtype, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).to(dtype)
    model = _Block(linear)
    rng = np.random.default_rng(1)
    layer = lorahook.LoraLayer(rng.standard_normal((8, 64)) * 0.2,
                               rng.standard_normal((96, 8)) * 0.2, 1.5)
    adapter = lorahook.LoraAdapter({(0, "q_proj"): layer})
    x = torch.randn(*shape, 64).to(dtype)
    with torch.inference_mode():
        base = linear(x)
        weight_before = linear.weight.clone()
        with attach(model, adapter, mapping=MAPPING) as hooks:
            assert len(hooks) == 1
            got = linear(x)
        assert torch.equal(linear.weight, weight_before) and linear.weight.dtype == dtype
    assert got.dtype == dtype
    delta = layer.scale * (x.double().numpy() @ layer.a.T.astype(np.float64)) @ \
        layer.b.T.astype(np.float64)
    ref = base.double().numpy() + delta
    err = np.abs(got.double().numpy() - ref)
    assert (err <= _ulp(ref, dtype) + 1e-5 * np.abs(ref).max()).all()


def test_a_half_adapter_on_a_bfloat16_linear():
    pytest.importorskip("ml_dtypes")
    import ml_dtypes
    torch.manual_seed(2)
    linear = torch.nn.Linear(32, 40).to(torch.bfloat16)
    rng = np.random.default_rng(3)
    adapter = lorahook.LoraAdapter({(0, "q_proj"): lorahook.LoraLayer(
        rng.standard_normal((4, 32)), rng.standard_normal((40, 4)))}).astype(ml_dtypes.bfloat16)
    layer = adapter.layers[(0, "q_proj")]
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.inference_mode():
        base = linear(x)
        with attach(_Block(linear), adapter, mapping=MAPPING):
            got = linear(x)
    ref = base.double().numpy() + (x.double().numpy() @ layer.a.astype(np.float64).T) @ \
        layer.b.astype(np.float64).T
    err = np.abs(got.double().numpy() - ref)
    assert (err <= _ulp(ref, torch.bfloat16) + 1e-5 * np.abs(ref).max()).all()


def test_bfloat16_generate_with_sequences_matches_peft(tmp_path):
    peft = pytest.importorskip("peft")
    base32, _ = small_qwen35_model()
    for i, name in enumerate(("a", "b")):
        torch.manual_seed(30 + i)
        model = peft.get_peft_model(copy.deepcopy(base32), peft.LoraConfig(
            init_lora_weights=False, r=4 * (i + 1), lora_alpha=8,
            target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj", "up_proj"]))
        model.save_pretrained(tmp_path / name)
    base = copy.deepcopy(base32).to(torch.bfloat16)
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "a", adapter_name="a")
    ref.load_adapter(tmp_path / "b", adapter_name="b")
    ref.eval()
    adapters = lorahook.AdapterSet()
    attached = attach(base, adapters)
    for name in ("a", "b"):
        adapters.add(name, lorahook.LoraAdapter.from_peft(tmp_path / name))
    torch.manual_seed(5)
    ids = torch.randint(1, 96, (3, 6))
    with torch.inference_mode():
        want = ref(input_ids=ids, adapter_names=["a", "__base__", "b"]).logits.float()
        with attached.sequences(["a", None, "b"]):
            got = base(input_ids=ids).logits.float()
            out = base.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        plain = base(input_ids=ids).logits.float()
    assert out.shape == (3, 10)
    # the base row is exactly the base model; the adapter rows agree with PEFT's bfloat16
    # computation to bfloat16 accuracy (PEFT rounds the LoRA branch to bfloat16 twice)
    assert torch.equal(got[1], plain[1])
    peak = float(want.abs().max())
    assert float((got - want).abs().max()) <= 0.05 * peak
    assert float((got[0] - plain[0]).abs().max()) > 0
