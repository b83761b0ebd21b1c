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

    python benchmarks/serve_bench.py --step-cost [--size 0.5b]

times the server's decode step in this process (no Ray, no HTTP): 64 rows over
8 adapters, with the rows' selection bound once and reused by every step (what
the server does) against a new selection -- a bind and a plan per hooked
linear -- at every step.
"""
import argparse
import json
import os
import sys
import tempfile

# the model, tokenizer and adapters of the server tests, at the sizes below
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
from serve_files import SIZES, save_all, start_server, stop_server  # noqa: E402


def burst(url, names, requests=64, max_tokens=32):
    """``requests`` concurrent streaming completions over ``names``: (req/s, TTFT seconds)."""
    import concurrent.futures
    import json
    import time

    import httpx

    def one(i):
        start = time.perf_counter()
        first = None
        with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
                "model": names[i % len(names)], "prompt": "the big red dog runs over the mat",
                "max_tokens": max_tokens, "temperature": 0, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and first is None:
                    if json.loads(line[6:])["choices"][0]["text"] is not None:
                        first = time.perf_counter() - start
        return first

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as ex:
        ttft = list(ex.map(one, range(requests)))
    wall = time.perf_counter() - t0
    ttft.sort()
    return requests / wall, ttft[len(ttft) // 2]


def lone(url, name):
    """One request alone: (time to first streamed token, time of a 1-token completion)."""
    import time

    import httpx
    body = {"model": name, "prompt": "the big red dog runs over the mat", "temperature": 0}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        httpx.post(url + "/v1/completions", json=dict(body, max_tokens=1), timeout=120)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json=dict(body, max_tokens=16, stream=True)) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break
        times.append((time.perf_counter() - t0, one))
    times.sort()
    return times[len(times) // 2]


def run(workdir, size="0.5b", adapters=8, requests=64, max_tokens=32, max_batch_size=64,
        threads=1):
    """Both servers on the same burst; a dict of figures.

    Both run with ``--threads threads`` (the rest of the machine is left to
    Ray's proxy and the clients) and ``--max-batch-size max_batch_size``;
    they differ only in ``--max-adapters 1``.
    """
    names = [f"adapter{i}" for i in range(adapters)]
    model_dir, adapters_dir = save_all(workdir, names, **SIZES[size])
    out = {"size": size, "model": SIZES[size], "max_batch_size": max_batch_size,
           "threads": threads}
    for label, extra in (("mixed", ()), ("one adapter per forward", ("--max-adapters", "1"))):
        proc, url = start_server(model_dir, adapters_dir, "--max-batch-size",
                                 str(max_batch_size), "--threads", str(threads), *extra)
        try:
            burst(url, names, 8, 4)  # warm-up: every adapter resident
            before = _stats(url)
            rps, ttft = burst(url, names, requests, max_tokens)
            after = _stats(url)
            out[label] = {"requests_per_s": rps, "median_ttft_s": ttft,
                          "steps": after["steps"] - before["steps"],
                          "admissions": [f"{n} requests, {k} adapters running" for n, k in
                                         after["batches"][len(before["batches"]):]],
                          "lone_ttft_s, lone_1_token_s": lone(url, names[0])}
        finally:
            stop_server(proc)
    out["mixed / one adapter per forward (requests/s)"] = (
        out["mixed"]["requests_per_s"] / out["one adapter per forward"]["requests_per_s"])
    lone_ttft, one_token = out["mixed"]["lone_ttft_s, lone_1_token_s"]
    out["lone first token / one-token completion"] = lone_ttft / one_token
    return out


def _stats(url):
    import httpx
    return httpx.get(url + "/lorahook/stats", timeout=60).json()


def step_cost(workdir, size="0.5b", rows=64, adapters=8, steps=16, rounds=5):
    """Median decode-step seconds: the selection reused across steps, and made anew per step."""
    import statistics
    import time

    import torch
    import transformers

    import lorahook
    from lorahook.server.engine import Batch, Request
    from lorahook.torch import attach, geometry_of

    names = [f"adapter{i}" for i in range(adapters)]
    model_dir, adapters_dir = save_all(workdir, names, **SIZES[size])
    torch.set_num_threads(1)
    lorahook.threads.configure(blas_threads=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    store = lorahook.AdapterSet(geometry_of(model), resolver=adapters_dir)
    attached = attach(model, store)
    prompt = tokenizer("the big red dog runs over the mat")["input_ids"]
    out = {"size": size, "rows": rows, "adapters": adapters}
    times = {"reused": [], "new per step": []}
    for _ in range(rounds):
        for label in times:
            run = Batch(model, tokenizer, attached, 0, [], True)
            run.admit([names[i % adapters] for i in range(rows)],
                      [Request(prompt, steps + 2, 0.0) for _ in range(rows)])
            run.step()  # the prefill
            for _ in range(steps):
                if label != "reused":
                    run._selection = None
                start = time.perf_counter()
                run.step()
                times[label].append(time.perf_counter() - start)
    for label, values in times.items():
        out[f"median decode step, selection {label} (s)"] = statistics.median(values)
    out["new per step / reused"] = (out["median decode step, selection new per step (s)"]
                                    / out["median decode step, selection reused (s)"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=[*SIZES, "all"], default="0.5b")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step-cost", action="store_true",
                        help="time the decode step with the selection reused or made per step")
    args = parser.parse_args()
    sizes = list(SIZES) if args.size == "all" else [args.size]
    import lorahook
    blas = lorahook.threads.info()["blas"]  # the servers inherit this environment
    print(f"lorahook's BLAS: {blas['internal_api']} {blas['version']}, {blas['architecture']} kernel")
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="lorahook-serve-bench-") as tmp:
            if args.step_cost:
                print(json.dumps(step_cost(tmp, size), indent=2), flush=True)
                continue
            print(json.dumps(run(tmp, size, max_batch_size=args.max_batch_size,
                                 threads=args.threads), indent=2), flush=True)


if __name__ == "__main__":
    main()
