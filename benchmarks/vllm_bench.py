"""lorahook inside vLLM, measured: per projection, and end to end.

``python benchmarks/vllm_bench.py ops [--dtype bfloat16] [--threads N]`` times
one projection's mixed-adapter delta on vLLM's stacked slot tensors: vLLM's
CPU torch ops (what its CPU punica wrapper runs: ``bgmv_shrink`` +
``bgmv_expand_slice``) against lorahook's candidates -- ``apply_slots`` (BLAS
on float32 copies, one thread, and OpenBLAS's own pool) and ``apply_pairs``
(the model's dtype, one thread, and a team of torch's OpenMP threads) -- the
same data, timed in alternation; medians.

``python benchmarks/vllm_bench.py serve [--config TEXT] [--rounds 3] [--without-lora]
[--breakdown] [--lora-target-modules M ...]`` starts vLLM offline (``LLM.generate``,
vLLM's defaults) on a random 0.5B-shaped Llama (hidden 896, 24 layers, MLP 4864, 14
heads, 2 KV heads) with 8 PEFT adapters of rank 8 on ``q_proj v_proj o_proj down_proj``
and times bursts of 64 requests x 32 greedy tokens, in float32 and bfloat16, on one and
two threads (``VLLM_CPU_OMP_THREADS_BIND``; all cores too on a larger machine), and in
both dtypes on two threads with ``--max-lora-rank 64``.  Each configuration keeps its
engines alive side by side -- lorahook's, vLLM's own LoRA kernels (``VLLM_PLUGINS=none``) and, with
``--without-lora``, vLLM started without ``--enable-lora`` -- and sends them bursts in
turn, round after round (every other round in reverse order); a ratio is taken within
a round, and the table gives the median over the rounds (the log line, their range).
vLLM's defaults: the plugin's engine is compiled (vLLM's own LoRA engine is not: vLLM
turns compilation off with LoRA), and so is the engine without LoRA.  ``--breakdown``
adds where the plugin's LoRA time went (per projection kind, and the per-step
metadata); it times every call, so its rates are not the ones to quote.
``--lora-target-modules`` starts both LoRA engines with vLLM's option of that name, so
that vLLM wraps only those modules (each wrapped projection is one more custom-op call
per step, with or without an adapter on it).

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


def ops(repeat=30, dtype="float32", threads=2):
    """One projection's delta: vLLM's torch ops against lorahook's candidates, in alternation.

    lorahook's candidates: ``apply_slots`` (SciPy's BLAS on float32 copies of
    the weights, on one thread and on OpenBLAS's own pool of ``threads``) and
    ``apply_pairs`` (weights in the model's dtype, on the calling thread and on
    a team of ``threads`` of torch's OpenMP pool, the one vLLM computes on).
    """
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    from lorahook._core.slot_rows import SlotRows, apply_slots
    from lorahook._core.slot_pairs import SlotPairs, apply_pairs, openmp_team

    torch.set_num_threads(threads)
    team = openmp_team(threads)
    tdt = getattr(torch, dtype)
    half = None if dtype == "float32" else dtype
    rows_out = []
    blas = [f"{i['internal_api']} {i.get('version')} {i.get('architecture')}"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    for n, d_in, d_out, rank, adapters in OP_SHAPES:
        g = torch.Generator().manual_seed(n + d_in)
        a = (torch.randn(adapters, 1, rank, d_in, generator=g) * 0.05).to(tdt)
        b = (torch.randn(adapters, 1, d_out, rank, generator=g) * 0.05).to(tdt)
        x = torch.randn(n, d_in, generator=g).to(tdt)
        ys = {k: torch.zeros(n, d_out, dtype=tdt) for k in ("vllm", "slots", "pairs")}
        idx = torch.arange(n) % adapters
        idx = idx[torch.randperm(n, generator=g)]

        def torch_ops():
            buf = torch.zeros(n, rank, dtype=torch.float32)
            bgmv_shrink(x, a, buf, idx, 1.0)
            bgmv_expand_slice(buf, b, ys["vllm"], idx, 0, d_out, True)

        def view(t):
            return t.numpy() if half is None else t.view(torch.int16).numpy().view(np.uint16)
        # apply_slots as lorahook.vllm ran it before apply_pairs: float32 copies of A (when
        # 16-bit) and of B transposed, made once per adapter activation (here once)
        av = (view(a) if half is None else a.float().numpy()).reshape(adapters, rank, d_in)
        btv = np.ascontiguousarray(b.float().numpy().reshape(adapters, d_out, rank)
                                   .transpose(0, 2, 1))
        # apply_pairs: A as vLLM keeps it, B transposed in the model's dtype
        bt16 = b.reshape(adapters, d_out, rank).transpose(1, 2).contiguous()
        pairs = SlotPairs([view(a).reshape(adapters, rank, d_in)], [view(bt16)],
                          [np.full(adapters, rank, np.int32)], half=half)
        xv = view(x)
        groups = SlotRows(idx.numpy(), adapters)  # built once per step in vLLM

        def slots_op():
            apply_slots(groups, xv, view(ys["slots"]), av, bt=btv, half=half)

        def pairs_op(tm):
            return lambda: apply_pairs(groups, xv, view(ys["pairs"]), pairs, half=half, team=tm)

        times = {}
        with threadpool_limits(1, user_api="blas"):
            times["vllm"], times["slots 1"] = _median_pair(torch_ops, slots_op, repeat)
        with threadpool_limits(threads, user_api="blas"):
            times["slots pool"] = _median_pair(slots_op, slots_op, repeat)[0]
        times["pairs 1"], times["pairs team"] = _median_pair(pairs_op(None), pairs_op(team),
                                                             repeat)
        for y in ys.values():
            y.zero_()
        torch_ops(), slots_op(), pairs_op(team)()
        ref = ys["vllm"].double()
        err = max(float((ys[k].double() - ref).abs().max() / ref.abs().max())
                  for k in ("slots", "pairs"))
        rows_out.append(dict(rows=n, d_in=d_in, d_out=d_out, rank=rank, adapters=adapters,
                             rel_diff=err, **{k: v * 1e6 for k, v in times.items()}))
    print(f"dtype {dtype}; {threads} threads; team: {team}; SciPy BLAS: {'; '.join(blas)}")
    print(f"| rows, projection, adapters | vLLM torch ops | apply_slots, 1 thread | apply_slots, "
          f"OpenBLAS pool of {threads} | apply_pairs, 1 thread | apply_pairs, team of {threads} |")
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['rows']} rows {r['d_in']}->{r['d_out']} r{r['rank']}, "
              f"{r['adapters']} adapters | {r['vllm']:.0f} us | {r['slots 1']:.0f} us | "
              f"{r['slots pool']:.0f} us | {r['pairs 1']:.0f} us | {r['pairs team']:.0f} us |")
    return rows_out


# --------------------------------------------------------------------------- end to end

def make_files(workdir, adapters=8):
    """The 0.5B-shaped model, its tokenizer and the adapters (made once, kept in workdir)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
    from vllm_files import save_model_and_adapters
    return save_model_and_adapters(workdir, [f"a{i}" for i in range(adapters)], size="0.5b")


# (label, dtype, VLLM_CPU_OMP_THREADS_BIND, --max-lora-rank)
CONFIGS = [
    ("float32, 1 thread", "float32", "0", 8),
    ("float32, 2 threads", "float32", "0-1", 8),
    ("bfloat16, 1 thread", "bfloat16", "0", 8),
    ("bfloat16, 2 threads", "bfloat16", "0-1", 8),
    ("bfloat16, 2 threads, --max-lora-rank 64", "bfloat16", "0-1", 64),
    ("float32, 2 threads, --max-lora-rank 64", "float32", "0-1", 64),
]


def _all_cores():
    n = len(os.sched_getaffinity(0))
    return "0" if n == 1 else f"0-{n - 1}"


def _configs(names):
    configs = list(CONFIGS)
    cores = _all_cores()
    if cores not in ("0", "0-1"):  # a machine with more cores: all of them too
        configs += [(f"float32, all {len(os.sched_getaffinity(0))} cores", "float32", cores, 8),
                    (f"bfloat16, all {len(os.sched_getaffinity(0))} cores", "bfloat16", cores, 8)]
    if names:  # a label given whole is that configuration alone, else every label holding it
        labels = {c[0] for c in configs}
        configs = [c for c in configs
                   if any(n == c[0] if n in labels else n in c[0] for n in names)]
    return configs


def _breakdown(path):
    """The plugin worker's profile: where a step's LoRA time goes."""
    import json
    try:
        with open(path, encoding="utf-8") as f:
            prof = json.load(f)
    except (OSError, ValueError):
        return "  (no profile written)"
    steps = max(prof["steps"], 1)
    lines = [f"  per-step metadata (update_metadata): {prof['metadata_s'] / steps * 1e6:.0f} us "
             f"a step over {prof['steps']} steps"]
    total = 0.0
    for key, (calls, secs) in sorted(prof["calls"].items(), key=lambda kv: -kv[1][1]):
        if not key.startswith("slot writes"):
            total += secs
        lines.append(f"  {key}: {calls} calls, {secs / max(calls, 1) * 1e6:.0f} us a call, "
                     f"{secs:.2f} s in all")
    lines.append(f"  LoRA calls in all: {total:.2f} s, metadata {prof['metadata_s']:.2f} s "
                 "('slot writes': following vLLM's writes of adapters into slots, once per "
                 "activation)")
    return "\n".join(lines)


class _Engine:
    """One vLLM engine kept alive in a process of its own (``tests/support/vllm_run.py``, mode
    ``bursts``), timing a burst whenever it is asked."""

    def __init__(self, spec, env, log):
        import json
        import subprocess

        from vllm_run import child_env  # tests/support/, on the path since make_files
        self.spec_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({**spec, "mode": "bursts"}, self.spec_file)
        self.spec_file.close()
        full = child_env({"PYTHONUNBUFFERED": "1", **env})
        self.log = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "..", "tests", "support", "vllm_run.py"),
             self.spec_file.name], env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True)
        self.wrapper = None

    def _line(self, prefix):
        seen = []
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.split()[1:]
            seen = (seen + [line])[-40:]
        raise RuntimeError(f"vLLM ended ({self.proc.wait()}); its stderr: {self.log.name}; "
                           f"its last lines:\n{''.join(seen)}")

    def ready(self):
        if self.wrapper is None:
            self.wrapper = self._line("READY")[0]
        return self

    def burst(self, label):
        self.proc.stdin.write(label + "\n")
        self.proc.stdin.flush()
        got, rate = self._line("RATE")
        assert got == label, (got, label)
        return float(rate)

    def rss(self):
        """The largest resident set among the engine's processes (its worker's), in bytes."""
        import psutil
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        sizes = []
        for p in procs:
            try:
                sizes.append(p.memory_info().rss)
            except psutil.Error:
                pass
        return max(sizes)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except Exception:
                self.proc.kill()
        self.log.close()
        os.unlink(self.spec_file.name)


def serve(workdir, requests=64, max_tokens=32, configs=None, rounds=3, without_lora=False,
          breakdown=False, target_modules=None):
    """Each configuration: lorahook's engine, vLLM's own LoRA engine (and vLLM without
    ``--enable-lora``) alive side by side, sent bursts in turn, ``rounds`` times.

    A round is lorahook with the 8 adapters, [vLLM without LoRA,] lorahook without
    adapters, vLLM's own LoRA with the adapters: each ratio is taken within a round,
    between bursts seconds apart, and the table gives the rounds' median ratio (a
    shared machine's speed drifts over minutes; a ratio of engines timed minutes apart
    measures the drift too) and the best rate of each.  Idle engines wait on a pipe.
    ``target_modules`` (vLLM's ``--lora-target-modules``) limits both LoRA engines'
    LoRA layers to those modules.
    """
    model_dir, adapter_dir, names = make_files(workdir)
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
    table = []
    for label, dtype, bind, max_rank in _configs(configs):
        base = dict(model=model_dir, adapters=adapter_dir, names=names, enable_lora=True,
                    requests=requests, max_tokens=max_tokens, max_loras=8,
                    max_lora_rank=max_rank, dtype=dtype, target_modules=target_modules)
        env = {"VLLM_CPU_KVCACHE_SPACE": kv, "VLLM_CPU_OMP_THREADS_BIND": bind}
        prof = os.path.join(workdir, "profile.json")
        if os.path.exists(prof):
            os.unlink(prof)
        specs = {"lorahook": (base, {**env, **({"LORAHOOK_VLLM_PROFILE": prof}
                                              if breakdown else {})}),
                 "own": (base, {**env, "VLLM_PLUGINS": "none"})}
        if without_lora:
            specs["no_lora"] = ({**base, "enable_lora": False, "names": []},
                                {**env, "VLLM_PLUGINS": "none"})
        engines = {}
        try:
            for key, (spec, e) in specs.items():  # one at a time: each compiles on every core
                engines[key] = _Engine(spec, e, os.path.join(workdir, f"{key}.log")).ready()
            assert engines["lorahook"].wrapper.startswith("lorahook"), engines["lorahook"].wrapper
            rates = {k: [] for k in ("lorahook", "base", "no_lora", "own")}
            order = [("lorahook", "lorahook", "adapters")]
            order += [("no_lora", "no_lora", "none")] if without_lora else []
            order += [("base", "lorahook", "none"), ("own", "own", "adapters")]
            for r in range(rounds):
                # every other round in reverse: the bursts a ratio compares trade places, so
                # a drift of the machine's speed within a round favours neither engine
                for key, engine, requests_of in order if r % 2 == 0 else order[::-1]:
                    rates[key].append(engines[engine].burst(requests_of))
        finally:
            for engine in engines.values():
                engine.close()

        def ratio(k1, k2):
            return statistics.median(_per_round(rates, k1, k2))

        def spread(k1, k2):
            r = _per_round(rates, k1, k2)
            return f"{min(r):.2f}-{max(r):.2f}"

        row = dict(config=label, rounds=rates, **{k: max(v) for k, v in rates.items() if v},
                   vs_base=ratio("lorahook", "base"), vs_own=ratio("lorahook", "own"))
        if without_lora:
            row["vs_no_lora"] = ratio("lorahook", "no_lora")
        table.append(row)
        print(f"{label}: requests/s per round: lorahook {_fmt(rates['lorahook'])}; "
              f"same engine without adapters {_fmt(rates['base'])}; vLLM's own LoRA "
              f"{_fmt(rates['own'])}"
              + (f"; vLLM without --enable-lora {_fmt(rates['no_lora'])} (ratios "
                 f"{spread('lorahook', 'no_lora')})" if without_lora else ""),
              flush=True)
        if breakdown:
            print(_breakdown(prof), flush=True)
    print()
    extra = " / vLLM without --enable-lora" if without_lora else ""
    versus = " lorahook / vLLM without --enable-lora |" if without_lora else ""
    print(f"| configuration | best requests/s: lorahook, 8 adapters / same engine, no adapters / "
          f"vLLM's own LoRA{extra} | median ratio: lorahook / no adapters |{versus} "
          "lorahook / vLLM's own |")
    print("|---|---|---|---|" + ("---|" if without_lora else ""))
    for r in table:
        plain = f" / {r['no_lora']:.2f}" if without_lora else ""
        vs = f" {r['vs_no_lora']:.3f} |" if without_lora else ""
        print(f"| {r['config']} | {r['lorahook']:.2f} / {r['base']:.2f} / {r['own']:.2f}{plain} | "
              f"{r['vs_base']:.3f} |{vs} {r['vs_own']:.2f} |")
    return table


# the tenants benchmark's engines, in two groups alive one after the other (a group's
# engines take bursts in turn, round after round): (key, tenants' kind, tenants,
# requests, --max-loras, --max-cpu-loras, --max-lora-rank, environment); a kind None is
# vLLM started without --enable-lora
OWN = {"VLLM_PLUGINS": "none"}              # vLLM's own kernels
INT8 = {"LORAHOOK_VLLM_ADAPTER_DTYPE": "int8"}  # lorahook's, adapters held in int8
TENANT_GROUPS = [
    [("t64", "rank 8", 64, 64, 64, 64, 8, {}),
     ("t64 int8", "rank 8", 64, 64, 64, 64, 8, INT8),
     ("t64 own", "rank 8", 64, 64, 64, 64, 8, OWN),
     ("t256 via 64", "rank 8", 256, 256, 64, 256, 8, {})],
    [("t256 mixed", "mixed", 256, 256, 256, 256, 64, {}),
     ("no lora", None, 0, 256, 1, 1, 8, OWN)],
]
TENANT_BURSTS = [  # (rate key, engine, requests with or without their adapters)
    [("t64", "t64", "adapters"), ("t64 none", "t64", "none"), ("t64 int8", "t64 int8", "adapters"),
     ("t64 own", "t64 own", "adapters"), ("t256 via 64", "t256 via 64", "adapters")],
    [("t256 mixed", "t256 mixed", "adapters"), ("no lora", "no lora", "none")],
]
# --only-64: the 64 tenants alone, with lorahook's slots in the model's dtype and in int8
ONLY_64 = ("t64", "t64 int8")


def tenants(workdir, configs=None, rounds=3, max_tokens=32, own_256=True, only_64=False):
    """Many tenants, each request its own adapter: lorahook's slots against vLLM's.

    For each configuration (bfloat16 and float32 on two threads), first: 64
    rank-8 tenants with ``--max-loras 64`` (lorahook with and without the
    adapters, lorahook with its slots in int8, vLLM's own kernels) and 256
    through ``--max-loras 64`` (``only_64``: lorahook's two 64-tenant engines
    alone, then nothing else); then 256
    tenants of ranks 8, 16 and 64 on different modules with ``--max-loras 256
    --max-cpu-loras 256 --max-lora-rank 64`` beside vLLM without LoRA: the
    rates, and the worker's resident set against that engine's, set against
    the adapters' own bytes in the model's dtype; then, alone, vLLM's own
    kernels and slots in that configuration (it may not start: the line says
    so).  Rates are tokens/s; a ratio is taken within a round.
    """
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))
    from vllm_files import TENANT_KINDS, save_model_and_adapters, save_tenants
    model_dir, _, _ = save_model_and_adapters(workdir, [], size="0.5b")
    kinds = {"rank 8": TENANT_KINDS[:1], "mixed": TENANT_KINDS}
    made = {k: save_tenants(os.path.join(workdir, k.replace(" ", "-")), 256, "0.5b", v)
            for k, v in kinds.items()}
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    table = []
    for label, dtype, bind, _ in _configs(configs or ["2 threads"]):
        if "max-lora-rank" in label:
            continue
        size = 2 if dtype == "bfloat16" else 4
        env = {"VLLM_CPU_KVCACHE_SPACE": kv, "VLLM_CPU_OMP_THREADS_BIND": bind}
        rates, rss = {}, {}
        mixed_bytes = made["mixed"][2] * size

        def spec(kind, n_tenants, n_requests, max_loras, cpu, rank):
            adapters, names, _ = made[kind or "mixed"]
            return dict(model=model_dir, adapters=adapters, names=names[:n_tenants],
                        enable_lora=kind is not None, requests=n_requests,
                        max_tokens=max_tokens, max_loras=max_loras, max_cpu_loras=cpu,
                        max_lora_rank=rank, dtype=dtype, max_num_seqs=64, warm_all=True)
        for group, order in zip(TENANT_GROUPS[:1] if only_64 else TENANT_GROUPS,
                                TENANT_BURSTS):
            if only_64:
                group = [g for g in group if g[0] in ONLY_64]
                order = [o for o in order if o[1] in ONLY_64]
            engines = {}
            try:
                for key, kind, n, nreq, loras, cpu, rank, extra in group:
                    engines[key] = _Engine(spec(kind, n, nreq, loras, cpu, rank), {**env, **extra},
                                           os.path.join(workdir, f"{key}.log")).ready()
                for r in range(rounds):
                    for key, engine, what in order if r % 2 == 0 else order[::-1]:
                        rates.setdefault(key, []).append(engines[engine].burst(what) * max_tokens)
                rss.update({k: engines[k].rss() for k in ("t256 mixed", "no lora")
                            if k in engines})
            finally:
                for engine in engines.values():
                    engine.close()
        def ratio(k1, k2):
            return statistics.median(a / b for a, b in zip(rates[k1], rates[k2], strict=True))
        if only_64:
            row = dict(config=label, rates=rates, vs_none=ratio("t64", "t64 none"),
                       int8_vs_none=ratio("t64 int8", "t64 none"),
                       int8_vs_f=ratio("t64 int8", "t64"))
            table.append(row)
            print(f"{label}: tokens/s per round: " + "; ".join(
                f"{k} {_fmt(v)}" for k, v in rates.items()), flush=True)
            print(f"| {label} | 64 tenants / no adapters: {row['vs_none']:.3f}, in int8 "
                  f"{row['int8_vs_none']:.3f}; int8 / {dtype} slots {row['int8_vs_f']:.3f} |",
                  flush=True)
            continue
        own = "not run"
        if own_256:
            e = _Engine({**spec("mixed", 256, 256, 256, 256, 64), "oom_first": True},
                        {**env, "VLLM_PLUGINS": "none"}, os.path.join(workdir, "t256-own.log"))
            try:
                e.ready()
                own_rate = e.burst("adapters") * max_tokens
                own = (f"started; {own_rate:.0f} tokens/s; worker resident set "
                       f"{e.rss() / 2**30:.2f} GiB")
            except RuntimeError as exc:
                own = f"did not start or serve: {str(exc).splitlines()[0]}"
            finally:
                e.close()

        lora_mem = rss["t256 mixed"] - rss["no lora"]
        row = dict(config=label, rates=rates, vs_none=ratio("t64", "t64 none"),
                   int8_vs_none=ratio("t64 int8", "t64 none"), vs_own=ratio("t64", "t64 own"), via64=ratio("t256 via 64", "t64"),
                   mixed_vs_none=ratio("t256 mixed", "no lora"), lora_mem=lora_mem,
                   adapters_bytes=mixed_bytes, own_256=own)
        table.append(row)
        print(f"{label}: tokens/s per round: " + "; ".join(f"{k} {_fmt(v)}"
                                                            for k, v in rates.items()),
              flush=True)
        print(f"{label}: 256 mixed tenants: worker resident set {rss['t256 mixed'] / 2**30:.2f} "
              f"GiB against {rss['no lora'] / 2**30:.2f} GiB without LoRA: LoRA "
              f"{lora_mem / 2**20:.0f} MiB for {mixed_bytes / 2**20:.0f} MiB of adapters "
              f"({lora_mem / mixed_bytes:.2f} x); vLLM's own kernels and slots: {own}",
              flush=True)
    print()
    if only_64:
        return table
    print("| configuration | 64 tenants, --max-loras 64: lorahook / no adapters | in int8 "
          "| / vLLM's own "
          "| 256 tenants via --max-loras 64 / 64 tenants | 256 mixed tenants, --max-loras 256 "
          "--max-lora-rank 64: / vLLM without LoRA | its LoRA memory / adapters' bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['config']} | {r['vs_none']:.3f} ({max(r['rates']['t64']):.0f} tokens/s) "
              f"| {r['int8_vs_none']:.3f} | {r['vs_own']:.2f} | {r['via64']:.2f} | {r['mixed_vs_none']:.2f} | "
              f"{r['lora_mem'] / 2**20:.0f} / {r['adapters_bytes'] / 2**20:.0f} MiB = "
              f"{r['lora_mem'] / r['adapters_bytes']:.2f} |")
    return table


def _per_round(rates, k1, k2):
    """Each round's ratio of ``k1``'s rate to ``k2``'s (bursts of the same round)."""
    return [a / b for a, b in zip(rates[k1], rates[k2], strict=True)]


def _fmt(values):
    return ", ".join(f"{v:.2f}" for v in values)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["ops", "serve", "tenants"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="ops: the threads of the pooled candidates (default: every core)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--config", action="append", default=None,
                   help="run only the configurations whose label contains this (repeatable)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--without-lora", action="store_true",
                   help="also time vLLM started without --enable-lora")
    p.add_argument("--breakdown", action="store_true",
                   help="serve: lorahook's engine records where its LoRA time goes "
                        "(LORAHOOK_VLLM_PROFILE) and the table is followed by it")
    p.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                   help="serve: vLLM's --lora-target-modules for both LoRA engines (the "
                        "adapters' modules are qkv_proj o_proj down_proj)")
    p.add_argument("--only-64", action="store_true",
                   help="tenants: lorahook's 64-tenant engines alone, slots in the model's "
                        "dtype and in int8")
    p.add_argument("--skip-own-256", action="store_true",
                   help="tenants: do not try vLLM's own kernels with 256 slots of rank 64")
    args = p.parse_args()
    if args.what == "ops":
        ops(dtype=args.dtype, threads=args.threads)
    elif args.what == "tenants":
        tenants(args.workdir or tempfile.mkdtemp(prefix="lorahook-vllm-bench-"),
                configs=args.config, rounds=args.rounds, own_256=not args.skip_own_256,
                only_64=args.only_64)
    else:
        workdir = args.workdir or tempfile.mkdtemp(prefix="lorahook-vllm-bench-")
        serve(workdir, configs=args.config, rounds=args.rounds,
              without_lora=args.without_lora, breakdown=args.breakdown,
              target_modules=args.lora_target_modules)


if __name__ == "__main__":
    main()
