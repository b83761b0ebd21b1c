"""Half-precision conversion throughput: each vector path against the portable one.

    python benchmarks/half_convert.py [--repeats N]

For a decode row (1024 values) and a prefill block (256 x 3584 values), times
widening (float16 / bfloat16 -> float32) and narrowing (float32 -> float16 /
bfloat16) on every path this CPU can run.  Each timing is the median over
repeats of a GIL-free loop of conversions on the same buffers (no Python call
per conversion), reported per call and as the portable path's time divided
by the path's time.  The conversions run on the calling thread only.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

from lorahook._core import halfconv as _halfconv

# the compiled entry points the tests build (tests/support/testing_core.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
from testing_core import core as _testing  # noqa: E402

SIZES = (("decode 1024", 1024), ("prefill 256x3584", 256 * 3584))
KINDS = ("float16", "bfloat16")
TARGET_SECONDS = 0.01  # per repeat


def inputs(n, kind, rng):
    """Realistic activations: float32 values and their 16-bit patterns."""
    f = (rng.standard_normal(n) * 2.0).astype(np.float32)
    return f, _halfconv.narrow(f, kind)


def median_seconds(src, out, kind, repeats):
    """Median seconds for one conversion of src into out."""
    loops = 1
    while True:  # enough loops that one repeat takes about TARGET_SECONDS
        t0 = time.perf_counter()
        _testing.half_repeat(src, out, kind, loops)
        dt = time.perf_counter() - t0
        if dt >= TARGET_SECONDS / 4 or loops >= 1 << 24:
            break
        loops *= 4
    loops = max(1, int(loops * TARGET_SECONDS / max(dt, 1e-9)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _testing.half_repeat(src, out, kind, loops)
        times.append((time.perf_counter() - t0) / loops)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)

    info = _halfconv.isas()
    paths = info["supported"]
    print(f"instruction sets on this CPU: {', '.join(paths)} (active at start: {info['active']})")
    rng = np.random.default_rng(0)
    old = _halfconv.set_isa("portable")
    try:
        header = f"{'size':<18}{'conversion':<22}" + "".join(f"{p:>12}" for p in paths)
        header += "".join(f"{'portable/' + p:>18}" for p in paths[1:])
        print(header)
        for label, n in SIZES:
            for kind in KINDS:
                f, h = inputs(n, kind, rng)
                for direction, src, out in (
                        ("widen", h, np.empty(n, dtype=np.float32)),
                        ("narrow", f, np.empty(n, dtype=np.uint16))):
                    times = {}
                    for p in paths:
                        _halfconv.set_isa(p)
                        times[p] = median_seconds(src, out, kind, args.repeats)
                    row = f"{label:<18}{direction + ' ' + kind:<22}"
                    row += "".join(f"{times[p] * 1e6:>10.2f}us" for p in paths)
                    row += "".join(f"{times['portable'] / times[p]:>17.1f}x" for p in paths[1:])
                    print(row)
    finally:
        _halfconv.set_isa(old)


if __name__ == "__main__":
    main()
