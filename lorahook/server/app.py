"""The Ray Serve application of ``lorahook serve``: one deployment, its routes and its replicas.

Each replica holds the model, an :class:`~lorahook.AdapterSet` bounded by
``capacity_bytes`` that loads adapters through
:func:`lorahook.ray_serve.shared_resolver` over the adapters directory (once
per cluster), :func:`lorahook.ray_serve.multiplexed` for Ray's routing, and
:func:`lorahook.ray_serve.batch` in streaming mode: requests for different
adapters share one batch, generated token by token
(:mod:`lorahook.server.engine`).  What a request may say is
:mod:`lorahook.server.openai`'s.

A request's way through a replica: the key, the body (``Content-Type``,
size, nesting), its parameters, its prompt tokens and the context, all before
it waits anywhere; then a place in the queue (``max_queued_requests``); then
a *lease* on its adapter: the adapter is made resident and pinned until the
request ends, so that no other request's load can evict it from under a
running row.  An adapter that cannot be resident beside the leased ones
waits for a lease to end; one larger than the capacity is a 503 at once.
Every wait counts against the request's deadline (``request_timeout``).
"""
import asyncio
import collections
import json
import os
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import ray
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from ..adapter import LoraAdapter
from ..errors import LoraCapacityError, LoraValidationError
from ..ray_serve import DONE, batch, multiplexed, shared_resolver
from .engine import model_context
from .openai import (RequestError, check_api_key, completion, error_body, fit_context,
                     is_json_content_type, parse_completion, parse_json, parse_load, parse_unload,
                     prompt_ids)

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
    runtime_root: Optional[str] = None  # runtime adapters allowed, from under this directory
    threads: int = 1
    max_model_len: Optional[int] = None
    max_body_bytes: int = 4 << 20
    max_queued_requests: int = 256
    request_timeout: float = 600.0
    shared: Any = None      # the shared_resolver over adapters_dir
    registry: Any = None    # the Registry actor of runtime adapters
    created: int = 0

    @property
    def base_id(self):
        return os.path.basename(self.model_dir.rstrip("/"))


@ray.remote(num_cpus=0)
class Registry:
    """Adapters loaded at run time, shared by every replica: name -> (path, version).

    An unloaded name keeps its entry with path ``None``: it is a 404 from
    then on, even where an adapters-directory adapter has that name.
    """

    def __init__(self):
        self._entries = {}
        self._version = 0

    def put(self, name, path):
        self._version += 1
        self._entries[name] = (path, self._version)

    def remove(self, name):
        entry = self._entries.get(name)
        if entry is None or entry[0] is None:
            return False
        self._version += 1
        self._entries[name] = (None, self._version)
        return True

    def entries(self):
        return dict(self._entries)


api = FastAPI(title="lorahook serve", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(RequestError)
async def _request_error(request, exc):
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(HTTPException)
async def _http_error(request, exc):
    message = {404: f"no endpoint {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request, exc):
    return JSONResponse(error_body("the request is not valid", "invalid_request_error"),
                        status_code=400)


@api.exception_handler(Exception)
async def _unexpected(request, exc):
    return JSONResponse(error_body(f"internal error ({type(exc).__name__})"), status_code=500)


class _Lease:
    """What a request holds until it ends: its adapter's residence and its place in the queue.

    :meth:`release` gives both back, once, however the request ends.
    """

    __slots__ = ("_release",)

    def __init__(self, release):
        self._release = release

    def release(self):
        release, self._release = self._release, None
        if release is not None:
            release()


def _read_runtime_adapter(path):
    """A runtime adapter's directory read; what is wrong is named, the files are never quoted."""
    from ..errors import LoraFormatError
    if not os.path.isdir(path):
        raise RequestError(400, "'lora_path' is not a directory", "lora_path")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise RequestError(400, "'lora_path' is not a PEFT adapter directory (it has no "
                                "adapter_config.json)", "lora_path")
    try:
        return LoraAdapter.from_peft(path)
    except LoraValidationError:
        raise RequestError(400, "'lora_path' does not fit this model", "lora_path") from None
    except LoraFormatError:
        raise RequestError(400, "'lora_path' is not a LoRA adapter lorahook can serve: its files "
                                "are malformed, or it uses a method lorahook does not "
                                "support", "lora_path") from None
    except (OSError, ValueError, UnicodeError, MemoryError):
        raise RequestError(400, "'lora_path' could not be read as a PEFT adapter",
                           "lora_path") from None


def _not_found(model):
    return RequestError(404, f"The model '{model[:256]}' does not exist", "model",
                        code="model_not_found")


def _too_large(limit):
    return RequestError(413, f"the request body is larger than {limit} bytes")


async def _until(awaitable, deadline):
    """``await awaitable`` until ``deadline`` (``time.monotonic``); then a 504."""
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(awaitable, remaining)
    except asyncio.TimeoutError:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise RequestError(504, "the request took longer than the server's request timeout",
                           code="timeout") from None


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
        self.context = s.max_model_len or model_context(self.model.config)
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
        self.runtime = {}    # name -> (path or None, version) of adapters loaded at run time
        self.paths = {}      # "name/vN" -> path of the runtime versions in use here
        self.adapters = lorahook.AdapterSet(geometry_of(self.model),
                                            capacity_bytes=s.capacity_bytes,
                                            resolver=self._resolve)
        self.attached = attach(self.model, self.adapters)
        self.load = multiplexed(self.adapters, 64)
        self.leases = collections.Counter()  # adapter key -> requests holding it resident
        self.room = asyncio.Event()          # set (and replaced) when a lease ends
        self.waiting = {}    # id(request) -> request, for requests not yet in a batch
        self.batches = []    # (requests admitted, distinct adapters then running), recent first
        self.steps, self.step_seconds = 0, 0.0

    # --- adapters ------------------------------------------------------

    # A runtime adapter is installed as "name/vN", one key per version; no
    # request may name a key with a "/": a request keeps the version it was
    # given for all its steps, even when a reload or an unload comes while it
    # decodes, and nothing else reaches an old version.

    def _resolve(self, key):
        """The AdapterSet's resolver (runs in worker threads)."""
        path = self.paths.get(key)
        if path is not None:
            return LoraAdapter.from_peft(path)
        shared = self.settings.shared
        return shared(key) if shared is not None and "/" not in key else None

    async def _sync_runtime(self):
        if self.settings.runtime_root is None:
            return
        entries = await self.settings.registry.entries.remote()
        if entries == self.runtime:
            return
        self.runtime = entries
        for key in set(self.paths) - self._current_keys():
            if not self.leases[key]:  # a leased one goes when its last request ends
                self._forget(key)

    def _current_keys(self):
        return {f"{name}/v{version}" for name, (path, version) in self.runtime.items()
                if path is not None}

    def _forget(self, key):
        self.paths.pop(key, None)
        try:
            self.adapters.remove(key)
        except KeyError:
            pass  # not resident here

    async def _key(self, model):
        """The adapter key for a request's ``model``; 404 for a name nothing serves."""
        await self._sync_runtime()
        entry = self.runtime.get(model)
        if entry is not None and entry[0] is not None:
            key = f"{model}/v{entry[1]}"
            self.paths[key] = entry[0]
            return key
        if entry is not None or self.settings.shared is None or "/" in model or "\\" in model:
            raise _not_found(model)
        return model

    async def _acquire(self, model, deadline):
        """Make ``model``'s adapter resident and pinned for a request; its key (``None``: base).

        The caller gives the key back with :meth:`_release` when the request ends.
        """
        if model == self.settings.base_id:
            return None
        key = await self._key(model)
        self.leases[key] += 1
        try:
            while True:
                try:
                    # pinned as it is loaded (no other load can evict it in between),
                    # then recorded in Ray's list of this replica's adapters
                    await asyncio.to_thread(self.adapters.pin, key)
                    await self.load(key)
                    return key
                except LoraCapacityError as exc:
                    alone = exc.nbytes
                    if (alone is not None and alone > self.settings.capacity_bytes) or not any(
                            n for k, n in self.leases.items() if k != key):
                        raise RequestError(503, f"adapter '{model}' cannot be made resident: "
                                                f"{exc}", "model") from None
                    room = self.room  # wait for a running request's adapter to leave
                    await _until(room.wait(), deadline)
        except BaseException as exc:
            self._release(key)
            if isinstance(exc, KeyError):
                raise _not_found(model) from None
            if isinstance(exc, LoraValidationError):
                raise RequestError(400, f"adapter '{model}' does not fit this model",
                                   "model") from None
            if isinstance(exc, ValueError):  # LoraFormatError
                raise RequestError(400, f"adapter '{model}' cannot be served: "
                                        f"{type(exc).__name__}", "model") from None
            raise

    def _release(self, key):
        self.leases[key] -= 1
        if self.leases[key] > 0:
            return
        del self.leases[key]
        try:
            self.adapters.unpin(key)
        except KeyError:
            pass
        if "/" in key and key not in self._current_keys():
            self._forget(key)  # replaced or unloaded while it ran
        self.room.set()
        self.room = asyncio.Event()

    def _listed(self):
        names = {n for n, (path, _) in self.runtime.items() if path is not None}
        adapters_dir = self.settings.adapters_dir
        if adapters_dir and os.path.isdir(adapters_dir):
            names.update(n for n in os.listdir(adapters_dir)
                         if n not in self.runtime
                         and os.path.isfile(os.path.join(adapters_dir, n, "adapter_config.json")))
        return sorted(names)

    # --- generation ----------------------------------------------------

    def _batch(self):
        from .engine import Batch
        return Batch(self.model, self.tokenizer, self.attached, self.pad, self.eos, self.joining)

    def _admit(self, run, names, requests):
        for request in requests:
            self.waiting.pop(id(request), None)
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

    @staticmethod
    def _chunk(live, report):
        return DONE if report is None else (*report, len(live.generated), live.error)

    async def _run_joining(self, names, requests):
        """Requests join between steps; a finished request's row leaves at once."""
        run = self._batch()
        self._admit(run, names, requests)
        while not run.done:
            joined = yield [self._chunk(live, report) for live, report in await self._step(run)]
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
                    chunks[live.index] = self._chunk(live, report)
            yield chunks

    async def _tokens(self, key, request, deadline, lease):
        """The request's ``(text, finish, used, error)`` chunks, until its deadline.

        However it ends (finished, failed, timed out, abandoned by its
        caller), its lease and its place in the queue are given back.
        """
        stream = self.generate(key, request)
        try:
            while True:
                try:
                    chunk = await _until(stream.__anext__(), deadline)
                except StopAsyncIteration:
                    return
                yield chunk
                if chunk[1] is not None:
                    return
        finally:
            lease.release()
            await stream.aclose()

    # --- HTTP ----------------------------------------------------------

    def _check_api_key(self, request):
        check_api_key(request.headers.get("authorization"), self.settings.api_key)

    async def _body(self, request):
        """The JSON object of a POST: 415 unless JSON, 413 over the size bound, 400 too deep."""
        if not is_json_content_type(request.headers.get("content-type")):
            raise RequestError(415, "the request body must be JSON (Content-Type: "
                                    "application/json)")
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        raw, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            raw.append(chunk)
        raw = b"".join(raw)
        return parse_json(raw) if size < 65536 else await asyncio.to_thread(parse_json, raw)

    @api.get("/health")
    async def health(self):
        return {"status": "ok"}

    @api.get("/lorahook/stats")
    async def stats(self, request: HttpRequest):
        """This replica's recent batches and steps, and its adapter set's counters."""
        self._check_api_key(request)
        return {"batches": self.batches[-100:], "steps": self.steps,
                "step_seconds": self.step_seconds, "torch_threads": self.threads,
                "joining": self.joining, "adapters": self.adapters.stats(),
                "queued": len(self.waiting), "leases": dict(self.leases)}

    @api.get("/v1/models")
    async def models(self, request: HttpRequest):
        self._check_api_key(request)
        await self._sync_runtime()
        base_id, created = self.settings.base_id, self.settings.created
        data = [{"id": base_id, "object": "model", "created": created, "owned_by": "lorahook",
                 "max_model_len": self.context}]
        data += [{"id": n, "object": "model", "created": created, "owned_by": "lorahook",
                  "parent": base_id} for n in await asyncio.to_thread(self._listed)]
        return {"object": "list", "data": data}

    @api.post("/v1/completions")
    async def completions(self, request: HttpRequest):
        return await self._complete(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: HttpRequest):
        return await self._complete(request, "chat")

    async def _complete(self, request, kind):
        from .engine import Request
        deadline = time.monotonic() + self.settings.request_timeout
        self._check_api_key(request)
        body = await self._body(request)
        settings = parse_completion(body, kind)
        ids = await asyncio.to_thread(prompt_ids, body, kind, self.tokenizer,
                                      self.model.config.vocab_size)
        max_tokens = fit_context(len(ids), settings["max_tokens"], self.context, kind)
        if len(self.waiting) >= self.settings.max_queued_requests:
            raise RequestError(503, f"the server is busy: {len(self.waiting)} requests are "
                                    f"waiting for a batch; try again later", code="overloaded")
        req = Request(ids, max_tokens, settings["temperature"], settings["top_p"],
                      settings["seed"], settings["stop"])
        self.waiting[id(req)] = req
        try:
            key = await self._acquire(settings["model"], deadline)
        except BaseException:
            self.waiting.pop(id(req), None)
            raise
        lease = _Lease(lambda: (self.waiting.pop(id(req), None),
                                key is not None and self._release(key)))
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        meta = (rid, settings["model"], int(time.time()), kind, len(ids))
        tokens = self._tokens(key, req, deadline, lease)
        weakref.finalize(tokens, lease.release)  # a response that never started its tokens
        if settings["stream"]:
            return StreamingResponse(self._events(tokens, meta),
                                     media_type="text/event-stream")
        text, reason, used = [], None, 0
        try:
            async for delta, finish, used, error in tokens:
                text.append(delta)
                if finish == "error":
                    raise RequestError(500, f"the request failed: {error}")
                if finish is not None:
                    reason = finish
                    break
        finally:
            await tokens.aclose()
        return completion(meta, "".join(text), reason, used)

    async def _events(self, tokens, meta):
        """Server-sent events: the first token at once, then what came in each
        ``FLUSH_S`` (a few tokens per event under load), then ``[DONE]``; a
        failure is an error event, then ``[DONE]``."""
        loop = asyncio.get_running_loop()
        try:
            held, last = [], None
            try:
                async for delta, finish, _, error in tokens:
                    if finish == "error":
                        raise RequestError(500, f"the request failed: {error}")
                    held.append(delta)
                    now = loop.time()
                    if finish is not None or last is None or now - last >= FLUSH_S:
                        yield "data: " + json.dumps(completion(meta, "".join(held), finish)) + "\n\n"
                        held, last = [], now
                    if finish is not None:
                        break
            except RequestError as exc:
                yield "data: " + json.dumps(exc.body()) + "\n\n"
            except Exception as exc:  # the batch itself failed
                yield "data: " + json.dumps(error_body(
                    f"the request failed ({type(exc).__name__})")) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await tokens.aclose()

    # --- runtime adapters ----------------------------------------------

    async def _runtime_body(self, request):
        """The body of a load / unload request (404 unless runtime adapters are on)."""
        self._check_api_key(request)
        if self.settings.runtime_root is None:
            raise RequestError(404, "runtime adapters are off (--allow-runtime-adapters)")
        return await self._body(request)

    def _served(self, name):
        """Whether ``name`` is served now (a runtime adapter, or one of the adapters directory)."""
        entry = self.runtime.get(name)
        if entry is not None:
            return entry[0] is not None
        adapters_dir = self.settings.adapters_dir
        return bool(adapters_dir) and os.path.isfile(
            os.path.join(adapters_dir, name, "adapter_config.json"))

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: HttpRequest):
        body = await self._runtime_body(request)
        name, path, inplace = parse_load(body, self.settings.base_id)
        root = self.settings.runtime_root
        real = await asyncio.to_thread(os.path.realpath, path)
        if os.path.commonpath([root, real]) != root:
            raise RequestError(400, "'lora_path' must be inside the server's runtime adapter "
                                    "root", "lora_path")
        await self._sync_runtime()
        if not inplace and await asyncio.to_thread(self._served, name):
            raise RequestError(400, f"an adapter named '{name}' is already served: give "
                                    f"\"load_inplace\": true to replace it", "lora_name")
        adapter = await asyncio.to_thread(_read_runtime_adapter, real)
        try:
            adapter.validate_against(self.adapters.model)
        except LoraValidationError:
            raise RequestError(400, "'lora_path' does not fit this model", "lora_path") from None
        await self.settings.registry.put.remote(name, real)
        return {"status": "ok", "lora_name": name}

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: HttpRequest):
        name = parse_unload(await self._runtime_body(request), self.settings.base_id)
        if not await self.settings.registry.remove.remote(name):
            raise RequestError(404, f"no runtime adapter named '{name}'", "lora_name")
        return {"status": "ok", "lora_name": name}


def build_app(model_dir, adapters_dir=None, *, replicas=1, capacity_bytes=None,
              max_batch_size=16, max_adapters=None, dtype="auto", api_key=None,
              runtime_root=None, batch_wait_timeout_s=0.01, threads=1, max_model_len=None,
              max_body_bytes=4 << 20, max_queued_requests=256, request_timeout=600.0):
    """The Ray Serve application (call after ``ray.init``).

    Each replica reserves ``threads`` of Ray's CPUs and runs torch on that
    many threads (Ray alone would give an actor one).  ``runtime_root``
    (a directory) allows runtime adapters from under it."""
    model_dir = os.path.abspath(model_dir)
    adapters_dir = os.path.abspath(adapters_dir) if adapters_dir else None
    registry = Registry.options(name=f"lorahook-serve-{uuid.uuid4().hex[:8]}",
                                namespace="lorahook").remote()
    settings = Settings(
        model_dir=model_dir, adapters_dir=adapters_dir, capacity_bytes=capacity_bytes,
        max_batch_size=max_batch_size, max_adapters=max_adapters,
        batch_wait_timeout_s=batch_wait_timeout_s, dtype=dtype, api_key=api_key,
        runtime_root=os.path.realpath(runtime_root) if runtime_root else None, threads=threads,
        max_model_len=max_model_len, max_body_bytes=max_body_bytes,
        max_queued_requests=max_queued_requests, request_timeout=request_timeout,
        shared=shared_resolver(adapters_dir) if adapters_dir else None, registry=registry,
        created=int(time.time()))
    # Ray's own queue in front of a replica answers in plain text: let every
    # request reach the replica, which answers overload as an OpenAI error.
    deployment = serve.deployment(LorahookServer).options(
        num_replicas=replicas,
        max_ongoing_requests=max_batch_size + max_queued_requests + 16,
        ray_actor_options={"num_cpus": threads})
    return deployment.bind(settings)
