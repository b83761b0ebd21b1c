"""Batches that mix adapters: the asyncio batcher behind :func:`lorahook.ray_serve.batch`.

Pure asyncio; this module never imports ray.  It works in any asyncio
program, inside a Ray Serve replica or not.

How it works
------------
Every call ``await obj.f(adapter_name, item)`` becomes a pending *call* (the
name, the item, a future and its arrival time) in a queue.  There is one
queue per instance (per decorated function for a plain function) and per
running event loop, made on first use and kept in the decorated function's
private state: the instance is referred to weakly and the loop is a weak key,
so an instance or a loop that is gone takes its queues with it, and nothing
is stored on the instance or the class.  That is why the decorated class
pickles at any time -- before or after use, with :mod:`pickle` or by value
with ``cloudpickle`` as Ray ships deployment classes -- and why one instance
works from several ``asyncio.run`` calls or from loops in several threads:
the settings travel, the queues do not.

A queue has at most one worker task, started by the first call that finds
it idle and ending when nothing is pending.  The worker forms a batch from
the pending calls, in arrival order, and runs the decorated function on it
in a task of its own, in an empty :class:`contextvars.Context`; it waits for
that task before it forms the next batch, so the batches of one queue run
one at a time.  A continuous streaming batch takes more pending calls itself
between its steps (``Joined``), so under steady load it may run for as long
as calls keep coming.

Cancellation: a caller cancelled while its call is pending removes the call
from the queue (the batch is never told).  Once a batch has started, the
function runs on its own task, so cancelling a caller only drops that
caller's result; the batch runs to its end for the others.
"""
import asyncio
import collections
import functools
import inspect
import math
import numbers
import sys
import threading
import warnings
from collections.abc import Mapping

from ._batch_queue import CHUNK, END, Call, Owner, Queue, fail, finish
from .._values import describe, is_int

__all__ = ["batch", "DONE", "Joined"]


class _Done:
    """The marker a streaming batch yields for an item that is finished."""

    __slots__ = ()

    def __repr__(self):
        return "lorahook.ray_serve.DONE"

    def __reduce__(self):
        return "DONE"


#: Yielded by a streaming batch function, in an item's place, once that item is finished.
DONE = _Done()


class Joined(collections.namedtuple("Joined", ("names", "items", "left"))):
    """What a continuous streaming batch is sent after each step (see :func:`batch`).

    ``names`` and ``items``: the calls that join the batch now, in arrival
    order, appended after its open items; ``left``: positions, in the step
    just yielded, of items whose callers stopped listening, which leave the
    batch now like finished ones.
    """

    __slots__ = ()

def _check_max_batch_size(value):
    if not is_int(value):
        raise TypeError(f"max_batch_size must be an int >= 1, found {describe(value)}")
    if value < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, found {value!r}")
    return int(value)


def _check_batch_wait_timeout_s(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"batch_wait_timeout_s must be a finite number of seconds >= 0, found {describe(value)}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"batch_wait_timeout_s must be a finite number of seconds >= 0, found {value!r}")
    return value


def _check_max_adapters(value):
    if value is None:
        return None
    if is_int(value):
        if value < 1:
            raise ValueError(
                f"max_adapters must be None, an int >= 1 or a callable fits(frozenset) -> bool, "
                f"found {value!r}")
        return int(value)
    if callable(value) and not isinstance(value, (bool, numbers.Number, str, bytes)):
        return value
    raise TypeError(
        f"max_adapters must be None, an int >= 1 or a callable fits(frozenset) -> bool, "
        f"found {describe(value)}")


def _check_adapter_name(name):
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(
            f"adapter_name must be a str or None (the base model), found {describe(name)}")
    if not name:
        raise ValueError(
            "adapter_name must be a non-empty str or None (the base model), found ''")
    return name


def _replica_max_ongoing_requests():
    """``max_ongoing_requests`` of the Ray Serve deployment this code runs in, or ``None``.

    ``None`` outside a replica.  Never imports ray: a replica has imported
    ``ray.serve`` long before any request arrives, so when it is not in
    :data:`sys.modules` there is no replica to ask.  The deployment's settings
    are read where Ray's own ``serve.batch`` reads them, from the replica
    context.
    """
    serve = sys.modules.get("ray.serve")
    get_context = getattr(serve, "get_replica_context", None)
    if get_context is None:
        return None
    try:
        context = get_context()
    except Exception:  # outside a replica Ray raises RayServeException
        return None
    value = getattr(getattr(context, "_deployment_config", None), "max_ongoing_requests", None)
    if not is_int(value):
        return None
    return int(value)


class _Batcher:
    """Settings and queues of one decorated function.  Pickles as its settings only."""

    def __init__(self, func, is_method, max_batch_size, batch_wait_timeout_s, max_adapters,
                 continuous=False):
        self.func = func
        self.continuous = continuous
        self.is_method = is_method
        self.streaming = inspect.isasyncgenfunction(func)
        self.qualname = getattr(func, "__qualname__", repr(func))
        self.max_batch_size = max_batch_size
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.max_adapters = max_adapters
        self._lock = threading.RLock()
        self._owners = {}  # id(owner) -> Owner

    def __reduce__(self):
        return (_Batcher, (self.func, self.is_method, self.max_batch_size,
                           self.batch_wait_timeout_s, self.max_adapters, self.continuous))

    # -- settings ---------------------------------------------------------

    def set_max_batch_size(self, max_batch_size):
        """Change ``max_batch_size`` (an int >= 1) for every instance, from the next batch on.

        Warns when the Ray Serve deployment this runs in has
        ``max_ongoing_requests`` below it.
        """
        self.max_batch_size = _check_max_batch_size(max_batch_size)
        self._poke_all()
        self._warn_if_replica_limits(stacklevel=2)

    def set_batch_wait_timeout_s(self, batch_wait_timeout_s):
        """Change ``batch_wait_timeout_s`` (finite, >= 0) for every instance, from now on."""
        self.batch_wait_timeout_s = _check_batch_wait_timeout_s(batch_wait_timeout_s)
        self._poke_all()

    def _poke_all(self):
        # Waiting workers recompute their deadline with the new settings.
        with self._lock:
            queues = [(loop, queue) for entry in self._owners.values()
                      for loop, queue in entry.queues.items()]
        for loop, queue in queues:
            try:
                loop.call_soon_threadsafe(queue.poke)
            except RuntimeError:  # that loop is closed: nothing waits there
                pass

    def _warn_if_replica_limits(self, stacklevel):
        limit = _replica_max_ongoing_requests()
        if limit is not None and limit < self.max_batch_size:
            warnings.warn(
                f"{self.qualname}: max_batch_size ({self.max_batch_size}) is larger than this "
                f"Ray Serve deployment's max_ongoing_requests ({limit}): a replica never holds "
                f"more than {limit} requests, so its batches never reach max_batch_size; set "
                f"max_ongoing_requests >= max_batch_size",
                UserWarning,
                stacklevel=stacklevel + 1,
            )

    # -- queues -----------------------------------------------------------

    def _queue(self, owner, loop):
        key = id(owner)
        owners = self._owners
        lock = self._lock
        with lock:
            entry = owners.get(key)
            if entry is None or entry.ref() is not owner:
                def forget(ref, key=key):
                    with lock:
                        current = owners.get(key)
                        if current is not None and current.ref is ref:
                            del owners[key]
                entry = owners[key] = Owner(owner, forget)
            queue = entry.queues.get(loop)
            if queue is not None:
                return queue
            queue = entry.queues[loop] = Queue(self)
        self._warn_if_replica_limits(stacklevel=4)
        return queue

    async def submit(self, owner, adapter_name, item):
        adapter_name = _check_adapter_name(adapter_name)
        loop = asyncio.get_running_loop()
        queue = self._queue(owner, loop)
        call = Call(adapter_name, item, loop.create_future(), loop.time())
        queue.put(call, owner)
        try:
            return await call.future
        except asyncio.CancelledError:
            queue.discard(call)
            raise

    async def submit_stream(self, owner, adapter_name, item):
        """A streaming call: its chunks as they come, until its item is finished.

        A caller that stops iterating (closes the iterator, or is cancelled)
        leaves its batch running for the others; its later chunks are dropped.
        """
        loop = asyncio.get_running_loop()
        queue = self._queue(owner, loop)
        call = Call(adapter_name, item, loop.create_future(), loop.time(), asyncio.Queue())
        queue.put(call, owner)
        try:
            while True:
                kind, value = await call.stream.get()
                if kind == CHUNK:
                    yield value
                elif kind == END:
                    return
                else:
                    raise value
        finally:
            if not call.future.done():  # the caller left early: the batch drops its chunks
                call.future.cancel()
                queue.discard(call)

    # -- running a batch ----------------------------------------------------

    def start(self, loop, owner, calls, queue):
        """The task running the function on ``calls``; called in an empty context."""
        names = [call.name for call in calls]
        items = [call.item for call in calls]
        args = (owner, names, items) if self.is_method else (names, items)
        if self.continuous:
            return loop.create_task(self._run_continuous(args, calls, queue))
        if self.streaming:
            return loop.create_task(self._run_stream(args, calls))
        return loop.create_task(self._run(args))

    def _check_step(self, step, expected, what):
        if isinstance(step, (str, bytes, bytearray, Mapping)) or not hasattr(step, "__len__"):
            raise TypeError(f"{self.qualname} must yield a list with one chunk (or DONE) "
                            f"per item, found {describe(step)}")
        if len(step) != expected:
            raise ValueError(
                f"{self.qualname} yielded {len(step)} chunks for a batch of {expected} "
                f"{what}; each step must hold one chunk (or DONE) per item, in order")

    async def _run(self, args):
        return await self.func(*args)

    async def _run_stream(self, args, calls):
        """Hand each step's chunks to their callers as the function yields them."""
        steps = self.func(*args)
        open_calls = set(range(len(calls)))
        try:
            async for step in steps:
                self._check_step(step, len(calls), "items")
                for i, chunk in enumerate(step):
                    if i not in open_calls:
                        continue
                    call = calls[i]
                    if chunk is DONE or call.future.done():  # finished, or its caller left
                        finish(call)
                        open_calls.discard(i)
                    else:
                        call.stream.put_nowait((CHUNK, chunk))
                if not open_calls:
                    break  # every item is finished: the function need not run on
        finally:
            await steps.aclose()
        for i in open_calls:  # the function ended: so did its items
            finish(calls[i])
        return [None] * len(calls)

    async def _run_continuous(self, args, calls, queue):
        """A streaming batch that pending calls join between its steps.

        ``calls`` is the worker's list of the batch's calls: joiners are
        appended to it, so that a failure or a cancellation reaches them too.
        """
        steps = self.func(*args)
        current = list(calls)  # the open items, in the order the function yields them
        sent = None
        try:
            while True:
                try:
                    step = await (steps.__anext__() if sent is None else steps.asend(sent))
                except StopAsyncIteration:
                    break
                self._check_step(step, len(current), "open items")
                still, left = [], []
                for i, (call, chunk) in enumerate(zip(current, step)):
                    if chunk is DONE:
                        finish(call)
                    elif call.future.done():  # its caller left: the item leaves the batch
                        left.append(i)
                    else:
                        call.stream.put_nowait((CHUNK, chunk))
                        still.append(call)
                names = frozenset(call.name for call in still if call.name is not None)
                joined = queue.join(self.max_batch_size - len(still), names, bool(still))
                if not still and not joined:
                    break  # every item is finished and nobody waits: the function need not run on
                calls.extend(joined)
                current = still + joined
                sent = Joined([call.name for call in joined], [call.item for call in joined],
                              left)
        finally:
            await steps.aclose()
        for call in calls:  # the function ended: so did its items
            finish(call)
        return None

    def deliver(self, calls, task):
        """Hand each caller of a finished batch its result, or the batch's exception."""
        try:
            exc = task.exception()
        except asyncio.CancelledError as cancelled:  # a CancelledError inside the function
            exc = cancelled
        if exc is None and (self.streaming or self.continuous):
            return  # every call was finished as its chunks came
        if exc is None:
            results = task.result()
            if isinstance(results, (str, bytes, bytearray, Mapping)) or not hasattr(results, "__len__"):
                exc = TypeError(
                    f"{self.qualname} must return a list with one result per item, "
                    f"found {describe(results)}")
            elif len(results) != len(calls):
                exc = ValueError(
                    f"{self.qualname} returned {len(results)} results for a batch of "
                    f"{len(calls)} items; it must return one result per item, in order")
            else:
                try:
                    results = list(results)
                except Exception as err:
                    exc = err
        if exc is not None:
            fail(calls, exc)
            return
        for call, result in zip(calls, results):
            if not call.future.done():  # its caller was cancelled: drop the result
                call.future.set_result(result)


def _decorate(func, max_batch_size, batch_wait_timeout_s, max_adapters, continuous=False):
    if not callable(func):
        raise TypeError(f"batch decorates an 'async def' function, found {describe(func)}")
    if not inspect.iscoroutinefunction(func) and not inspect.isasyncgenfunction(func):
        raise TypeError(
            f"batch decorates an 'async def' function, found the regular function "
            f"{getattr(func, '__qualname__', func)!r}")
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        params = None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if (params is None or any(p.kind not in positional for p in params)
            or len(params) not in (2, 3)):
        raise TypeError(
            f"batch decorates f(self, adapter_names, items) or f(adapter_names, items), found "
            f"{func.__qualname__}{inspect.signature(func) if params is not None else '(?)'}")
    is_method = len(params) == 3
    if continuous and not inspect.isasyncgenfunction(func):
        raise TypeError(f"batch(continuous=True) decorates an async generator function, found "
                        f"the coroutine function {func.__qualname__!r}")
    batcher = _Batcher(func, is_method, max_batch_size, batch_wait_timeout_s, max_adapters,
                       continuous)

    if batcher.streaming and is_method:
        def wrapper(self, adapter_name, item, /):
            return batcher.submit_stream(self, _check_adapter_name(adapter_name), item)
    elif batcher.streaming:
        def wrapper(adapter_name, item, /):
            return batcher.submit_stream(None, _check_adapter_name(adapter_name), item)
    elif is_method:
        async def wrapper(self, adapter_name, item, /):
            return await batcher.submit(self, adapter_name, item)
    else:
        async def wrapper(adapter_name, item, /):
            return await batcher.submit(None, adapter_name, item)
    signature = inspect.signature(wrapper)
    wrapper = functools.wraps(func)(wrapper)
    wrapper.__signature__ = signature
    wrapper.set_max_batch_size = batcher.set_max_batch_size
    wrapper.set_batch_wait_timeout_s = batcher.set_batch_wait_timeout_s
    wrapper._lorahook_batcher = batcher
    return wrapper


def batch(max_batch_size=16, batch_wait_timeout_s=0.01, max_adapters=None, continuous=False):
    """Batch concurrent calls of an async function, mixing adapters in one batch.

    Decorates ``async def f(self, adapter_names, items) -> list`` (a method)
    or ``async def f(adapter_names, items) -> list`` (a plain function),
    recognised by the number of its positional parameters, three or two.
    Callers ``await obj.f(adapter_name, item)`` -- one adapter name (a
    non-empty ``str``, or ``None`` for the base model) and one item -- and get
    back their own result.  ``@batch`` alone uses the defaults.

    Batches
        Pending calls of any adapters are gathered into one batch of at most
        ``max_batch_size`` calls (never split by adapter, nor by Ray's
        multiplexed model id).  A batch starts when it is full or when
        ``batch_wait_timeout_s`` seconds have passed since the oldest pending
        call arrived, whichever is first, and never before the previous batch
        of the same instance has finished; ``0`` takes whatever is pending as
        soon as the batching task runs.  ``f`` receives the names and items as two lists
        in arrival order and must return a list (or another sized sequence)
        with one result per item, in the same order.

    ``max_adapters``
        ``None`` (no limit), an ``int`` ``k >= 1`` (at most ``k`` distinct
        non-``None`` names in a batch, like vLLM's ``max_loras``), or a
        callable ``fits(names) -> bool`` taking a ``frozenset`` of the
        distinct non-``None`` names a batch would hold.  A call whose adapter
        would break the limit is left for a later batch; left calls go first
        there, in arrival order, so no adapter starves behind a steady stream
        of others.  ``fits`` is asked while batches are formed, in an empty
        context, possibly more than once for the same set: make it fast and
        free of side effects, and monotone (a subset of a set that fits
        fits).  A call whose adapter does not fit on its own fails with
        ``ValueError``; if ``fits`` raises, or returns something other than a
        ``bool`` (``TypeError``), that error goes to the call being placed.

    Streaming
        When ``f`` is an async generator function (``async def`` with
        ``yield``), the decorated function streams: a caller iterates
        ``async for chunk in obj.f(adapter_name, item)``.  ``f`` yields, once
        per step, a list with one entry per item of its batch: a chunk for that
        item's caller, or :data:`DONE` once that item is finished (later
        entries for it are ignored).  A caller's iteration ends when its item
        is done (or when ``f`` returns), not when its batch is; ``f`` is closed
        once every item is done.  A caller that stops iterating (closes its
        iterator, or is cancelled) leaves the batch running for the others and
        its later chunks are dropped; an exception from ``f``, or a step of the
        wrong length (``ValueError``), reaches the callers whose items were not
        finished yet.

    Continuous batching (``continuous=True``, streaming only)
        Pending calls join a running batch between its steps instead of
        waiting for it to end.  Each step of ``f`` holds one entry per *open*
        item: the items it was called with and those that joined later, in
        the order they came, without those ``f`` yielded :data:`DONE` for in
        an earlier step and those that left.  After each step
        ``f`` is sent (as the value of its ``yield``) a :class:`Joined`
        ``(names, items, left)``: ``left`` lists the positions, in the step
        just yielded, of items whose callers stopped listening (they leave
        the batch, so ``f`` can stop computing them); ``names`` and ``items``
        are the calls that join now, at the end of the open items, chosen in
        arrival order within ``max_batch_size`` open items and
        ``max_adapters`` distinct adapters (counting those of the open
        items), without waiting for ``batch_wait_timeout_s``.  ``f`` is closed
        once no item is open and no call is pending::

            @batch(max_batch_size=16, continuous=True)
            async def generate(self, names, items):
                run = Engine(names, items)
                while run.open:
                    joined = yield run.step()   # one chunk (or DONE) per open item
                    run.drop(joined.left)
                    run.add(joined.names, joined.items)

    Concurrency and context
        The batches of one instance run one at a time (different instances,
        and different event loops, batch independently).  ``f`` runs in a
        task of its own in an empty :class:`contextvars.Context`: nothing the
        callers set in context variables (a sequence selection, Ray's request
        context) is visible inside it.

    Errors and cancellation
        An exception raised by ``f`` (including a ``CancelledError`` raised
        inside it), a result that is not a sized sequence (``TypeError``) or
        one of the wrong length (``ValueError``) is raised to every caller of
        that batch, and to no other caller.  A caller cancelled before its
        batch starts is removed and never reaches ``f``; one cancelled after
        its batch started leaves ``f`` running for everyone and its result is
        dropped.

    Queues, pickling, event loops
        Queues are made on first use, one per instance and per running event
        loop, and are not part of the decorated function's pickled state: the
        decorated class or function pickles at any time (with ``cloudpickle``
        by value too), and an instance can be used from several
        ``asyncio.run`` calls or from event loops in several threads.

    Settings
        The returned function has ``set_max_batch_size(n)`` and
        ``set_batch_wait_timeout_s(s)`` (for a Ray Serve deployment's
        ``reconfigure``).  Settings belong to the decorated function: they
        apply to all its instances, from the next batch decision on.

    Ray Serve
        Inside a Ray Serve replica whose deployment has
        ``max_ongoing_requests`` below ``max_batch_size``, a ``UserWarning``
        says so when a queue is first made and on ``set_max_batch_size``: the
        replica never holds enough requests to fill a batch.  Outside Ray
        there is no check, and ray is never imported.

    Parameters
    ----------
    max_batch_size : int, default 16
        The most calls in one batch (the most open items, continuous).
    batch_wait_timeout_s : float, default 0.01
        How long a batch waits, from its oldest pending call, to fill.
    max_adapters : None, int or callable, default None
        The distinct adapters a batch may hold (see above).
    continuous : bool, default False
        Let pending calls join a running streaming batch between its steps.

    Returns
    -------
    callable
        The decorator (or, used bare as ``@batch``, the batched function).

    Raises
    ------
    TypeError, ValueError
        Naming the argument at fault, for invalid settings, a function that
        is not ``async def`` or has the wrong parameters, and (at the call)
        an adapter name that is not a non-empty ``str`` or ``None``.
    """
    if callable(max_batch_size) and not isinstance(max_batch_size, numbers.Number):
        # Used bare: @batch
        func = max_batch_size
        if batch_wait_timeout_s != 0.01 or max_adapters is not None or continuous:
            raise TypeError(
                "batch(func) takes no other arguments; write @batch(max_batch_size=..., "
                "batch_wait_timeout_s=..., max_adapters=...) to set them")
        return _decorate(func, 16, 0.01, None)
    if not isinstance(continuous, bool):
        raise TypeError(f"continuous must be True or False, found {describe(continuous)}")
    max_batch_size = _check_max_batch_size(max_batch_size)
    batch_wait_timeout_s = _check_batch_wait_timeout_s(batch_wait_timeout_s)
    max_adapters = _check_max_adapters(max_adapters)

    def decorator(func):
        return _decorate(func, max_batch_size, batch_wait_timeout_s, max_adapters, continuous)

    return decorator
