"""lorahook.ray_serve.batch with async-generator functions: per-caller token streams."""
import asyncio
import pickle

import pytest

from lorahook._batching import DONE, batch


def run(coro, timeout=20):
    async def guarded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(guarded())


class Counter:
    """Item n streams n chunks ``(name, i)``, one per step; the batches are recorded."""

    def __init__(self):
        self.batches = []
        self.steps = 0
        self.closed = 0

    @batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def gen(self, names, items):
        self.batches.append(list(zip(names, items)))
        try:
            step = 0
            while True:
                self.steps += 1
                yield [(name, step) if step < n else DONE for name, n in zip(names, items)]
                step += 1
                await asyncio.sleep(0.01)
        finally:
            self.closed += 1


async def collect(it, stamps=None):
    out = []
    async for chunk in it:
        out.append(chunk)
        if stamps is not None:
            stamps.append(asyncio.get_running_loop().time())
    return out


def test_each_caller_gets_its_own_chunks_and_ends_with_its_item():
    c = Counter()

    async def main():
        ends = {}

        async def one(name, n):
            out = await collect(c.gen(name, n))
            ends[name] = asyncio.get_running_loop().time()
            return out

        outs = await asyncio.gather(one("a", 2), one(None, 6), one("b", 1))
        return outs, ends

    outs, ends = run(main())
    assert outs == [[("a", 0), ("a", 1)], [(None, i) for i in range(6)], [("b", 0)]]
    assert len(c.batches) == 1  # one mixed batch
    # the short items end well before the long one, which keeps its batch alive
    assert ends["b"] < ends["a"] < ends[None]
    assert c.closed == 1 and c.steps == 7  # closed once every item was done


def test_a_caller_that_leaves_does_not_break_the_batch():
    c = Counter()

    async def main():
        async def leaver():
            async for chunk in c.gen("x", 50):
                if chunk[1] == 1:
                    break  # the client disconnects
            return "left"

        return await asyncio.gather(leaver(), collect(c.gen("y", 4)))

    left, rest = run(main())
    assert left == "left" and rest == [("y", i) for i in range(4)]
    assert c.steps < 50  # the batch stopped once nobody was listening


def test_errors_and_wrong_steps_reach_unfinished_callers_only():
    @batch(max_batch_size=4, batch_wait_timeout_s=0.05)
    async def gen(names, items):
        yield [1 if n else DONE for n in items]
        raise RuntimeError("boom")

    @batch(max_batch_size=4, batch_wait_timeout_s=0.05)
    async def short(names, items):
        yield [1]

    async def main():
        done_first = await asyncio.gather(collect(gen("a", 0)), collect(gen("b", 1)),
                                          return_exceptions=True)
        wrong = await asyncio.gather(collect(short("a", 0)), collect(short("b", 0)),
                                     return_exceptions=True)
        return done_first, wrong

    done_first, wrong = run(main())
    assert done_first[0] == []
    assert isinstance(done_first[1], RuntimeError) and "boom" in str(done_first[1])
    assert all(isinstance(e, ValueError) and "1 chunks for a batch of 2" in str(e) for e in wrong)


def test_a_caller_cancelled_before_its_batch_never_reaches_it():
    seen = []

    @batch(max_batch_size=4, batch_wait_timeout_s=0.2)
    async def gen(names, items):
        seen.append(list(items))
        yield [DONE] * len(items)

    async def main():
        t = asyncio.ensure_future(collect(gen("a", 1)))
        await asyncio.sleep(0.01)
        t.cancel()
        await collect(gen("b", 2))

    run(main())
    assert seen == [[2]]


def test_done_pickles_as_itself_and_streaming_classes_pickle():
    assert pickle.loads(pickle.dumps(DONE)) is DONE
    assert repr(DONE) == "lorahook.ray_serve.DONE"
    c = pickle.loads(pickle.dumps(Counter()))
    assert run(collect(c.gen("a", 3))) == [("a", 0), ("a", 1), ("a", 2)]
