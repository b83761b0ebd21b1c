"""Print the DoRA-generate and cross-encoder comparisons against PEFT (one run).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/variants.py [--rounds N]

and the per-row cost of DoRA against plain LoRA of the same rank (the asv
``bench_rows.DoraRows`` cases, timed here in one process).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.bench_rows import DoraRows  # noqa: E402

from lorahook import threads  # noqa: E402
from lorahook.cli.bench import variants as bench_variants  # noqa: E402


def dora_rows(repeats=31):
    """DoRA/plain per shape: the two timed in alternation, on the same input and output."""
    lines = []
    for rows in DoraRows.params[0]:
        for shape in DoraRows.params[1]:
            benches = {}
            for variant in DoraRows.params[2]:
                benches[variant] = DoraRows()
                benches[variant].setup(rows, shape, variant)
            benches["dora"].x, benches["dora"].y = benches["plain"].x, benches["plain"].y
            n = max(10, 2000 // rows)
            times = {variant: [] for variant in benches}
            for _ in range(repeats):
                for variant, bench in benches.items():
                    t0 = time.perf_counter()
                    for _ in range(n):
                        bench.time_apply(rows, shape, variant)
                    times[variant].append((time.perf_counter() - t0) / n)
            med = {variant: statistics.median(t) for variant, t in times.items()}
            lines.append(f"  {rows:4d} rows, {shape[0]} -> {shape[1]}, rank 16: plain "
                         f"{med['plain'] * 1e6:8.1f} us, DoRA {med['dora'] * 1e6:8.1f} us, "
                         f"DoRA/plain {med['dora'] / med['plain']:.2f}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("DoRA row against a plain LoRA row (float32, medians):")
    print("\n".join(dora_rows()))
    print(bench_variants.format_report(bench_variants.run(rounds=args.rounds)))
    blas = threads.info().get("blas", {})
    print(f"BLAS: {blas}")


if __name__ == "__main__":
    main()
