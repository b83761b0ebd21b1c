"""The modules of a PyTorch model that :mod:`lorahook.torch` hooks, and their base weights.

Which linears and embeddings lorahook hooks (float ``nn.Linear`` and
``nn.Embedding`` on the CPU, the quantized linears of torchao, bitsandbytes,
optimum-quanto and torch's dynamic quantization, recognised by class without
importing their libraries), their ``(d_in, d_out)``, and a hooked linear's
base weight as float32 (for DoRA), dequantized by its own library or measured.
torch is imported inside the functions that need it.
"""

__all__ = ["QUANTIZED_LINEARS", "SUPPORTED_LINEARS", "class_name", "linear_kind",
           "hookable_modules", "shape_of", "dequantized", "base_of", "base_weights"]

# Quantized linear classes, by (module path, class name) anywhere in a module's
# MRO: recognised without importing their libraries.
QUANTIZED_LINEARS = {
    ("bitsandbytes.nn.modules", "Linear8bitLt"): "bitsandbytes 8-bit",
    ("bitsandbytes.nn.modules", "Linear4bit"): "bitsandbytes 4-bit",
    ("optimum.quanto.nn.qlinear", "QLinear"): "optimum-quanto",
    ("torch.ao.nn.quantized.dynamic.modules.linear", "Linear"): "torch dynamic int8",
}
SUPPORTED_LINEARS = ("torch.nn.Linear (float32, bfloat16 or float16 weights, or a torchao "
                      "quantized weight), bitsandbytes Linear8bitLt / Linear4bit, optimum-quanto "
                      "QLinear and torch.ao.nn.quantized.dynamic.Linear")


def class_name(obj):
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def linear_kind(mod, path):
    """What kind of linear ``mod`` is (``"float"``, ``"torchao"``, ...), or ``None`` if none lorahook hooks.

    ``TypeError`` for a float ``nn.Linear`` lorahook cannot serve (a float64
    weight, a weight on another device).
    """
    import torch
    from torch import nn

    for cls in type(mod).__mro__:
        kind = QUANTIZED_LINEARS.get((cls.__module__, cls.__name__))
        if kind is not None:
            return kind
    if isinstance(mod, nn.Embedding):
        if mod.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16) \
                or mod.weight.device.type != "cpu":
            raise TypeError(f"lorahook.torch: {path}: weight is {mod.weight.dtype} on "
                            f"{mod.weight.device}; an nn.Embedding must have float32, bfloat16 "
                            f"and float16 weights on the CPU")
        return "embedding"
    if type(mod) is not nn.Linear:
        return None
    weight = mod.weight
    if type(weight) not in (torch.Tensor, nn.Parameter):
        return "torchao" if type(weight).__module__.startswith("torchao.") else None
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"lorahook.torch: {path}: weight is {weight.dtype}; a float nn.Linear "
                        f"must have float32, bfloat16 and float16 weights")
    if weight.device.type != "cpu":
        raise TypeError(f"lorahook.torch: {path}: weight is on {weight.device}, expected the CPU")
    return "float"


def hookable_modules(model, resolve):
    """``({path: key}, {key: (path, class name)})``: the hookable and the other mapped modules."""
    found, unsupported, where = {}, {}, {}
    for path, mod in model.named_modules():
        if ".lora_A" in path or ".lora_B" in path or path.endswith(".base_layer"):
            raise TypeError(f"lorahook.torch: {path}: the model already carries PEFT LoRA layers; "
                            f"attach lorahook to the base model instead")
        key = resolve(path)
        if key is None:
            continue
        key = (None if key[0] is None else int(key[0]), str(key[1]))
        if linear_kind(mod, path) is None:
            unsupported.setdefault(key, (path, class_name(mod)))
            continue
        if key in where:
            raise ValueError(f"lorahook.torch: {path} and {where[key]} both map to {key}")
        found[path] = where[key] = key
    return found, {k: v for k, v in unsupported.items() if k not in where}


def shape_of(mod):
    """``(d_in, d_out)`` of a hooked module: a linear's features, an embedding's table."""
    if hasattr(mod, "num_embeddings"):
        return int(mod.num_embeddings), int(mod.embedding_dim)
    return int(mod.in_features), int(mod.out_features)


def dequantized(mod):
    """A quantized linear's weight dequantized by its own library, or ``None``.

    bitsandbytes 8-bit and 4-bit (before its CPU backend repacks a 4-bit
    weight on the first forward, with its scales rounded to bfloat16; after
    that, ``None``: the module is measured), and weights that dequantize
    themselves (torchao, quanto, torch's dynamic quantized ``Linear``).  The
    library is the one that made the module, already imported.
    """
    import sys
    weight = getattr(mod, "weight", None)
    if linear_kind(mod, "") == "bitsandbytes 4-bit":
        state = weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            return None  # repacked (scales now bfloat16): measured as it computes
        return sys.modules["bitsandbytes.functional"].dequantize_4bit(weight.data, state)
    if linear_kind(mod, "") == "bitsandbytes 8-bit":  # int8 rows, one scale per row
        scb = getattr(weight, "SCB", None)
        if scb is None or weight.dtype != sys.modules["torch"].int8:
            return None
        return weight.data.float() * (scb.float()[:, None] / 127.0)
    if callable(weight) and not hasattr(weight, "dequantize"):  # torch dynamic: weight()
        weight = weight()
    dequantize = getattr(weight, "dequantize", None)
    return dequantize() if callable(dequantize) else None


def base_of(mod):
    """``(W, b)`` of a hooked linear as float32 arrays, dequantized once.

    A float ``nn.Linear`` gives its own weight; a quantized one its library's
    dequantization (as PEFT's DoRA does), or, for a library lorahook does not
    know how to ask, the module is measured by running it (``b = f(0)``,
    ``W = (f(I) - b)^T``): the weight it computes with.
    """
    import torch
    d_in, d_out = shape_of(mod)
    with torch.inference_mode():
        weight = getattr(mod, "weight", None)
        bias = getattr(mod, "bias", None)
        if callable(bias):  # torch's dynamic quantized Linear
            bias = bias()
        bias = None if bias is None else bias.detach().float().numpy().copy()
        if type(mod) is torch.nn.Linear and type(weight) in (torch.Tensor, torch.nn.Parameter):
            return weight.detach().float().numpy().copy(), bias
        w = dequantized(mod)
        if w is not None and tuple(w.shape) == (d_out, d_in):
            return w.detach().float().numpy().copy(), bias
        dtype = next((p.dtype for p in mod.parameters() if p.is_floating_point()), torch.float32)
        probe = torch.cat([torch.zeros(1, d_in, dtype=dtype), torch.eye(d_in, dtype=dtype)])
        out = mod(probe).float()
        b = out[0]
        w = (out[1:] - b).T.contiguous().numpy().copy()
        return w, (b.numpy().copy() if bool((b != 0).any()) else None)


def base_weights(model, found):
    """A ``with_base`` callable reading each DoRA layer's base from the model (once per key)."""
    paths = {key: path for path, key in found.items()}
    cache = {}

    def lookup(layer_idx, module):
        key = (layer_idx, module)
        if key not in cache:
            path = paths.get(key)
            if path is None:
                return None
            cache[key] = base_of(model.get_submodule(path))
        return cache[key]

    return lookup
