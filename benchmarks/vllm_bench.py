"""lorahook inside vLLM, measured: per projection, and end to end.

``python benchmarks/vllm_bench.py ops`` times one projection's mixed-adapter
delta on vLLM's stacked slot tensors: vLLM's CPU torch ops (what its CPU
punica wrapper runs: ``bgmv_shrink`` + ``bgmv_expand_slice``) against
lorahook's ``apply_slots`` with the step's ``SlotRows``, one thread each,
the same data, timed in alternation; medians and their ratio.

``python benchmarks/vllm_bench.py serve [--mode offline|server]`` starts vLLM on a
random 0.5B-shaped Llama (hidden 896, 24 layers, MLP 4864, 14 heads, 2 KV
heads, float32) with 8 PEFT adapters of rank 8 on ``q_proj v_proj o_proj
down_proj``, one compute thread, and sends 64 requests x 32 greedy tokens:
offline ``LLM.generate`` and the OpenAI server, each with lorahook, with
vLLM's own kernels (``VLLM_PLUGINS=none``), the same engine without adapters,
and vLLM without ``--enable-lora``.  Requests per second.

Run it with the OpenBLAS overrides of this machine unset, in that command
only: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/vllm_bench.py ops``.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

# rows, d_in, d_out, rank, adapters
OP_SHAPES = [
    (8, 896, 896, 8, 8),
    (64, 896, 4864, 8, 8),
    (64, 4096, 4096, 16, 8),
    (256, 1024, 3584, 16, 8),
    (512, 4096, 4096, 16, 4),
]


def _median_pair(f, g, repeat):
    tf, tg = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        t1 = time.perf_counter()
        g()
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        tg.append(t2 - t1)
    return statistics.median(tf), statistics.median(tg)


def ops(repeat=30, dtype="float32"):
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    from lorahook._stacked import SlotRows, apply_slots

    torch.set_num_threads(1)
    tdt = getattr(torch, dtype)
    half = None if dtype == "float32" else dtype
    rows_out = []
    with threadpool_limits(1):
        blas = [f"{i['internal_api']} {i.get('version')} {i.get('architecture')}"
                for i in threadpool_info() if i.get("user_api") == "blas"]
        for n, d_in, d_out, rank, adapters in OP_SHAPES:
            g = torch.Generator().manual_seed(n + d_in)
            a = (torch.randn(adapters, 1, rank, d_in, generator=g) * 0.05).to(tdt)
            b = (torch.randn(adapters, 1, d_out, rank, generator=g) * 0.05).to(tdt)
            x = torch.randn(n, d_in, generator=g).to(tdt)
            y1 = torch.zeros(n, d_out, dtype=tdt)
            y2 = torch.zeros(n, d_out, dtype=tdt)
            idx = torch.arange(n) % adapters
            idx = idx[torch.randperm(n, generator=g)]

            def torch_ops():
                buf = torch.zeros(n, rank, dtype=torch.float32)
                bgmv_shrink(x, a, buf, idx, 1.0)
                bgmv_expand_slice(buf, b, y1, idx, 0, d_out, True)

            def view(t):
                return t.numpy() if half is None else t.view(torch.int16).numpy().view(np.uint16)
            # what lorahook.vllm hands the kernel: A as vLLM keeps it (float32 A is not
            # copied), B transposed once per adapter activation (float32), made here once
            av = (view(a) if half is None else a.float().numpy()).reshape(adapters, rank, d_in)
            btv = np.ascontiguousarray(b.float().numpy().reshape(adapters, d_out, rank)
                                       .transpose(0, 2, 1))
            xv, yv = view(x), view(y2)

            def lorahook_op():
                # the grouping is built once per step in vLLM; here once per call (an upper bound)
                apply_slots(SlotRows(idx.numpy(), adapters), xv, yv, av, bt=btv, half=half)

            torch_ops(), lorahook_op()
            t_v, t_l = _median_pair(torch_ops, lorahook_op, repeat)
            y1.zero_(), y2.zero_()
            torch_ops(), lorahook_op()
            err = float((y1.float() - y2.float()).abs().max() / y1.float().abs().max())
            rows_out.append(dict(rows=n, d_in=d_in, d_out=d_out, rank=rank, adapters=adapters,
                                 vllm_us=t_v * 1e6, lorahook_us=t_l * 1e6, ratio=t_l / t_v,
                                 rel_diff=err))
    print(f"kernel BLAS: {'; '.join(blas)}; dtype {dtype}; one thread")
    print("| rows, projection, adapters | vLLM torch ops | lorahook apply_slots | ratio |")
    print("|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['rows']} rows {r['d_in']}->{r['d_out']} r{r['rank']}, {r['adapters']} adapters "
              f"| {r['vllm_us']:.0f} us | {r['lorahook_us']:.0f} us | {r['ratio']:.3f} |")
    return rows_out


# --------------------------------------------------------------------------- end to end

def make_files(workdir, adapters=8):
    """The 0.5B-shaped model, its tokenizer and the adapters (made once, kept in workdir)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from vllm_files import save_model_and_adapters
    return save_model_and_adapters(workdir, [f"a{i}" for i in range(adapters)], size="0.5b")


def serve(workdir, modes=("offline", "server"), requests=64, max_tokens=32):
    model_dir, adapter_dir, names = make_files(workdir)
    from vllm_run import launch  # tests/, on the path since make_files
    results = {}
    cases = [("lorahook", {}, True, True), ("vllm own", {"VLLM_PLUGINS": "none"}, True, True),
             ("lorahook, no adapters", {}, True, False),
             ("vllm own, no adapters", {"VLLM_PLUGINS": "none"}, True, False),
             ("vllm without --enable-lora", {"VLLM_PLUGINS": "none"}, False, False)]
    for mode in modes:
        for label, env, enable, use in cases:
            spec = dict(mode=mode, model=model_dir, adapters=adapter_dir,
                        names=names if use else [], enable_lora=enable, requests=requests,
                        max_tokens=max_tokens, max_loras=8, max_lora_rank=8, bench=True)
            out, _ = launch(spec, {"VLLM_CPU_KVCACHE_SPACE":
                                   os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **env})
            results[(mode, label)] = out["requests_per_s"]
            print(f"{mode:8s} {label:28s} {out['requests_per_s']:.2f} requests/s", flush=True)
    for mode in modes:
        lh, own = results[(mode, "lorahook")], results[(mode, "vllm own")]
        base = results[(mode, "lorahook, no adapters")]
        print(f"{mode}: lorahook / vLLM's own LoRA = {lh / own:.2f}; "
              f"lorahook / same engine without adapters = {lh / base:.2f}")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["ops", "serve"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mode", choices=["offline", "server", "both"], default="both")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if args.what == "ops":
        ops(dtype=args.dtype)
    else:
        workdir = args.workdir or tempfile.mkdtemp(prefix="lorahook-vllm-bench-")
        serve(workdir, ("offline", "server") if args.mode == "both" else (args.mode,))


if __name__ == "__main__":
    main()
