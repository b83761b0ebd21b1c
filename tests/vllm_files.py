"""A model, tokenizer and PEFT adapters for the vLLM tests and benchmark (made locally)."""
import os

from lorahook._bench_serve import SIZES, save_adapter, save_model

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
