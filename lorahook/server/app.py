"""The Ray Serve application of ``lorahook serve``: one deployment, its routes and its replicas.

Each replica holds the model, an :class:`~lorahook.AdapterSet` bounded by
``capacity_bytes`` that loads adapters through
:func:`lorahook.ray_serve.shared_resolver` over the adapters directory (once
per cluster), :func:`lorahook.ray_serve.multiplexed` for Ray's routing, and
:func:`lorahook.ray_serve.batch` in streaming mode: requests for different
adapters share one batch, generated token by token
(:mod:`lorahook.server.engine`).  What a request may say is
:mod:`lorahook.server.openai`'s.
"""
import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import ray
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from ..adapter import LoraAdapter
from ..ray_serve import DONE, batch, multiplexed, shared_resolver
from .openai import RequestError, completion, json_object, parse_completion, prompt_ids

__all__ = ["Settings", "build_app"]

# A stream sends what it has at most this often after its first token (each event
# costs the replica and Ray's proxy more than a decode step of a small model).
FLUSH_S = 0.05


@dataclass(frozen=True)
class Settings:
    """What every replica is built from (pickled to each replica)."""

    model_dir: str
    adapters_dir: Optional[str] = None
    capacity_bytes: Optional[int] = None
    max_batch_size: int = 16
    max_adapters: Optional[int] = None
    batch_wait_timeout_s: float = 0.01
    dtype: str = "auto"
    api_key: Optional[str] = None
    allow_runtime_adapters: bool = False
    threads: int = 1
    shared: Any = None      # the shared_resolver over adapters_dir
    registry: Any = None    # the Registry actor of runtime adapters
    created: int = 0

    @property
    def base_id(self):
        return os.path.basename(self.model_dir.rstrip("/"))


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


api = FastAPI(title="lorahook serve")


@api.exception_handler(RequestError)
async def _request_error(request, exc):
    return JSONResponse(exc.body(), status_code=exc.status)


async def _json_body(request):
    """A request's JSON object (``RequestError`` 400 for anything else)."""
    try:
        body = await request.json()
    except ValueError:
        raise RequestError(400, "the request body is not valid JSON") from None
    return json_object(body)


@serve.ingress(api)
class LorahookServer:
    """One replica: the model, its adapters, its batches, and the HTTP routes."""

    def __init__(self, settings):
        import torch
        import transformers

        import lorahook
        from lorahook.torch import attach, geometry_of

        from .engine import cache_of, joinable

        self.settings = s = settings
        torch.set_num_threads(s.threads)
        self.threads = torch.get_num_threads()
        lorahook.threads.configure(blas_threads=1)
        kw = {} if s.dtype == "auto" else {"dtype": getattr(torch, s.dtype)}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(s.model_dir, **kw).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(s.model_dir)
        config = self.model.generation_config
        eos = config.eos_token_id if config.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        pad = self.tokenizer.pad_token_id
        self.pad = pad if isinstance(pad, int) else (self.eos[0] if self.eos else 0)
        with torch.inference_mode():  # can requests join a running batch on this cache?
            probe = self.model(input_ids=torch.tensor([[self.pad]]), use_cache=True)
        self.joining = joinable(cache_of(probe))
        batched = batch(max_batch_size=s.max_batch_size,
                        batch_wait_timeout_s=s.batch_wait_timeout_s,
                        max_adapters=s.max_adapters, continuous=self.joining)
        self.generate = batched(self._run_joining if self.joining else self._run_fixed)
        self.runtime = {}    # name -> (path, version) of adapters loaded at run time
        self.paths = {}      # "name/vN" -> path: every runtime version a request was given
        self.adapters = lorahook.AdapterSet(geometry_of(self.model),
                                            capacity_bytes=s.capacity_bytes,
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
            return LoraAdapter.from_peft(path)
        shared = self.settings.shared
        return shared(name) if shared is not None and "/" not in name else None

    async def _sync_runtime(self):
        if not self.settings.allow_runtime_adapters:
            return
        entries = await self.settings.registry.entries.remote()
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
        if model == self.settings.base_id:
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
        adapters_dir = self.settings.adapters_dir
        if adapters_dir and os.path.isdir(adapters_dir):
            names.update(n for n in os.listdir(adapters_dir)
                         if os.path.isfile(os.path.join(adapters_dir, n, "adapter_config.json")))
        return sorted(names)

    # --- generation ----------------------------------------------------

    def _batch(self):
        from .engine import Batch
        return Batch(self.model, self.tokenizer, self.attached, self.pad, self.eos, self.joining)

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

    async def _run_joining(self, names, requests):
        """Requests join between steps; a finished request's row leaves at once."""
        run = self._batch()
        self._admit(run, names, requests)
        while not run.done:
            joined = yield [DONE if report is None else (*report, len(live.generated))
                            for live, report in await self._step(run)]
            run.retire(joined.left)
            if joined.names:
                self._admit(run, joined.names, joined.items)

    async def _run_fixed(self, names, requests):
        """A cache that cannot take rows (sliding windows, linear attention): whole batches."""
        run = self._batch()
        self._admit(run, names, requests)
        while not run.done:
            chunks = [DONE] * len(requests)
            for live, report in await self._step(run):
                if report is not None:
                    chunks[live.index] = (*report, len(live.generated))
            yield chunks

    # --- HTTP ----------------------------------------------------------

    def _check_api_key(self, request):
        api_key = self.settings.api_key
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
        self._check_api_key(request)
        return {"batches": self.batches[-100:], "steps": self.steps,
                "step_seconds": self.step_seconds, "torch_threads": self.threads,
                "joining": self.joining, "adapters": self.adapters.stats()}

    @api.get("/v1/models")
    async def models(self, request: HttpRequest):
        self._check_api_key(request)
        await self._sync_runtime()
        base_id, created = self.settings.base_id, self.settings.created
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
        from .engine import Request
        self._check_api_key(request)
        body = await _json_body(request)
        settings = parse_completion(body, kind)
        ids = prompt_ids(body, kind, self.tokenizer, self.model.config.vocab_size)
        name = await self._adapter(settings["model"])
        req = Request(ids, settings["max_tokens"], settings["temperature"],
                      settings["top_p"], settings["seed"], settings["stop"])
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        meta = (rid, settings["model"], int(time.time()), kind, len(ids))
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
        return completion(meta, "".join(text), reason, used)

    async def _events(self, stream, meta):
        """Server-sent events: the first token at once, then what came in each
        ``FLUSH_S`` (a few tokens per event under load), then ``[DONE]``."""
        loop = asyncio.get_running_loop()
        try:
            held, last = [], None
            async for delta, finish, _ in stream:
                held.append(delta)
                now = loop.time()
                if finish is not None or last is None or now - last >= FLUSH_S:
                    yield "data: " + json.dumps(completion(meta, "".join(held), finish)) + "\n\n"
                    held, last = [], now
                if finish is not None:
                    break
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()

    async def _runtime_body(self, request):
        """The body of a load / unload request (404 unless runtime adapters are on)."""
        self._check_api_key(request)
        if not self.settings.allow_runtime_adapters:
            raise RequestError(404, "runtime adapters are off (--allow-runtime-adapters)")
        return await _json_body(request)

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: HttpRequest):
        body = await self._runtime_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or name == self.settings.base_id or "/" in name:
            raise RequestError(400, "'lora_name' must be a non-empty name other than the "
                                    "base model's", "lora_name")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise RequestError(400, f"'lora_path' must be a PEFT adapter directory on the "
                                    f"server, got {json.dumps(path)[:80]}", "lora_path")
        try:  # read and checked here, before any replica is told of it
            adapter = await asyncio.to_thread(LoraAdapter.from_peft, path)
            adapter.validate_against(self.adapters.model)
        except ValueError as exc:
            raise RequestError(400, f"'{path}' cannot be served: {exc}", "lora_path") from None
        await self.settings.registry.put.remote(name, os.path.abspath(path))
        return {"status": "ok", "lora_name": name}

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: HttpRequest):
        name = (await self._runtime_body(request)).get("lora_name")
        if not await self.settings.registry.remove.remote(name):
            raise RequestError(404, f"no runtime adapter named '{name}'", "lora_name")
        return {"status": "ok", "lora_name": name}


def build_app(model_dir, adapters_dir=None, *, replicas=1, capacity_bytes=None,
              max_batch_size=16, max_adapters=None, dtype="auto", api_key=None,
              allow_runtime_adapters=False, batch_wait_timeout_s=0.01, threads=1):
    """The Ray Serve application (call after ``ray.init``).

    Each replica reserves ``threads`` of Ray's CPUs and runs torch on that
    many threads (Ray alone would give an actor one)."""
    model_dir = os.path.abspath(model_dir)
    adapters_dir = os.path.abspath(adapters_dir) if adapters_dir else None
    registry = Registry.options(name=f"lorahook-serve-{uuid.uuid4().hex[:8]}",
                                namespace="lorahook").remote()
    settings = Settings(
        model_dir=model_dir, adapters_dir=adapters_dir, capacity_bytes=capacity_bytes,
        max_batch_size=max_batch_size, max_adapters=max_adapters,
        batch_wait_timeout_s=batch_wait_timeout_s, dtype=dtype, api_key=api_key,
        allow_runtime_adapters=allow_runtime_adapters, threads=threads,
        shared=shared_resolver(adapters_dir) if adapters_dir else None, registry=registry,
        created=int(time.time()))
    deployment = serve.deployment(LorahookServer).options(
        num_replicas=replicas, max_ongoing_requests=2 * max_batch_size,
        ray_actor_options={"num_cpus": threads})
    return deployment.bind(settings)
