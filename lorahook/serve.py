"""``lorahook serve``: an OpenAI-compatible server for one causal LM and many adapters.

Runs on Ray Serve (``pip install 'lorahook[serve]'``): a FastAPI ingress
deployment of ``--replicas`` replicas, each holding the model, an
:class:`~lorahook.AdapterSet` bounded by ``--capacity-bytes`` that loads
adapters through :func:`lorahook.ray_serve.shared_resolver` over
``--adapters`` (once per cluster), :func:`lorahook.ray_serve.multiplexed`
for Ray's routing, and :func:`lorahook.ray_serve.batch` in streaming mode:
requests for different adapters share one batch, generated token by token
(:mod:`lorahook._engine`), and each request's stream starts with its first
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
``import lorahook`` never imports this module; it imports ray, fastapi,
torch and transformers when the server is built.
"""
import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid

__all__ = ["add_arguments", "main", "build_app", "parse_completion"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
# A stream sends what it has at most this often after its first token (each event
# costs the replica and Ray's proxy more than a decode step of a small model).
_FLUSH_S = 0.05
_DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}


class RequestError(Exception):
    """An OpenAI-style error: HTTP status, message, type, offending parameter, code."""

    def __init__(self, status, message, param=None, kind=None, code=None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error",
                             404: "invalid_request_error", 503: "server_error"}.get(status,
                                                                                  "server_error")
        self.code = code

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


# --------------------------------------------------------------------------- request checks


def _number(body, name, default, lo, hi, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise RequestError(400, f"'{name}' must be {kind}, got {json.dumps(value)[:40]}", name)
    if not lo <= value <= hi:
        raise RequestError(400, f"'{name}' must be in [{lo}, {hi}], got {value}", name)
    return value


def parse_completion(body, kind):
    """The sampling settings of a completion or chat body (``RequestError`` for a bad one)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required: the base model's id or an adapter name",
                           "model")
    n = _number(body, "n", 1, 1, 1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings",
                           "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    return {
        "model": model,
        "n": n,
        "max_tokens": _number(body, "max_tokens", _DEFAULT_MAX_TOKENS[kind], 1, 1 << 20,
                              integer=True),
        "temperature": float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        "top_p": float(_number(body, "top_p", 1.0, 0.0, 1.0)),
        "seed": _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True),
        "stop": stop,
        "stream": stream,
    }


# --------------------------------------------------------------------------- the app


def build_app(model_dir, adapters_dir=None, *, replicas=1, capacity_bytes=None,
              max_batch_size=16, max_adapters=None, dtype="auto", api_key=None,
              allow_runtime_adapters=False, batch_wait_timeout_s=0.01, threads=1):
    """The Ray Serve application (call after ``ray.init``).

    Each replica reserves ``threads`` of Ray's CPUs and runs torch on that
    many threads (Ray alone would give an actor one)."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve

    from .ray_serve import DONE, batch, multiplexed, shared_resolver

    model_dir = os.path.abspath(model_dir)
    base_id = os.path.basename(model_dir.rstrip("/"))
    adapters_dir = os.path.abspath(adapters_dir) if adapters_dir else None
    shared = shared_resolver(adapters_dir) if adapters_dir else None
    registry = _registry_class().options(name=f"lorahook-serve-{uuid.uuid4().hex[:8]}",
                                         namespace="lorahook").remote()
    api = FastAPI(title="lorahook serve")
    created = int(time.time())

    @api.exception_handler(RequestError)
    async def _error(request, exc):
        return JSONResponse(exc.body(), status_code=exc.status)

    @serve.deployment(num_replicas=replicas, max_ongoing_requests=2 * max_batch_size,
                      ray_actor_options={"num_cpus": threads})
    @serve.ingress(api)
    class LorahookServer:
        def __init__(self):
            import torch
            import transformers

            import lorahook
            from lorahook.torch import attach, geometry_of

            torch.set_num_threads(threads)
            self.threads = torch.get_num_threads()
            lorahook.threads.configure(blas_threads=1)
            kw = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
            self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kw).eval()
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
            config = self.model.generation_config
            eos = config.eos_token_id if config.eos_token_id is not None else self.tokenizer.eos_token_id
            self.eos = [eos] if isinstance(eos, int) else list(eos or [])
            pad = self.tokenizer.pad_token_id
            self.pad = pad if isinstance(pad, int) else (self.eos[0] if self.eos else 0)
            from lorahook._engine import cache_of, joinable
            with torch.inference_mode():  # can requests join a running batch on this cache?
                probe = self.model(input_ids=torch.tensor([[self.pad]]), use_cache=True)
            self.joining = joinable(cache_of(probe))
            self.generate = self._generate_joining if self.joining else self._generate_fixed
            self.runtime = {}    # name -> (path, version) of adapters loaded at run time
            self.paths = {}      # "name/vN" -> path: every runtime version a request was given
            self.adapters = lorahook.AdapterSet(geometry_of(self.model),
                                                capacity_bytes=capacity_bytes,
                                                resolver=self._resolve)
            self.attached = attach(self.model, self.adapters)
            self.load = multiplexed(self.adapters, 64)
            self.batches = []  # (requests admitted, distinct adapters then running), recent first
            self.steps, self.step_seconds = 0, 0.0

        # --- adapters ------------------------------------------------------

        # A runtime adapter is installed as "name/vN", one name per version (no
        # directory adapter can have a "/"): a request keeps the version it was
        # given for all its steps, even when a reload comes while it decodes.

        def _resolve(self, name):
            path = self.paths.get(name)
            if path is not None:
                return lorahook_from_peft(path)
            return shared(name) if shared is not None and "/" not in name else None

        async def _sync_runtime(self):
            if not allow_runtime_adapters:
                return
            entries = await registry.entries.remote()
            if entries == self.runtime:
                return
            self.runtime = entries
            current = {f"{name}/v{version}" for name, (_, version) in entries.items()}
            for key in set(self.paths) - current:  # replaced or unloaded: free it here
                try:                               # (a request still decoding reloads it)
                    self.adapters.remove(key)
                except KeyError:
                    pass                           # not resident here

        async def _adapter(self, model):
            """The adapter name for a request's ``model`` (``None``: the base model)."""
            if model == base_id:
                return None
            await self._sync_runtime()
            key = model
            if model in self.runtime:
                path, version = self.runtime[model]
                key = f"{model}/v{version}"
                self.paths[key] = path
            try:
                name = await self.load(key)
            except KeyError:
                raise RequestError(404, f"The model '{model}' does not exist", "model",
                                   code="model_not_found") from None
            except MemoryError as exc:
                raise RequestError(503, f"adapter '{model}' cannot be made resident: {exc}",
                                   "model") from None
            except ValueError as exc:  # LoraFormatError / LoraValidationError
                raise RequestError(400, f"adapter '{model}' cannot be served: "
                                        f"{type(exc).__name__}", "model") from None
            return name

        def _listed(self):
            names = set(self.runtime)
            if adapters_dir and os.path.isdir(adapters_dir):
                names.update(n for n in os.listdir(adapters_dir)
                             if os.path.isfile(os.path.join(adapters_dir, n, "adapter_config.json")))
            return sorted(names)

        # --- generation ----------------------------------------------------

        def _admit(self, run, names, requests):
            run.admit(names, requests)
            self.batches.append((len(names), len({r.name for r in run.open} - {None})))
            del self.batches[:-1000]

        async def _step(self, run):
            """One step off the event loop: ``(live request, report)`` per open request."""
            start = time.perf_counter()
            reports = await asyncio.to_thread(run.step)
            self.step_seconds += time.perf_counter() - start
            self.steps += 1
            return zip(run.reported, reports)

        @batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s,
               max_adapters=max_adapters, continuous=True)
        async def _generate_joining(self, names, requests):
            """Requests join between steps; a finished request's row leaves at once."""
            from lorahook._engine import Batch
            run = Batch(self.model, self.tokenizer, self.attached, self.pad, self.eos, True)
            self._admit(run, names, requests)
            while not run.done:
                joined = yield [DONE if report is None else (*report, len(live.generated))
                                for live, report in await self._step(run)]
                run.retire(joined.left)
                if joined.names:
                    self._admit(run, joined.names, joined.items)

        @batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s,
               max_adapters=max_adapters)
        async def _generate_fixed(self, names, requests):
            """A cache that cannot take rows (sliding windows, linear attention): whole batches."""
            from lorahook._engine import Batch
            run = Batch(self.model, self.tokenizer, self.attached, self.pad, self.eos, False)
            self._admit(run, names, requests)
            while not run.done:
                chunks = [DONE] * len(requests)
                for live, report in await self._step(run):
                    if report is not None:
                        chunks[live.index] = (*report, len(live.generated))
                yield chunks

        # --- HTTP ----------------------------------------------------------

        def _check_key(self, request):
            if api_key is not None:
                header = request.headers.get("authorization", "")
                if header != f"Bearer {api_key}":
                    raise RequestError(401, "Incorrect API key provided", code="invalid_api_key")

        @api.get("/health")
        async def health(self):
            return {"status": "ok"}

        @api.get("/lorahook/stats")
        async def stats(self, request: HttpRequest):
            """This replica's recent batches and steps, and its adapter set's counters."""
            self._check_key(request)
            return {"batches": self.batches[-100:], "steps": self.steps,
                    "step_seconds": self.step_seconds, "torch_threads": self.threads,
                    "joining": self.joining, "adapters": self.adapters.stats()}

        @api.get("/v1/models")
        async def models(self, request: HttpRequest):
            self._check_key(request)
            await self._sync_runtime()
            data = [{"id": base_id, "object": "model", "created": created, "owned_by": "lorahook"}]
            data += [{"id": n, "object": "model", "created": created, "owned_by": "lorahook",
                      "parent": base_id} for n in self._listed()]
            return {"object": "list", "data": data}

        @api.post("/v1/completions")
        async def completions(self, request: HttpRequest):
            return await self._complete(request, "completion")

        @api.post("/v1/chat/completions")
        async def chat_completions(self, request: HttpRequest):
            return await self._complete(request, "chat")

        async def _complete(self, request, kind):
            self._check_key(request)
            body = await _json_body(request)
            settings = parse_completion(body, kind)
            prompt_ids = self._prompt(body, kind)
            name = await self._adapter(settings["model"])
            from lorahook._engine import Request
            req = Request(prompt_ids, settings["max_tokens"], settings["temperature"],
                          settings["top_p"], settings["seed"], settings["stop"])
            rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
            meta = (rid, settings["model"], int(time.time()), kind, len(prompt_ids))
            stream = self.generate(name, req)
            if settings["stream"]:
                return StreamingResponse(self._events(stream, meta), media_type="text/event-stream")
            text, reason, used = [], None, 0
            async for delta, finish, used in stream:
                text.append(delta)
                if finish is not None:
                    reason = finish
                    break
            await stream.aclose()
            return _completion(meta, "".join(text), reason, used)

        def _prompt(self, body, kind):
            if kind == "chat":
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str)
                        and isinstance(m.get("content"), str) for m in messages):
                    raise RequestError(400, "'messages' must be a non-empty list of "
                                            "{role, content} objects with string content",
                                       "messages")
                if not getattr(self.tokenizer, "chat_template", None):
                    raise RequestError(400, "this model's tokenizer has no chat template: use "
                                            "/v1/completions", "messages")
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
                return [int(t) for t in ids]
            prompt = body.get("prompt")
            vocab = self.model.config.vocab_size
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str) and prompt:
                return self.tokenizer(prompt)["input_ids"]
            if (isinstance(prompt, list) and prompt and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                    for t in prompt)):
                return list(prompt)
            raise RequestError(400, f"'prompt' must be a non-empty string or a list of token "
                                    f"ids in [0, {vocab})", "prompt")

        async def _events(self, stream, meta):
            """Server-sent events: the first token at once, then what came in each
            ``_FLUSH_S`` (a few tokens per event under load), then ``[DONE]``."""
            loop = asyncio.get_running_loop()
            try:
                held, last = [], None
                async for delta, finish, _ in stream:
                    held.append(delta)
                    now = loop.time()
                    if finish is not None or last is None or now - last >= _FLUSH_S:
                        yield "data: " + json.dumps(_completion(meta, "".join(held), finish)) + "\n\n"
                        held, last = [], now
                    if finish is not None:
                        break
                yield "data: [DONE]\n\n"
            finally:
                await stream.aclose()

        async def _runtime_body(self, request):
            """The body of a load / unload request (404 unless runtime adapters are on)."""
            self._check_key(request)
            if not allow_runtime_adapters:
                raise RequestError(404, "runtime adapters are off (--allow-runtime-adapters)")
            return await _json_body(request)

        @api.post("/v1/load_lora_adapter")
        async def load_lora_adapter(self, request: HttpRequest):
            body = await self._runtime_body(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or name == base_id or "/" in name:
                raise RequestError(400, "'lora_name' must be a non-empty name other than the "
                                        "base model's", "lora_name")
            if not isinstance(path, str) or not os.path.isdir(path):
                raise RequestError(400, f"'lora_path' must be a PEFT adapter directory on the "
                                        f"server, got {json.dumps(path)[:80]}", "lora_path")
            try:  # read and checked here, before any replica is told of it
                adapter = await asyncio.to_thread(lorahook_from_peft, path)
                adapter.validate_against(self.adapters.model)
            except ValueError as exc:
                raise RequestError(400, f"'{path}' cannot be served: {exc}", "lora_path") from None
            await registry.put.remote(name, os.path.abspath(path))
            return {"status": "ok", "lora_name": name}

        @api.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(self, request: HttpRequest):
            name = (await self._runtime_body(request)).get("lora_name")
            if not await registry.remove.remote(name):
                raise RequestError(404, f"no runtime adapter named '{name}'", "lora_name")
            return {"status": "ok", "lora_name": name}

    return LorahookServer.bind()


async def _json_body(request):
    """A request's JSON object (``RequestError`` 400 for anything else)."""
    try:
        body = await request.json()
    except ValueError:
        raise RequestError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def lorahook_from_peft(path):
    from .adapter import LoraAdapter
    return LoraAdapter.from_peft(path)


def _completion(meta, text, reason, used=None):
    """An OpenAI completion object: whole (with ``usage``), or a streamed chunk (``used`` None)."""
    rid, model, created, kind, prompt_tokens = meta
    chunk = used is None
    if kind == "chat":
        choice = {("delta" if chunk else "message"): {"role": "assistant", "content": text}}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"text": text}
        obj = "text_completion"
    choice.update(index=0, finish_reason=reason, logprobs=None)
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if not chunk:
        out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": used,
                        "total_tokens": prompt_tokens + used}
    return out


def _registry_class():
    import ray

    @ray.remote(num_cpus=0)
    class Registry:
        """Adapters loaded at run time: name -> (path, version), shared by every replica."""

        def __init__(self):
            self._entries = {}
            self._version = 0

        def put(self, name, path):
            self._version += 1
            self._entries[name] = (path, self._version)

        def remove(self, name):
            return self._entries.pop(name, None) is not None

        def entries(self):
            return dict(self._entries)

    return Registry


# --------------------------------------------------------------------------- command line


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
