"""lorahook.ray_serve.batch: mixed-adapter batches in plain asyncio, no Ray cluster.

Ordering is controlled with asyncio events and ``batch_wait_timeout_s=0``
(a batch takes whatever is pending when its worker runs), not with sleeps.
"""
import asyncio
import contextvars
import gc
import pickle
import os
import subprocess
import sys
import textwrap
import threading
import types
import warnings
import weakref

import pytest

from lorahook.ray_serve import _batching
from lorahook.ray_serve._batching import batch

# children run from this folder, so they import the installed lorahook, not the source tree
_HERE = os.path.dirname(os.path.abspath(__file__))


def run(coro, timeout=20):
    """asyncio.run with a guard: a bug fails the test instead of hanging it."""
    async def guarded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(guarded())


async def settle(rounds=5):
    """Let every task that is ready run until it blocks."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Recorder:
    """Records each batch; optionally holds every batch at ``gate`` until it is set."""

    def __init__(self):
        self.batches = []
        self.gate = None
        self.entered = None
        self.finished = 0
        self.active = 0
        self.max_active = 0

    async def run(self, names, items):
        self.batches.append((list(names), list(items)))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.entered is not None:
                self.entered.set()
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.active -= 1
        self.finished += 1
        return [f"{name}:{item}" for name, item in zip(names, items)]


def make_model(**settings):
    """A new decorated class, so settings never leak between tests."""
    class Model(Recorder):
        @batch(**settings)
        async def f(self, adapter_names, items):
            return await self.run(adapter_names, items)
    return Model


class Pickled(Recorder):
    """Module level, so pickle finds it by reference."""

    @batch(max_batch_size=4, batch_wait_timeout_s=0)
    async def f(self, adapter_names, items):
        return await self.run(adapter_names, items)


@batch(max_batch_size=3, batch_wait_timeout_s=0)
async def plain(adapter_names, items):
    return [(name, item, len(items)) for name, item in zip(adapter_names, items)]


# -- batches -------------------------------------------------------------------------------

def test_mixed_adapters_share_one_batch_in_arrival_order():
    model = make_model(max_batch_size=16, batch_wait_timeout_s=0)()
    names = ["a", "b", None, "c", "a", "d", None, "b"]

    async def main():
        return await asyncio.gather(*(model.f(n, i) for i, n in enumerate(names)))

    results = run(main())
    assert model.batches == [(names, list(range(8)))]
    assert results == [f"{n}:{i}" for i, n in enumerate(names)]


def test_max_batch_size_cuts_batches_in_arrival_order():
    model = make_model(max_batch_size=4, batch_wait_timeout_s=0)()

    async def main():
        return await asyncio.gather(*(model.f("ab"[i % 2], i) for i in range(10)))

    results = run(main())
    assert [items for _, items in model.batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert results == [f"{'ab'[i % 2]}:{i}" for i in range(10)]


def test_a_full_batch_starts_without_waiting_for_the_timeout():
    # With an hour of timeout, only a full batch can start.
    model = make_model(max_batch_size=3, batch_wait_timeout_s=3600)()

    async def main():
        first = asyncio.ensure_future(model.f("a", 0))
        await settle()
        assert model.batches == []  # waiting for more calls
        second = asyncio.ensure_future(model.f("b", 1))
        await settle()
        assert model.batches == []
        third = model.f(None, 2)
        return await asyncio.gather(first, second, third)

    assert run(main()) == ["a:0", "b:1", "None:2"]
    assert model.batches == [(["a", "b", None], [0, 1, 2])]


def test_a_batch_that_is_not_full_waits_for_the_timeout():
    timeout = 0.05

    class Model:
        @batch(max_batch_size=8, batch_wait_timeout_s=timeout)
        async def f(self, adapter_names, items):
            self.started = asyncio.get_running_loop().time()
            return items

    model = Model()

    async def main():
        arrived = asyncio.get_running_loop().time()
        assert await model.f("a", 1) == 1
        return arrived

    arrived = run(main())
    # Lower bound only: the batch does not start before the timeout (1 ms for clock rounding).
    assert model.started - arrived >= timeout - 1e-3


def test_timeout_counts_from_the_oldest_pending_call():
    # A batch started by the timeout holds every call pending at that moment.
    model = make_model(max_batch_size=8, batch_wait_timeout_s=0.05)()

    async def main():
        first = asyncio.ensure_future(model.f("a", 0))
        await settle()
        second = asyncio.ensure_future(model.f("b", 1))
        return await asyncio.gather(first, second)

    assert run(main()) == ["a:0", "b:1"]
    assert model.batches == [(["a", "b"], [0, 1])]


def test_batches_of_one_instance_run_one_at_a_time():
    model = make_model(max_batch_size=2, batch_wait_timeout_s=0)()

    async def main():
        model.gate = asyncio.Event()
        model.entered = asyncio.Event()
        calls = [asyncio.ensure_future(model.f("a", i)) for i in range(2)]
        await model.entered.wait()
        calls += [asyncio.ensure_future(model.f("b", i)) for i in range(2, 7)]
        await settle()
        assert len(model.batches) == 1  # the others wait for the running batch
        model.gate.set()
        return await asyncio.gather(*calls)

    results = run(main())
    assert results == [f"{'a' if i < 2 else 'b'}:{i}" for i in range(7)]
    assert model.max_active == 1
    assert [items for _, items in model.batches] == [[0, 1], [2, 3], [4, 5], [6]]


def test_two_instances_have_separate_queues():
    Model = make_model(max_batch_size=8, batch_wait_timeout_s=0)
    blocked, free = Model(), Model()

    async def main():
        blocked.gate = asyncio.Event()
        blocked.entered = asyncio.Event()
        held = [asyncio.ensure_future(blocked.f("a", i)) for i in range(3)]
        await blocked.entered.wait()
        # The other instance batches and finishes while the first one is held.
        assert await asyncio.gather(*(free.f("b", i) for i in range(10, 13))) == [
            "b:10", "b:11", "b:12"]
        assert not any(call.done() for call in held)
        blocked.gate.set()
        return await asyncio.gather(*held)

    assert run(main()) == ["a:0", "a:1", "a:2"]
    assert blocked.batches == [(["a"] * 3, [0, 1, 2])]
    assert free.batches == [(["b"] * 3, [10, 11, 12])]


def test_plain_function():
    async def main():
        return await asyncio.gather(*(plain(n, i) for i, n in enumerate(["x", None, "y", "x"])))

    assert run(main()) == [("x", 0, 3), (None, 1, 3), ("y", 2, 3), ("x", 3, 1)]


def test_bare_decorator_uses_the_defaults():
    class Model(Recorder):
        @batch
        async def f(self, adapter_names, items):
            return await self.run(adapter_names, items)

    model = Model()

    async def main():
        return await asyncio.gather(*(model.f("a", i) for i in range(20)))

    run(main())
    assert [len(items) for _, items in model.batches] == [16, 4]


# -- event loops, instances, memory --------------------------------------------------------

def test_one_instance_across_two_asyncio_runs():
    model = make_model(max_batch_size=4, batch_wait_timeout_s=0)()

    async def main(offset):
        return await asyncio.gather(*(model.f("a", offset + i) for i in range(3)))

    assert run(main(0)) == ["a:0", "a:1", "a:2"]
    assert run(main(10)) == ["a:10", "a:11", "a:12"]
    assert [items for _, items in model.batches] == [[0, 1, 2], [10, 11, 12]]


def test_event_loops_in_two_threads_batch_independently():
    # Each loop's batch holds only that loop's calls, and the two batches run at
    # the same time: each waits, inside the batch, for the other loop's batch.
    Model = make_model(max_batch_size=8, batch_wait_timeout_s=0)
    model = Model()
    barrier = threading.Barrier(2, timeout=10)
    results, errors = {}, []

    async def rendezvous(names, items):
        await asyncio.to_thread(barrier.wait)
        return [f"{name}:{item}" for name, item in zip(names, items)]

    model.run = rendezvous

    def worker(tag):
        async def main():
            return await asyncio.gather(*(model.f(tag, f"{tag}{i}") for i in range(3)))
        try:
            results[tag] = run(main())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(tag,)) for tag in "xy"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert results == {tag: [f"{tag}:{tag}{i}" for i in range(3)] for tag in "xy"}


def test_queues_keep_neither_instance_nor_loop_alive():
    Model = make_model(max_batch_size=4, batch_wait_timeout_s=0)
    model = Model()
    loops = []

    async def main():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        await asyncio.gather(*(model.f("a", i) for i in range(3)))

    run(main())
    gc.collect()
    assert loops[0]() is None
    instance = weakref.ref(model)
    del model
    gc.collect()
    assert instance() is None
    assert Model.f._lorahook_batcher._owners == {}


def test_instances_without_weak_references_work():
    class Slotted:
        __slots__ = ("seen",)

        def __init__(self):
            self.seen = []

        @batch(max_batch_size=4, batch_wait_timeout_s=0)
        async def f(self, adapter_names, items):
            self.seen.append(list(items))
            return items

    model = Slotted()

    async def main():
        return await asyncio.gather(*(model.f("a", i) for i in range(3)))

    assert run(main()) == [0, 1, 2]
    assert model.seen == [[0, 1, 2]]


# -- max_adapters and fairness -------------------------------------------------------------

def test_max_adapters_int_limits_distinct_names_and_leftovers_go_first():
    model = make_model(max_batch_size=8, batch_wait_timeout_s=0, max_adapters=1)()

    async def main():
        model.gate = asyncio.Event()
        model.entered = asyncio.Event()
        first = [asyncio.ensure_future(model.f(n, i))
                 for i, n in enumerate(["a", "b", None, "a", "b", "c"])]
        await model.entered.wait()
        # Arrive while the first batch runs: they queue behind the calls it left.
        later = [asyncio.ensure_future(model.f(n, i)) for i, n in [(6, "b"), (7, "a")]]
        await settle()
        model.gate.set()
        return await asyncio.gather(*first, *later)

    run(main())
    assert model.batches == [
        (["a", None, "a"], [0, 2, 3]),
        (["b", "b", "b"], [1, 4, 6]),
        (["c"], [5]),
        (["a"], [7]),
    ]


def test_max_adapters_counts_only_named_adapters():
    model = make_model(max_batch_size=8, batch_wait_timeout_s=0, max_adapters=2)()
    names = [None, "a", None, "b", "c", None, "a"]

    async def main():
        return await asyncio.gather(*(model.f(n, i) for i, n in enumerate(names)))

    run(main())
    assert model.batches == [([None, "a", None, "b", None, "a"], [0, 1, 2, 3, 5, 6]),
                             (["c"], [4])]


def test_max_adapters_callable():
    cost = {"big": 3, "s1": 1, "s2": 1, "s3": 1}
    seen = []

    def fits(names):
        seen.append(names)
        return sum(cost[name] for name in names) <= 3

    model = make_model(max_batch_size=8, batch_wait_timeout_s=0, max_adapters=fits)()
    names = ["s1", "big", "s2", None, "s3", "big"]

    async def main():
        return await asyncio.gather(*(model.f(n, i) for i, n in enumerate(names)))

    run(main())
    assert model.batches == [(["s1", "s2", None, "s3"], [0, 2, 3, 4]),
                             (["big", "big"], [1, 5])]
    assert all(type(names) is frozenset and None not in names for names in seen)


def test_an_adapter_that_never_fits_fails_alone():
    def fits(names):
        return "huge" not in names

    model = make_model(max_batch_size=8, batch_wait_timeout_s=0, max_adapters=fits)()

    async def main():
        return await asyncio.gather(*(model.f(n, i) for i, n in enumerate(["a", "huge", "b"])),
                                    return_exceptions=True)

    a, huge, b = run(main())
    assert (a, b) == ("a:0", "b:2")
    assert isinstance(huge, ValueError) and "'huge'" in str(huge)
    assert model.batches == [(["a", "b"], [0, 2])]


def test_a_failing_or_non_bool_fits_reaches_only_that_call():
    def fits(names):
        if "raises" in names:
            raise LookupError("no size known for 'raises'")
        if "vague" in names:
            return 1
        return True

    model = make_model(max_batch_size=8, batch_wait_timeout_s=0, max_adapters=fits)()

    async def main():
        return await asyncio.gather(*(model.f(n, i) for i, n in
                                      enumerate(["a", "raises", "vague", None])),
                                    return_exceptions=True)

    a, raises, vague, base = run(main())
    assert (a, base) == ("a:0", "None:3")
    assert isinstance(raises, LookupError)
    assert isinstance(vague, TypeError) and "bool" in str(vague)
    assert model.batches == [(["a", None], [0, 3])]


def test_no_starvation_under_a_steady_stream_of_another_adapter():
    # One adapter per batch; every "a" batch brings two more "a" calls, for 20
    # batches. The lone "b" call is served right after the "a" calls that
    # arrived before it, while the stream is still going.
    class Model:
        def __init__(self):
            self.batches = []
            self.next_item = 0
            self.stream = []

        def submit(self, name):
            self.next_item += 1
            call = asyncio.ensure_future(self.f(name, self.next_item))
            self.stream.append(call)
            return call

        @batch(max_batch_size=2, batch_wait_timeout_s=0, max_adapters=1)
        async def f(self, adapter_names, items):
            self.batches.append((list(adapter_names), list(items)))
            if len(self.batches) < 20 and adapter_names[0] == "a":
                self.submit("a")
                self.submit("a")
            await asyncio.sleep(0)
            return items

    model = Model()

    async def main():
        for _ in range(3):
            model.submit("a")
        model.submit("b")
        for _ in range(3):
            model.submit("a")
        while any(not call.done() for call in model.stream):
            await asyncio.gather(*model.stream)

    run(main())
    names = [batch_names for batch_names, _ in model.batches]
    where = names.index(["b"])
    assert model.batches[where] == (["b"], [4])
    # before "b": the three "a" calls that arrived before it (two batches)
    assert where == 2
    assert any(n == ["a", "a"] for n in names[where + 1:])


# -- context, results, errors --------------------------------------------------------------

REQUEST = contextvars.ContextVar("REQUEST", default="unset")


def test_batches_run_in_an_empty_context():
    seen = {}

    def fits(names):
        seen.setdefault("fits", REQUEST.get())
        return True

    class Model:
        @batch(max_batch_size=4, batch_wait_timeout_s=0, max_adapters=fits)
        async def f(self, adapter_names, items):
            seen["f"] = REQUEST.get()
            seen["vars"] = len(contextvars.copy_context())
            return items

    model = Model()

    async def one(i):
        REQUEST.set(f"caller {i}")
        return await model.f("a", i)

    async def main():
        REQUEST.set("main")
        return await asyncio.gather(*(one(i) for i in range(3)))

    assert run(main()) == [0, 1, 2]
    assert seen == {"fits": "unset", "f": "unset", "vars": 0}


def test_an_exception_reaches_every_caller_of_its_batch_and_no_other():
    class Boom(Exception):
        pass

    class Model:
        @batch(max_batch_size=2, batch_wait_timeout_s=0)
        async def f(self, adapter_names, items):
            if "boom" in items:
                raise Boom("batch failed")
            return items

    model = Model()

    async def main():
        return await asyncio.gather(*(model.f(n, item) for n, item in
                                      [("a", 1), ("b", "boom"), ("a", 3), ("c", 4)]),
                                    return_exceptions=True)

    first, second, third, fourth = run(main())
    assert isinstance(first, Boom) and second is first
    assert (third, fourth) == (3, 4)


def test_a_cancelled_error_inside_f_reaches_its_batch_only():
    class Model:
        @batch(max_batch_size=2, batch_wait_timeout_s=0)
        async def f(self, adapter_names, items):
            if items[0] == 0:
                raise asyncio.CancelledError("inside f")
            return items

    model = Model()

    async def main():
        calls = [asyncio.ensure_future(model.f("a", i)) for i in range(4)]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in results[:2])
    assert results[2:] == [2, 3]


@pytest.mark.parametrize("returned, error", [
    (lambda items: items[:-1], ValueError),
    (lambda items: items + [None], ValueError),
    (lambda items: None, TypeError),
    (lambda items: "ab", TypeError),
])
def test_a_wrong_result_reaches_its_batch_only(returned, error):
    class Model:
        @batch(max_batch_size=2, batch_wait_timeout_s=0)
        async def f(self, adapter_names, items):
            if items[0] == 0:
                return returned(items)
            return items

    model = Model()

    async def main():
        return await asyncio.gather(*(model.f("a", i) for i in range(4)),
                                    return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, error) and "Model.f" in str(r) for r in results[:2])
    assert results[2:] == [2, 3]


def test_a_tuple_result_is_fine():
    @batch(max_batch_size=4, batch_wait_timeout_s=0)
    async def f(adapter_names, items):
        return tuple(items)

    async def main():
        return await asyncio.gather(*(f("a", i) for i in range(3)))

    assert run(main()) == [0, 1, 2]


# -- cancellation --------------------------------------------------------------------------

def test_a_call_cancelled_before_its_batch_never_reaches_f():
    model = make_model(max_batch_size=8, batch_wait_timeout_s=0)()

    async def main():
        model.gate = asyncio.Event()
        model.entered = asyncio.Event()
        running = asyncio.ensure_future(model.f("a", 0))
        await model.entered.wait()
        doomed = asyncio.ensure_future(model.f("b", 1))
        kept = asyncio.ensure_future(model.f("c", 2))
        await settle()
        doomed.cancel()
        await settle()
        model.gate.set()
        assert await asyncio.gather(running, kept) == ["a:0", "c:2"]
        with pytest.raises(asyncio.CancelledError):
            await doomed

    run(main())
    assert model.batches == [(["a"], [0]), (["c"], [2])]


def test_a_lone_call_cancelled_while_waiting_never_reaches_f():
    model = make_model(max_batch_size=8, batch_wait_timeout_s=3600)()

    async def main():
        call = asyncio.ensure_future(model.f("a", 0))
        await settle()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await settle()
        # the queue is idle again: its worker ended, a new call starts a new one
        model.f.set_batch_wait_timeout_s(0)
        return await model.f("b", 1)

    assert run(main()) == "b:1"
    assert model.batches == [(["b"], [1])]


def test_a_call_cancelled_during_its_batch_leaves_f_running():
    model = make_model(max_batch_size=8, batch_wait_timeout_s=0)()

    async def main():
        model.gate = asyncio.Event()
        model.entered = asyncio.Event()
        doomed = asyncio.ensure_future(model.f("a", 0))
        kept = asyncio.ensure_future(model.f("b", 1))
        await model.entered.wait()
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert model.finished == 0 and not kept.done()
        model.gate.set()
        return await kept

    assert run(main()) == "b:1"
    assert model.finished == 1
    assert model.batches == [(["a", "b"], [0, 1])]


# -- pickling ------------------------------------------------------------------------------

def test_pickle_before_and_after_use():
    model = Pickled()
    for _ in range(2):
        assert pickle.loads(pickle.dumps(Pickled)) is Pickled
        assert pickle.loads(pickle.dumps(Pickled.f)) is Pickled.f
        assert pickle.loads(pickle.dumps(plain)) is plain
        copy = pickle.loads(pickle.dumps(model))
        assert copy.batches == model.batches

        async def main():
            return await asyncio.gather(*(model.f("a", i) for i in range(2)),
                                        plain("p", 0))

        assert run(main()) == ["a:0", "a:1", ("p", 0, 1)]


def test_cloudpickle_ships_the_class_by_value_before_and_after_use():
    cloudpickle = pytest.importorskip("cloudpickle")

    def fits(names):  # a local callable travels with the class
        return len(names) <= 1

    Model = make_model(max_batch_size=2, batch_wait_timeout_s=0, max_adapters=fits)
    Model.f.set_max_batch_size(3)

    async def use(model):
        return await asyncio.gather(*(model.f(n, i) for i, n in enumerate("aabaa")))

    # In one process cloudpickle hands back the class it tracks; what matters here
    # is that pickling works at any time (a fresh process is tested below).
    before = cloudpickle.loads(cloudpickle.dumps(Model))
    model = Model()
    run(use(model))
    after = cloudpickle.loads(cloudpickle.dumps(Model))
    for cls in (before, after, Model):
        copy = cls()
        assert run(use(copy)) == [f"{n}:{i}" for i, n in enumerate("aabaa")]
        assert copy.batches == [(["a", "a", "a"], [0, 1, 3]), (["b"], [2]), (["a"], [4])]


def test_cloudpickled_class_runs_in_a_fresh_process():
    # As Ray ships a deployment class: by value, after use, to a process that
    # never saw it; the settings and a local max_adapters callable travel along.
    cloudpickle = pytest.importorskip("cloudpickle")

    def fits(names):
        return len(names) <= 1

    class Shipped:
        def __init__(self):
            self.batches = []

        @batch(max_batch_size=2, batch_wait_timeout_s=0, max_adapters=fits)
        async def f(self, adapter_names, items):
            self.batches.append(list(items))
            return [f"{name}:{item}" for name, item in zip(adapter_names, items)]

    async def use(model):
        return await asyncio.gather(*(model.f("a", i) for i in range(3)))

    Shipped.f.set_max_batch_size(3)
    run(use(Shipped()))  # used before shipping
    payload = cloudpickle.dumps(Shipped)
    child = textwrap.dedent("""
        import asyncio, sys, cloudpickle
        Shipped = cloudpickle.loads(sys.stdin.buffer.read())
        model = Shipped()
        async def main():
            names = ["a", "b", None, "a", "a"]
            return await asyncio.gather(*(model.f(n, i) for i, n in enumerate(names)))
        print(asyncio.run(main()), model.batches)
        print("ray" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", child], input=payload, capture_output=True,
                         timeout=120, cwd=_HERE)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split("\n")[:2] == [
        "['a:0', 'b:1', 'None:2', 'a:3', 'a:4'] [[0, 2, 3], [1], [4]]", "False"]


# -- settings ------------------------------------------------------------------------------

def test_set_max_batch_size_applies_to_the_next_batches():
    Model = make_model(max_batch_size=8, batch_wait_timeout_s=0)
    model = Model()

    async def main(n):
        return await asyncio.gather(*(model.f("a", i) for i in range(n)))

    run(main(5))
    Model.f.set_max_batch_size(2)
    run(main(5))
    model.f.set_max_batch_size(3)  # through an instance, as in a deployment's reconfigure
    run(main(4))
    assert [len(items) for _, items in model.batches] == [5, 2, 2, 1, 3, 1]


def test_set_batch_wait_timeout_s_wakes_a_waiting_batch():
    model = make_model(max_batch_size=8, batch_wait_timeout_s=3600)()

    async def main():
        calls = [asyncio.ensure_future(model.f("a", i)) for i in range(2)]
        await settle()
        assert model.batches == []
        model.f.set_batch_wait_timeout_s(0)
        return await asyncio.gather(*calls)

    assert run(main()) == ["a:0", "a:1"]


def test_setters_validate():
    Model = make_model()
    with pytest.raises(ValueError, match="max_batch_size"):
        Model.f.set_max_batch_size(0)
    with pytest.raises(TypeError, match="max_batch_size"):
        Model.f.set_max_batch_size(2.0)
    with pytest.raises(ValueError, match="batch_wait_timeout_s"):
        Model.f.set_batch_wait_timeout_s(-1)
    with pytest.raises(TypeError, match="batch_wait_timeout_s"):
        Model.f.set_batch_wait_timeout_s("0.1")
    settings = Model.f._lorahook_batcher
    assert (settings.max_batch_size, settings.batch_wait_timeout_s) == (16, 0.01)


# -- arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(max_batch_size=0), ValueError, "max_batch_size"),
    (dict(max_batch_size=2.5), TypeError, "max_batch_size"),
    (dict(max_batch_size=True), TypeError, "max_batch_size"),
    (dict(batch_wait_timeout_s=-0.1), ValueError, "batch_wait_timeout_s"),
    (dict(batch_wait_timeout_s=float("inf")), ValueError, "batch_wait_timeout_s"),
    (dict(batch_wait_timeout_s=float("nan")), ValueError, "batch_wait_timeout_s"),
    (dict(batch_wait_timeout_s=None), TypeError, "batch_wait_timeout_s"),
    (dict(max_adapters=0), ValueError, "max_adapters"),
    (dict(max_adapters="a"), TypeError, "max_adapters"),
    (dict(max_adapters=2.0), TypeError, "max_adapters"),
])
def test_bad_settings(kwargs, error, words):
    with pytest.raises(error, match=words):
        batch(**kwargs)


def test_bad_functions():
    def sync(self, adapter_names, items):
        return items

    async def agen(self, adapter_names, items):  # streams: see test_batching_stream.py
        yield items

    async def one(items):
        return items

    async def star(self, *args):
        return args

    with pytest.raises(TypeError, match="async def"):
        batch()(sync)
    assert callable(batch()(agen))
    with pytest.raises(TypeError, match="adapter_names, items"):
        batch()(one)
    with pytest.raises(TypeError, match="adapter_names, items"):
        batch()(star)
    with pytest.raises(TypeError, match="no other arguments"):
        batch(plain.__wrapped__, 0.5)


def test_bad_adapter_names():
    async def main():
        with pytest.raises(TypeError, match="adapter_name"):
            await plain(3, "x")
        with pytest.raises(ValueError, match="adapter_name.*None"):
            await plain("", "x")
        with pytest.raises(TypeError):
            await plain("a")  # one name and one item

    run(main())


def test_signature_is_the_callers():
    import inspect
    assert str(inspect.signature(Pickled.f)) == "(self, adapter_name, item, /)"
    assert str(inspect.signature(plain)) == "(adapter_name, item, /)"
    assert Pickled.f.__name__ == "f" and Pickled.f.__qualname__ == "Pickled.f"


# -- the Ray Serve warning -----------------------------------------------------------------

def test_warns_when_max_ongoing_requests_is_below_max_batch_size(monkeypatch):
    limit = {"value": 4}
    monkeypatch.setattr(_batching, "_replica_max_ongoing_requests", lambda: limit["value"])
    Model = make_model(max_batch_size=8, batch_wait_timeout_s=0)

    async def main(model):
        return await model.f("a", 1)

    with pytest.warns(UserWarning, match=r"max_batch_size \(8\).*max_ongoing_requests \(4\)"):
        run(main(Model()))
    with pytest.warns(UserWarning, match=r"max_batch_size \(5\)"):
        Model.f.set_max_batch_size(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Model.f.set_max_batch_size(4)  # equal is fine
        run(main(Model()))
        limit["value"] = None  # not in a replica
        Model.f.set_max_batch_size(64)
        run(main(Model()))


def test_no_replica_means_no_warning_and_no_ray_import():
    had_ray = "ray" in sys.modules
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = make_model(max_batch_size=1000, batch_wait_timeout_s=0)()
        assert run(model.f("a", 1)) == "a:1"
    assert ("ray" in sys.modules) == had_ray  # batching never imports ray itself
    if "ray.serve" not in sys.modules:
        assert _batching._replica_max_ongoing_requests() is None


def test_reads_the_replica_context_like_ray(monkeypatch):
    serve = pytest.importorskip("ray.serve")
    # Outside a replica, Ray refuses to give a context: no limit.
    assert _batching._replica_max_ongoing_requests() is None
    context = types.SimpleNamespace(
        _deployment_config=types.SimpleNamespace(max_ongoing_requests=2))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    assert _batching._replica_max_ongoing_requests() == 2
    Model = make_model(max_batch_size=3, batch_wait_timeout_s=0)
    with pytest.warns(UserWarning, match=r"max_ongoing_requests \(2\)"):
        assert run(Model().f(None, 1)) == "None:1"


# -- imports -------------------------------------------------------------------------------

def _child(code):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, cwd=_HERE)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_lorahook_never_imports_ray():
    out = _child("""
        import sys
        import lorahook, lorahook.ray_serve._batching
        print(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
    """)
    assert out.strip() == "[]"


def test_ray_serve_without_ray_batches_and_names_the_extra_for_the_rest():
    # batch is plain asyncio: it imports and runs without ray; the names that need
    # Ray Serve say what to install when they are first read
    out = _child("""
        import asyncio, sys
        sys.modules["ray"] = None  # as if ray were not installed
        import lorahook.ray_serve as rs

        class M:
            @rs.batch(max_batch_size=2, batch_wait_timeout_s=0)
            async def f(self, names, items):
                return [i * 2 for i in items]

        async def main():
            m = M()
            return await asyncio.gather(m.f(None, 1), m.f("a", 2))
        print(asyncio.run(main()))
        for name in ("multiplexed", "shared_resolver", "SharedResolver", "AdapterLease"):
            try:
                getattr(rs, name)
            except ImportError as exc:
                print(name, "ImportError", exc)
        try:
            from lorahook.ray_serve import shared_resolver
        except ImportError as exc:
            print("from-import ImportError", exc)
        print("ray" in sys.modules and sys.modules["ray"] is not None)
    """)
    lines = out.strip().splitlines()
    assert lines[0] == "[2, 4]"
    for name in ("multiplexed", "shared_resolver", "SharedResolver", "AdapterLease"):
        assert any(l.startswith(f"{name} ImportError") and "pip install 'lorahook[ray]'" in l
                   for l in lines), out
    assert any(l.startswith("from-import ImportError") for l in lines), out
    assert lines[-1] == "False"


def test_ray_serve_names_no_attribute_it_does_not_have():
    import lorahook.ray_serve as rs
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        rs.nothing_here


def test_ray_serve_exports_batch():
    pytest.importorskip("ray.serve")
    import lorahook.ray_serve as ray_serve
    assert ray_serve.batch is batch
    assert set(ray_serve.__all__) == {"batch", "DONE", "Joined", "multiplexed", "shared_resolver",
                                      "SharedResolver", "AdapterLease"}
