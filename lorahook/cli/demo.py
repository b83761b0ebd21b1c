"""``lorahook demo``: the main job on a Qwen3.5-shaped model, checked and timed.

Adapters (random ones, or PEFT directories given with ``--model``) are put in
an :class:`~lorahook.AdapterSet`, a batch of rows mixing them is bound and run
through every projection, each result is checked against numpy in float64,
and lorahook is timed against a numpy loop doing the same work.
"""
import json
import math
import os
import tempfile
import time

from ._command import EXIT_MISFIT, EXIT_OK, CommandError, load_adapter
from ._command import load_model, one_line, ranges_text, set_text

__all__ = ["add_arguments", "cmd_demo"]

#: Name of the embedded demo geometry (package data).
DEMO_CONFIG = "qwen3_5_demo.json"



def add_arguments(p):
    """``lorahook demo``'s options, on the argparse parser ``p``."""
    p.add_argument("--adapter", action="append", metavar="DIR",
                   help="a PEFT adapter directory or safetensors file (repeatable); needs --model")
    p.add_argument("--model", metavar="CONFIG_JSON", help="the model's config.json (with --adapter)")
    p.add_argument("--rows", type=int, default=64, help="rows in the batch (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--time", type=float, default=1.0, metavar="SECONDS",
                   help="time budget for the speed measurement, 0 to skip (default 1)")


def _demo_config_path():
    from importlib import resources
    return resources.files("lorahook.cli").joinpath("data", DEMO_CONFIG)


def _demo_adapters(config, rng):
    """Three adapters over the demo model, different ranks, scales and coverage."""
    import numpy as np
    from ..adapter import LoraAdapter
    from ..layer import LoraLayer
    from ..models import QWEN35_MLP_MODULES
    specs = [
        # name, rank, lora_alpha, which modules
        ("support", 8, 16, lambda layer, module: True),
        ("legal", 16, 16, lambda layer, module: module not in QWEN35_MLP_MODULES),
        ("sql", 4, 8, lambda layer, module: module in QWEN35_MLP_MODULES and layer >= 1),
    ]
    adapters = {}
    for name, rank, alpha, covers in specs:
        layers = {}
        for layer_idx, module, d_in, d_out in config.projections():
            if not covers(layer_idx, module):
                continue
            a = rng.standard_normal((rank, d_in)) / math.sqrt(d_in)
            b = rng.standard_normal((d_out, rank)) * 0.1
            layers[(layer_idx, module)] = LoraLayer(a.astype(np.float32), b.astype(np.float32),
                                                    scale=alpha / rank)
        adapters[name] = LoraAdapter(layers, name=name)
    return adapters


def _same_layer(x, y):
    import numpy as np
    return (np.array_equal(x.a, y.a) and np.array_equal(x.b, y.b)
            and math.isclose(x.scale, y.scale, rel_tol=1e-12)
            and (x.bias is None) == (y.bias is None)
            and (x.bias is None or np.array_equal(x.bias, y.bias)))


def _reference(adapters, row_names, scales, key, x, base):
    """float64 numpy: ``base + s_i * layer.scale * (B @ (A @ x_i) + bias)`` per row."""
    import numpy as np
    ref = base.astype(np.float64)
    x64 = x.astype(np.float64)
    for name, adapter in adapters.items():
        layer = adapter.layers.get(key)
        if layer is None or layer.rank == 0:
            continue
        idx = [i for i, n in enumerate(row_names) if n == name and scales[i] != 0.0]
        if not idx:
            continue
        s = np.asarray([scales[i] for i in idx], dtype=np.float64)[:, None] * layer.scale
        delta = (x64[idx] @ layer.a.astype(np.float64).T) @ layer.b.astype(np.float64).T
        if layer.bias is not None:
            delta += layer.bias.astype(np.float64)
        ref[idx] += s * delta
    return ref


def _numpy_batch(adapters, row_names, scales, projections, xs, outs):
    """What one would write in plain numpy (float32, rows grouped by adapter)."""
    import numpy as np
    groups = {}
    for i, n in enumerate(row_names):
        if n is not None and scales[i] != 0.0:
            groups.setdefault(n, []).append(i)
    groups = {n: (np.asarray(idx), np.asarray([scales[i] for i in idx], dtype=np.float32)[:, None])
              for n, idx in groups.items()}
    for (layer_idx, module, _, _), x, out in zip(projections, xs, outs):
        for name, (idx, s) in groups.items():
            layer = adapters[name].layers.get((layer_idx, module))
            if layer is None or layer.rank == 0:
                continue
            delta = (x[idx] @ layer.a.T) @ layer.b.T
            if layer.bias is not None:
                delta += layer.bias
            out[idx] += (s * np.float32(layer.scale)) * delta


def _timed(fn, budget):
    """Calls per second of ``fn`` over about ``budget`` seconds (at least 3 calls)."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if n >= 3 and elapsed >= budget:
            return n / elapsed


def cmd_demo(args, out):
    import numpy as np
    from ..hook import apply_lora_rows
    from ..adapter import LoraAdapter
    from ..errors import LoraValidationError
    from ..adapter_set import AdapterSet

    w = out.write
    if (args.adapter is None) != (args.model is None):
        raise CommandError("demo: --adapter and --model go together (give both, or neither)")
    if args.rows < 1:
        raise CommandError(f"demo: --rows must be at least 1, got {args.rows}")
    rng = np.random.default_rng(args.seed)

    if args.model is None:
        from ..models import Qwen35Config
        with _demo_config_path().open("r", encoding="utf-8") as f:
            config = Qwen35Config.from_dict(json.load(f))
        w(f"model     embedded {DEMO_CONFIG}: {config.describe()}\n")
        generated = _demo_adapters(config, rng)
        tmp = tempfile.TemporaryDirectory(prefix="lorahook-demo-")
        adapters = {}
        with tmp:
            for name, adapter in generated.items():
                path = os.path.join(tmp.name, name)
                adapter.save_peft(path, architecture="qwen3_5",
                                  metadata={"name": name, "base_model": "lorahook demo"})
                loaded = LoraAdapter.from_peft(path)
                same = loaded.keys() == adapter.keys() and all(
                    _same_layer(loaded.layers[k], adapter.layers[k]) for k in adapter.keys())
                if not same:
                    raise CommandError(f"demo: the adapter {name!r} read back from its PEFT "
                                       f"directory differs from the one written", EXIT_MISFIT)
                adapters[name] = loaded
            w(f"adapters  {len(adapters)} generated (seed {args.seed}), written as PEFT directories "
              f"with save_peft to a temporary directory (removed afterwards), read back with "
              f"from_peft (identical A, B and scales)\n")
    else:
        config = load_model(args.model)
        w(f"model     {args.model}: {config.describe()}\n")
        adapters = {}
        for path in args.adapter:
            name = os.path.basename(os.path.normpath(path)) or path
            base, n = name, 2
            while name in adapters:
                name, n = f"{base}#{n}", n + 1
            adapter = load_adapter(path)
            try:
                adapter.validate_against(config)
            except LoraValidationError as exc:
                raise CommandError(f"does not fit: {path}: {one_line(exc)}", EXIT_MISFIT) from None
            adapters[name] = adapter
        w(f"adapters  {len(adapters)} loaded: {', '.join(args.adapter)}\n")

    aset = AdapterSet(model=config)  # validates every adapter before installing it
    for name, adapter in adapters.items():
        aset.add(name, adapter)
    for name, adapter in adapters.items():
        layers = sorted({k[0] for k in adapter.keys() if k[0] is not None})
        ranks = set_text([l.rank for l in adapter.layers.values()])
        scl = set_text([l.scale for l in adapter.layers.values()], "{:g}")
        w(f"  {name:<10} rank {ranks:<6} scale {scl:<8} {adapter.num_adapted_layers:>3} projections "
          f"on layers {ranges_text(layers):<10} {adapter.num_parameters:>9,} params  fits the model\n")

    # The batch: rows cycle through the adapters and None, with per-row scales.
    names = list(adapters)
    choices = names + [None]
    row_names = [choices[i % len(choices)] for i in range(args.rows)]
    scale_choices = (1.0, 0.5, 1.5, 0.0, 0.75)
    scales = [scale_choices[(i // len(choices)) % len(scale_choices)] for i in range(args.rows)]
    untouched = [i for i in range(args.rows) if row_names[i] is None or scales[i] == 0.0]
    counts = ", ".join(f"{n} x{row_names.count(n)}" for n in names) + f", none x{row_names.count(None)}"
    w(f"batch     {args.rows} rows: {counts}; per-row scales {set_text(scales, '{:g}')} "
      f"({sum(1 for s in scales if s == 0.0)} rows at scale 0)\n")

    projections = config.projections()
    xs, bases = [], []
    for layer_idx, module, d_in, d_out in projections:
        x = rng.standard_normal((args.rows, d_in), dtype=np.float32)
        weight = (rng.standard_normal((d_out, d_in), dtype=np.float32) / np.float32(math.sqrt(d_in)))
        xs.append(x)
        bases.append(x @ weight.T)  # what the server's projection computed: y = W x
    hooked = sum(1 for (l, m, _, _) in projections
                 if any(a.is_active(l, m) for a in adapters.values()))

    # Check: one pass through every projection of every layer, against float64 numpy.
    hook = aset.bind(row_names, scales)
    worst_out, worst_delta, bitwise_ok, ran = 0.0, 0.0, True, 0
    for (layer_idx, module, d_in, d_out), x, base in zip(projections, xs, bases):
        got = base.copy()
        apply_lora_rows(hook, layer_idx, module, x, got, d_in, d_out)
        ran += 1
        ref = _reference(adapters, row_names, scales, (layer_idx, module), x, base)
        ref_delta = ref - base.astype(np.float64)
        got_delta = got.astype(np.float64) - base.astype(np.float64)
        scale_out = float(np.max(np.abs(ref))) or 0.0
        scale_delta = float(np.max(np.abs(ref_delta)))
        err_out = float(np.max(np.abs(got - ref)))
        err_delta = float(np.max(np.abs(got_delta - ref_delta)))
        # Relative to max|ref|; where the reference is all zeros, absolute 1e-6 (in limit units).
        worst_out = max(worst_out, err_out / scale_out if scale_out else err_out * 10.0)
        worst_delta = max(worst_delta, err_delta / scale_delta if scale_delta else err_delta * 10.0)
        if untouched and not np.array_equal(got[untouched], base[untouched]):
            bitwise_ok = False
    w(f"run       {ran} projections over {config.num_layers} layers ({hooked} hooked by some "
      f"adapter), each one apply_lora_rows(AdapterSet.bind(rows, scales), ...) in place\n")
    limit = 1e-5
    passed = worst_out <= limit and worst_delta <= limit and bitwise_ok
    w(f"check     {'passed' if passed else 'FAILED'}: max relative error {worst_out:.1e} (output), "
      f"{worst_delta:.1e} (delta), limit {limit:.0e}, against a float64 numpy reference; "
      f"{len(untouched)} rows with no adapter or scale 0 "
      f"{'bit-identical' if bitwise_ok else 'CHANGED'}\n")

    # Speed: a whole batch through the whole model, binding included.
    outs = [b.copy() for b in bases]

    def lorahook_pass():
        h = aset.bind(row_names, scales)
        for (layer_idx, module, d_in, d_out), x, o in zip(projections, xs, outs):
            apply_lora_rows(h, layer_idx, module, x, o, d_in, d_out)

    def numpy_pass():
        _numpy_batch(adapters, row_names, scales, projections, xs, outs)

    if args.time > 0:
        per_s_lh = _timed(lorahook_pass, args.time / 2) * args.rows
        per_s_np = _timed(numpy_pass, args.time / 2) * args.rows
        w(f"speed     lorahook {per_s_lh:,.0f} rows/s, numpy (float32, rows grouped by adapter) "
          f"{per_s_np:,.0f} rows/s: {per_s_lh / per_s_np:.1f}x "
          f"(rows through all {ran} projections)\n")
    return EXIT_OK if passed else EXIT_MISFIT


# --------------------------------------------------------------------------- parser
