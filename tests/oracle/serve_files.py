"""The server tests' files (made by lorahook._bench_serve) and a PEFT reference."""
from lorahook._bench_serve import model, save_adapter, save_all, save_model, tokenizer  # noqa: F401


def peft_reference(model_dir, adapter_dir, prompt_ids, max_new_tokens):
    """Greedy tokens of transformers (+ PEFT with ``adapter_dir``) for one prompt."""
    import torch
    import transformers
    from peft import PeftModel
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    m = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.inference_mode():
        out = m.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=2)
    return out[0, len(prompt_ids):].tolist()
