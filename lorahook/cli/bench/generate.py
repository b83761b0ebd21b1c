"""Mixed-adapter ``generate``: lorahook against the base model and PEFT's ``adapter_names``.

One scenario, shared by ``lorahook bench``, ``benchmarks/compare.py`` and the
asv suite: a random Qwen3.5 (hidden 512, intermediate 1408, 4 layers -- three
Gated DeltaNet, one full attention --, vocab 256, 8 heads, 2 KV heads, head
dim 64, linear attention 4 key / 8 value heads of dims 32), float32, torch on
2 threads; 4 prompts of 24 tokens, 16 new tokens, greedy.  Three adapters
(ranks 8, 16 with rsLoRA, and 16) cover every projection; the batch selects
``["a", "b", None, "c"]``.  Contenders, each a whole ``generate``:

* ``base``: the model without adapters;
* ``peft``: a ``peft.PeftModel`` holding the three adapters,
  ``generate(..., adapter_names=["a", "b", "__base__", "c"])``;
* ``lorahook``: the base model attached to an :class:`~lorahook.AdapterSet`,
  ``with attached.sequences(["a", "b", None, "c"]): generate(...)``.

With ``quant`` the base is quantized, the same way for every contender
(each gets its own copy): ``"bnb-4bit"`` (bitsandbytes NF4, float32 compute,
loaded with ``BitsAndBytesConfig`` and ``device_map="cpu"``; PEFT's
``Linear4bit`` LoRA layers) or ``"torchao-int8"`` (torchao ``quantize_`` with
int8 weight-only; PEFT's torchao layers).

The contenders run in turn, one ``generate`` each per round, so a slow
spell on a shared machine lands on all of them; the figures are medians over
rounds.  Needs torch, transformers and peft, and the quantization library
for ``quant`` (``ImportError`` otherwise).
"""
import copy
import tempfile
import time

import numpy as np

__all__ = ["GENERATE_CONFIG", "QUANTIZED", "build", "run", "format_report"]

GENERATE_CONFIG = dict(
    vocab_size=256, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=512,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
           "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a": dict(r=8, lora_alpha=16),
            "b": dict(r=16, lora_alpha=32, use_rslora=True),
            "c": dict(r=16, lora_alpha=16)}
SELECTION = ["a", "b", None, "c"]
PROMPT, NEW_TOKENS = 24, 16
QUANTIZED = ("bnb-4bit", "torchao-int8")


def _quantized_copies(base, workdir, quant, n):
    """``n`` copies of ``base`` quantized as ``quant`` (see the module docstring)."""
    import torch
    import transformers

    if quant == "bnb-4bit":
        import bitsandbytes  # noqa: F401  (ImportError when it is missing)
        base.save_pretrained(f"{workdir}/base")
        config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        return [transformers.AutoModelForCausalLM.from_pretrained(
            f"{workdir}/base", quantization_config=config, device_map="cpu").eval()
            for _ in range(n)]
    if quant == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        copies = [copy.deepcopy(base) for _ in range(n)]
        for model in copies:
            quantize_(model, Int8WeightOnlyConfig())
        return copies
    raise ValueError(f"quant must be None or one of {QUANTIZED}, got {quant!r}")


def build(workdir, dtype="float32", quant=None):
    """The model, PEFT's model and lorahook's attachment; adapters saved under ``workdir``.

    ``dtype`` (``"float32"`` or ``"bfloat16"``) is the models' dtype; PEFT
    keeps its defaults for that dtype, lorahook its float32 adapters.  With
    ``quant`` (one of :data:`QUANTIZED`) the three models are quantized
    float32 bases.
    """
    import peft
    import torch
    import transformers

    from ... import AdapterSet, LoraAdapter
    from ...torch import attach

    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(**GENERATE_CONFIG)
    base = transformers.Qwen3_5ForCausalLM(config).float().eval()
    for i, (name, lora) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            init_lora_weights=False, target_modules=TARGETS, **lora))
        model.save_pretrained(f"{workdir}/{name}")
    if quant is not None:
        if dtype != "float32":
            raise ValueError(f"quantized scenarios run float32 activations, got dtype={dtype!r}")
        base, for_peft, hooked = _quantized_copies(base, workdir, quant, 3)
    else:
        base = base.to(getattr(torch, dtype))
        for_peft, hooked = copy.deepcopy(base), copy.deepcopy(base)
    peft_model = peft.PeftModel.from_pretrained(for_peft, f"{workdir}/a", adapter_name="a")
    for name in ("b", "c"):
        peft_model.load_adapter(f"{workdir}/{name}", adapter_name=name)
    peft_model.eval()
    adapters = AdapterSet()
    attached = attach(hooked, adapters)
    for name in ADAPTERS:
        adapters.add(name, LoraAdapter.from_peft(f"{workdir}/{name}"))
    torch.manual_seed(1)
    inputs = dict(input_ids=torch.randint(1, GENERATE_CONFIG["vocab_size"], (4, PROMPT)),
                  attention_mask=torch.ones((4, PROMPT), dtype=torch.long))
    return base, peft_model, hooked, attached, inputs


def contenders(base, peft_model, hooked, attached, inputs):
    """``name -> zero-argument callable`` running one ``generate``."""
    import torch

    kw = dict(inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0)
    peft_names = ["__base__" if n is None else n for n in SELECTION]

    def run_base():
        with torch.inference_mode():
            return base.generate(**kw)

    def run_peft():
        with torch.inference_mode():
            return peft_model.generate(**kw, adapter_names=peft_names)

    def run_lorahook():
        with torch.inference_mode(), attached.sequences(SELECTION):
            return hooked.generate(**kw)

    return {"base": run_base, "peft": run_peft, "lorahook": run_lorahook}


def timed(calls, rounds):
    """Each call once (a warm-up, whose results are returned), then ``rounds`` rounds of
    every call in turn; returns ``(results, median seconds by name)``."""
    outs = {name: fn() for name, fn in calls.items()}
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return outs, {name: float(np.median(t)) for name, t in times.items()}


def run(rounds=7, torch_threads=2, dtype="float32", quant=None):
    """Time the three contenders; returns a dict of medians (seconds) and ratios."""
    import torch

    from ... import threads

    previous = threads.configure(blas_threads=1)
    old = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        with tempfile.TemporaryDirectory(prefix="lorahook-bench-") as workdir:
            outs, med = timed(contenders(*build(workdir, dtype, quant)), rounds)
    finally:
        torch.set_num_threads(old)
        threads.configure(blas_threads=previous)
    return {
        "median": med,
        "lorahook/base": med["lorahook"] / med["base"],
        "lorahook/peft": med["lorahook"] / med["peft"],
        "peft/base": med["peft"] / med["base"],
        "same_tokens": outs["lorahook"].tolist() == outs["peft"].tolist(),
        "rounds": rounds,
        "torch_threads": torch_threads,
        "dtype": dtype,
        "quant": quant,
    }


def format_report(res):
    """Lines for :func:`run`'s result."""
    med = res["median"]
    return "\n".join([
        f"mixed-batch generate (4 sequences: 3 adapters + base, prompt {PROMPT}, {NEW_TOKENS} new "
        f"tokens, random Qwen3.5 hidden 512 x 4 layers, {res.get('dtype', 'float32')}"
        f"{', base ' + res['quant'] if res.get('quant') else ''}, torch "
        f"{res['torch_threads']} "
        f"threads; medians of {res['rounds']} rounds):",
        f"  base {med['base'] * 1e3:.1f} ms, PEFT adapter_names {med['peft'] * 1e3:.1f} ms, "
        f"lorahook sequences {med['lorahook'] * 1e3:.1f} ms",
        f"  lorahook/base {res['lorahook/base']:.3f}, lorahook/PEFT {res['lorahook/peft']:.3f}, "
        f"PEFT/base {res['peft/base']:.3f}; same tokens as PEFT: "
        f"{'yes' if res['same_tokens'] else 'NO'}",
    ])
