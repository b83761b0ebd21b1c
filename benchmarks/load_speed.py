"""How fast ``LoraAdapter.from_peft`` loads, against reading the same bytes with ``np.fromfile``.

    python benchmarks/load_speed.py [--repeats N] [--rank R] [--stages] [--keep DIR]

Writes the Qwen3.5-0.8B adapter (rank 16 on every projection, about 43 MB in float32) as
float32, float16 and bfloat16 PEFT directories, reads each once (warm page cache), then
times, in turns within every repeat: ``np.fromfile`` of the float32 weights file and
``from_peft`` of each directory. Prints medians and the ratios the project holds itself
to: float32 load / float32 fromfile <= 2, float16 and bfloat16 load / float32 fromfile <= 3.
Loads keep the checked layouts of recent headers (adapters of one model, rank and targets
share them); a last row times a float32 load with those forgotten, the first of its layout.

The yardstick itself moves with the machine: ``np.fromfile`` allocates fresh memory, and how
fast the kernel hands out (huge) pages differs between processes and with other load; compare
ratios from one run only.

``--stages`` adds where a float32 load spends its time (header, PEFT names and config,
tensor data, building the adapter) and, for comparison, reading every tensor through the
``safetensors`` package's own ``safe_open(..., framework="numpy")``.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))
from bench_store import STORE_DTYPES, write_store  # noqa: E402

from lorahook import LoraAdapter  # noqa: E402

TARGETS = {"F32": 2.0, "F16": 3.0, "BF16": 3.0}


def _weights(directory):
    return os.path.join(directory, "adapter_model.safetensors")


def _forget_layouts():
    """Clear what loads keep of the layouts they have seen (header, read plan, names, scales, module paths)."""
    from lorahook.files import safetensors_file as safetensors
    from lorahook.models import lookup

    safetensors._forget_layouts()
    lookup._placed.cache_clear()


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _stages(paths, repeats):
    from safetensors import safe_open

    from lorahook.files import reader
    from lorahook.files.safetensors_file import read_float32, read_safetensors_header

    directory = paths["F32"]
    weights = _weights(directory)
    header = read_safetensors_header(weights)
    data = reader.read_peft(directory)
    names = [n for n in header[0]]
    flip = [n for n in names if ".lora_B." in n]

    def through_safetensors():
        with safe_open(weights, framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def names_and_config():  # read_peft without its data read
        saved = reader._collect
        reader._collect = lambda *args: None
        try:
            reader.read_peft(directory)
        finally:
            reader._collect = saved

    cases = {
        "np.fromfile (the yardstick)": lambda: np.fromfile(weights, dtype=np.uint8),
        "header: parse and check": lambda: read_safetensors_header(weights),
        "names, config, header (no data)": names_and_config,
        "tensor data (B transposed, finite check)": lambda: read_float32(
            weights, names, transposed=flip, header=header, finite=True),
        "building the adapter (_from_data)": lambda: LoraAdapter._from_data(data),
        "from_peft, all of it": lambda: LoraAdapter.from_peft(directory),
        "safetensors safe_open + get_tensor, every tensor": through_safetensors,
    }
    times = {k: [] for k in cases}
    for _ in range(repeats):
        for k, fn in cases.items():
            times[k].append(_timed(fn))
    base = np.median(times["np.fromfile (the yardstick)"])
    print("\nwhere a float32 load spends its time (medians):")
    for k, v in times.items():
        print(f"  {k:50s} {np.median(v) * 1e3:8.2f} ms  {np.median(v) / base:5.2f} x fromfile")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--keep", help="write the adapters under this directory and keep them")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="lorahook-load-") as tmp:
        root = args.keep or tmp
        paths = write_store(root, rank=args.rank)
        f32_weights = _weights(paths["F32"])
        for directory in paths.values():  # warm the page cache
            np.fromfile(_weights(directory), dtype=np.uint8)
            LoraAdapter.from_peft(directory)
        nbytes = LoraAdapter.from_peft(paths["F32"]).nbytes

        times = {"fromfile": [], "F32 first": []}
        times.update({d: [] for d in STORE_DTYPES})
        for _ in range(args.repeats):
            times["fromfile"].append(_timed(lambda: np.fromfile(f32_weights, dtype=np.uint8)))
            for dtype in STORE_DTYPES:
                times[dtype].append(_timed(lambda: LoraAdapter.from_peft(paths[dtype])))
            _forget_layouts()
            times["F32 first"].append(_timed(lambda: LoraAdapter.from_peft(paths["F32"])))
            for dtype in STORE_DTYPES:  # the others' layouts known again, as before the forgetting
                LoraAdapter.from_peft(paths[dtype])

        base = float(np.median(times["fromfile"]))
        print(f"adapter: Qwen3.5-0.8B geometry, rank {args.rank}, {nbytes / 1e6:.1f} MB as float32; "
              f"medians of {args.repeats} repeats, warm page cache")
        q1, q3 = np.percentile(times["fromfile"], [25, 75])
        print(f"  np.fromfile(F32 file)          {base * 1e3:8.2f} ms   (quartiles {q1 * 1e3:.2f} .. {q3 * 1e3:.2f} ms)")
        failed = []
        for dtype in STORE_DTYPES:
            med = float(np.median(times[dtype]))
            ratio = med / base
            ok = ratio <= TARGETS[dtype]
            failed += [] if ok else [dtype]
            print(f"  from_peft({dtype:4s})                {med * 1e3:8.2f} ms   {ratio:5.2f} x F32 fromfile "
                  f"(target <= {TARGETS[dtype]:g}: {'ok' if ok else 'MISSED'})")
        first = float(np.median(times["F32 first"]))
        print(f"  from_peft(F32), first of its layout {first * 1e3:8.2f} ms   {first / base:5.2f} x F32 fromfile "
              f"(nothing kept from earlier loads)")
        if args.stages:
            _stages(paths, args.repeats)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
