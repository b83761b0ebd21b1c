"""The timed scenarios of ``lorahook bench``: single projections, the server loop, mixed batches.

How each contender is timed is described in :mod:`lorahook.cli.bench`.
"""
import os
import threading
import time

import numpy as np

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


class Timer:
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


def seeded_rng():
    return np.random.default_rng(1234)


def _layer(rng, d_in, d_out, rank, scale=2.0):
    from ...layer import LoraLayer
    a = (rng.standard_normal((rank, d_in)) / np.sqrt(d_in)).astype(np.float32)
    b = (rng.standard_normal((d_out, rank)) / np.sqrt(rank)).astype(np.float32)
    return LoraLayer(a, b, scale)


def import_torch():
    try:
        import torch
        import torch.nn.functional as F
    except Exception:  # any import failure means "no torch contender"
        return None, None
    return torch, F


def sgemm_peak(timer):
    from scipy.linalg import blas
    m = 1024
    a = np.asfortranarray(seeded_rng().standard_normal((m, m)).astype(np.float32))
    t = timer.median(lambda: blas.sgemm(1.0, a, a), min_samples=3)
    return 2.0 * m ** 3 / t / 1e9


def single(timer, rng, torch, F, n, d_in, d_out, rank, rounds=1):
    from ... import LoraAdapter, apply_lora_rows
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


def half(timer, rng, n, d_in, d_out, rank, rounds=1):
    """One adapter on float32, bfloat16 and float16 rows, and a bfloat16 adapter, in rounds.

    bfloat16 rows go in as uint16 bit patterns through the entry lorahook.torch
    uses (``_rows.apply_lora_bits``), so that the benchmark needs no ml_dtypes.
    """
    from ... import LoraAdapter, apply_lora_rows
    from ..._core.halfconv import narrow as _half_narrow
    from ..._rows import apply_lora_bits
    layer = _layer(rng, d_in, d_out, rank)
    hook = LoraAdapter({(0, "q_proj"): layer})
    X = rng.standard_normal((n, d_in)).astype(np.float32)
    Y = np.zeros((n, d_out), np.float32)
    Xh, Yh = X.astype(np.float16), Y.astype(np.float16)
    Xb, Yb = _half_narrow(X, "bfloat16"), _half_narrow(Y, "bfloat16")
    contenders = {
        "float32": lambda: apply_lora_rows(hook, 0, "q_proj", X, Y, d_in, d_out),
        "bfloat16": lambda: apply_lora_bits(hook, 0, "q_proj", Xb, Yb, d_in, d_out, True),
        "float16": lambda: apply_lora_rows(hook, 0, "q_proj", Xh, Yh, d_in, d_out),
    }
    half_adapter = hook.astype(np.float16)  # 16-bit weights, widened on each call
    contenders["float16 adapter"] = lambda: apply_lora_rows(half_adapter, 0, "q_proj", X, Y,
                                                            d_in, d_out)
    return _rounds(timer, contenders, rounds)


def server_loop(timer, rng, n_rows, n_layers):
    """Per projection: numpy base matmul, then the hook (rank 16 everywhere)."""
    from ... import LoraAdapter, Qwen35Config, apply_lora_rows
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


def two_threads(timer, rng, n_rows=128, d_in=1024, d_out=3584, rank=16):
    """Two Python threads calling at once vs one."""
    from ... import LoraAdapter, apply_lora_rows
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


def mixed(timer, rng, torch, n_adapters=8, per=16, d_in=1024, d_out=3584, rank=16, rounds=1):
    try:
        from ...adapter_set import AdapterSet
    except ImportError:
        return {"skip": "lorahook.AdapterSet is not available"}
    from ... import LoraAdapter, apply_lora_rows
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


def adapter_dtypes(timer, rng, n_adapters, per, d_in, d_out, rank, rounds=1):
    """One mixed batch (``per`` rows for each of ``n_adapters``) with the adapters held in
    float32, bfloat16 (with ml_dtypes) and int8, float32 rows; medians in rounds."""
    try:
        from ...adapter_set import AdapterSet
        from ... import LoraAdapter, apply_lora_rows
        LoraAdapter({}).astype("int8")
    except (ImportError, TypeError):
        return {"skip": "this lorahook holds no int8 adapters"}
    dtypes = ["float32", "int8"]
    try:
        import ml_dtypes  # noqa: F401  (names bfloat16 for lorahook)
        dtypes.insert(1, "bfloat16")
    except ImportError:
        pass
    names = [f"a{i}" for i in range(n_adapters)]
    adapters = [LoraAdapter({(0, "up_proj"): _layer(rng, d_in, d_out, rank)}) for _ in names]
    rows = [names[i // per] for i in range(n_adapters * per)]
    X = rng.standard_normal((len(rows), d_in)).astype(np.float32)
    Y = np.zeros((len(rows), d_out), np.float32)
    contenders = {}
    for dt in dtypes:
        aset = AdapterSet(dtype=dt)
        for name, adapter in zip(names, adapters):
            aset.add(name, adapter)
        bound = aset.bind(rows)
        contenders[dt] = (lambda b: lambda: apply_lora_rows(b, 0, "up_proj", X, Y, d_in, d_out))(bound)
    out = _rounds(timer, contenders, rounds)
    out["nbytes"] = {dt: sum(a.astype(dt).nbytes for a in adapters) for dt in dtypes}
    return out


def compare_thread_settings(timer, rng):
    """The same cases with SciPy's BLAS on one thread and on every core."""
    from ... import threads
    cores = os.cpu_count() or 1
    timer = Timer(budget=min(timer.budget, 0.15), pause=timer.pause)
    rows = []
    for blas in dict.fromkeys((1, cores)):
        threads.configure(blas_threads=blas)
        lone = single(timer, rng, None, None, 512, 4096, 4096, 16)["lorahook"]
        dec = single(timer, rng, None, None, 1, 4096, 4096, 64)["lorahook"]
        loop = server_loop(timer, rng, 128, 4)
        two = two_threads(timer, rng)
        rows.append((blas, lone, dec, loop["base"], loop["hooked"], two["one"], two["two"]))
    threads.configure(blas_threads=1)
    return rows


def bind_cost_setup(rng, n_rows=256, n_adapters=8, rank=16):
    """Qwen3.5-0.8B, ``n_adapters`` adapters covering every projection, random row names.

    Returns ``(adapter_set, row_names, one_pass)`` where ``one_pass(hook)``
    applies ``hook`` to every projection of the model once.
    """
    from ... import AdapterSet, LoraAdapter, Qwen35Config, apply_lora_rows
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


def bind_cost(rng, rounds):
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


