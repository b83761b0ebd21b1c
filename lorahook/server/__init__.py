"""``lorahook serve``: an OpenAI-compatible server for one causal LM and many adapters.

Runs on Ray Serve (``pip install 'lorahook[serve]'``): a FastAPI ingress
deployment of ``--replicas`` replicas, each holding the model, an
:class:`~lorahook.AdapterSet` bounded by ``--capacity-bytes`` that loads
adapters through :func:`lorahook.ray_serve.shared_resolver` over
``--adapters`` (once per cluster), :func:`lorahook.ray_serve.multiplexed`
for Ray's routing, and :func:`lorahook.ray_serve.batch` in streaming mode:
requests for different adapters share one batch, generated token by token
(:mod:`lorahook.server.engine`), and each request's stream starts with its first
token and ends when it is done.  Batching is continuous where the model's
cache allows it (transformers' dynamic cache of full-attention layers): a
request that arrives while a batch decodes joins it at the next step, and a
finished request's row leaves at once; models with sliding-window or
linear-attention caches run whole batches.  Each replica reserves
``--threads`` of Ray's CPUs and runs torch on that many threads.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (with the tokenizer's chat template) and, with
``--allow-runtime-adapters``, vLLM's ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.  Errors are OpenAI's error object.
``import lorahook`` never imports this package, and importing it imports only
the standard library: ray, fastapi, torch and transformers are imported when
the server starts (:mod:`lorahook.server.app`).  The protocol is
:mod:`lorahook.server.openai`, the generation :mod:`lorahook.server.engine`.
"""
import os
import signal
import sys
import threading
import time

__all__ = ["add_arguments", "main", "DTYPES"]

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(parser):
    parser.add_argument("model_dir", metavar="MODEL_DIR",
                        help="a transformers causal LM and its tokenizer (a local directory)")
    parser.add_argument("--adapters", metavar="DIR",
                        help="PEFT adapters, one directory each: <DIR>/<name> is served as "
                             "model '<name>'")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument("--replicas", type=int, default=1, help="server replicas (1)")
    parser.add_argument("--capacity-bytes", type=int, default=None,
                        help="bytes of adapters each replica keeps resident (default: no bound)")
    parser.add_argument("--max-batch-size", type=int, default=16,
                        help="requests generated together in one batch (16)")
    parser.add_argument("--max-adapters", type=int, default=None,
                        help="distinct adapters in one batch (default: no limit)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each replica, which reserves that many of Ray's "
                             "CPUs (default: this machine's CPUs divided among the replicas)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the model's dtype (auto: as saved)")
    parser.add_argument("--address", default="local",
                        help="Ray: 'local' starts one here (default), 'auto' or an address "
                             "joins a cluster")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    parser.add_argument("--allow-runtime-adapters", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    return parser


def _wait_healthy(url, deadline):
    import urllib.request
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def main(args, out=sys.stdout):
    """Run the server until SIGINT or SIGTERM; the exit code."""
    for name, low in (("replicas", 1), ("max_batch_size", 1), ("port", 1), ("threads", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    if not os.path.isdir(args.model_dir):
        raise FileNotFoundError(f"MODEL_DIR {args.model_dir!r} is not a directory")
    if args.adapters and not os.path.isdir(args.adapters):
        raise FileNotFoundError(f"--adapters {args.adapters!r} is not a directory")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from .app import build_app

    stop = threading.Event()
    init = dict(include_dashboard=False, log_to_driver=False)
    if args.address == "local":
        init.update(address="local")
    else:
        init.update(address=args.address)
    ray.init(**init)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app(args.model_dir, args.adapters, replicas=args.replicas,
                        capacity_bytes=args.capacity_bytes, max_batch_size=args.max_batch_size,
                        max_adapters=args.max_adapters, dtype=args.dtype, api_key=args.api_key,
                        allow_runtime_adapters=args.allow_runtime_adapters,
                        threads=threads)
        serve.run(app, name="lorahook", route_prefix="/", blocking=False)
        # after Ray's own set-up, which installs handlers of its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        url = f"http://{args.host}:{args.port}"
        if not _wait_healthy(url, time.monotonic() + 300):
            raise RuntimeError(f"the server did not answer at {url}/health (each of the "
                               f"{args.replicas} replicas reserves {threads} of Ray's CPUs: "
                               f"{ray.cluster_resources().get('CPU', 0):g} in this cluster; "
                               f"see --threads)")
        print(f"lorahook serve: {url}/v1 (model '{os.path.basename(os.path.abspath(args.model_dir))}')",
              file=out, flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
