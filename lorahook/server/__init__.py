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
only when it fits beside the running rows' adapters (``--capacity-bytes``,
by default a quarter of the machine's memory divided among the replicas;
``--adapter-dtype`` holds them in 16 or 8 bits), and the head node's shared loader
keeps at most ``--resolver-capacity-bytes``: thousands of adapters on disk
never grow a server without bound.
Operated as a server: with ``--address local`` (the default) everything of
Ray's listens on 127.0.0.1 but Ray Serve's replica gRPC servers (one per
replica, which Serve binds to all interfaces).  On SIGTERM or SIGINT the
server drains: new requests get a 503 at once, the admitted ones have
``--drain-timeout`` seconds to finish, the rest end with an error (an error
event and ``[DONE]`` for a stream), then the application, Serve and Ray (when
it started them) stop, and the process exits 0.  A second signal ends the
drain at once.  With ``--address`` it joins a cluster; what the application
keeps cluster-wide lives on the head node (:mod:`lorahook.server.state`).
The same application runs under Ray Serve's own tooling through
``lorahook.server.app:app_builder``.

``import lorahook`` never imports this package, and importing it imports only
the standard library: ray, fastapi, torch and transformers are imported when
the server starts (:mod:`lorahook.server.app`).  The options are
:mod:`lorahook.server.options`, the protocol :mod:`lorahook.server.openai`,
the generation :mod:`lorahook.server.engine`.
"""
import os
import signal
import sys
import threading
import time

from .options import DTYPES, add_arguments, api_key, check_arguments, key_warning, settings_from

__all__ = ["add_arguments", "main", "DTYPES", "APP_NAME"]

#: The name of the Ray Serve application ``lorahook serve`` deploys.
APP_NAME = "lorahook"


def _wait_healthy(url, deadline, stop):
    import urllib.request
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _drain(state, seconds, signals, out):
    """Drain the application: until every replica has no request in flight, at most
    ``seconds`` (and a margin for the replicas to end what is left), or a second signal."""
    import ray
    print(f"lorahook serve: draining (at most {seconds:g} s)", file=out, flush=True)
    ray.get(state.drain.remote(seconds), timeout=30)
    end = time.monotonic() + seconds + 5
    while time.monotonic() < end and len(signals) < 2:
        if not ray.get(state.busy.remote(), timeout=30):
            time.sleep(0.5)  # the last events leave Serve's proxy
            return
        time.sleep(0.1)


def _stop(local, settings):
    """Stop the application, and Serve and Ray if this process started them."""
    import ray
    from ray import serve

    from ..ray_serve import NAMESPACE
    from .state import state_name
    try:
        if local:
            serve.shutdown()
        else:  # a joined cluster keeps its other applications
            serve.delete(APP_NAME)
            names = [state_name(APP_NAME)]
            if settings.adapters_dir:
                names.append(settings.resolver_name)
            for name in names:
                try:
                    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                except ValueError:
                    pass
    finally:
        ray.shutdown()


def main(args, out=sys.stdout):
    """Run the server until SIGINT or SIGTERM, then drain and stop it; the exit code."""
    key = check_arguments(args)
    local = args.address == "local"
    if local:
        # a single-node Ray on the loopback address, as Ray does on its own on macOS
        # and Windows (read when ray is imported, so set before anything imports it)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    settings = settings_from(args, key)
    print(f"lorahook serve: adapters held in {settings.adapter_dtype}, at most "
          f"{settings.capacity_bytes} bytes per replica (--capacity-bytes), "
          f"{settings.resolver_capacity_bytes} bytes shared (--resolver-capacity-bytes)",
          file=out, flush=True)
    warning = key_warning(settings)
    if warning:
        print(f"lorahook serve: warning: {warning}", file=sys.stderr, flush=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from .app import build_app
    from .state import state_of

    signals = []
    stop = threading.Event()
    if local:  # Ray's own servers on loopback, no dashboard
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    else:
        ray.init(address=args.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/", blocking=False)

        def on_signal(*_):
            signals.append(1)
            stop.set()

        # after Ray's own set-up, which installs handlers of its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        url = f"http://{args.host}:{args.port}"
        if not _wait_healthy(url, time.monotonic() + 300, stop) and not stop.is_set():
            raise RuntimeError(f"the server did not answer at {url}/health (each of the "
                               f"{args.replicas} replicas reserves {settings.threads} of Ray's "
                               f"CPUs: {ray.cluster_resources().get('CPU', 0):g} in this "
                               f"cluster; see --threads)")
        if not stop.is_set():
            print(f"lorahook serve: {url}/v1 (model '{settings.base_id}')", file=out, flush=True)
        while not stop.wait(0.5):
            pass
        _drain(state_of(APP_NAME), args.drain_timeout, signals, out)
    finally:
        _stop(local, settings)
    print("lorahook serve: stopped", file=out, flush=True)
    return 0
