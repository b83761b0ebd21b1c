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
import os
import sys

from ._command import EXIT_MISFIT, EXIT_OK, EXIT_USAGE, CommandError, adapter_files
from ._command import load_adapter, load_model, one_line, ranges_text
from ._command import set_text, size_text, user_errors
from . import demo

__all__ = ["main", "build_parser"]

PROG = "lorahook"

# --------------------------------------------------------------------------- info


def cmd_info(args, out):
    kind, config_path, weights_path = adapter_files(args.path)
    adapter = load_adapter(args.path)
    peft_config = {}
    if config_path is not None:
        with open(config_path, encoding="utf-8") as f:
            peft_config = json.load(f)
    from ..files import read_safetensors_header
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
    w(f"on disk     {dtype_text} tensors, {size_text(file_size)}\n")
    w(f"parameters  {adapter.num_parameters:,} ({size_text(4 * adapter.num_parameters)} as float32)\n")
    w(f"covers      {len(keys)} projections on {len(layers)} layers ({ranges_text(layers) or 'none'})\n")
    paths = list(adapter.module_paths.values())
    if paths:
        from ..models import families_placing
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
        w(f"  {module:<18}{ranges_text([i for i, _ in entries]):<16}"
          f"{set_text([l.rank for _, l in entries]):<8}"
          f"{set_text([l.scale for _, l in entries], '{:g}'):<14}{shapes:<16}{bias}\n")
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
    from ..errors import LoraValidationError
    adapter = load_adapter(args.path)
    config = load_model(args.model)
    try:
        adapter.validate_against(config)
    except LoraValidationError as exc:
        raise CommandError(f"does not fit: {one_line(exc)}", EXIT_MISFIT) from None
    layers = sorted({k[0] for k in adapter.keys() if k[0] is not None})
    extra = len(adapter.saved_modules) + sum(k[0] is None for k in adapter.keys())
    more = f", {extra} model-level modules" if extra else ""
    out.write(f"fits: {args.path} ({adapter.num_adapted_layers} projections on {len(layers)} layers{more}) "
              f"fits {args.model} ({config.describe()})\n")
    return EXIT_OK


# --------------------------------------------------------------------------- bench


def cmd_bench(args, out):
    try:
        from . import bench
    except ImportError as exc:
        raise CommandError(f"lorahook bench is not available: {exc}") from None
    code = bench.main(list(args.bench_args))
    return EXIT_OK if code is None else int(code)


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
    demo.add_arguments(p)
    p.set_defaults(func=demo.cmd_demo)

    from .. import server
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
    from .. import server
    missing = _missing_serve_modules()
    if missing:
        raise CommandError(f"needs Ray Serve, FastAPI and transformers (no {missing[0]}): "
                           f"pip install 'lorahook[serve]'", EXIT_USAGE) from None
    return server.main(args, out)


def _version():
    try:
        from .. import __version__
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
    except user_errors() as exc:
        _error(args.command, one_line(exc))
        return EXIT_USAGE
    except BrokenPipeError:  # pragma: no cover - e.g. piped into head
        return EXIT_OK


def _error(command, message):
    sys.stderr.write(f"{PROG} {command}: error: {message}\n")
    sys.stderr.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
