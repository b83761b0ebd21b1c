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
``POST /v1/unload_lora_adapter`` for adapters under ``--runtime-adapter-root``.
Every error is OpenAI's error object.

Safe to put on a network behind a key: every endpoint but ``/health`` needs
it (``--api-key``, ``--api-key-file`` or ``LORAHOOK_API_KEY``); a request's
failure is its own (a 400 naming a bad parameter before admission, or, for a
failure while its batch runs, an error for that request alone while the
other rows go on); prompts must fit the context (``--max-model-len``);
bodies, nesting, the queue (``--max-queued-requests``) and each request's
time (``--request-timeout``) are bounded; an adapter is admitted into a batch
only when it fits beside the running rows' adapters (``--capacity-bytes``).
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
                        help="bytes of adapters each replica keeps resident; a request waits "
                             "until its adapter fits beside the running ones (default: no bound)")
    parser.add_argument("--max-batch-size", type=int, default=16,
                        help="requests generated together in one batch (16)")
    parser.add_argument("--max-adapters", type=int, default=None,
                        help="distinct adapters in one batch (default: no limit)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + max_tokens of a request, at most the model's context "
                             "(default: the model's context)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="largest request body, bigger ones get 413 (4 MiB)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests each replica lets wait for a batch; more get 503 (256)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may take from its arrival; then 504, or an "
                             "error event for a stream (600)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each replica, which reserves that many of Ray's "
                             "CPUs (default: this machine's CPUs divided among the replicas)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the model's dtype (auto: as saved)")
    parser.add_argument("--address", default="local",
                        help="Ray: 'local' starts one here on 127.0.0.1 without its dashboard "
                             "(default), 'auto' or an address joins a cluster")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                             "(visible in a process listing: prefer --api-key-file or "
                             "LORAHOOK_API_KEY)")
    parser.add_argument("--api-key-file", metavar="PATH", default=None,
                        help="read the key from this file (its first line)")
    parser.add_argument("--allow-runtime-adapters", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "(needs --runtime-adapter-root)")
    parser.add_argument("--runtime-adapter-root", metavar="DIR", default=None,
                        help="the directory runtime adapters must be under (symlinks followed)")
    return parser


def api_key(args, environ=os.environ):
    """The key from --api-key, --api-key-file or LORAHOOK_API_KEY (in that order), or None."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key")
        return key
    key = args.api_key if args.api_key is not None else environ.get("LORAHOOK_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return None if key is None else key.strip()


def check_arguments(args):
    """Refuse bad settings before Ray starts; returns the API key (or ``None``)."""
    for name, low in (("replicas", 1), ("max_batch_size", 1), ("port", 1), ("threads", 1),
                      ("max_adapters", 1), ("capacity_bytes", 0), ("max_model_len", 1),
                      ("max_body_bytes", 1), ("max_queued_requests", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}")
    if not args.request_timeout > 0:
        raise ValueError("--request-timeout must be > 0")
    if not os.path.isdir(args.model_dir):
        raise FileNotFoundError(f"MODEL_DIR {args.model_dir!r} is not a directory")
    if args.adapters and not os.path.isdir(args.adapters):
        raise FileNotFoundError(f"--adapters {args.adapters!r} is not a directory")
    if args.allow_runtime_adapters and not args.runtime_adapter_root:
        raise ValueError("--allow-runtime-adapters needs --runtime-adapter-root DIR (the "
                         "directory runtime adapters must be under)")
    if args.runtime_adapter_root and not args.allow_runtime_adapters:
        raise ValueError("--runtime-adapter-root is for --allow-runtime-adapters")
    if args.runtime_adapter_root and not os.path.isdir(args.runtime_adapter_root):
        raise FileNotFoundError(f"--runtime-adapter-root {args.runtime_adapter_root!r} is not "
                                f"a directory")
    return api_key(args)


def _context(model_dir, max_model_len):
    """``--max-model-len`` checked against the model's context (read from its config)."""
    import transformers
    from .engine import model_context
    context = model_context(transformers.AutoConfig.from_pretrained(model_dir))
    if max_model_len is None:
        if context is None:
            raise ValueError("the model's config gives no max_position_embeddings: give "
                             "--max-model-len")
        return None
    if context is not None and max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} is more than the model's context "
                         f"({context} tokens)")
    return max_model_len


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


APP_NAME = "lorahook"


def main(args, out=sys.stdout):
    """Run the server until SIGINT or SIGTERM; the exit code."""
    key = check_arguments(args)
    local = args.address == "local"
    if local:
        # a single-node Ray on the loopback address, as Ray does on its own on macOS
        # and Windows (read when ray is imported, so set before anything imports it)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    max_model_len = _context(args.model_dir, args.max_model_len)
    if args.allow_runtime_adapters and key is None:
        print("lorahook serve: warning: runtime adapters are allowed without an API key: anyone "
              "who can reach the server can load adapters from under "
              f"{args.runtime_adapter_root}", file=sys.stderr, flush=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from .app import build_app

    stop = threading.Event()
    if local:  # Ray's own servers on loopback, no dashboard
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    else:
        ray.init(address=args.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app(args.model_dir, args.adapters, replicas=args.replicas,
                        capacity_bytes=args.capacity_bytes, max_batch_size=args.max_batch_size,
                        max_adapters=args.max_adapters, dtype=args.dtype, api_key=key,
                        runtime_root=args.runtime_adapter_root, threads=threads,
                        max_model_len=max_model_len, max_body_bytes=args.max_body_bytes,
                        max_queued_requests=args.max_queued_requests,
                        request_timeout=args.request_timeout)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
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
            if local:
                serve.shutdown()
            else:  # a joined cluster keeps its other applications
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0
