"""A model, tokenizer and PEFT adapters for the vLLM tests and benchmark (made locally)."""
import os

from serve_files import SIZES, save_adapter, save_model

# the tiny model: head_dim 64, which vLLM's CPU attention serves
TINY = dict(hidden=128, layers=2, intermediate=256, heads=2, kv_heads=1)


def save_model_and_adapters(workdir, names, size="tiny", **lora):
    """``(model_dir, adapters_dir, names)``: a random Llama and one adapter per name."""
    shape = TINY if size == "tiny" else SIZES[size]
    model_dir = os.path.join(workdir, f"llama-{size}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        save_model(model_dir, **shape)
    adapters = os.path.join(workdir, "adapters")
    for seed, name in enumerate(names):
        path = os.path.join(adapters, name)
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            save_adapter(path, 100 + seed, shape, **lora)
    return model_dir, adapters, list(names)


def peft_greedy(model_dir, adapter_dir, prompt_ids, max_new_tokens):
    """Greedy tokens of transformers (+ PEFT with ``adapter_dir``), and each step's top-two log-probabilities."""
    import torch
    import transformers
    from peft import PeftModel
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    m = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.inference_mode():
        out = m.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    top2 = [torch.log_softmax(s[0].double(), -1).topk(2).values.tolist() for s in out.scores]
    return out.sequences[0, len(prompt_ids):].tolist(), top2


def assert_same_or_tie(got, ref, ref_top2, tol, what):
    """``got`` equals ``ref`` token for token, or parts from it only where the reference was torn.

    Where the two first differ, the reference's top-two log-probabilities
    must lie within ``tol`` of each other (two nearly equal logits rounded
    apart); after that the sequences are not compared.
    """
    assert len(got) == len(ref), (what, got, ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            gap = ref_top2[i][0] - ref_top2[i][1]
            assert gap <= tol, (f"{what}: token {i} is {g}, the reference's {r} "
                                f"(log-probability gap {gap:.4f})", got, ref)
            return False
    return True
