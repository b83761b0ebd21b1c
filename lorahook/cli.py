"""The ``lorahook`` command line (also ``python -m lorahook``).

Commands::

    lorahook info PATH                          what an adapter holds
    lorahook validate PATH --model CONFIG_JSON  does it fit the model (Llama, Mistral, Qwen2,
                                                Qwen3, Gemma 1-3, Phi-3, Qwen3.5, BERT)?
    lorahook bench [...]                        side-by-side throughput comparison
    lorahook demo [--adapter DIR ... --model CONFIG_JSON]
                                                the main job, checked and timed

Exit codes: 0 success (or "fits"), 1 the adapter does not fit the model (or the
demo's check failed), 2 a usage error or an unreadable / invalid file.  User
mistakes print one line to stderr, never a traceback.

The library modules are imported inside each command, so ``lorahook --help``
works even when an optional part cannot be imported.
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time

__all__ = ["main", "build_parser"]

PROG = "lorahook"

EXIT_OK = 0
EXIT_MISFIT = 1
EXIT_USAGE = 2

#: Name of the embedded demo geometry (package data).
DEMO_CONFIG = "qwen3_5_demo.json"


class CommandError(Exception):
    """A user mistake: printed as one line, with an exit code."""

    def __init__(self, message, code=EXIT_USAGE):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- helpers


def _user_errors():
    """The exception types that mean "the user gave us a bad file or value".

    lorahook's own errors and ``OSError``; argument errors are argparse's
    (exit 2) or :class:`CommandError`.  Anything else is a bug and shows its
    traceback.
    """
    from .errors import LoraFormatError, LoraValidationError
    return (LoraFormatError, LoraValidationError, OSError)


def _one_line(exc):
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = " ".join(text.split())
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.strerror}: {exc.filename}"
    return text or type(exc).__name__


def _adapter_files(path):
    """``(kind, config_path_or_None, safetensors_path)`` for an adapter location."""
    if os.path.isdir(path):
        config = os.path.join(path, "adapter_config.json")
        weights = os.path.join(path, "adapter_model.safetensors")
        if not os.path.exists(config):
            raise CommandError(f"{path}: not a PEFT adapter directory (no adapter_config.json)")
        return "PEFT directory", config, weights
    if not os.path.exists(path):
        raise CommandError(f"{path}: no such file or directory")
    if os.path.basename(path) == "adapter_config.json":
        return _adapter_files(os.path.dirname(path) or ".")
    return "safetensors file", None, path


def load_adapter(path):
    """Load a PEFT directory (or its ``adapter_config.json``) or a bare safetensors file."""
    from .adapter import LoraAdapter
    kind, config, _ = _adapter_files(path)
    if config is not None:
        return LoraAdapter.from_peft(os.path.dirname(config))
    return LoraAdapter.from_safetensors(path)


def load_model(path):
    """The :class:`~lorahook.ModelGeometry` chosen by the file's ``model_type``."""
    from .models import load_model_config
    if not os.path.exists(path):
        raise CommandError(f"{path}: no such file or directory")
    return load_model_config(path)


def _ranges(indices):
    """``[0, 1, 2, 5, 7, 8]`` -> ``'0-2, 5, 7-8'``."""
    out, run = [], []
    for i in sorted(set(indices)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def _set_text(values, fmt="{}"):
    values = sorted(set(values))
    return ", ".join(fmt.format(v) for v in values)


def _size_text(n_bytes):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024.0
    return f"{n_bytes} B"  # pragma: no cover


def _describe_model(config):
    return config.describe()


# --------------------------------------------------------------------------- info


def cmd_info(args, out):
    kind, config_path, weights_path = _adapter_files(args.path)
    adapter = load_adapter(args.path)
    peft_config = {}
    if config_path is not None:
        with open(config_path, encoding="utf-8") as f:
            peft_config = json.load(f)
    from .files import read_safetensors_header
    dtypes = {}
    for entry in read_safetensors_header(weights_path)[0].values():
        dtypes[entry["dtype"]] = dtypes.get(entry["dtype"], 0) + 1
    file_size = os.path.getsize(weights_path) if os.path.exists(weights_path) else 0

    keys = adapter.keys()
    layers = sorted({k[0] for k in keys if k[0] is not None})
    by_module = {}
    for key in keys:
        if key[0] is not None:
            by_module.setdefault(key[1], []).append((key[0], adapter.layers[key]))
    model_level = [k for k in keys if k[0] is None]

    w = out.write
    w(f"adapter     {args.path} ({kind})\n")
    if adapter.name:
        w(f"name        {adapter.name}\n")
    if peft_config:
        base = peft_config.get("base_model_name_or_path")
        if base:
            w(f"base model  {base}\n")
        bits = [f"r={peft_config.get('r')}", f"lora_alpha={peft_config.get('lora_alpha')}"]
        if peft_config.get("use_rslora"):
            bits.append("use_rslora")
        if peft_config.get("lora_bias"):
            bits.append("lora_bias")
        if peft_config.get("use_dora"):
            bits.append("use_dora")
        tm = peft_config.get("target_modules")
        if isinstance(tm, list):
            tm = ",".join(sorted(tm))
        if isinstance(tm, str) and len(tm) > 80:
            count = f" ({len(peft_config['target_modules'])} entries)" if isinstance(
                peft_config.get("target_modules"), list) else ""
            tm = tm[:77] + "..." + count
        bits.append(f"target_modules={tm}")
        w(f"peft        {' '.join(bits)}\n")
        for pat in ("rank_pattern", "alpha_pattern"):
            if peft_config.get(pat):
                w(f"{pat:<12}{len(peft_config[pat])} entries\n")
    dtype_text = ", ".join(f"{d} x{n}" for d, n in sorted(dtypes.items())) or "unknown"
    w(f"on disk     {dtype_text} tensors, {_size_text(file_size)}\n")
    w(f"parameters  {adapter.num_parameters:,} ({_size_text(4 * adapter.num_parameters)} as float32)\n")
    w(f"covers      {len(keys)} projections on {len(layers)} layers ({_ranges(layers) or 'none'})\n")
    paths = list(adapter.module_paths.values())
    if paths:
        from .models import families_placing
        families = families_placing(paths)
        text = (f"{', '.join(families)} (by module paths)" if families
                else "none: its module paths mix families")
        w(f"families    {text}\n")
    if by_module:
        w(f"  {'module':<18}{'layers':<16}{'rank':<8}{'scale':<14}{'d_in -> d_out':<16}bias\n")
    for module in sorted(by_module):
        entries = by_module[module]
        shapes = ", ".join(f"{a} -> {b}" for a, b in sorted({(l.d_in, l.d_out) for _, l in entries}))
        bias = "yes" if any(l.bias is not None for _, l in entries) else "-"
        w(f"  {module:<18}{_ranges([i for i, _ in entries]):<16}"
          f"{_set_text([l.rank for _, l in entries]):<8}"
          f"{_set_text([l.scale for _, l in entries], '{:g}'):<14}{shapes:<16}{bias}\n")
    for key in model_level:  # lm_head, embeddings, heads (layer_idx None)
        layer = adapter.layers[key]
        kind = "embedding LoRA" if layer.is_embedding else "LoRA"
        w(f"  {key[1]:<18}{'model-level':<16}{layer.rank:<8}{layer.scale:<14g}"
          f"{f'{layer.d_in} -> {layer.d_out}':<16}{kind}\n")
    if adapter.has_dora:
        w("dora        magnitude vectors on every layer (base weights needed: with_base, "
          "AdapterSet(base_weights=) or lorahook.torch.attach)\n")
    for key, module in sorted(adapter.saved_modules.items(), key=lambda kv: str(kv[0])):
        what = "embedding" if module.is_embedding else "linear" + (" + bias" if module.bias is not None else "")
        w(f"saved       {key[1]} ({what}, {module.d_in} -> {module.d_out}, modules_to_save)\n")
    metadata = adapter.metadata
    if metadata:
        w("metadata\n")
        for k in sorted(metadata):
            w(f"  {k}: {metadata[k]}\n")
    return EXIT_OK


# --------------------------------------------------------------------------- validate


def cmd_validate(args, out):
    from .errors import LoraValidationError
    adapter = load_adapter(args.path)
    config = load_model(args.model)
    try:
        adapter.validate_against(config)
    except LoraValidationError as exc:
        raise CommandError(f"does not fit: {_one_line(exc)}", EXIT_MISFIT) from None
    layers = sorted({k[0] for k in adapter.keys() if k[0] is not None})
    extra = len(adapter.saved_modules) + sum(k[0] is None for k in adapter.keys())
    more = f", {extra} model-level modules" if extra else ""
    out.write(f"fits: {args.path} ({adapter.num_adapted_layers} projections on {len(layers)} layers{more}) "
              f"fits {args.model} ({_describe_model(config)})\n")
    return EXIT_OK


# --------------------------------------------------------------------------- bench


def cmd_bench(args, out):
    try:
        from . import bench
    except ImportError as exc:
        raise CommandError(f"lorahook bench is not available: {exc}") from None
    code = bench.main(list(args.bench_args))
    return EXIT_OK if code is None else int(code)


# --------------------------------------------------------------------------- demo


def _demo_config_path():
    from importlib import resources
    return resources.files("lorahook").joinpath("data", DEMO_CONFIG)


def _demo_adapters(config, rng):
    """Three adapters over the demo model, different ranks, scales and coverage."""
    import numpy as np
    from .adapter import LoraAdapter
    from .layer import LoraLayer
    from .models import QWEN35_MLP_MODULES
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
    from . import apply_lora_rows
    from .adapter import LoraAdapter
    from .errors import LoraValidationError
    from .adapter_set import AdapterSet

    w = out.write
    if (args.adapter is None) != (args.model is None):
        raise CommandError("demo: --adapter and --model go together (give both, or neither)")
    if args.rows < 1:
        raise CommandError(f"demo: --rows must be at least 1, got {args.rows}")
    rng = np.random.default_rng(args.seed)

    if args.model is None:
        from .models import Qwen35Config
        with _demo_config_path().open("r", encoding="utf-8") as f:
            config = Qwen35Config.from_dict(json.load(f))
        w(f"model     embedded {DEMO_CONFIG}: {_describe_model(config)}\n")
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
        w(f"model     {args.model}: {_describe_model(config)}\n")
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
                raise CommandError(f"does not fit: {path}: {_one_line(exc)}", EXIT_MISFIT) from None
            adapters[name] = adapter
        w(f"adapters  {len(adapters)} loaded: {', '.join(args.adapter)}\n")

    aset = AdapterSet(model=config)  # validates every adapter before installing it
    for name, adapter in adapters.items():
        aset.add(name, adapter)
    for name, adapter in adapters.items():
        layers = sorted({k[0] for k in adapter.keys() if k[0] is not None})
        ranks = _set_text([l.rank for l in adapter.layers.values()])
        scl = _set_text([l.scale for l in adapter.layers.values()], "{:g}")
        w(f"  {name:<10} rank {ranks:<6} scale {scl:<8} {adapter.num_adapted_layers:>3} projections "
          f"on layers {_ranges(layers):<10} {adapter.num_parameters:>9,} params  fits the model\n")

    # The batch: rows cycle through the adapters and None, with per-row scales.
    names = list(adapters)
    choices = names + [None]
    row_names = [choices[i % len(choices)] for i in range(args.rows)]
    scale_choices = (1.0, 0.5, 1.5, 0.0, 0.75)
    scales = [scale_choices[(i // len(choices)) % len(scale_choices)] for i in range(args.rows)]
    untouched = [i for i in range(args.rows) if row_names[i] is None or scales[i] == 0.0]
    counts = ", ".join(f"{n} x{row_names.count(n)}" for n in names) + f", none x{row_names.count(None)}"
    w(f"batch     {args.rows} rows: {counts}; per-row scales {_set_text(scales, '{:g}')} "
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


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Apply, inspect and check LoRA adapters for CPU inference.",
        epilog="Exit codes: 0 ok / fits, 1 does not fit, 2 usage error or unreadable / invalid file.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("info", help="what an adapter holds",
                       description="Summarise a PEFT adapter directory or a safetensors file: "
                                   "modules, layers, ranks, scales, parameters, dtype on disk, metadata.")
    p.add_argument("path", metavar="PATH", help="PEFT adapter directory or .safetensors file")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("validate", help="check an adapter against a model config.json",
                       description="Check that every adapter layer fits the model's projections. "
                                   "Exit 0 and 'fits' when it does, 1 when it does not.")
    p.add_argument("path", metavar="PATH", help="PEFT adapter directory or .safetensors file")
    p.add_argument("--model", required=True, metavar="CONFIG_JSON",
                   help="the model's config.json, chosen by its model_type: llama, mistral, qwen2, "
                        "qwen3, gemma, gemma2, gemma3(_text), phi3, qwen3_5(_text), "
                        "qwen3_5_moe(_text) or bert")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("bench", help="side-by-side throughput comparison",
                       description="Run the throughput comparison (options: lorahook bench --help).",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="the main job on an embedded model, checked and timed",
                       description="Generate adapters for an embedded Qwen3.5 geometry, write them "
                                   "as PEFT directories, load them back, validate them, run a mixed "
                                   "batch (several adapters, rows without one, per-row scales) "
                                   "through every projection of every layer, check it against a "
                                   "float64 numpy reference and time it. With --adapter and "
                                   "--model, the same with your own files.")
    p.add_argument("--adapter", action="append", metavar="DIR",
                   help="a PEFT adapter directory or safetensors file (repeatable); needs --model")
    p.add_argument("--model", metavar="CONFIG_JSON", help="the model's config.json (with --adapter)")
    p.add_argument("--rows", type=int, default=64, help="rows in the batch (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--time", type=float, default=1.0, metavar="SECONDS",
                   help="time budget for the speed measurement, 0 to skip (default 1)")
    p.set_defaults(func=cmd_demo)

    from . import server
    p = sub.add_parser("serve", help="an OpenAI-compatible server for a model and its adapters",
                       description="Serve a transformers causal LM and PEFT adapters over "
                                   "OpenAI's API (/v1/models, /v1/completions, "
                                   "/v1/chat/completions, streaming), on Ray Serve: requests for "
                                   "different adapters share batches. Needs "
                                   "pip install 'lorahook[serve]'. Stops on SIGINT or SIGTERM.")
    server.add_arguments(p)
    p.set_defaults(func=cmd_serve)
    return parser


def _missing_serve_modules():
    """The modules ``lorahook serve`` needs that are not installed, found without importing any.

    Ray reads settings from the environment when it is imported, which the
    server sets first; ``find_spec`` of a dotted name imports its parent, so
    ``ray.serve`` is looked for as a folder of the ``ray`` package instead.
    """
    import os
    from importlib.util import find_spec
    missing = [m for m in ("fastapi", "ray", "transformers") if find_spec(m) is None]
    if not missing:
        places = find_spec("ray").submodule_search_locations or []
        if not any(os.path.isdir(os.path.join(p, "serve")) for p in places):
            missing = ["ray.serve"]
    return missing


def cmd_serve(args, out):
    from . import server
    missing = _missing_serve_modules()
    if missing:
        raise CommandError(f"needs Ray Serve, FastAPI and transformers (no {missing[0]}): "
                           f"pip install 'lorahook[serve]'", EXIT_USAGE) from None
    return server.main(args, out)


def _version():
    try:
        from . import __version__
        return __version__
    except Exception:  # pragma: no cover - a broken build still prints help
        return "unknown"


def main(argv=None):
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # ``bench`` owns all of its arguments, including --help.
    if argv and argv[0] == "bench":
        args = argparse.Namespace(func=cmd_bench, bench_args=argv[1:], command="bench")
    else:
        args = parser.parse_args(argv)
    try:
        return args.func(args, sys.stdout)
    except CommandError as exc:
        _error(args.command, str(exc))
        return exc.code
    except _user_errors() as exc:
        _error(args.command, _one_line(exc))
        return EXIT_USAGE
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return EXIT_OK


def _error(command, message):
    sys.stderr.write(f"{PROG} {command}: error: {message}\n")
    sys.stderr.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
