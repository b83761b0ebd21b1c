"""Mixed-adapter batches on Ray Serve: ``lorahook.ray_serve.batch`` against Ray's ``serve.batch``.

    pip install 'lorahook[ray]'
    python benchmarks/ray_serve_batch.py [--rounds 5] [--json out.json]

A script, not an asv suite: it starts a local Ray cluster (two CPUs, no
dashboard, usage statistics off, HTTP on 127.0.0.1) and shuts it down.

The scenario: one replica of a model whose forward dominates the cost of a
request -- four float32 ``4096 x 4096`` projections (256 MiB of weights read by
every forward), each with a rank-16 LoRA adapter from an
:class:`~lorahook.AdapterSet` of 8 adapters.  On a CPU a float32 forward of 16
rows is compute-bound and costs several times a forward of one row (measured
here: about 3x per projection), so the throughput ratio stays below the ratio
of forward counts.
64 requests, 8 per adapter, are sent at once through a ``DeploymentHandle``
with Ray's multiplexed model id; the replica routes them with
:func:`lorahook.ray_serve.multiplexed` and batches them with

* ``lorahook``: :func:`lorahook.ray_serve.batch` -- one batch holds any
  adapters;
* ``serve.batch``: Ray's own batcher, which splits every batch by model id
  into one forward per adapter.

Both use ``max_batch_size=16`` and ``batch_wait_timeout_s=0.01``, and both run
their forwards on one worker thread (a one-thread executor, BLAS at one
thread), so the compute per forward is the same and only the number of
forwards differs.  Each round sends the 64 requests and waits for all of them;
the contenders alternate, round by round, and the figures are medians.

Then the same lorahook deployment with two replicas against one, on the
machine's cores: each replica holds the adapters Ray routes to it.

Reported: requests per second, the ratio, and the forwards each round took
(goal: >= 3x over ``serve.batch``; required: >= 2x, with at most 8 forwards
for 64 requests).  ``--check`` exits 1 when the requirement is not met.
"""
import argparse
import asyncio
import concurrent.futures
import json
import os
import socket
import statistics
import sys
import time

import numpy as np

D, LAYERS, RANK = 4096, 4, 16
ADAPTERS = [f"tenant{i}" for i in range(8)]
REQUESTS = 64
MAX_BATCH_SIZE, WAIT_S = 16, 0.01


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(serve, lorahook_batch, multiplexed):
    """The deployment class (made here: ray is imported only once the script runs)."""
    import lorahook
    from lorahook import AdapterSet, LoraAdapter, LoraLayer, apply_lora_rows

    @serve.deployment(max_ongoing_requests=REQUESTS, ray_actor_options={"num_cpus": 0})
    class Model:
        def __init__(self):
            import threadpoolctl
            lorahook.threads.configure(blas_threads=1)
            self._limits = threadpoolctl.threadpool_limits(1)  # numpy's BLAS too
            rng = np.random.default_rng(0)
            self.weights = [(rng.standard_normal((D, D), dtype=np.float32) / np.float32(D ** 0.5))
                            for _ in range(LAYERS)]
            self.adapters = AdapterSet(capacity_bytes=None)
            for i, name in enumerate(ADAPTERS):
                r = np.random.default_rng(100 + i)
                self.adapters.add(name, LoraAdapter({
                    (layer, "q_proj"): LoraLayer(r.standard_normal((RANK, D)) / np.sqrt(D),
                                                 r.standard_normal((D, RANK)) * 0.1)
                    for layer in range(LAYERS)}))
            self.load = multiplexed(self.adapters, len(ADAPTERS))
            self.pool = concurrent.futures.ThreadPoolExecutor(1)  # one forward thread
            self.forwards = 0

        def _forward(self, names, xs):
            hook = self.adapters.bind(names)
            x = np.ascontiguousarray(np.stack(xs), dtype=np.float32)
            for layer, w in enumerate(self.weights):
                y = x @ w.T
                apply_lora_rows(hook, layer, "q_proj", x, y, D, D)
                x = np.tanh(y)
            self.forwards += 1
            return [float(row[0]) for row in x]

        async def _run(self, names, xs):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.pool, self._forward, names, xs)

        # lorahook: one batch, any adapters
        async def mixed(self, x):
            name = await self.load(serve.get_multiplexed_model_id())
            return await self.mixed_batch(name, x)

        @lorahook_batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=WAIT_S)
        async def mixed_batch(self, names, xs):
            return await self._run(names, xs)

        # Ray's serve.batch: one sub-batch per model id
        async def split(self, x):
            await self.load(serve.get_multiplexed_model_id())
            return await self.split_batch(x)

        @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=WAIT_S)
        async def split_batch(self, xs):
            name = serve.get_multiplexed_model_id() or None  # the sub-batch's model id
            return await self._run([name] * len(xs), xs)

        def take_forwards(self):
            n, self.forwards = self.forwards, 0
            return n

    return Model


def one_round(handle, method, xs):
    """Send the 64 requests at once; seconds until the last answer."""
    t0 = time.perf_counter()
    responses = [getattr(handle.options(multiplexed_model_id=ADAPTERS[i % len(ADAPTERS)]),
                         method).remote(x) for i, x in enumerate(xs)]
    for r in responses:
        r.result(timeout_s=300)
    return time.perf_counter() - t0


def run(rounds=5):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from lorahook.ray_serve import batch, multiplexed

    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(D).astype(np.float32) for _ in range(REQUESTS)]
    res = {"requests": REQUESTS, "adapters": len(ADAPTERS), "rounds": rounds,
           "max_batch_size": MAX_BATCH_SIZE, "batch_wait_timeout_s": WAIT_S,
           "model": f"{LAYERS} x float32 {D}x{D} projections, rank-{RANK} adapters",
           "cpus": os.cpu_count()}
    # Ray puts the driver's working directory first on the workers' sys.path: start it
    # from here, so that a source checkout's lorahook/ never shadows the installed one.
    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        os.chdir(cwd)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
        Model = build(serve, batch, multiplexed)

        # --- one replica: lorahook.batch against serve.batch -----------------
        handle = serve.run(Model.bind(), name="bench", route_prefix="/bench")
        for method in ("mixed", "split"):  # warm-up: adapters reported, code paths run
            one_round(handle, method, xs)
        handle.take_forwards.remote().result(timeout_s=60)
        times = {"mixed": [], "split": []}
        counts = {"mixed": [], "split": []}
        for _ in range(rounds):
            for method in ("mixed", "split"):
                times[method].append(one_round(handle, method, xs))
                counts[method].append(handle.take_forwards.remote().result(timeout_s=60))
        med = {m: statistics.median(t) for m, t in times.items()}
        res["one_replica"] = {
            "lorahook_batch": {"seconds": med["mixed"], "requests_per_s": REQUESTS / med["mixed"],
                               "forwards_per_round": counts["mixed"]},
            "serve_batch": {"seconds": med["split"], "requests_per_s": REQUESTS / med["split"],
                            "forwards_per_round": counts["split"]},
            "throughput_ratio": med["split"] / med["mixed"],
        }

        # --- two replicas against one (lorahook.batch) ----------------------
        one = med["mixed"]
        handle = serve.run(Model.options(num_replicas=2).bind(), name="bench",
                           route_prefix="/bench")
        for _ in range(2):  # warm-up: each adapter settles on a replica
            one_round(handle, "mixed", xs)
            time.sleep(0.5)
        two = statistics.median(one_round(handle, "mixed", xs) for _ in range(rounds))
        res["two_replicas"] = {"seconds": two, "requests_per_s": REQUESTS / two,
                               "speedup_over_one": one / two}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return res


def verdict(res):
    """``(required met, goal met)`` for the one-replica comparison."""
    one = res["one_replica"]
    few = max(one["lorahook_batch"]["forwards_per_round"]) <= 8
    return few and one["throughput_ratio"] >= 2.0, few and one["throughput_ratio"] >= 3.0


def format_report(res):
    one, two = res["one_replica"], res["two_replicas"]
    lh, rb = one["lorahook_batch"], one["serve_batch"]
    return "\n".join([
        f"{res['requests']} requests for {res['adapters']} adapters at once, one replica "
        f"({res['model']}), max_batch_size {res['max_batch_size']}, one forward thread; "
        f"medians of {res['rounds']} rounds on {res['cpus']} CPUs:",
        f"  lorahook.ray_serve.batch: {lh['requests_per_s']:7.1f} requests/s "
        f"({lh['seconds'] * 1e3:.0f} ms a round), forwards per round {lh['forwards_per_round']}",
        f"  Ray serve.batch:          {rb['requests_per_s']:7.1f} requests/s "
        f"({rb['seconds'] * 1e3:.0f} ms a round), forwards per round {rb['forwards_per_round']}",
        f"  throughput ratio lorahook / serve.batch: {one['throughput_ratio']:.2f}x",
        f"two replicas against one (lorahook.batch): {two['requests_per_s']:.1f} requests/s, "
        f"{two['speedup_over_one']:.2f}x",
        f"required (>= 2x, <= 8 forwards for {res['requests']} requests): "
        f"{'met' if verdict(res)[0] else 'NOT MET'}; goal (>= 3x): "
        f"{'met' if verdict(res)[1] else 'not met'}",
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless >= 2x with at most 8 forwards for 64 requests")
    args = parser.parse_args(argv)
    res = run(args.rounds)
    print(format_report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if args.check and not verdict(res)[0] else 0


if __name__ == "__main__":
    sys.exit(main())
