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

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/serve_bench.py tenants
        [--size 0.5b|small] [--requests 512] [--adapter-dtype float32] [--skip-vllm]

many tenants: 256 rank-8 adapters on disk (``q_proj v_proj o_proj down_proj``), a
capacity that holds 32 of them (``--capacity-bytes``, ``--max-models-per-replica
32``), 32 concurrent clients sending streaming requests one after another, each
naming an adapter drawn with Zipf(1.0) popularity (the k-th most popular with
probability proportional to 1/k; seeded, the same requests for both servers).
Then the same to vLLM's OpenAI server with lorahook's plugin, on the same model,
adapters and requests, with ``--max-loras 32 --max-cpu-loras 32`` (the same
capacity, in adapters).  Both run on one core (``--threads 1``,
``VLLM_CPU_OMP_THREADS_BIND=0``).  Reports failed requests (there must be none),
requests and streamed tokens per second, and the time to first token (median,
p99) of warm and cold requests: a request is cold when its adapter is not among
the 32 most recently requested before it (its first use, or one the capacity
has most likely evicted), warm otherwise.
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


# --------------------------------------------------------------------------- many tenants

TENANTS, ROOM, CLIENTS = 256, 32, 32
TENANT_PROMPT = "the big red dog runs over the mat"


def zipf_requests(count, tenants=TENANTS, seed=0):
    """``count`` adapter indices drawn with Zipf(1.0) popularity over ``tenants`` (seeded)."""
    import numpy as np
    p = 1.0 / np.arange(1, tenants + 1)
    return np.random.default_rng(seed).choice(tenants, size=count, p=p / p.sum()).tolist()


def warm_or_cold(picks, room=ROOM):
    """For each request in order: whether its adapter is among the ``room`` most recently
    requested distinct adapters before it (warm) or not (cold)."""
    import collections
    recent, out = collections.OrderedDict(), []
    for k in picks:
        out.append(k in recent)
        recent[k] = None
        recent.move_to_end(k)
        if len(recent) > room:
            recent.popitem(last=False)
    return out


def _stream(client, url, model, max_tokens):
    """One streaming completion: (seconds to its first token, tokens streamed, error or None)."""
    import time
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        with client.stream("POST", url + "/v1/completions", json={
                "model": model, "prompt": TENANT_PROMPT, "max_tokens": max_tokens,
                "temperature": 0, "stream": True}) as resp:
            if resp.status_code != 200:
                return None, 0, f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                body = json.loads(line[6:])
                if "error" in body:
                    return None, tokens, f"error event: {body['error']}"
                if body.get("choices") and body["choices"][0].get("text"):
                    tokens += 1
                    if first is None:
                        first = time.perf_counter() - start
    except Exception as exc:  # a failed request is counted, not raised
        return None, tokens, f"{type(exc).__name__}: {exc}"
    return first, tokens, None


def tenant_load(url, names, picks, max_tokens=16, clients=CLIENTS):
    """``clients`` threads send ``picks`` (adapter indices) in order, each request when its
    client's previous one ended; returns the figures of the run."""
    import concurrent.futures
    import statistics
    import threading
    import time

    import httpx

    warm = warm_or_cold(picks)
    lock, results = threading.Lock(), [None] * len(picks)
    queue = iter(range(len(picks)))

    def client_loop():
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    i = next(queue, None)
                if i is None:
                    return
                results[i] = _stream(client, url, names[picks[i]], max_tokens)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as ex:
        list(ex.map(lambda _: client_loop(), range(clients)))
    wall = time.perf_counter() - t0
    failures = [r[2] for r in results if r[2] is not None]

    def spread(flag):
        t = sorted(r[0] for r, w in zip(results, warm) if w == flag and r[0] is not None)
        if not t:
            return {"count": 0}
        return {"count": len(t), "median_ttft_s": statistics.median(t),
                "p99_ttft_s": t[min(len(t) - 1, int(round(0.99 * (len(t) - 1))))]}

    return {"requests": len(picks), "failed": len(failures), "failures": failures[:5],
            "requests_per_s": len(picks) / wall,
            "tokens_per_s": sum(r[1] for r in results) / wall,
            "warm": spread(True), "cold": spread(False)}


def _vllm_server(model_dir, adapters_dir, names, log):
    """vLLM's OpenAI server with lorahook's plugin over the same adapters: (process, URL)."""
    from vllm_run import child_env, start_api_server
    args = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", str(CLIENTS),
            "--seed", "0", "--enable-lora", "--max-loras", str(ROOM), "--max-cpu-loras",
            str(ROOM), "--max-lora-rank", "8", "--lora-modules",
            *[f"{n}={os.path.join(adapters_dir, n)}" for n in names]]
    env = child_env({"VLLM_CPU_OMP_THREADS_BIND": "0", "PYTHONUNBUFFERED": "1"})
    return start_api_server(model_dir, args, env, log, timeout=900)


def tenants(workdir, size="0.5b", requests=512, max_tokens=16, adapter_dtype="float32",
            vllm=True):
    """lorahook serve, then vLLM with lorahook's plugin, on 256 tenants with room for 32."""
    from serve_files import save_model
    from vllm_files import TENANT_KINDS, save_tenants
    model_dir = save_model(os.path.join(workdir, f"llama-{size}"), **SIZES[size])
    adapters_dir, names, elements = save_tenants(workdir, TENANTS, size, TENANT_KINDS[:1])
    per_adapter = elements // TENANTS * (2 if adapter_dtype != "float32" else 4)
    picks = zipf_requests(requests)
    out = {"size": size, "tenants": TENANTS, "room": ROOM, "clients": CLIENTS,
           "requests": requests, "max_tokens": max_tokens, "adapter_dtype": adapter_dtype,
           "distinct adapters requested": len(set(picks)),
           "cold requests": warm_or_cold(picks).count(False)}
    proc, url = start_server(model_dir, adapters_dir, "--capacity-bytes",
                             str(ROOM * per_adapter), "--max-models-per-replica", str(ROOM),
                             "--max-batch-size", str(CLIENTS), "--threads", "1",
                             "--adapter-dtype", adapter_dtype)
    try:
        tenant_load(url, names, [0] * CLIENTS, max_tokens)  # warm-up: the model, not the tenants
        out["lorahook serve"] = tenant_load(url, names, picks, max_tokens)
        out["lorahook serve"]["adapters"] = _stats(url)["adapters"]
    finally:
        stop_server(proc)
    if vllm:
        with open(os.path.join(workdir, "vllm.log"), "w") as log:
            proc, url = _vllm_server(model_dir, adapters_dir, names, log)
            try:
                tenant_load(url, names, [0] * CLIENTS, max_tokens)
                out["vLLM + lorahook plugin"] = tenant_load(url, names, picks, max_tokens)
            finally:
                proc.terminate()
                proc.wait(120)
        a, b = out["lorahook serve"], out["vLLM + lorahook plugin"]
        out["lorahook serve / vLLM (requests/s)"] = a["requests_per_s"] / b["requests_per_s"]
    return out


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "tenants":
        p = argparse.ArgumentParser(prog="serve_bench.py tenants",
                                    description="lorahook serve for many tenants, beside vLLM")
        p.add_argument("--size", choices=list(SIZES), default="0.5b")
        p.add_argument("--requests", type=int, default=512)
        p.add_argument("--max-tokens", type=int, default=16)
        p.add_argument("--adapter-dtype", choices=["float32", "bfloat16", "float16"],
                       default="float32")
        p.add_argument("--skip-vllm", action="store_true")
        a = p.parse_args(sys.argv[2:])
        with tempfile.TemporaryDirectory(prefix="lorahook-tenants-") as tmp:
            print(json.dumps(tenants(tmp, a.size, a.requests, a.max_tokens, a.adapter_dtype,
                                     not a.skip_vllm), indent=2), flush=True)
        return
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
