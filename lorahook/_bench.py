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
:func:`lorahook._kernels.set_gemm_crossover` changes it.
"""
import argparse
import os
import platform
import sys
import threading
import time

import numpy as np

__all__ = ["run", "main", "format_report"]

# Qwen3.5-0.8B text geometry (the fields the projection table needs).
QWEN35_0_8B = {
    "model_type": "qwen3_5_text",
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "vocab_size": 248320,
}


class _Timer:
    def __init__(self, budget, pause):
        self.budget = budget
        self.pause = pause

    def median(self, fn, min_samples=5, max_samples=2000):
        """Median seconds per call of ``fn`` in its own block."""
        time.sleep(self.pause)
        fn()
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-7)
        inner = max(1, int(2e-4 / one))
        samples = []
        end = time.perf_counter() + self.budget
        while len(samples) < max_samples and (len(samples) < min_samples or time.perf_counter() < end):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
        return float(np.median(samples))


def _rng():
    return np.random.default_rng(1234)


def _layer(rng, d_in, d_out, rank, scale=2.0):
    from .adapter import LoraLayer
    a = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
    b = (rng.standard_normal((d_out, rank)) / np.sqrt(rank)).astype(np.float32)
    return LoraLayer(a, b, scale)


def _torch():
    try:
        import torch
        import torch.nn.functional as F
    except Exception:  # any import failure means "no torch contender"
        return None, None
    return torch, F


def _sgemm_peak(timer):
    from scipy.linalg import blas
    m = 1024
    a = np.asfortranarray(_rng().standard_normal((m, m)).astype(np.float32))
    t = timer.median(lambda: blas.sgemm(1.0, a, a), min_samples=3)
    return 2.0 * m ** 3 / t / 1e9


def _single(timer, rng, torch, F, n, d_in, d_out, rank, rounds=1):
    from . import LoraAdapter, apply_lora_rows
    layer = _layer(rng, d_in, d_out, rank)
    hook = LoraAdapter({(0, "q_proj"): layer})
    X = rng.standard_normal((n, d_in)).astype(np.float32)
    Y = np.zeros((n, d_out), np.float32)
    a, b, s = layer.a, layer.b, np.float32(layer.scale)
    contenders = {"lorahook": lambda: apply_lora_rows(hook, 0, "q_proj", X, Y, d_in, d_out)}

    def numpy_lora():
        y = Y  # in-place update of the caller's array
        y += s * ((X @ a.T) @ b.T)
    contenders["numpy"] = numpy_lora
    if torch is not None:
        tx, ta, tb, ty = (torch.from_numpy(v) for v in (X, a.copy(), b.copy(), Y))
        sf = float(s)

        def torch_lora():
            with torch.no_grad():
                ty.add_(F.linear(F.linear(tx, ta), tb), alpha=sf)
        contenders["torch"] = torch_lora
    # Rounds of one block per contender, in turn; each contender's figure is
    # the median of its block medians, so a slow spell on a shared machine
    # hits every contender alike instead of one of them.
    out = _rounds(timer, contenders, rounds)
    out["flops"] = 2.0 * n * rank * (d_in + d_out)
    return out


def _half(timer, rng, n, d_in, d_out, rank, rounds=1):
    """One adapter on float32, bfloat16 and float16 rows, and a bfloat16 adapter, in rounds.

    bfloat16 rows go in as uint16 bit patterns through the entry lorahook.torch
    uses (``_rows._apply_lora_bits``), so that the benchmark needs no ml_dtypes.
    """
    from . import LoraAdapter, apply_lora_rows
    from ._halfconv import narrow as _half_narrow
    from ._rows import _apply_lora_bits
    layer = _layer(rng, d_in, d_out, rank)
    hook = LoraAdapter({(0, "q_proj"): layer})
    X = rng.standard_normal((n, d_in)).astype(np.float32)
    Y = np.zeros((n, d_out), np.float32)
    Xh, Yh = X.astype(np.float16), Y.astype(np.float16)
    Xb, Yb = _half_narrow(X, "bfloat16"), _half_narrow(Y, "bfloat16")
    contenders = {
        "float32": lambda: apply_lora_rows(hook, 0, "q_proj", X, Y, d_in, d_out),
        "bfloat16": lambda: _apply_lora_bits(hook, 0, "q_proj", Xb, Yb, d_in, d_out, True),
        "float16": lambda: apply_lora_rows(hook, 0, "q_proj", Xh, Yh, d_in, d_out),
    }
    half_adapter = hook.astype(np.float16)  # 16-bit weights, widened on each call
    contenders["float16 adapter"] = lambda: apply_lora_rows(half_adapter, 0, "q_proj", X, Y,
                                                            d_in, d_out)
    return _rounds(timer, contenders, rounds)


def _server_loop(timer, rng, n_rows, n_layers):
    """Per projection: numpy base matmul, then the hook (rank 16 everywhere)."""
    from . import LoraAdapter, Qwen35Config, apply_lora_rows
    cfg = Qwen35Config.from_dict(QWEN35_0_8B)
    # Base weights are shared between layers of one type (memory); adapters are per layer.
    weights, inputs, layers, plan = {}, {}, {}, []
    for li in range(n_layers):
        kind = cfg.layer_type(li)
        for m in cfg.modules_for_layer(li):
            d_in, d_out = cfg.projection_shape(li, m)
            if (kind, m) not in weights:
                weights[(kind, m)] = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
            if d_in not in inputs:
                inputs[d_in] = rng.standard_normal((n_rows, d_in)).astype(np.float32)
            layers[(li, m)] = _layer(rng, d_in, d_out, 16)
            plan.append((li, m, weights[(kind, m)].T, inputs[d_in], d_in, d_out))
    hook = LoraAdapter(layers)
    hook_time = [0.0]

    def base():
        for li, m, wt, x, d_in, d_out in plan:
            x @ wt

    def hooked():
        for li, m, wt, x, d_in, d_out in plan:
            y = x @ wt
            apply_lora_rows(hook, li, m, x, y, d_in, d_out)

    def hooked_timed():
        pc = time.perf_counter
        for li, m, wt, x, d_in, d_out in plan:
            y = x @ wt
            t0 = pc()
            apply_lora_rows(hook, li, m, x, y, d_in, d_out)
            hook_time[0] += pc() - t0

    # Paired iterations: base and hooked loops alternate one pass at a time
    # (both use numpy's BLAS pool and lorahook's kernels on this thread, so no
    # pause is needed between them), and "added" is the median of the ratio
    # within each adjacent pair, so slow drift in the machine's load cancels.
    pc = time.perf_counter
    time.sleep(timer.pause)
    base()
    hooked()
    t_base, t_hooked = [], []
    start = pc()
    while len(t_base) < 5 or (pc() - start < 6 * timer.budget and len(t_base) < 200):
        for fn, sink in ((base, t_base), (hooked, t_hooked)) if len(t_base) % 2 else (
                (hooked, t_hooked), (base, t_base)):
            t0 = pc()
            fn()
            sink.append(pc() - t0)
    out = {"base": float(np.median(t_base)), "hooked": float(np.median(t_hooked)),
           "added": float(np.median(np.array(t_hooked) / np.array(t_base))) - 1.0}
    hook_time[0] = 0.0
    reps = 3
    for _ in range(reps):
        hooked_timed()
    out["hook_only"] = hook_time[0] / reps
    out["projections"] = len(plan)
    return out


def _two_threads(timer, rng, n_rows=128, d_in=1024, d_out=3584, rank=16):
    """Two Python threads calling at once vs one."""
    from . import LoraAdapter, apply_lora_rows
    hook = LoraAdapter({(0, "up_proj"): _layer(rng, d_in, d_out, rank)})
    per_thread = [(rng.standard_normal((n_rows, d_in)).astype(np.float32),
                   np.zeros((n_rows, d_out), np.float32)) for _ in range(2)]
    t1 = timer.median(lambda: apply_lora_rows(hook, 0, "up_proj", *per_thread[0], d_in, d_out))
    k = max(20, int(timer.budget * 2 / max(t1, 1e-6)))

    def work(i):
        x, y = per_thread[i]
        for _ in range(k):
            apply_lora_rows(hook, 0, "up_proj", x, y, d_in, d_out)

    def block(nthreads):
        time.sleep(timer.pause)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    # alternate the two settings, best block of each
    ones, twos = [], []
    for _ in range(3):
        ones.append(block(1))
        twos.append(block(2))
    one, two = min(ones), min(twos)
    return {"one": one / k, "two": two / (2 * k), "speedup": 2 * one / two}


def _rounds(timer, contenders, rounds):
    """Median of each contender's block medians over ``rounds`` rounds, in turn."""
    blocks = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            blocks[name].append(timer.median(fn))
    return {name: float(np.median(v)) for name, v in blocks.items()}


def _mixed(timer, rng, torch, n_adapters=8, per=16, d_in=1024, d_out=3584, rank=16, rounds=1):
    try:
        from .serving import AdapterSet
    except ImportError:
        return {"skip": "lorahook.AdapterSet is not available"}
    from . import LoraAdapter, apply_lora_rows
    n = n_adapters * per
    names = [f"a{i}" for i in range(n_adapters)]
    row_names = [names[i // per] for i in range(n)]
    X = rng.standard_normal((n, d_in)).astype(np.float32)
    Y = np.zeros((n, d_out), np.float32)
    layers = [_layer(rng, d_in, d_out, rank) for _ in names]
    aset = AdapterSet()
    for name, layer in zip(names, layers):
        aset.add(name, LoraAdapter({(0, "up_proj"): layer}))
    bound = aset.bind(row_names)
    single = LoraAdapter({(0, "up_proj"): layers[0]})
    contenders = {
        "lorahook": lambda: apply_lora_rows(bound, 0, "up_proj", X, Y, d_in, d_out),
        "single": lambda: apply_lora_rows(single, 0, "up_proj", X, Y, d_in, d_out),
    }
    out = {"flops": 2.0 * n * rank * (d_in + d_out)}
    try:
        import peft
        from peft import LoraConfig, get_peft_model
    except Exception:
        out["peft_skip"] = "peft is not installed"
    if torch is None:
        out["peft_skip"] = "torch is not installed"
    if "peft_skip" in out:
        out.update(_rounds(timer, contenders, rounds))
        return out

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = torch.nn.Linear(d_in, d_out, bias=False)

        def forward(self, x):
            return self.up_proj(x)

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["up_proj"], lora_dropout=0.0)
    model = get_peft_model(Net(), cfg, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, LoraConfig(r=rank, lora_alpha=2 * rank,
                                           target_modules=["up_proj"], lora_dropout=0.0))
    lora_linear = model.base_model.model.up_proj
    with torch.no_grad():
        for name, layer in zip(names, layers):
            lora_linear.lora_A[name].weight.copy_(torch.from_numpy(layer.a.copy()))
            lora_linear.lora_B[name].weight.copy_(torch.from_numpy(layer.b.copy()))
    zeros_shape = (n, d_out)
    lora_linear.base_layer.forward = lambda x, *a, **k: torch.zeros(zeros_shape, dtype=x.dtype)
    tx = torch.from_numpy(X)
    model.eval()

    def peft_mixed():
        with torch.no_grad():
            return lora_linear(tx, adapter_names=row_names)
    contenders["peft"] = peft_mixed
    out.update(_rounds(timer, contenders, rounds))
    # sanity: the same delta (scale alpha / r = 2 on both sides)
    ref = peft_mixed().numpy()
    got = np.zeros_like(Y)
    apply_lora_rows(bound, 0, "up_proj", X, got, d_in, d_out)
    out["max_rel_diff"] = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    out["peft_version"] = peft.__version__
    return out


def _thread_study(timer, rng):
    """The same cases with SciPy's BLAS on one thread and on every core."""
    from . import threads
    cores = os.cpu_count() or 1
    timer = _Timer(budget=min(timer.budget, 0.15), pause=timer.pause)
    rows = []
    for blas in dict.fromkeys((1, cores)):
        threads.configure(blas_threads=blas)
        lone = _single(timer, rng, None, None, 512, 4096, 4096, 16)["lorahook"]
        dec = _single(timer, rng, None, None, 1, 4096, 4096, 64)["lorahook"]
        loop = _server_loop(timer, rng, 128, 4)
        two = _two_threads(timer, rng)
        rows.append((blas, lone, dec, loop["base"], loop["hooked"], two["one"], two["two"]))
    threads.configure(blas_threads=1)
    return rows


def run(progress=None, quick=False, thread_study=None):
    """Run every scenario; returns a dict (see :func:`format_report`).

    ``progress(done, total, label)`` is called before each step.  ``quick``
    shortens every block and times each contender in one round instead of
    three; ``thread_study`` (default: not ``quick``) adds the comparison of
    thread settings.  Runs with ``threads.configure(blas_threads=1)`` and
    gives the previous setting back at the end.
    """
    from . import threads
    previous = threads.info()["blas_threads"]
    try:
        return _run(progress, quick, thread_study)
    finally:
        threads.configure(blas_threads=previous)


def _run(progress, quick, thread_study):
    from . import NoopLoraHook, apply_lora_rows
    from . import threads
    threads.configure(blas_threads=None)  # as the process found it: lorahook's default
    default_blas = threads.info()["blas"]
    if thread_study is None:
        thread_study = not quick
    timer = _Timer(budget=0.08 if quick else 0.3, pause=0.05 if quick else 0.25)
    rounds = 1 if quick else 3
    torch, F = _torch()
    rng = _rng()
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
            res["peak"] = _sgemm_peak(timer)
        elif label == "noop":
            x = np.zeros((1, 1024), np.float32)
            y = np.zeros((1, 1024), np.float32)
            noop = NoopLoraHook()
            res["noop"] = timer.median(lambda: apply_lora_rows(noop, 0, "q_proj", x, y, 1024, 1024))
        elif label.startswith(("decode", "prefill")):
            res["single"][label] = _single(timer, rng, torch, F, *params, rounds=rounds)
        elif label.startswith("server"):
            res["server"][label] = _server_loop(timer, rng, *params)
            threads.configure(blas_threads=None)
            try:
                res["server_default"][label] = _server_loop(timer, rng, *params)
            finally:
                threads.configure(blas_threads=1)
        elif label.startswith("two threads"):
            res["threads"] = _two_threads(timer, rng)
        elif label.startswith("mixed"):
            res["mixed"] = dict(_mixed(timer, rng, torch, rounds=rounds), label=label)
        elif label.startswith("half"):
            res.setdefault("half", {})[label[5:]] = _half(timer, rng, *params, rounds=rounds)
        elif label.startswith("bind"):
            res["bind"] = _bind_cost(rng, 3 if quick else 9)
        elif label.startswith("generate"):
            res["generate"] = _generate_scenario(quick)
        elif label == "thread study":
            res["thread_study"] = _thread_study(timer, rng)
    if progress is not None:
        progress(len(steps), len(steps), "done")
    res["info"] = threads.info()
    res["torch"] = None if torch is None else (torch.__version__, torch.get_num_threads())
    res["blas_threads"] = res["info"]["blas_threads"]
    return res


def bind_cost_setup(rng, n_rows=256, n_adapters=8, rank=16):
    """Qwen3.5-0.8B, ``n_adapters`` adapters covering every projection, random row names.

    Returns ``(adapter_set, row_names, one_pass)`` where ``one_pass(hook)``
    applies ``hook`` to every projection of the model once.
    """
    from . import AdapterSet, LoraAdapter, Qwen35Config, apply_lora_rows
    cfg = Qwen35Config.from_dict(QWEN35_0_8B)
    shapes = {(li, m): (d_in, d_out) for li, m, d_in, d_out in cfg.projections()}
    keys = list(shapes)
    adapters = AdapterSet()
    for i in range(n_adapters):
        adapters.add(f"a{i}", LoraAdapter({k: _layer(rng, *shapes[k], rank) for k in keys}))
    names = [f"a{int(i)}" for i in rng.integers(0, n_adapters, n_rows)]
    xs = {d: rng.standard_normal((n_rows, d)).astype(np.float32) for d, _ in shapes.values()}
    ys = {d: np.zeros((n_rows, d), np.float32) for _, d in shapes.values()}

    def one_pass(hook):
        for k in keys:
            d_in, d_out = shapes[k]
            apply_lora_rows(hook, k[0], k[1], xs[d_in], ys[d_out], d_in, d_out)

    return adapters, names, one_pass


def _bind_cost(rng, rounds):
    """``bind`` + one pass over every projection, against a pass with a batch bound earlier."""
    adapters, names, one_pass = bind_cost_setup(rng)
    bound = adapters.bind(names)
    one_pass(bound)
    pc = time.perf_counter
    warm, fresh, bind = [], [], []
    for _ in range(rounds):
        t0 = pc()
        one_pass(bound)
        warm.append(pc() - t0)
        t0 = pc()
        hook = adapters.bind(names)
        t1 = pc()
        one_pass(hook)
        fresh.append(pc() - t0)
        bind.append(t1 - t0)
    return {"warm": float(np.median(warm)), "fresh": float(np.median(fresh)),
            "bind": float(np.median(bind))}


def _generate_scenario(quick):
    """:mod:`lorahook._bench_generate`, or why it was skipped."""
    try:
        from . import _bench_generate as bench_generate
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
            from ._bench_generate import format_report as generate_report
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
