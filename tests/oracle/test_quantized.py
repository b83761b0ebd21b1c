"""LoRA on quantized bases (README: Quantized models): torchao, bitsandbytes, optimum-quanto, torch dynamic.

A small random Llama is quantized by each library on the CPU.  Two adapters
are made by PEFT (``init_lora_weights=False``) on the float model and read
with ``LoraAdapter.from_peft``.  For every kind, at every hooked linear of a
mixed-adapter forward, the delta lorahook added equals a float64 reference
computed from the linear's recorded input, and rows without an adapter are
bit-identical to the bare quantized module's output.  Where PEFT has LoRA
layers for the library (bitsandbytes 8-bit and 4-bit, torchao), whole-model
outputs and greedy tokens equal PEFT's mixed batches on the same quantized
model.

With ``LORAHOOK_REQUIRE_QUANT=1`` (CI) a missing quantization library fails
these tests instead of skipping them.
"""
import copy
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lorahook  # noqa: E402
from lorahook.torch import attach, geometry_of  # noqa: E402

pytestmark = pytest.mark.oracle

REQUIRED = os.environ.get("LORAHOOK_REQUIRE_QUANT", "") not in ("", "0")
HERE = os.path.dirname(os.path.abspath(__file__))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a": dict(r=4, lora_alpha=8, target_modules=TARGETS),
            "b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])}
SELECTED = ["a", None, "b", "a"]
PEFT_NAMES = ["a", "__base__", "b", "a"]


def _library(name):
    try:
        return pytest.importorskip(name)
    except pytest.skip.Exception:
        if REQUIRED:
            pytest.fail(f"{name} is not installed but LORAHOOK_REQUIRE_QUANT is set")
        raise


# --------------------------------------------------------------------------- the models

def _float_llama():
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The float model, its saved directory and the adapters' directories."""
    root = tmp_path_factory.mktemp("quantized")
    base = _float_llama()
    base.save_pretrained(root / "llama")
    for i, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(20 + i)
        model = peft.get_peft_model(copy.deepcopy(base),
                                    peft.LoraConfig(init_lora_weights=False, **config))
        model.save_pretrained(root / name)
    return base, root


def _torchao(config_name, **kwargs):
    def make(base, root, dtype=torch.float32):
        _library("torchao")
        from torchao.quantization import quantize_
        if config_name == "PrototypeInt4WeightOnlyConfig":
            from torchao.prototype.quantization import int4
            config = int4.PrototypeInt4WeightOnlyConfig(**kwargs)
        else:
            import torchao.quantization as tq
            config = getattr(tq, config_name)(**kwargs)
        model = copy.deepcopy(base).to(dtype)
        quantize_(model, config)
        return model
    return make


def _bitsandbytes(**kwargs):
    def make(base, root, dtype=torch.float32):
        _library("bitsandbytes")
        config = transformers.BitsAndBytesConfig(**kwargs)
        return transformers.AutoModelForCausalLM.from_pretrained(
            root / "llama", quantization_config=config, device_map="cpu", dtype=dtype).eval()
    return make


def _quanto(weights):
    def make(base, root, dtype=torch.float32):
        quanto = _library("optimum.quanto")
        model = copy.deepcopy(base).to(dtype)
        quanto.quantize(model, weights=getattr(quanto, weights))
        quanto.freeze(model)
        return model
    return make


def _torch_dynamic(base, root, dtype=torch.float32):
    return torch.ao.quantization.quantize_dynamic(copy.deepcopy(base), {torch.nn.Linear},
                                                  dtype=torch.qint8)


KINDS = {
    "torchao-int8-weight-only": _torchao("Int8WeightOnlyConfig"),
    "torchao-int8-dynamic": _torchao("Int8DynamicActivationInt8WeightConfig"),
    "torchao-int4-weight-only": _torchao("PrototypeInt4WeightOnlyConfig", group_size=32),
    "bitsandbytes-8bit": _bitsandbytes(load_in_8bit=True),
    "bitsandbytes-4bit-nf4": _bitsandbytes(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_compute_dtype=torch.float32),
    "bitsandbytes-4bit-fp4": _bitsandbytes(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                           bnb_4bit_compute_dtype=torch.float32),
    "quanto-qint8": _quanto("qint8"),
    "quanto-qint4": _quanto("qint4"),
    "torch-dynamic-int8": _torch_dynamic,
}
# the kinds PEFT has LoRA layers for
PEFT_KINDS = ["torchao-int8-weight-only", "torchao-int8-dynamic", "bitsandbytes-8bit",
              "bitsandbytes-4bit-nf4"]


def _quantized(kind, world, dtype=torch.float32):
    base, root = world
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KINDS[kind](base, root, dtype)


def _adapter_set(root):
    aset = lorahook.AdapterSet()
    for name in ADAPTERS:
        aset.add(name, lorahook.LoraAdapter.from_peft(root / name))
    return aset


def _ids():
    torch.manual_seed(3)
    return torch.randint(1, 256, (len(SELECTED), 7))


# --------------------------------------------------------------------------- geometry

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_geometry_of_a_quantized_model_is_the_float_models(world, kind):
    quantized = _quantized(kind, world)
    assert geometry_of(quantized) == geometry_of(world[0])
    assert len(geometry_of(quantized).projections()) == 14


# --------------------------------------------------------------------------- per linear

def _check_linear(record, adapters, dtype):
    """One hooked linear's call: the delta against float64, untouched rows bit-identical."""
    key, x, after, bare = record
    rows = x.shape[0] // len(SELECTED)
    x64 = x.double().reshape(len(SELECTED), rows, -1)
    got = after.double().reshape(len(SELECTED), rows, -1)
    base = bare.double().reshape(len(SELECTED), rows, -1)
    for s, name in enumerate(SELECTED):
        layer = adapters[name].layers.get(key) if name is not None else None
        if layer is None:
            assert torch.equal(after.reshape(len(SELECTED), rows, -1)[s],
                               bare.reshape(len(SELECTED), rows, -1)[s]), (key, s)
            continue
        a, b = torch.from_numpy(layer.a.astype(np.float64)), torch.from_numpy(
            layer.b.astype(np.float64))
        delta = layer.scale * (x64[s] @ a.T) @ b.T
        want = base[s] + delta
        peak = float(delta.abs().max())
        # float32: the delta to 1e-5 of its size, plus float32 rounding of the sum; 16-bit
        # rows are rounded once more, to their own precision
        ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
        limit = 1e-5 * peak + 2 * ulp * float(want.abs().max())
        err = float((got[s] - want).abs().max())
        assert err <= limit, f"{key} sequence {s}: |got - want| = {err:.3g} > {limit:.3g}"


def _recorded_forward(model, attached, dtype=torch.float32):
    """Run a mixed forward, recording every hooked linear's input, output and bare output."""
    records = []

    def recorder(key):
        def hook(mod, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            bare = mod.forward(inputs[0])  # the quantized module alone (forward: no hooks)
            records.append((key, x.to(output.dtype).float(),
                            output.reshape(-1, output.shape[-1]).clone(),
                            bare.reshape(-1, bare.shape[-1]).clone()))
        return hook

    handles = [model.get_submodule(path).register_forward_hook(recorder(key))
               for path, key in attached.modules.items() if key[0] is not None]
    try:
        with torch.no_grad(), attached.sequences(SELECTED):
            model(input_ids=_ids())
    finally:
        for h in handles:
            h.remove()
    return records


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_mixed_rows_equal_a_float64_reference_and_base_rows_are_bit_identical(world, kind):
    model = _quantized(kind, world)
    aset = _adapter_set(world[1])
    attached = attach(model, aset)
    assert len(attached) == 16  # 14 projections, lm_head and embed_tokens
    records = _recorded_forward(model, attached)
    assert len(records) == 14
    adapters = {name: aset.get(name) for name in ADAPTERS}
    for record in records:
        _check_linear(record, adapters, torch.float32)


@pytest.mark.parametrize("kind", ["torchao-int8-weight-only", "bitsandbytes-4bit-nf4"])
def test_bfloat16_rows_on_a_quantized_base(world, kind):
    model = _quantized(kind, world, torch.bfloat16)
    aset = _adapter_set(world[1])
    attached = attach(model, aset)
    records = _recorded_forward(model, attached)
    assert records and all(r[2].dtype == torch.bfloat16 for r in records)
    adapters = {name: aset.get(name) for name in ADAPTERS}
    for record in records:
        _check_linear(record, adapters, torch.bfloat16)


# --------------------------------------------------------------------------- against PEFT

def _peft_model(kind, world):
    ref = peft.PeftModel.from_pretrained(_quantized(kind, world), world[1] / "a",
                                         adapter_name="a")
    ref.load_adapter(world[1] / "b", adapter_name="b")
    return ref.eval()


@pytest.mark.parametrize("kind", PEFT_KINDS)
def test_every_hooked_linear_equals_peft_s_lora_layer_on_the_same_input(world, kind):
    # PEFT's layer for the library (bitsandbytes, torchao) is fed the very input lorahook saw,
    # with PEFT's mixed-batch adapter_names: the outputs agree to float32 accuracy
    ref = _peft_model(kind, world)
    model = _quantized(kind, world)
    aset = _adapter_set(world[1])
    attached = attach(model, aset)
    paths = {key: path for path, key in attached.modules.items()}
    kinds = set()
    for key, x, after, _ in _recorded_forward(model, attached):
        layer = ref.base_model.model.get_submodule(paths[key])
        kinds.add(type(layer).__module__)
        with torch.no_grad():
            want = layer(x.reshape(len(SELECTED), -1, x.shape[-1]), adapter_names=PEFT_NAMES)
        want = want.reshape(after.shape)
        peak = float(want.abs().max())
        err = float((after - want).abs().max())
        assert err <= 2e-6 * peak, f"{key}: |lorahook - PEFT| = {err:.3g}, peak {peak:.3g}"
    assert kinds <= {"peft.tuners.lora.bnb", "peft.tuners.lora.torchao"}, kinds


# whole models: where the base is weight-only quantized, outputs are continuous in the
# activations (dynamic activation quantization rounds them to int8 at every linear, so a
# last-bit difference upstream can move a value by a quantization step)
@pytest.mark.parametrize("kind", [k for k in PEFT_KINDS if "dynamic" not in k])
def test_mixed_forward_equals_peft_sequence_by_sequence(world, kind):
    ref = _peft_model(kind, world)
    model = _quantized(kind, world)
    attached = attach(model, _adapter_set(world[1]))
    ids = _ids()
    with torch.no_grad():
        want = ref(input_ids=ids, adapter_names=PEFT_NAMES).logits
        with ref.disable_adapter():
            peft_base = ref(input_ids=ids).logits
        bare = model(input_ids=ids).logits
        with attached.sequences(SELECTED):
            got = model(input_ids=ids).logits
    assert torch.equal(bare, peft_base)  # the same quantized base in both
    assert torch.equal(got[1], bare[1])  # the sequence without an adapter
    delta = float((want - peft_base).abs().max())
    err = float((got - want).abs().max())
    # through a whole 4-bit model, the last bits of each delta (lorahook and PEFT sum
    # in different orders) grow more than through an 8-bit one; each linear's delta is
    # checked against float64 in test_mixed_rows_equal_a_float64_reference...
    tol = 2.5e-4 if "4bit" in kind else 5e-5
    assert delta > 1e-2 and err <= tol * float(want.abs().max()), (err, delta)


def test_greedy_tokens_on_a_4bit_base_equal_peft(world):
    kind = "bitsandbytes-4bit-nf4"
    ref = _peft_model(kind, world)
    model = _quantized(kind, world)
    attached = attach(model, _adapter_set(world[1]))
    kw = dict(input_ids=_ids(), max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(**kw, adapter_names=PEFT_NAMES)
        with attached.sequences(SELECTED):
            got = model.generate(**kw)
        bare = model.generate(**kw)
    assert got.tolist() == want.tolist()
    assert got.tolist() != bare.tolist()  # the adapters changed some tokens


def test_beam_search_with_left_padding_on_a_4bit_base_equals_peft(world):
    kind = "bitsandbytes-4bit-nf4"
    ref = _peft_model(kind, world)
    model = _quantized(kind, world)
    attached = attach(model, _adapter_set(world[1]))
    ids = _ids()
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    ids[2, :3], mask[2, :3] = 0, 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3,
              num_return_sequences=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(**kw, adapter_names=PEFT_NAMES)
        with attached.sequences(SELECTED):
            got = model.generate(**kw)
    assert got.shape == (2 * len(SELECTED), ids.shape[1] + 5)
    assert got.tolist() == want.tolist()


# --------------------------------------------------------------------------- refusals

class _OwnLinear(torch.nn.Linear):
    """A linear class lorahook does not know."""


def test_an_adapter_naming_an_unsupported_module_is_refused_by_path_and_class(world):
    model = copy.deepcopy(world[0])
    old = model.model.layers[1].self_attn.o_proj  # adapter "a" covers it, "b" does not
    own = _OwnLinear(old.in_features, old.out_features, bias=False)
    own.load_state_dict(old.state_dict())
    model.model.layers[1].self_attn.o_proj = own
    adapter = lorahook.LoraAdapter.from_peft(world[1] / "a")
    pattern = (r"layer 1 module 'o_proj' names model\.layers\.1\.self_attn\.o_proj, a "
               r".*_OwnLinear, which lorahook does not hook; supported: torch\.nn\.Linear")
    with pytest.raises(lorahook.LoraValidationError, match=pattern):
        attach(model, adapter)
    attached = attach(model, _adapter_set(world[1]))
    assert "model.layers.1.self_attn.o_proj" not in attached.modules
    with pytest.raises(lorahook.LoraValidationError, match="adapter 'a' " + pattern):
        with attached.sequences(["a"]):
            pass
    with attached.sequences(["b"]):  # an adapter that does not name it is served
        pass
    assert [p[:2] for p in geometry_of(model).projections()].count((1, "o_proj")) == 0


def test_importing_lorahook_torch_imports_no_quantization_library():
    code = ("import sys, lorahook, lorahook.torch; "
            "print(sorted(m for m in ('bitsandbytes', 'torchao', 'optimum', 'optimum.quanto') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=HERE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
