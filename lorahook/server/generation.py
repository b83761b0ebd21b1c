"""A replica's generation: requests batched across adapters, token by token, as chunks.

:func:`lorahook.ray_serve.batch` in streaming mode gathers the requests;
:class:`lorahook.server.engine.Batch` runs them.  With a joinable cache a
request joins a running batch at the next step and a finished one leaves at
once; other caches run whole batches.  Each request's ``(text, finish,
used, error)`` chunks come until its deadline.
"""
import asyncio
import time

from ..ray_serve import DONE, batch
from .deadline import until

__all__ = ["Generation"]


class Generation:
    """One replica's batches: ``tokens(key, request, deadline, release)`` per request."""

    def __init__(self, model, tokenizer, attached, settings, joining, pad, eos):
        self.model, self.tokenizer, self.attached = model, tokenizer, attached
        self.joining, self.pad, self.eos = joining, pad, eos
        batched = batch(max_batch_size=settings.max_batch_size,
                        batch_wait_timeout_s=settings.batch_wait_timeout_s,
                        max_adapters=settings.max_adapters, continuous=joining)
        self.generate = batched(self._run_joining if joining else self._run_fixed)
        self.waiting = {}    # id(request) -> request, for requests not yet in a batch
        self.batches = []    # (requests admitted, distinct adapters then running), recent last
        self.steps, self.step_seconds = 0, 0.0

    def stats(self):
        return {"batches": self.batches[-100:], "steps": self.steps,
                "step_seconds": self.step_seconds, "joining": self.joining,
                "queued": len(self.waiting)}

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

    async def tokens(self, key, request, deadline, release):
        """The request's ``(text, finish, used, error)`` chunks, until its deadline.

        However it ends (finished, failed, timed out, drained, abandoned by
        its caller), ``release()`` is called once it has.
        """
        stream = self.generate(key, request)
        try:
            while True:
                try:
                    chunk = await until(stream.__anext__(), deadline)
                except StopAsyncIteration:
                    return
                yield chunk
                if chunk[1] is not None:
                    return
        finally:
            release()
            await stream.aclose()
