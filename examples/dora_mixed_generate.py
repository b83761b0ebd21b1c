"""A DoRA adapter, a plain LoRA adapter and the base model in one ``generate`` batch.

    pip install lorahook torch==2.13.0 transformers peft
    python examples/dora_mixed_generate.py

PEFT refuses ``adapter_names`` batches with DoRA adapters, so a PEFT server runs
one ``generate`` per adapter. lorahook serves them together: ``attach`` gives the
DoRA layers the model's own weights (their norm needs them once) and the batch
mixes DoRA rows, plain rows and base rows. The script builds a small random Llama,
saves two PEFT adapters, generates the mixed batch once with lorahook, then each
sequence alone with PEFT, and checks that the tokens agree.
"""
import tempfile

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

import lorahook
from lorahook.torch import attach

SELECTION = ["dora", "plain", None]


def make_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def save_adapter(path, seed, **lora):
    torch.manual_seed(seed)
    model = get_peft_model(make_model(), LoraConfig(init_lora_weights=False, r=8, lora_alpha=16,
                                                    target_modules="all-linear", **lora))
    with torch.no_grad():  # a trained magnitude differs from the base weight's norm
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.1)
    model.save_pretrained(path)


def main():
    lorahook.threads.configure(blas_threads=1)  # the server setting (README, Threads)
    workdir = tempfile.mkdtemp(prefix="lorahook-dora-")
    save_adapter(f"{workdir}/dora", 1, use_dora=True)
    save_adapter(f"{workdir}/plain", 2)

    model = make_model()
    adapters = lorahook.AdapterSet(lorahook.torch.geometry_of(model))
    attached = attach(model, adapters)            # DoRA layers get the model's weights
    for name in ("dora", "plain"):
        adapters.add(name, lorahook.LoraAdapter.from_peft(f"{workdir}/{name}"))
    prompts = torch.randint(1, 128, (len(SELECTION), 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), attached.sequences(SELECTION):
        mixed = model.generate(prompts, max_new_tokens=10, do_sample=False)

    for i, name in enumerate(SELECTION):
        alone = make_model() if name is None else PeftModel.from_pretrained(make_model(), f"{workdir}/{name}")
        with torch.inference_mode():
            ref = alone.generate(prompts[i:i + 1], max_new_tokens=10, do_sample=False)[0]
        same = mixed[i][:len(ref)].tolist() == ref.tolist()
        print(f"{str(name):>6}: {mixed[i, 12:].tolist()}  same as PEFT alone: {same}")
        assert same


if __name__ == "__main__":
    main()
