"""The pending calls of :func:`lorahook.ray_serve.batch` and the queue that forms batches of them.

One :class:`Queue` per instance and event loop holds the pending calls in
arrival order; its worker task forms each batch (at most ``max_batch_size``
calls, at most ``max_adapters`` distinct adapters) and hands it to the
batcher (:mod:`lorahook.ray_serve._batching`).  Pure asyncio.
"""
import asyncio
import collections
import contextvars
import weakref

from .._values import describe

# what a streaming call's queue carries: a chunk, the end, an error
CHUNK, END, ERROR = 0, 1, 2


class Call:
    """One pending ``await f(adapter_name, item)`` (or, streaming, ``f(adapter_name, item)``).

    ``future`` is done once the call has its result, its error, or (streaming)
    is finished or abandoned by its caller; a streaming call's chunks go
    through ``stream``.
    """

    __slots__ = ("name", "item", "future", "arrival", "stream")

    def __init__(self, name, item, future, arrival, stream=None):
        self.name = name
        self.item = item
        self.future = future
        self.arrival = arrival
        self.stream = stream


def fail(calls, exc):
    for call in calls:
        if not call.future.done():
            if call.stream is not None:
                call.stream.put_nowait((ERROR, exc))
                call.future.set_result(None)
            else:
                call.future.set_exception(exc)


def cancel(calls):
    for call in calls:
        if call.stream is not None and not call.future.done():
            call.stream.put_nowait((ERROR, asyncio.CancelledError()))
        call.future.cancel()


def finish(call):
    """A streaming call is done: its caller's iteration ends."""
    if not call.future.done():
        call.stream.put_nowait((END, None))
        call.future.set_result(None)


def wake(future):
    if not future.done():
        future.set_result(None)


class Owner:
    """The queues of one instance (or of a plain function): event loop -> :class:`Queue`."""

    __slots__ = ("ref", "queues")

    def __init__(self, owner, callback):
        try:
            self.ref = weakref.ref(owner, callback)
        except TypeError:
            # Not weakly referenceable (``__slots__`` without ``__weakref__``,
            # or None for a plain function): keep it, and its queues, for the
            # life of the decorated function.
            self.ref = lambda owner=owner: owner
        self.queues = weakref.WeakKeyDictionary()


class Queue:
    """Pending calls of one instance in one event loop, and the worker that batches them.

    Used only from the thread running that loop.  It keeps no reference to
    the loop (a weak key) nor, when idle, to the instance.  While calls are
    pending it does reach the loop through their futures, so a loop closed
    with calls still pending (``asyncio.run`` cancels them first) keeps its
    queue alive.
    """

    __slots__ = ("_batcher", "_pending", "_waiter", "_worker", "__weakref__")

    def __init__(self, batcher):
        self._batcher = batcher
        self._pending = collections.deque()
        self._waiter = None
        self._worker = None

    def put(self, call, owner):
        self._pending.append(call)
        if self._worker is None:
            loop = asyncio.get_running_loop()
            # The worker (and so max_adapters) never sees the first caller's context.
            self._worker = contextvars.Context().run(
                loop.create_task, self._work(loop, owner),
                name=f"lorahook batch worker for {self._batcher.qualname}")
        elif len(self._pending) >= self._batcher.max_batch_size:
            # Only now can a waiting batch be full; an arrival never moves the
            # deadline, which counts from the oldest pending call.
            self.poke()

    def discard(self, call):
        """Forget a call whose caller was cancelled before its batch started."""
        try:
            self._pending.remove(call)
        except ValueError:
            return  # already in a batch, or already failed
        self.poke()  # the oldest pending call may have changed

    def poke(self):
        """Make a waiting worker look at the queue and the settings again."""
        if self._waiter is not None:
            wake(self._waiter)

    def _select(self, limit, names=frozenset(), in_order=False):
        """The calls of the next batch, without taking them, and whether the batch is full.

        Walks the pending calls in arrival order and takes every call that
        keeps the batch within ``limit`` calls and ``max_adapters`` (counting
        ``names``, the adapters of a running batch the calls would join).  A
        call whose adapter does not fit on its own fails here (``ValueError``),
        as does one for which ``fits`` raises (with that exception) or does not
        return a bool (``TypeError``).  The first pending call is always taken
        or failed, so every call is served in a bounded number of batches.
        ``in_order`` stops at the first call that does not fit (calls joining
        a running batch: one that must wait holds back those behind it).
        """
        rule = self._batcher.max_adapters
        chosen = []
        failed = []
        for call in list(self._pending):  # fits() may add calls
            if len(chosen) >= limit:
                break
            if call.future.done():
                continue
            name = call.name
            if name is None or name in names or rule is None:
                chosen.append(call)
                if name is not None:
                    names = names | {name}
                continue
            candidate = names | {name}
            if isinstance(rule, int):
                fits = len(candidate) <= rule
            else:
                try:
                    fits = rule(candidate)
                except Exception as exc:
                    failed.append((call, exc))
                    continue
                if not isinstance(fits, bool):
                    failed.append((call, TypeError(
                        f"max_adapters callable {describe(rule)} must return a bool, "
                        f"found {describe(fits)} for {set(candidate)!r}")))
                    continue
            if fits:
                chosen.append(call)
                names = candidate
            elif in_order:
                break
            elif not names:
                if isinstance(rule, int):
                    reason = f"max_adapters={rule}"
                else:
                    reason = f"max_adapters callable {describe(rule)} returned False for {{{name!r}}}"
                failed.append((call, ValueError(
                    f"adapter {name!r} does not fit in a batch on its own ({reason}), "
                    f"so no batch can serve it")))
        for call, exc in failed:
            self._pending.remove(call)
            fail((call,), exc)
        return chosen, len(chosen) >= limit

    def take(self, chosen):
        """Remove ``chosen`` from the pending calls; the others stay first, in arrival order."""
        taken = set(map(id, chosen))
        left = [call for call in self._pending if id(call) not in taken]
        self._pending.clear()
        self._pending.extend(left)

    def join(self, limit, names, busy):
        """Pending calls that join a running continuous batch now (up to ``limit``).

        ``names``: the adapters of its open items; ``busy``: whether it has any."""
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
        if limit <= 0 or not self._pending:
            return []
        # While items are open, a call that must wait holds back those behind
        # it; once none is, the calls form a batch as the worker would.
        chosen, _ = self._select(limit, names, in_order=busy)
        self.take(chosen)
        return chosen

    async def _sleep_until(self, loop, deadline):
        waiter = self._waiter = loop.create_future()
        timer = loop.call_at(deadline, wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def _work(self, loop, owner):
        batcher = self._batcher
        running = ()
        task = None
        try:
            while True:
                pending = self._pending
                while pending and pending[0].future.done():
                    pending.popleft()
                if not pending:
                    return
                chosen, full = self._select(batcher.max_batch_size)
                if not pending:
                    return
                deadline = pending[0].arrival + batcher.batch_wait_timeout_s
                if not chosen or (not full and loop.time() < deadline):
                    await self._sleep_until(loop, deadline)
                    continue
                self.take(chosen)
                running = chosen  # a continuous batch appends the calls that join it
                task = contextvars.Context().run(batcher.start, loop, owner, chosen, self)
                # wait() neither raises the batch's exception here nor cancels
                # the batch when a caller is cancelled.
                await asyncio.wait((task,))
                batcher.deliver(chosen, task)
                running, task = (), None
        except (asyncio.CancelledError, Exception) as exc:
            # The worker itself was cancelled (its event loop is shutting
            # down) or failed: nobody must wait forever.
            if task is not None:
                task.cancel()
            waiting = list(running) + list(self._pending)
            self._pending.clear()
            if isinstance(exc, asyncio.CancelledError):
                cancel(waiting)
            else:
                fail(waiting, exc)
            raise
        finally:
            self._worker = None
