"""lorahook serve: mixed-adapter batches against one adapter per forward (one run).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/serve_bench.py

64 concurrent streaming requests over 8 adapters (32 tokens each, greedy) to a
local server on a random Llama (hidden 1024, 4 layers; batches of up to 32), then the same to a server
started with --max-adapters 1; prints requests/s, median time to first token, and
a lone request's time to first token against a one-token completion (one prefill).
"""
import json
import tempfile

from lorahook import _bench_serve


def main():
    with tempfile.TemporaryDirectory(prefix="lorahook-serve-bench-") as tmp:
        print(json.dumps(_bench_serve.run(tmp), indent=2))


if __name__ == "__main__":
    main()
