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


def int8_copy(src, dst):
    """A copy of the PEFT adapter ``src`` at ``dst`` whose LoRA factors hold the values an int8
    slot holds (a scale per row of ``lora_A`` and per output, i.e. per row of ``lora_B``);
    embedding factors, which keep vLLM's slots, as they were."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from lora_refs import int8_values
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "adapter_config.json"), dst)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("lora_A.weight", "lora_B.weight")):  # per row of A, per row of B
            tensors[name] = int8_values(t, 1).astype(np.float32)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return dst


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


# the modules of a Llama decoder layer: (d_in, d_out) from its shape
def _module_shapes(shape):
    h, m = shape["hidden"], shape["intermediate"]
    kv = h // shape["heads"] * shape["kv_heads"]
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv),
            "self_attn.v_proj": (h, kv), "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (h, m), "mlp.up_proj": (h, m), "mlp.down_proj": (m, h)}


# tenants' adapters: each rank on its own modules (PEFT's names)
TENANT_KINDS = [
    (8, ["q_proj", "v_proj", "o_proj", "down_proj"]),
    (16, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]),
    (64, ["q_proj", "v_proj"]),
]


def save_tenants(workdir, count, size="tiny", kinds=TENANT_KINDS):
    """``(adapters_dir, names, nbytes)``: ``count`` PEFT LoRA adapters written directly.

    Adapter ``i`` has the rank and modules of ``kinds[i % len(kinds)]``,
    random ``A`` (PEFT's initialisation scale) and ``B`` in bfloat16 files;
    ``nbytes`` is every adapter's parameter count, in elements, summed (times
    the model dtype's size, the bytes they hold).  Written without building a
    model, so hundreds take seconds.
    """
    import json

    import torch
    from safetensors.torch import save_file

    shape = TINY if size == "tiny" else SIZES[size]
    shapes = _module_shapes({"intermediate": 2 * shape["hidden"], "heads": 4, "kv_heads": 2,
                             **shape})
    adapters = os.path.join(workdir, f"tenants-{size}")
    names, elements = [], 0
    for i in range(count):
        rank, targets = kinds[i % len(kinds)]
        name = f"t{i:04d}-r{rank}"
        names.append(name)
        path = os.path.join(adapters, name)
        tensors = {}
        g = torch.Generator().manual_seed(1000 + i)
        for layer in range(shape["layers"]):
            for module, (d_in, d_out) in shapes.items():
                if module.split(".")[-1] not in targets:
                    continue
                key = f"base_model.model.model.layers.{layer}.{module}"
                a = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
                b = torch.randn(d_out, rank, generator=g) * (0.5 / rank ** 0.5)
                tensors[key + ".lora_A.weight"] = a.to(torch.bfloat16)
                tensors[key + ".lora_B.weight"] = b.to(torch.bfloat16)
                elements += a.numel() + b.numel()
        if not os.path.exists(os.path.join(path, "adapter_config.json")):
            os.makedirs(path, exist_ok=True)
            save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                           "lora_alpha": 2 * rank, "target_modules": targets,
                           "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": "",
                           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
                           "modules_to_save": None}, f)
    return adapters, names, elements
