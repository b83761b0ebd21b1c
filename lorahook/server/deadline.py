"""A request's deadline in a replica: its own timeout, or the replica's drain if that ends first."""
import asyncio
import time

from .openai import RequestError

__all__ = ["Drain", "Deadline", "until"]

# How often a long wait looks again at its deadline (a drain may bring it forward).
_SLICE_S = 0.25


class Drain:
    """A replica's drain: ``end`` is ``None`` until it starts, then the ``time.monotonic()``
    at which the requests still running are ended."""

    __slots__ = ("end",)

    def __init__(self):
        self.end = None

    @property
    def started(self):
        return self.end is not None


class Deadline:
    """``seconds`` from now, or the replica's drain end if that is sooner."""

    __slots__ = ("at", "drain")

    def __init__(self, seconds, drain):
        self.at = time.monotonic() + seconds
        self.drain = drain

    def remaining(self):
        end = self.drain.end
        return (self.at if end is None else min(self.at, end)) - time.monotonic()

    def error(self):
        end = self.drain.end
        if end is not None and end < self.at:
            return RequestError(503, "the server shut down before the request finished (its "
                                     "drain timeout ended)", code="shutting_down")
        return RequestError(504, "the request took longer than the server's request timeout",
                            code="timeout")


async def until(awaitable, deadline):
    """``await awaitable`` until ``deadline`` (a :class:`Deadline`); then its error.

    The wait looks at the deadline again every quarter second, so a drain
    that starts meanwhile ends it in time.  The awaitable is cancelled if the
    deadline comes first, or if the caller is cancelled.
    """
    remaining = deadline.remaining()
    if remaining <= 0:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise deadline.error()
    future = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait((future,), timeout=min(remaining, _SLICE_S))
            if done:
                return future.result()
            remaining = deadline.remaining()
            if remaining <= 0:
                raise deadline.error()
    finally:
        if not future.done():
            future.cancel()
            try:  # its cancellation runs to its end before the caller goes on
                await future
            except BaseException:
                pass
