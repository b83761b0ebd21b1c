"""Adapters on disk: loading a PEFT directory, and what a loaded adapter keeps.

The adapter has the geometry of Qwen3.5-0.8B with rank 16 on every projection (about
43 MB in float32), written once per run in ``setup_cache`` as float32, float16 and
bfloat16 PEFT directories. The files are read once before timing, so the page cache is
warm: these figures are the cost of parsing, checking, converting and copying, not of
the disk.
"""
import json
import os

import numpy as np

from lorahook import LoraAdapter, LoraLayer, Qwen35Config

from . import measured_here
from .bench_rows import qwen35_0_8b


STORE_DTYPES = ("F32", "F16", "BF16")


def qwen_adapter(rank=16, seed=0):
    """A random adapter with Qwen3.5-0.8B's projections, ``rank`` on every one."""
    cfg = Qwen35Config.from_dict(qwen35_0_8b())
    rng = np.random.default_rng(seed)
    layers = {}
    for li in range(cfg.num_hidden_layers):
        for module in cfg.modules_for_layer(li):
            d_in, d_out = cfg.projection_shape(li, module)
            a = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
            b = (rng.standard_normal((d_out, rank)) / np.sqrt(rank)).astype(np.float32)
            layers[(li, module)] = LoraLayer(a, b, 2.0)
    return LoraAdapter(layers, name="qwen35-r16")


def _half_bits(values, dtype):
    """float32 ``values`` rounded to the bits of ``dtype`` (F16 or BF16), as uint16."""
    if dtype == "F16":
        return values.astype(np.float16).view(np.uint16)
    bits = values.view(np.uint32).astype(np.uint64)
    bits += 0x7FFF + ((bits >> 16) & 1)  # round to nearest, ties to even
    return (bits >> 16).astype(np.uint16)


def write_store(root, rank=16):
    """Write the adapter as ``root/F32``, ``root/F16`` and ``root/BF16`` PEFT directories."""
    import safetensors
    from safetensors.numpy import load_file

    adapter = qwen_adapter(rank)
    f32 = os.path.join(root, "F32")
    adapter.save_peft(f32, architecture="qwen3_5")
    weights = load_file(os.path.join(f32, "adapter_model.safetensors"))
    with open(os.path.join(f32, "adapter_config.json")) as f:
        config = json.load(f)
    for dtype, name in (("F16", "float16"), ("BF16", "bfloat16")):
        directory = os.path.join(root, dtype)
        os.makedirs(directory, exist_ok=True)
        bits = {k: np.ascontiguousarray(_half_bits(v, dtype)) for k, v in weights.items()}
        specs = {k: safetensors.TensorSpec(dtype=name, shape=list(v.shape), data_ptr=v.ctypes.data,
                                           data_len=v.nbytes)
                 for k, v in bits.items()}
        safetensors.serialize_file(specs, os.path.join(directory, "adapter_model.safetensors"),
                                   metadata={"format": "pt"})
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    return {dtype: os.path.join(root, dtype) for dtype in STORE_DTYPES}


def _warm(directory):
    with open(os.path.join(directory, "adapter_model.safetensors"), "rb") as f:
        while f.read(1 << 24):
            pass


class Load:
    """``LoraAdapter.from_peft`` of the Qwen3.5-0.8B rank-16 adapter, by dtype on disk."""

    params = [list(STORE_DTYPES)]
    param_names = ["dtype"]
    timeout = 300

    def setup_cache(self):
        if not measured_here(__name__):
            return {}  # setup skips: measured in another environment
        # asv runs this in a directory of its own and removes it after the run
        try:
            return write_store(os.path.abspath("store"))
        except NotImplementedError:  # a version without Qwen3.5's config: setup skips
            return {}

    def setup(self, paths, dtype):
        if not paths:
            raise NotImplementedError
        self.path = paths[dtype]
        _warm(self.path)

    def time_from_peft(self, paths, dtype):
        LoraAdapter.from_peft(self.path)

    def peakmem_from_peft(self, paths, dtype):
        LoraAdapter.from_peft(self.path)

    def track_nbytes(self, paths, dtype):
        return LoraAdapter.from_peft(self.path).nbytes

    track_nbytes.unit = "bytes"

    def track_file_bytes(self, paths, dtype):
        return os.path.getsize(os.path.join(self.path, "adapter_model.safetensors"))

    track_file_bytes.unit = "bytes"

