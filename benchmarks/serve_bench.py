"""lorahook serve: mixed-adapter batches against one adapter per forward (one run).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/serve_bench.py [--size 0.5b|small|all]
        [--max-batch-size 64] [--threads 1]

64 concurrent streaming requests over 8 adapters (32 tokens each, greedy) to a
local server on a random Llama, then the same to the same server started with
--max-adapters 1 (one adapter per forward, what a server without mixed batches
does).  Prints requests/s, median time to first token, forward steps, each
server's admissions (requests that started, and distinct adapters then running),
and a lone request's time to first token against a one-token completion (one
prefill).  Sizes: "0.5b" has the layers of a 0.5B decoder (hidden 896, 24 layers,
MLP 4864, 14 heads, 2 KV heads); "small" is hidden 1024, 4 layers, whose steps
cost little next to the HTTP streaming of 64 clients on the same machine.
"""
import argparse
import json
import tempfile

from lorahook import _bench_serve


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=[*_bench_serve.SIZES, "all"], default="0.5b")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sizes = list(_bench_serve.SIZES) if args.size == "all" else [args.size]
    import lorahook
    blas = lorahook.threads.info()["blas"]  # the servers inherit this environment
    print(f"lorahook's BLAS: {blas['internal_api']} {blas['version']}, {blas['architecture']} kernel")
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="lorahook-serve-bench-") as tmp:
            print(json.dumps(_bench_serve.run(tmp, size, max_batch_size=args.max_batch_size,
                                              threads=args.threads), indent=2), flush=True)


if __name__ == "__main__":
    main()
