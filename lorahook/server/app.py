"""The Ray Serve application of ``lorahook serve``: one deployment, its routes and its replicas.

Each replica holds the model, its adapters (:mod:`lorahook.server.adapters`:
an :class:`~lorahook.AdapterSet` bounded by ``capacity_bytes`` that loads the
adapters directory once per cluster, runtime adapters, leases) and its
batches (:mod:`lorahook.server.generation`).  What a request may say is
:mod:`lorahook.server.openai`'s; what the application keeps cluster-wide is
:mod:`lorahook.server.state`'s.

A request's way through a replica: refused with a 503 if the server is
draining; then the key, the body (``Content-Type``, size, nesting), its
parameters, its prompt tokens and the context, all before it waits anywhere;
then a place in the queue (``max_queued_requests``); then a lease on its
adapter until it ends.  Every wait counts against the request's deadline
(``request_timeout``, or the drain's end if that comes first).

Ray Serve's own tooling (``serve run``, ``serve deploy``, KubeRay's
RayService) runs the same server through :func:`app_builder`::

    serve run lorahook.server.app:app_builder model_dir=/models/base adapters=/models/lora
"""
import asyncio
import json
import os
import sys
import time
import uuid
import weakref

import ray
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from ..errors import LoraValidationError
from .adapters import ReplicaAdapters, read_runtime_adapter
from .deadline import Deadline, Drain
from .engine import model_context
from .generation import Generation
from .openai import (RequestError, check_api_key, completion, error_body, fit_context,
                     is_json_content_type, parse_completion, parse_json, parse_load, parse_unload,
                     prompt_ids)
from .options import check_arguments, key_warning, parse_builder_args, settings_from
from .state import state_of

__all__ = ["app_builder", "build_app", "LorahookServer"]

# A stream sends what it has at most this often after its first token (each event
# costs the replica and Ray's proxy more than a decode step of a small model).
FLUSH_S = 0.05

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
    """What a request holds until it ends: its place among the requests in flight, in the
    queue, and its adapter's residence, each given back by a callable added as it is taken.

    :meth:`release` gives them all back, last taken first, once.
    """

    __slots__ = ("_parts",)

    def __init__(self, *parts):
        self._parts = list(parts)

    def add(self, part):
        self._parts.append(part)

    def release(self):
        parts, self._parts = self._parts, []
        for part in reversed(parts):
            part()


def _too_large(limit):
    return RequestError(413, f"the request body is larger than {limit} bytes")


def _shutting_down():
    return RequestError(503, "the server is shutting down and takes no new requests",
                        code="shutting_down")


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
        self.id = uuid.uuid4().hex
        self.app_name = serve.get_replica_context().app_name
        self.drain = Drain()
        self.in_flight = 0   # requests admitted and not ended
        torch.set_num_threads(s.threads)
        self.threads = torch.get_num_threads()
        lorahook.threads.configure(blas_threads=1)
        kw = {} if s.dtype == "auto" else {"dtype": getattr(torch, s.dtype)}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(s.model_dir, **kw).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(s.model_dir)
        self.context = s.max_model_len or model_context(self.model.config)
        config = self.model.generation_config
        eos = config.eos_token_id if config.eos_token_id is not None else self.tokenizer.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        pad = self.tokenizer.pad_token_id
        pad = pad if isinstance(pad, int) else (eos[0] if eos else 0)
        with torch.inference_mode():  # can requests join a running batch on this cache?
            probe = self.model(input_ids=torch.tensor([[pad]]), use_cache=True)
        self.adapters = ReplicaAdapters(s, geometry_of(self.model), state_of(self.app_name))
        attached = attach(self.model, self.adapters.set)
        self.generation = Generation(self.model, self.tokenizer, attached, s,
                                     joinable(cache_of(probe)), pad, eos)
        # the constructor runs on the replica's event loop
        self._follower = asyncio.get_running_loop().create_task(self._follow_drain())

    # --- the drain -----------------------------------------------------

    async def _follow_drain(self):
        """Wait for the application's drain; then report the requests in flight until none is."""
        while True:
            try:
                await self.adapters.state.join.remote(self.id)
                seconds = await self.adapters.state.draining.remote()
                break
            except ray.exceptions.RayError:  # the state actor is gone: join its successor
                await asyncio.sleep(1.0)
                self.adapters.state = state_of(self.app_name)
        self.drain.end = time.monotonic() + seconds
        while True:
            in_flight = self.in_flight
            try:
                await self.adapters.state.report.remote(self.id, in_flight)
            except ray.exceptions.RayError:
                return  # the stopping process has gone
            if not in_flight:
                return
            await asyncio.sleep(0.1)

    def __del__(self):
        # Serve calls this when it stops the replica (after its requests have ended)
        adapters = getattr(self, "adapters", None)
        if adapters is not None:
            try:
                adapters.state.leave.remote(self.id)
            except Exception:
                pass

    def _admit(self):
        """Count a new request in flight, unless the server is draining (then a 503)."""
        if self.drain.started:
            raise _shutting_down()
        self.in_flight += 1

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
        if self.drain.started:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @api.get("/lorahook/stats")
    async def stats(self, request: HttpRequest):
        """This replica's recent batches and steps, and its adapter set's counters."""
        self._check_api_key(request)
        return {**self.generation.stats(), "replica": self.id, "torch_threads": self.threads,
                "adapters": self.adapters.set.stats(), "leases": dict(self.adapters.leases),
                "in_flight": self.in_flight, "draining": self.drain.started}

    @api.get("/v1/models")
    async def models(self, request: HttpRequest):
        self._check_api_key(request)
        await self.adapters.sync()
        base_id, created = self.settings.base_id, self.settings.created
        data = [{"id": base_id, "object": "model", "created": created, "owned_by": "lorahook",
                 "max_model_len": self.context}]
        data += [{"id": n, "object": "model", "created": created, "owned_by": "lorahook",
                  "parent": base_id} for n in await asyncio.to_thread(self.adapters.listed)]
        return {"object": "list", "data": data}

    @api.post("/v1/completions")
    async def completions(self, request: HttpRequest):
        return await self._complete(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: HttpRequest):
        return await self._complete(request, "chat")

    async def _complete(self, request, kind):
        self._admit()
        lease = _Lease(self._ended)
        try:
            return await self._completion(request, kind, lease)
        except BaseException:
            lease.release()
            raise

    def _ended(self):
        self.in_flight -= 1

    async def _completion(self, request, kind, lease):
        """The completion of an admitted request; ``lease.release()`` once it has ended."""
        from .engine import Request
        deadline = Deadline(self.settings.request_timeout, self.drain)
        self._check_api_key(request)
        body = await self._body(request)
        settings = parse_completion(body, kind)
        ids = await asyncio.to_thread(prompt_ids, body, kind, self.tokenizer,
                                      self.model.config.vocab_size)
        max_tokens = fit_context(len(ids), settings["max_tokens"], self.context, kind)
        waiting = self.generation.waiting
        if len(waiting) >= self.settings.max_queued_requests:
            raise RequestError(503, f"the server is busy: {len(waiting)} requests are "
                                    f"waiting for a batch; try again later", code="overloaded")
        req = Request(ids, max_tokens, settings["temperature"], settings["top_p"],
                      settings["seed"], settings["stop"])
        waiting[id(req)] = req
        lease.add(lambda: waiting.pop(id(req), None))
        key = await self.adapters.acquire(settings["model"], deadline)
        if key is not None:
            lease.add(lambda: self.adapters.release(key))
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        meta = (rid, settings["model"], int(time.time()), kind, len(ids))
        tokens = self.generation.tokens(key, req, deadline, lease.release)
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
        if self.drain.started:
            raise _shutting_down()
        return await self._body(request)

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: HttpRequest):
        body = await self._runtime_body(request)
        name, path, inplace = parse_load(body, self.settings.base_id)
        root = self.settings.runtime_root
        real = await asyncio.to_thread(os.path.realpath, path)
        if os.path.commonpath([root, real]) != root:
            raise RequestError(400, "'lora_path' must be inside the server's runtime adapter "
                                    "root", "lora_path")
        await self.adapters.sync()
        if not inplace and await asyncio.to_thread(self.adapters.served, name):
            raise RequestError(400, f"an adapter named '{name}' is already served: give "
                                    f"\"load_inplace\": true to replace it", "lora_name")
        adapter = await asyncio.to_thread(read_runtime_adapter, real)
        try:
            adapter.validate_against(self.adapters.set.model)
        except LoraValidationError:
            raise RequestError(400, "'lora_path' does not fit this model", "lora_path") from None
        await self.adapters.put(name, real)
        return {"status": "ok", "lora_name": name}

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: HttpRequest):
        name = parse_unload(await self._runtime_body(request), self.settings.base_id)
        if not await self.adapters.remove(name):
            raise RequestError(404, f"no runtime adapter named '{name}'", "lora_name")
        return {"status": "ok", "lora_name": name}


def build_app(settings):
    """The Ray Serve application for :class:`~lorahook.server.options.Settings`.

    Each replica reserves ``settings.threads`` of Ray's CPUs and runs torch on
    that many threads (Ray alone would give an actor one).  Nothing starts
    until the application is deployed (``serve.run``), so this may run
    anywhere Ray Serve builds applications.
    """
    # Ray's own queue in front of a replica answers in plain text: let every
    # request reach the replica, which answers overload as an OpenAI error.
    # A replica Serve stops (a redeployment, a scale-down) lets its requests
    # run for the drain timeout.
    deployment = serve.deployment(LorahookServer).options(
        num_replicas=settings.replicas,
        max_ongoing_requests=settings.max_batch_size + settings.max_queued_requests + 16,
        ray_actor_options={"num_cpus": settings.threads},
        graceful_shutdown_timeout_s=settings.drain_timeout,
        graceful_shutdown_wait_loop_s=0.5)
    return deployment.bind(settings)


def app_builder(args):
    """Ray Serve's application builder: the application for ``lorahook serve``'s options.

    ``args`` holds the command line's long option names with underscores
    (``max_batch_size``) and ``model_dir`` for the positional argument, as
    ``serve run lorahook.server.app:app_builder model_dir=DIR adapters=DIR``
    or a Serve config file's ``args`` give them.  Options of the ``lorahook
    serve`` process (``host``, ``port``, ``address``) belong to Serve's
    config instead and are refused, as is any unknown name.
    """
    options = parse_builder_args(args)
    settings = settings_from(options, check_arguments(options))
    warning = key_warning(settings)
    if warning:
        print(f"lorahook.server.app: warning: {warning}", file=sys.stderr, flush=True)
    return build_app(settings)
