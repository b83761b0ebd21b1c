"""Multi-tenant generation: four prompts, three adapters and the base model, one batch.

    pip install lorahook torch==2.13.0 transformers
    python examples/multi_tenant_generate.py

A small Qwen3.5 with random weights (the geometry ``lorahook demo`` uses) and
three random adapters written as PEFT directories.  The four prompts are
generated together, each with its own adapter (or none), through one
``attach(model, adapters)`` and ``attached.sequences([...])``; then each
prompt is generated alone with its adapter, and the tokens must agree.

With PEFT the same batch would be::

    peft_model.generate(**batch, adapter_names=["support", "legal", "__base__", "sql"])

With lorahook the base model stays a plain transformers model::

    attached = attach(model, adapters)
    with attached.sequences(["support", "legal", None, "sql"]):
        model.generate(**batch)
"""
import json
import tempfile
from importlib import resources

import numpy as np
import torch
import transformers

import lorahook
from lorahook.torch import attach

SELECTION = ["support", "legal", None, "sql"]
RANKS = {"support": 8, "legal": 16, "sql": 4}


def random_adapter(config, rank, seed):
    """A rank-``rank`` adapter on every projection of ``config``, saved and read as PEFT would."""
    rng = np.random.default_rng(seed)
    layers = {}
    for layer_idx, module, d_in, d_out in config.projections():
        layers[(layer_idx, module)] = lorahook.LoraLayer(
            rng.standard_normal((rank, d_in)) / np.sqrt(d_in),
            rng.standard_normal((d_out, rank)) * 0.5, scale=2.0)
    return lorahook.LoraAdapter(layers)


def main():
    lorahook.threads.configure(blas_threads=1)  # a server setting: see the README's "Threads"
    raw = json.loads(resources.files("lorahook.cli").joinpath("data/qwen3_5_demo.json").read_text())
    geometry = lorahook.Qwen35Config.from_dict(raw)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**raw)).eval()

    adapters = lorahook.AdapterSet(model=geometry)
    with tempfile.TemporaryDirectory(prefix="lorahook-tenants-") as tmp:
        for i, (name, rank) in enumerate(RANKS.items()):
            random_adapter(geometry, rank, seed=i).save_peft(f"{tmp}/{name}", architecture="qwen3_5")
            adapters.add(name, lorahook.LoraAdapter.from_peft(f"{tmp}/{name}"))
    attached = attach(model, adapters)
    print(f"hooked {len(attached)} linears; adapters {adapters.names()}")

    # four prompts of different lengths, left-padded into one batch
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, raw["vocab_size"], n).tolist() for n in (7, 12, 5, 9)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        with attached.sequences(SELECTION):
            batch = model.generate(input_ids=ids, attention_mask=mask, **kw)
        for i, (prompt, name) in enumerate(zip(prompts, SELECTION)):
            with attached.sequences([name]):
                alone = model.generate(input_ids=torch.tensor([prompt]), **kw)
            got = batch[i, width:].tolist()
            want = alone[0, len(prompt):].tolist()
            status = "same tokens" if got == want else "DIFFERENT"
            print(f"prompt {i} ({name or 'base model'}): {got} -- alone: {status}")
            if got != want:
                raise SystemExit(f"prompt {i}: the batch and the lone generation differ")
        base = model.generate(input_ids=ids, attention_mask=mask, **kw)  # outside: base model
        print(f"outside the block the model is the base model: "
              f"{'differs from the adapters' if not torch.equal(base, batch) else 'unchanged?'}")


if __name__ == "__main__":
    main()
