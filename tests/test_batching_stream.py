"""lorahook.ray_serve.batch with async-generator functions: per-caller token streams."""
import asyncio
import pickle

import pytest

from lorahook.ray_serve._batching import DONE, batch


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


# --------------------------------------------------------------------------- continuous batching


class Streamer:
    @batch(max_batch_size=4, continuous=True)
    async def gen(self, names, items):
        yield [DONE] * len(items)


def joiner(max_batch_size=3, max_adapters=None, pause=0.01):
    """An instance whose ``gen`` is a continuous batch: item n streams chunks 0..n-1.

    It records the open items of each step, what it is sent, and how often it
    is called and closed; it drops the items that finished or left, as the
    contract asks.
    """

    class Joiner:
        def __init__(self):
            self.calls, self.closed = 0, 0
            self.steps, self.sent = [], []

        @batch(max_batch_size=max_batch_size, batch_wait_timeout_s=0.02,
               max_adapters=max_adapters, continuous=True)
        async def gen(self, names, items):
            self.calls += 1
            live = [[name, n, 0] for name, n in zip(names, items)]  # name, length, next chunk
            try:
                while live:
                    self.steps.append([(name, n) for name, n, _ in live])
                    out = [DONE if i >= n else (name, i) for name, n, i in live]
                    joined = yield out
                    self.sent.append(joined)
                    live = [entry for k, (entry, chunk) in enumerate(zip(live, out))
                            if chunk is not DONE and k not in joined.left]
                    for entry in live:
                        entry[2] += 1
                    live += [[name, n, 0] for name, n in zip(joined.names, joined.items)]
                    await asyncio.sleep(pause)
            finally:
                self.closed += 1

    return Joiner()


def test_continuous_calls_join_a_running_batch_between_steps():
    j = joiner(max_batch_size=4)

    async def main():
        first = asyncio.ensure_future(collect(j.gen("a", 40)))
        while not j.steps:  # the batch of "a" is running (40 steps of 10 ms)
            await asyncio.sleep(0.005)
        later = await asyncio.gather(collect(j.gen("b", 2)), collect(j.gen(None, 3)))
        return await first, later

    first, (b, base) = run(main())
    assert first == [("a", i) for i in range(40)]
    assert b == [("b", 0), ("b", 1)]
    assert base == [(None, 0), (None, 1), (None, 2)]
    assert j.calls == 1 and j.closed == 1  # one batch: the others joined it
    joins = [s for s in j.sent if s.names]
    assert sorted(name or "" for s in joins for name in s.names) == ["", "b"]
    assert max(len(step) for step in j.steps) == 3
    # a finished item leaves one step after its DONE
    last_b = max(k for k, step in enumerate(j.steps) if ("b", 2) in step)
    assert all(("b", 2) not in step for step in j.steps[last_b + 1:])


def test_continuous_joining_keeps_max_batch_size_and_max_adapters():
    j = joiner(max_batch_size=2, max_adapters=1)

    async def main():
        a = asyncio.ensure_future(collect(j.gen("a", 6)))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(collect(j.gen(name, 2))) for name in ("b", "a", "a")]
        return await asyncio.gather(a, *rest)

    outs = run(main())
    assert outs[0] == [("a", i) for i in range(6)]
    assert outs[1:] == [[("b", 0), ("b", 1)], [("a", 0), ("a", 1)], [("a", 0), ("a", 1)]]
    assert max(len(step) for step in j.steps) <= 2
    for step in j.steps:
        assert len({name for name, _ in step}) <= 1  # "b" never joined a step of "a"
    # "b" waited for the open "a" to finish, and the "a" behind it waited for "b"
    first_b = next(k for k, step in enumerate(j.steps) if step[0][0] == "b")
    assert all(name == "a" for step in j.steps[:first_b] for name, _ in step)
    assert sum(1 for step in j.steps[:first_b] for name, n in step if n == 2) == 0


def test_continuous_a_caller_that_leaves_is_sent_as_left_and_dropped():
    j = joiner(max_batch_size=4, pause=0.02)

    async def main():
        keep = asyncio.ensure_future(collect(j.gen("a", 6)))
        gone = j.gen("b", 100)
        assert await gone.__anext__() == ("b", 0)
        await gone.aclose()
        return await keep

    assert run(main()) == [("a", i) for i in range(6)]
    lefts = [s.left for s in j.sent if s.left]
    assert len(lefts) == 1 and len(lefts[0]) == 1
    after = j.sent.index(next(s for s in j.sent if s.left))
    assert all(name == "a" for step in j.steps[after + 1:] for name, _ in step)
    assert j.closed == 1


def test_continuous_wrong_step_length_reaches_open_callers():
    class Bad:
        @batch(max_batch_size=4, batch_wait_timeout_s=0.01, continuous=True)
        async def gen(self, names, items):
            yield [0] * len(items)
            yield [0] * (len(items) + 1)

    b = Bad()

    async def main():
        return await asyncio.gather(collect(b.gen("a", 1)), return_exceptions=True)

    (err,) = run(main())
    assert isinstance(err, ValueError) and "open items" in str(err)


def test_continuous_settings_are_checked_and_pickled():
    with pytest.raises(TypeError, match="async generator"):
        @batch(continuous=True)
        async def f(names, items):
            return items
    with pytest.raises(TypeError, match="continuous"):
        batch(continuous=1)
    batcher = Streamer.gen._lorahook_batcher
    cls, args = batcher.__reduce__()
    assert cls(*args).continuous is True


def test_continuous_a_drained_batch_takes_the_next_adapter_whole():
    # max_adapters=1 with interleaved arrivals: each adapter's calls still run together
    j = joiner(max_batch_size=8, max_adapters=1, pause=0.005)

    async def main():
        return await asyncio.gather(*(collect(j.gen("abc"[i % 3], 3)) for i in range(9)))

    outs = run(main())
    assert [len(out) for out in outs] == [3] * 9
    sizes = [len(step) for k, step in enumerate(j.steps)
             if k == 0 or {name for name, _ in step} != {name for name, _ in j.steps[k - 1]}]
    assert sizes == [3, 3, 3]  # three batches of one adapter, three calls each
