"""DoRA, lm_head and embedding LoRA, and modules_to_save against PEFT itself.

Each adapter is trained by nobody: PEFT makes it with random (non-zero) factors and
saves it; lorahook loads the file, mixes it per sequence with other adapters and the
base model in one batch, and every sequence must equal PEFT running that adapter alone.
"""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import lorahook  # noqa: E402
from lorahook import AdapterSet, LoraAdapter  # noqa: E402
from lorahook.torch import attach  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB = 64


def _llama(cls=transformers.LlamaForCausalLM, **extra):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, pad_token_id=0, **extra)
    return cls(config).eval()


def _save(model_fn, path, seed, **lora):
    """A PEFT adapter with random factors (and magnitudes, saved heads) written to ``path``."""
    torch.manual_seed(seed)
    pm = peft.get_peft_model(model_fn(), peft.LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.rand_like(p))   # a magnitude that is not the base norm
            elif "modules_to_save" in name:
                p.add_(0.3 * torch.randn_like(p))      # a head that differs from the base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.save_pretrained(str(path))
    return path


def _peft_alone(model_fn, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(model_fn(), str(path)).eval()


def _close(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.abs(got - ref).max() <= 2e-5 * max(np.abs(ref).max(), 1.0)


def _mixed_equals_peft(model_fn, dirs, names, ids, **forward):
    """Per-sequence forward outputs of one mixed batch equal PEFT's adapter by adapter."""
    model = model_fn()
    aset = AdapterSet(lorahook.torch.geometry_of(model))
    for name, path in dirs.items():
        aset.add(name, LoraAdapter.from_peft(path))
    attached = attach(model, aset)
    with torch.inference_mode(), attached.sequences(names):
        mixed = model(input_ids=ids, **forward).logits.numpy()
    with torch.inference_mode():
        base = model_fn()(input_ids=ids, **forward).logits.numpy()
    for i, name in enumerate(names):
        if name is None:  # the base rows: bit-identical to the model without lorahook
            assert np.array_equal(mixed[i], base[i])
            continue
        with torch.inference_mode():
            ref = _peft_alone(model_fn, dirs[name])(input_ids=ids[i:i + 1], **forward).logits
        _close(mixed[i], ref[0].numpy())
    return model, attached


def _ids(n, length=7, seed=1):
    return torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def test_dora_plain_and_base_in_one_batch_equal_peft_and_generate_the_same_tokens(tmp_path):
    dirs = {"dora": _save(_llama, tmp_path / "dora", 1, r=4, lora_alpha=8, use_dora=True,
                          target_modules=["q_proj", "v_proj", "down_proj", "lm_head"]),
            "plain": _save(_llama, tmp_path / "plain", 2, r=4, lora_alpha=8,
                           target_modules=["q_proj", "o_proj"])}
    assert LoraAdapter.from_peft(dirs["dora"]).has_dora
    names = ["dora", "plain", None]
    model, attached = _mixed_equals_peft(_llama, dirs, names, _ids(3))
    prompt = _ids(3, 5, seed=3)
    with torch.inference_mode(), attached.sequences(names):
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False).numpy()
    for i, name in enumerate(names):
        ref_model = _llama() if name is None else _peft_alone(_llama, dirs[name])
        with torch.inference_mode():
            ref = ref_model.generate(input_ids=prompt[i:i + 1], max_new_tokens=6, do_sample=False)
        ref = ref[0].numpy()  # a sequence that ends early is padded in the batch
        assert np.array_equal(tokens[i][:len(ref)], ref)
        assert (tokens[i][len(ref):] == 0).all()


def test_embedding_and_lm_head_lora_equal_peft_per_sequence(tmp_path):
    dirs = {"emb": _save(_llama, tmp_path / "emb", 3, r=4, lora_alpha=8,
                         target_modules=["embed_tokens", "lm_head", "q_proj"]),
            "head": _save(_llama, tmp_path / "head", 4, r=2, lora_alpha=4,
                          target_modules=["lm_head"])}
    adapter = LoraAdapter.from_peft(dirs["emb"])
    assert adapter.layers[(None, "embed_tokens")].is_embedding
    assert (None, "lm_head") in adapter.layers
    _mixed_equals_peft(_llama, dirs, [None, "emb", "head", "emb"], _ids(4))


def test_llama_sequence_classifier_with_a_saved_score_head(tmp_path):
    def classifier():
        return _llama(transformers.LlamaForSequenceClassification, num_labels=3)

    dirs = {"a": _save(classifier, tmp_path / "a", 5, r=4, lora_alpha=8, task_type="SEQ_CLS",
                       target_modules=["q_proj", "v_proj"]),
            "b": _save(classifier, tmp_path / "b", 6, r=2, lora_alpha=2, task_type="SEQ_CLS",
                       use_dora=True, target_modules=["k_proj"])}
    adapter = LoraAdapter.from_peft(dirs["a"])
    assert set(adapter.saved_modules) == {(None, "score")}
    _mixed_equals_peft(classifier, dirs, ["a", None, "b"], _ids(3))


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48, num_labels=1)
    return transformers.BertForSequenceClassification(config).eval()


def test_bert_cross_encoder_rerankers_mixed_per_row(tmp_path):
    dirs = {f"r{i}": _save(_bert, tmp_path / f"r{i}", 10 + i, r=4, lora_alpha=8,
                           task_type="SEQ_CLS", target_modules=["query", "value"])
            for i in range(3)}
    assert set(LoraAdapter.from_peft(dirs["r0"]).saved_modules) == {(None, "classifier")}
    ids = _ids(4, 9)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding
    model = _bert()
    aset = AdapterSet(lorahook.BertConfig(2, 32, 48, vocab_size=VOCAB, num_labels=1))
    for name, path in dirs.items():
        aset.add(name, LoraAdapter.from_peft(path))
    names = ["r2", "r0", None, "r1"]
    attached = attach(model, aset)
    with torch.inference_mode():
        with attached.sequences(names):
            scores = model(input_ids=ids, attention_mask=mask).logits.numpy()
        base = _bert()(input_ids=ids, attention_mask=mask).logits.numpy()
    for i, name in enumerate(names):
        if name is None:  # the row without a reranker: the base model's, bit for bit
            assert np.array_equal(scores[i], base[i])
            continue
        with torch.inference_mode():
            ref = _peft_alone(_bert, dirs[name])(input_ids=ids[i:i + 1],
                                                 attention_mask=mask[i:i + 1]).logits.numpy()
        _close(scores[i], ref[0])


@pytest.mark.parametrize("kind", ["dora", "embedding", "saved"])
def test_save_peft_round_trips_through_peft(tmp_path, kind):
    if kind == "saved":
        def model_fn():
            return _llama(transformers.LlamaForSequenceClassification, num_labels=3)
        lora = dict(task_type="SEQ_CLS", target_modules=["q_proj"])
    else:
        model_fn = _llama
        lora = dict(use_dora=kind == "dora",
                    target_modules=["embed_tokens", "q_proj"] if kind == "embedding" else ["q_proj", "lm_head"])
    src = _save(model_fn, tmp_path / "src", 7, r=4, lora_alpha=8, **lora)
    adapter = LoraAdapter.from_peft(src)
    out = adapter.save_peft(tmp_path / "out")
    again = LoraAdapter.from_peft(out)
    assert again.nbytes == adapter.nbytes
    ids = _ids(2)
    with torch.inference_mode():
        ref = _peft_alone(model_fn, src)(input_ids=ids).logits.numpy()
        got = _peft_alone(model_fn, out)(input_ids=ids).logits.numpy()
    _close(got, ref)


def test_dora_layer_equals_a_float64_reference_checked_against_peft():
    torch.manual_seed(3)
    base = torch.nn.Linear(24, 40)
    pm = peft.get_peft_model(torch.nn.Sequential(base), peft.LoraConfig(
        r=3, lora_alpha=6, use_dora=True, target_modules=["0"], init_lora_weights=False))
    layer = pm.base_model.model[0]
    with torch.no_grad():
        layer.lora_magnitude_vector["default"].weight.mul_(1.3)
    a = layer.lora_A["default"].weight.detach().numpy().astype(np.float64)
    b = layer.lora_B["default"].weight.detach().numpy().astype(np.float64)
    m = layer.lora_magnitude_vector["default"].weight.detach().numpy().astype(np.float64)
    w = base.weight.detach().numpy().astype(np.float64)
    bias = base.bias.detach().numpy().astype(np.float64)
    scale = 2.0
    x = np.random.default_rng(0).standard_normal((5, 24))
    # DoRA's formula (LoraLayer's docstring) in float64
    g = m / np.linalg.norm(w + scale * b @ a, axis=1)
    y = x @ w.T + bias
    ref = y + (g - 1) * (y - bias) + g * (scale * (x @ a.T) @ b.T)
    with torch.no_grad():
        peft_out = layer(torch.from_numpy(x).float()).numpy()
    _close(peft_out, ref)  # the reference is PEFT's DoRA
    dora = LoraAdapter({(0, "proj"): lorahook.LoraLayer(a, b, scale, magnitude=m)})
    out = y.astype(np.float32)
    with pytest.raises(ValueError, match="DoRA layer without its base weight"):
        lorahook.apply_lora_rows(dora, 0, "proj", x.astype(np.float32), out)
    assert np.array_equal(out, y.astype(np.float32))  # nothing written
    based = dora.with_base({(0, "proj"): (w, bias)})
    lorahook.apply_lora_rows(based, 0, "proj", x.astype(np.float32), out)
    _close(out, ref)


def test_a_4bit_base_weight_is_what_bitsandbytes_dequantizes(tmp_path):
    # PEFT's DoRA dequantizes a Linear4bit on each forward; bitsandbytes' CPU backend repacks
    # the weight on the first forward (scales rounded to bfloat16), after which that
    # dequantization goes wrong, so PEFT's own DoRA on such a base is no reference here.
    # lorahook dequantizes with bitsandbytes before the first forward and measures the
    # module after it: the weight it then computes with.
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    from lorahook.torch.modules import base_of as _base_of
    mods = (model.model.layers[0].self_attn.q_proj, model.model.layers[0].mlp.down_proj)
    want = [bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).numpy() for m in mods]
    for mod, w4 in zip(mods, want):
        w, b = _base_of(mod)
        assert b is None and np.array_equal(w, w4)
    with torch.inference_mode():
        model(input_ids=_ids(1))  # repacks every 4-bit weight
    for mod, w4 in zip(mods, want):
        w, _ = _base_of(mod)
        assert np.abs(w - w4).max() <= 2.0 ** -7 * np.abs(w4).max()


@pytest.mark.parametrize("kind", ["bitsandbytes-8bit", "torchao-int8"])
def test_dora_on_a_quantized_base_equals_peft(tmp_path, kind):
    # PEFT dequantizes the base weight for DoRA's norm; so does attach, once per linear
    def wide():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()

    if kind == "bitsandbytes-8bit":
        pytest.importorskip("bitsandbytes")
        wide().save_pretrained(tmp_path / "base")

        def quantized():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return transformers.AutoModelForCausalLM.from_pretrained(
                    tmp_path / "base", device_map="cpu",
                    quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True)).eval()
    else:
        quantization = pytest.importorskip("torchao.quantization")

        def quantized():
            model = wide()
            quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
            return model

    path = _save(wide, tmp_path / "dora", 9, r=4, lora_alpha=8, use_dora=True,
                 target_modules=["q_proj", "v_proj", "up_proj"])
    model = quantized()
    aset = AdapterSet()
    attached = attach(model, aset)
    aset.add("dora", LoraAdapter.from_peft(path))
    ids = _ids(2)
    with torch.inference_mode():
        bare = model(input_ids=ids).logits.numpy()
        with attached.sequences(["dora", None]):
            got = model(input_ids=ids).logits.numpy()
        ref = _peft_alone(quantized, path)(input_ids=ids[:1]).logits.numpy()
    assert np.array_equal(got[1], bare[1])
    assert np.abs(ref[0] - bare[0]).max() > 1e-2  # the adapter changes the output
    got, ref = got[0].astype(np.float64), ref[0].astype(np.float64)
    assert np.abs(got - ref).max() <= 5e-5 * np.abs(ref).max()
