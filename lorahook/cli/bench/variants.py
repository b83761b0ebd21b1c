"""Adapters beyond plain LoRA, timed against PEFT: DoRA in ``generate``, BERT rerankers.

Two scenarios, shared by ``benchmarks/variants.py``, the asv suite and the
examples; both build random models locally (nothing is downloaded):

* **DoRA generate** -- the random Qwen3.5 of :mod:`lorahook.cli.bench.generate`
  (float32, torch on 2 threads), two adapters on every projection, ``dora``
  (``use_dora``, rank 16) and ``plain`` (rank 16), and three prompts of 24
  tokens, 16 new tokens, greedy, selecting ``["dora", "plain", None]``.
  lorahook runs one ``generate`` for the mixed batch; PEFT cannot mix DoRA
  adapters in a batch (``adapter_names`` refuses DoRA), so it runs three, one
  per sequence, with that adapter active (and the base with the adapters
  disabled).
* **cross-encoder** -- a random BERT sequence classifier (hidden 384, 6
  layers, intermediate 1536, one label: a reranker's score), four reranker
  adapters (rank 8 on query/key/value/attention output, the ``classifier``
  head in ``modules_to_save``), 32 query-passage pairs of 64 tokens, each
  scored by the reranker of its row (eight rows per adapter, interleaved).
  lorahook scores the batch in one forward; PEFT runs ``adapter_names`` with
  the same per-row names.

Contenders run in turn, one call each per round; figures are medians.  Needs
torch, transformers and peft (``ImportError`` otherwise).
"""
import copy
import tempfile

from .generate import GENERATE_CONFIG, TARGETS, timed as _timed

__all__ = ["build_dora", "dora_contenders", "build_rerankers", "reranker_contenders", "run",
           "format_report"]

DORA_SELECTION = ["dora", "plain", None]
PROMPT, NEW_TOKENS = 24, 16
BERT = dict(vocab_size=512, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
            intermediate_size=1536, num_labels=1)
RERANKERS = ("news", "code", "legal", "medical")
PAIRS, PAIR_TOKENS = 32, 64


def _saved_adapter(model, path, seed, **lora):
    """Save a PEFT adapter with random factors (DoRA magnitudes off the base norm)."""
    import peft
    import torch

    torch.manual_seed(seed)
    pm = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.rand_like(p))
            elif "modules_to_save" in name:
                p.add_(0.1 * torch.randn_like(p))
    pm.save_pretrained(path)


def build_dora(workdir):
    """``(hooked model, attached, PEFT model, inputs)`` of the DoRA scenario."""
    import peft
    import torch
    import transformers

    from ... import AdapterSet, LoraAdapter
    from ...torch import attach

    torch.manual_seed(0)
    base = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**GENERATE_CONFIG)).eval()
    _saved_adapter(copy.deepcopy(base), f"{workdir}/dora", 1, r=16, lora_alpha=32,
                   use_dora=True, target_modules=TARGETS)
    _saved_adapter(copy.deepcopy(base), f"{workdir}/plain", 2, r=16, lora_alpha=32,
                   target_modules=TARGETS)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{workdir}/dora",
                                                adapter_name="dora")
    peft_model.load_adapter(f"{workdir}/plain", adapter_name="plain")
    peft_model.eval()
    adapters = AdapterSet()
    attached = attach(base, adapters)  # DoRA layers get the model's weights on install
    for name in ("dora", "plain"):
        adapters.add(name, LoraAdapter.from_peft(f"{workdir}/{name}"))
    torch.manual_seed(1)
    ids = torch.randint(1, GENERATE_CONFIG["vocab_size"], (len(DORA_SELECTION), PROMPT))
    return base, attached, peft_model, ids


def dora_contenders(base, attached, peft_model, ids):
    """``name -> callable`` running the scenario; each returns the tokens per sequence."""
    import torch

    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0)

    def run_lorahook():
        with torch.inference_mode(), attached.sequences(DORA_SELECTION):
            return base.generate(input_ids=ids, **kw)

    def run_peft():  # one generate per sequence: PEFT cannot mix DoRA adapters in a batch
        out = []
        with torch.inference_mode():
            for i, name in enumerate(DORA_SELECTION):
                if name is None:
                    with peft_model.disable_adapter():
                        out.append(peft_model.generate(input_ids=ids[i:i + 1], **kw))
                else:
                    peft_model.set_adapter(name)
                    out.append(peft_model.generate(input_ids=ids[i:i + 1], **kw))
        return torch.cat(out)

    return {"peft": run_peft, "lorahook": run_lorahook}


def build_rerankers(workdir):
    """``(hooked model, attached, PEFT model, inputs, names)`` of the cross-encoder scenario."""
    import peft
    import torch
    import transformers

    from ... import AdapterSet, BertConfig, LoraAdapter
    from ...torch import attach

    torch.manual_seed(0)
    base = transformers.BertForSequenceClassification(transformers.BertConfig(**BERT)).eval()
    for i, name in enumerate(RERANKERS):
        _saved_adapter(copy.deepcopy(base), f"{workdir}/{name}", 10 + i, r=8, lora_alpha=16,
                       task_type="SEQ_CLS",
                       target_modules=["query", "key", "value", "attention.output.dense"])
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{workdir}/{RERANKERS[0]}",
                                                adapter_name=RERANKERS[0])
    for name in RERANKERS[1:]:
        peft_model.load_adapter(f"{workdir}/{name}", adapter_name=name)
    peft_model.eval()
    adapters = AdapterSet(BertConfig(BERT["num_hidden_layers"], BERT["hidden_size"],
                                     BERT["intermediate_size"], vocab_size=BERT["vocab_size"],
                                     num_labels=BERT["num_labels"]))
    for name in RERANKERS:
        adapters.add(name, LoraAdapter.from_peft(f"{workdir}/{name}"))
    attached = attach(base, adapters)
    torch.manual_seed(1)
    inputs = dict(input_ids=torch.randint(1, BERT["vocab_size"], (PAIRS, PAIR_TOKENS)),
                  attention_mask=torch.ones((PAIRS, PAIR_TOKENS), dtype=torch.long))
    names = [RERANKERS[i % len(RERANKERS)] for i in range(PAIRS)]
    return base, attached, peft_model, inputs, names


def reranker_contenders(base, attached, peft_model, inputs, names):
    """``name -> callable`` scoring the batch; each returns the scores."""
    import torch

    def run_lorahook():
        with torch.inference_mode(), attached.sequences(names):
            return base(**inputs).logits

    def run_peft():
        with torch.inference_mode():
            return peft_model(**inputs, adapter_names=names).logits

    return {"peft": run_peft, "lorahook": run_lorahook}


def run(rounds=5, torch_threads=2):
    """Time both scenarios; a dict of medians (seconds), ratios and agreement checks."""
    import torch

    from ... import threads

    previous = threads.configure(blas_threads=1)
    old = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        with tempfile.TemporaryDirectory(prefix="lorahook-bench-") as workdir:
            outs, dora = _timed(dora_contenders(*build_dora(workdir)), rounds)
            same_tokens = outs["lorahook"].tolist() == outs["peft"].tolist()
            scores, rerank = _timed(reranker_contenders(*build_rerankers(workdir)), rounds)
            err = float((scores["lorahook"] - scores["peft"]).abs().max())
    finally:
        torch.set_num_threads(old)
        threads.configure(blas_threads=previous)
    return {"dora": dora, "rerank": rerank, "same_tokens": same_tokens, "score_err": err,
            "rounds": rounds, "torch_threads": torch_threads}


def format_report(res):
    d, r = res["dora"], res["rerank"]
    return "\n".join([
        f"DoRA + plain + base in one generate (3 sequences, prompt {PROMPT}, {NEW_TOKENS} new "
        f"tokens; medians of {res['rounds']} rounds, torch {res['torch_threads']} threads):",
        f"  lorahook one mixed batch {d['lorahook'] * 1e3:.1f} ms, PEFT one generate per "
        f"sequence {d['peft'] * 1e3:.1f} ms: lorahook/PEFT {d['lorahook'] / d['peft']:.3f}; "
        f"same tokens: {'yes' if res['same_tokens'] else 'NO'}",
        f"BERT cross-encoder, {len(RERANKERS)} rerankers mixed per row ({PAIRS} pairs of "
        f"{PAIR_TOKENS} tokens, saved classifier heads):",
        f"  lorahook {r['lorahook'] * 1e3:.1f} ms, PEFT adapter_names {r['peft'] * 1e3:.1f} ms: "
        f"lorahook/PEFT {r['lorahook'] / r['peft']:.3f}; max score difference "
        f"{res['score_err']:.2e}",
    ])
