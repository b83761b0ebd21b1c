"""Side-by-side throughput comparison (``lorahook bench``, ``benchmarks/compare.py``).

Everything runs in one process.  Each contender is timed in its own block
after a short pause, so that the previous contender's BLAS / OpenMP worker
threads have stopped spinning; a block is a warm-up call and then repeated
samples (fast calls are grouped so that one sample lasts at least ~0.2 ms)
and its median per call.  The single-projection scenarios run three rounds
of one block per contender in turn (the mixed batch too) and report each
contender's median of its block medians, so that a slow spell on a shared
machine does not land on one contender only.  The run starts with
``lorahook.threads.configure(blas_threads=1)`` (the documented server
setting: SciPy's BLAS, which lorahook calls, on one thread); numpy's BLAS and
torch run as they start.  The server loop is also timed with SciPy's BLAS as
the process found it (lorahook's default: nothing configured) and both
figures are printed.  Contenders:

* lorahook: ``apply_lora_rows`` with a :class:`~lorahook.LoraAdapter`;
* numpy, batched: ``y += s * ((X @ A.T) @ B.T)``;
* PyTorch, batched (when torch imports):
  ``y.add_(F.linear(F.linear(X, A), B), alpha=s)``;
* for the mixed batch, PEFT's ``adapter_names=`` forward on an ``nn.Linear``
  holding the same adapters, with the base layer's forward replaced by one
  returning zeros (LoRA part only).

In the server loop, base and hooked passes alternate one at a time and
"added" is the median, over adjacent pairs, of hooked time / base time - 1;
"hook calls" is the time spent inside ``apply_lora_rows`` in the
hooked loop (timed per call), which is far less sensitive to other load on
the machine.

"Two Python threads": two callers at once against one, each call on its
own thread (lorahook's kernels run on the calling thread).

GFLOP/s count ``2 * rows * rank * (d_in + d_out)`` and are compared with
this machine's own ``sgemm`` peak (1024^3, SciPy's BLAS at its thread
count, one by default: a one-core peak) measured in the same run.  The BLAS libraries and thread
counts in use (threadpoolctl) are printed with the table.

How the sgemv/sgemm crossover was chosen
----------------------------------------
With one lorahook thread and SciPy's BLAS on one thread, ``apply_lora_rows``
was timed with the crossover forced to 1 (sgemm pair for every batch) and to
infinity (two sgemv per row) for ``(d_in, d_out, rank)`` in {1024->1024 r16,
1024->3584 r16, 4096->4096 r16, 2048->2048 r8, 1024->1024 r64,
4096->4096 r64} and 4-96 rows (median of 150 calls each).  With ``B`` kept
transposed, so that ``y += s B t`` is an ``'N'`` sgemv, the row loop is the
faster path for longer than one might guess: the time ratio sgemm/sgemv was
1.9-2.1 at 8 rows, 1.3-1.7 at 16, 0.8-1.7 at 32 (below 1 only at rank 64) and
0.7-1.2 at 48-96 rows.  The default crossover is 32 rows, where the two paths
are within about 15% of each other at ranks 8-64;
:func:`lorahook._core.segments.set_gemm_crossover` changes it.
"""
import argparse
import os
import platform
import sys

import numpy as np

from .rows import (Timer, adapter_dtypes, bind_cost, half, import_torch, mixed, seeded_rng, server_loop,
                   sgemm_peak, single, compare_thread_settings, two_threads)

__all__ = ["run", "main", "format_report"]


def run(progress=None, quick=False, thread_study=None):
    """Run every scenario; returns a dict (see :func:`format_report`).

    ``progress(done, total, label)`` is called before each step.  ``quick``
    shortens every block and times each contender in one round instead of
    three; ``thread_study`` (default: not ``quick``) adds the comparison of
    thread settings.  Runs with ``threads.configure(blas_threads=1)`` and
    gives the previous setting back at the end.
    """
    from ... import threads
    previous = threads.info()["blas_threads"]
    try:
        return _run(progress, quick, thread_study)
    finally:
        threads.configure(blas_threads=previous)


def _run(progress, quick, thread_study):
    from ... import NoopLoraHook, apply_lora_rows
    from ... import threads
    threads.configure(blas_threads=None)  # as the process found it: lorahook's default
    default_blas = threads.info()["blas"]
    if thread_study is None:
        thread_study = not quick
    timer = Timer(budget=0.08 if quick else 0.3, pause=0.05 if quick else 0.25)
    rounds = 1 if quick else 3
    torch, F = import_torch()
    rng = seeded_rng()
    steps = [
        ("sgemm peak", None),
        ("noop", None),
        ("decode 1 row 1024->1024 r16", (1, 1024, 1024, 16)),
        ("decode 1 row 4096->4096 r64", (1, 4096, 4096, 64)),
        ("prefill 256 rows 1024->3584 r16", (256, 1024, 3584, 16)),
        ("prefill 512 rows 4096->4096 r16", (512, 4096, 4096, 16)),
        ("server decode 1 row x 24 layers", (1, 24)),
        ("server prefill 128 rows x 4 layers", (128, 4)),
        ("two threads x 128 rows", None),
        ("mixed 128 rows, 8 adapters x 16 rows, 1024->3584 r16", None),
        ("half decode 1 row 1024->1024 r16", (1, 1024, 1024, 16)),
        ("half prefill 256 rows 1024->3584 r16", (256, 1024, 3584, 16)),
        ("adapters decode 8 rows, 8 adapters x 1 row, 1024->3584 r16", (8, 1, 1024, 3584, 16)),
        ("adapters decode 64 rows, 64 adapters x 1 row, 896->4864 r16", (64, 1, 896, 4864, 16)),
        ("adapters prefill 128 rows, 8 adapters x 16 rows, 1024->3584 r16", (8, 16, 1024, 3584, 16)),
        ("bind 256 rows x 8 adapters + one pass (Qwen3.5-0.8B)", None),
        ("generate 4 sequences, 3 adapters + base", None),
    ]
    if thread_study:
        steps.append(("thread study", None))
    res = {"single": {}, "server": {}, "server_default": {}, "quick": quick,
           "default_blas_threads": None if default_blas is None else default_blas["num_threads"]}
    threads.configure(blas_threads=1)
    for i, (label, params) in enumerate(steps):
        if progress is not None:
            progress(i, len(steps), label)
        if label == "sgemm peak":
            res["peak"] = sgemm_peak(timer)
        elif label == "noop":
            x = np.zeros((1, 1024), np.float32)
            y = np.zeros((1, 1024), np.float32)
            noop = NoopLoraHook()
            res["noop"] = timer.median(lambda: apply_lora_rows(noop, 0, "q_proj", x, y, 1024, 1024))
        elif label.startswith(("decode", "prefill")):
            res["single"][label] = single(timer, rng, torch, F, *params, rounds=rounds)
        elif label.startswith("server"):
            res["server"][label] = server_loop(timer, rng, *params)
            threads.configure(blas_threads=None)
            try:
                res["server_default"][label] = server_loop(timer, rng, *params)
            finally:
                threads.configure(blas_threads=1)
        elif label.startswith("two threads"):
            res["threads"] = two_threads(timer, rng)
        elif label.startswith("mixed"):
            res["mixed"] = dict(mixed(timer, rng, torch, rounds=rounds), label=label)
        elif label.startswith("adapters"):
            res.setdefault("adapter_dtypes", {})[label[9:]] = adapter_dtypes(
                timer, rng, *params, rounds=rounds)
        elif label.startswith("half"):
            res.setdefault("half", {})[label[5:]] = half(timer, rng, *params, rounds=rounds)
        elif label.startswith("bind"):
            res["bind"] = bind_cost(rng, 3 if quick else 9)
        elif label.startswith("generate"):
            res["generate"] = _generate_scenario(quick)
        elif label == "thread study":
            res["thread_study"] = compare_thread_settings(timer, rng)
    if progress is not None:
        progress(len(steps), len(steps), "done")
    res["info"] = threads.info()
    res["torch"] = None if torch is None else (torch.__version__, torch.get_num_threads())
    res["blas_threads"] = res["info"]["blas_threads"]
    return res


def _generate_scenario(quick):
    """:mod:`lorahook.cli.bench.generate`, or why it was skipped."""
    try:
        from . import generate as bench_generate
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return {"skip": f"needs torch, transformers and peft ({exc})"}
    out = {dtype: bench_generate.run(rounds=3 if quick else 7, dtype=dtype)
           for dtype in ("float32", "bfloat16")}
    for quant in bench_generate.QUANTIZED:
        try:
            out[quant] = bench_generate.run(rounds=3 if quick else 7, quant=quant)
        except ImportError as exc:
            out[quant] = {"skip": f"needs its library ({exc})"}
    return out


def _ms(t):
    return f"{t * 1e3:.3f}" if t < 1e-2 else f"{t * 1e3:.1f}"


def format_report(res):
    """The table and notes for a :func:`run` result, as one string."""
    lines, targets = [], []
    peak = res["peak"]
    lines.append(f"lorahook.threads.configure(blas_threads={res['blas_threads']}) (SciPy's BLAS as found: "
                 f"{res['default_blas_threads']} thread(s)); kernels run on the calling thread")
    lines.append(f"sgemm peak (1024^3, SciPy BLAS, {res['blas_threads']} thread(s)): {peak:.1f} GFLOP/s"
                 " (%peak below is against this)")
    lines.append("")
    hdr = f"{'scenario':36} {'lorahook ms':>11} {'numpy ms':>9} {'torch ms':>9} {'lh/np':>6} {'lh/pt':>6} {'GFLOP/s':>8} {'%peak':>6}"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    lines.append(f"{'noop':36} {_ms(res['noop']):>11}")
    for label, r in res["single"].items():
        t = r["lorahook"]
        pt = r.get("torch")
        gf = r["flops"] / t / 1e9
        lines.append(f"{label:36} {_ms(t):>11} {_ms(r['numpy']):>9} {(_ms(pt) if pt else '-'):>9} "
                     f"{t / r['numpy']:6.2f} {(f'{t / pt:6.2f}' if pt else '     -')} {gf:8.1f} {100 * gf / peak:5.0f}%")
    s = res["single"]
    d1 = s["decode 1 row 1024->1024 r16"]
    p256 = s["prefill 256 rows 1024->3584 r16"]
    p512 = s["prefill 512 rows 4096->4096 r16"]
    targets.append(("decode 1024 r16: lorahook / numpy", d1["lorahook"] / d1["numpy"], 0.75))
    if "torch" in d1:
        targets.append(("decode 1024 r16: lorahook / torch", d1["lorahook"] / d1["torch"], 0.5))
        targets.append(("prefill 256 1024->3584: lorahook / torch", p256["lorahook"] / p256["torch"], 0.7))
    targets.append(("prefill 256 1024->3584: lorahook / numpy", p256["lorahook"] / p256["numpy"], 0.5))
    if "torch" in p512:
        targets.append(("prefill 512 4096->4096: lorahook / torch", p512["lorahook"] / p512["torch"], 0.8))
    targets.append(("noop / decode 1024 r16", res["noop"] / d1["lorahook"], 0.2))
    lines.append("")
    lines.append(f"{'server loop (Qwen3.5-0.8B, r16)':36} {'base ms':>9} {'hooked ms':>10} {'added':>7} {'hook calls ms':>14} {'calls/base':>10}")
    for label, r in res["server"].items():
        add = r["added"]
        lines.append(f"{label:36} {_ms(r['base']):>9} {_ms(r['hooked']):>10} {100 * add:6.1f}% {_ms(r['hook_only']):>14}"
                     f" {100 * r['hook_only'] / r['base']:9.1f}%  ({r['projections']} projections)")
        limit = 0.12 if "decode" in label else 0.15
        targets.append((f"{label}: added time", add, limit))
        d = res.get("server_default", {}).get(label)
        if d is not None:
            lines.append(f"  {'  as found, nothing configured':34} {_ms(d['base']):>9} {_ms(d['hooked']):>10} "
                         f"{100 * d['added']:6.1f}% {_ms(d['hook_only']):>14}"
                         f" {100 * d['hook_only'] / d['base']:9.1f}%  (SciPy BLAS {res['default_blas_threads']} threads)")
    th = res["threads"]
    lines.append("")
    lines.append(f"two Python threads x 128 rows 1024->3584 r16: one caller {_ms(th['one'])} ms/call, "
                 f"two callers {_ms(th['two'])} ms/call, throughput x{th['speedup']:.2f}")
    targets.append(("two threads: throughput vs one (>=)", th["speedup"], 1.5))
    mx = res.get("mixed", {})
    lines.append("")
    if "skip" in mx:
        lines.append(f"mixed batch: skipped ({mx['skip']})")
    else:
        line = (f"{mx['label']}: lorahook {_ms(mx['lorahook'])} ms, single adapter {_ms(mx['single'])} ms, "
                f"{mx['flops'] / mx['lorahook'] / 1e9:.1f} GFLOP/s")
        if "peft" in mx:
            line += (f", PEFT {mx['peft_version']} adapter_names= {_ms(mx['peft'])} ms "
                     f"(lh/peft {mx['lorahook'] / mx['peft']:.2f}; max rel diff {mx['max_rel_diff']:.1e})")
            targets.append(("mixed: lorahook / PEFT", mx["lorahook"] / mx["peft"], 0.3))
        else:
            line += f"; PEFT skipped ({mx['peft_skip']})"
        lines.append(line)
        targets.append(("mixed: lorahook / single adapter", mx["lorahook"] / mx["single"], 2.5))
    half = res.get("half")
    if half:
        lines.append("")
        lines.append(f"{'half precision (ms per call)':36} {'float32':>9} {'bfloat16':>9} {'float16':>9} "
                     f"{'bf16/f32':>9} {'f16/f32':>8} {'f16 adapter':>12}")
        for label, r in half.items():
            f32 = r["float32"]
            lines.append(f"{label:36} {_ms(f32):>9} {_ms(r['bfloat16']):>9} {_ms(r['float16']):>9} "
                         f"{r['bfloat16'] / f32:9.2f} {r['float16'] / f32:8.2f} "
                         f"{_ms(r['float16 adapter']):>12}")
            targets.append((f"{label}: bfloat16 / float32", r["bfloat16"] / f32, 1.5))
            targets.append((f"{label}: float16 / float32", r["float16"] / f32, 1.5))
    held = res.get("adapter_dtypes")
    if held:
        lines.append("")
        lines.append(f"{'adapters held in (ms per call)':60} {'float32':>9} {'bfloat16':>9} "
                     f"{'int8':>9} {'int8/f32':>9} {'bytes int8/f32':>15}")
        for label, r in held.items():
            if "skip" in r:
                lines.append(f"{label}: skipped ({r['skip']})")
                continue
            bf = _ms(r["bfloat16"]) if "bfloat16" in r else "-"
            lines.append(f"{label:60} {_ms(r['float32']):>9} {bf:>9} {_ms(r['int8']):>9} "
                         f"{r['int8'] / r['float32']:9.2f} "
                         f"{r['nbytes']['int8'] / r['nbytes']['float32']:15.2f}")
            if label.startswith("decode"):
                targets.append((f"{label}: int8 / float32 adapters", r["int8"] / r["float32"], 1.0))
    bc = res.get("bind")
    if bc is not None:
        ratio = bc["fresh"] / bc["warm"]
        lines.append("")
        lines.append(f"bind 256 rows over 8 adapters, then one pass over every projection of "
                     f"Qwen3.5-0.8B (r16): {_ms(bc['fresh'])} ms (bind alone {_ms(bc['bind'])} ms), "
                     f"against {_ms(bc['warm'])} ms with a batch bound earlier: x{ratio:.3f}")
        targets.append(("first pass after bind / pass bound earlier", ratio, 1.1))
    gen = res.get("generate")
    if gen is not None:
        lines.append("")
        if "skip" in gen:
            lines.append(f"mixed-batch generate: skipped ({gen['skip']})")
        else:
            from .generate import format_report as generate_report
            for label, g in gen.items():
                if "skip" in g:
                    lines.append(f"mixed-batch generate, base {label}: skipped ({g['skip']})")
                    continue
                lines.append(generate_report(g))
                # quantized bases: lorahook's float32 delta weighs more beside a cheaper base
                base_limit, peft_limit = (1.3, 0.8) if g.get("quant") else (1.2, 0.75)
                targets.append((f"generate {label}: lorahook / base model", g["lorahook/base"],
                                base_limit))
                targets.append((f"generate {label}: lorahook / PEFT", g["lorahook/peft"],
                                peft_limit))
    if res.get("thread_study"):
        lines.append("")
        lines.append("thread settings (server loop: 128 rows x 4 layers; callers: 128 rows 1024->3584, ms per call):")
        lines.append(f"  {'SciPy BLAS':>10} {'prefill 512 4096 ms':>20} {'decode 4096 r64 ms':>19} "
                     f"{'loop base ms':>13} {'loop hooked ms':>15} {'1 caller':>9} {'2 callers':>10}")
        for blas, lone, dec, base, hooked, one, two in res["thread_study"]:
            lines.append(f"  {blas:>10} {_ms(lone):>20} {_ms(dec):>19} {_ms(base):>13} "
                         f"{_ms(hooked):>15} {_ms(one):>9} {_ms(two):>10}")
    lines.append("")
    lines.append(f"{'target':48} {'value':>7} {'limit':>6} met")
    for name, value, limit in targets:
        ok = value >= limit if "(>=)" in name else value <= limit
        lines.append(f"{name:48} {value:7.3f} {limit:6.2f} {'yes' if ok else 'NO'}")
    lines.append("")
    lines.append("BLAS libraries (lorahook.threads.info()):")
    for what, key in (("lorahook (SciPy)", "blas"), ("numpy", "numpy_blas")):
        lib = res["info"][key]
        if lib is None:
            lines.append(f"  {what}: not identified")
        else:
            lines.append(f"  {what}: {lib['internal_api']} {lib['version']} {lib['architecture']} kernels, "
                         f"{lib['num_threads']} threads, {lib['filepath']}")
    if res["info"]["numpy_shares_blas"]:
        lines.append("  numpy and SciPy share one BLAS: configure() leaves it alone")
    if res["torch"]:
        lines.append(f"  torch {res['torch'][0]}: {res['torch'][1]} intra-op threads")
    else:
        lines.append("  torch: not installed (PyTorch columns skipped)")
    lines.append(f"  {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
                 f"{', quick run' if res['quick'] else ''}")
    return "\n".join(lines)


def _progress_bar(stream):
    def progress(done, total, label):
        width = 24
        fill = width * done // max(total, 1)
        stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {label[:48]:48}")
        if done == total:
            stream.write("\n")
        stream.flush()
    return progress


def main(argv=None):
    """``lorahook bench [--quick] [--no-thread-study]``; returns an exit code."""
    parser = argparse.ArgumentParser(prog="lorahook bench", description=(
        "Time lorahook against numpy and PyTorch on decode, prefill and server-loop scenarios."))
    parser.add_argument("--quick", action="store_true", help="short blocks (a rough run in ~30 s)")
    parser.add_argument("--no-thread-study", action="store_true",
                        help="skip the comparison of thread settings")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr (it is drawn only on a terminal)")
    args = parser.parse_args(argv)
    # the bar redraws one line with \r: only on a terminal, never into a log
    progress = None if args.no_progress or not sys.stderr.isatty() else _progress_bar(sys.stderr)
    res = run(progress=progress, quick=args.quick,
              thread_study=False if args.no_thread_study else None)
    print(format_report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
