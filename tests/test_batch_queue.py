"""lorahook.ray_serve._batch_queue: which pending calls form a batch, on their own (no batcher runs).

The queue is driven through what the batcher uses of it (``put`` is left to
tests/test_batching.py, which runs the worker): ``join`` picks the calls that
join a running batch, ``take`` removes chosen calls, ``discard`` a cancelled
one.  Calls that cannot be served fail on their own futures, with the reason.
"""
import asyncio

import pytest

from lorahook.ray_serve._batch_queue import Call, Queue


class Batcher:
    """The settings a queue reads of its batcher."""

    qualname = "f"

    def __init__(self, max_adapters=None, max_batch_size=8):
        self.max_adapters = max_adapters
        self.max_batch_size = max_batch_size


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def queue_of(loop, names, **settings):
    q = Queue(Batcher(**settings))
    calls = [Call(name, i, loop.create_future(), float(i)) for i, name in enumerate(names)]
    q._pending.extend(calls)
    return q, calls


def names_of(calls):
    return [c.name for c in calls]


def test_join_takes_calls_in_arrival_order_within_the_limit(loop):
    q, calls = queue_of(loop, ["a", "b", None, "a", "c"])
    chosen = q.join(3, frozenset(), busy=False)
    assert chosen == calls[:3]
    assert list(q._pending) == calls[3:]  # the others stay, in arrival order


def test_join_keeps_the_adapter_count_within_max_adapters(loop):
    q, calls = queue_of(loop, ["a", "b", "a", "c", None, "b"], max_adapters=2)
    chosen = q.join(10, frozenset(), busy=False)
    # "c" would make three adapters: left for a later batch; rows without an adapter fit
    assert names_of(chosen) == ["a", "b", "a", None, "b"]
    assert names_of(q._pending) == ["c"]


def test_a_busy_batch_is_joined_in_order_only(loop):
    q, calls = queue_of(loop, ["a", "c", "a"], max_adapters=2)
    # the running batch already holds "a" and "b": "c" must wait, and holds back the "a" after it
    chosen = q.join(10, frozenset({"a", "b"}), busy=True)
    assert names_of(chosen) == ["a"]
    assert names_of(q._pending) == ["c", "a"]


def test_an_adapter_that_fits_no_batch_fails_its_call_with_the_reason(loop):
    q, calls = queue_of(loop, ["b", "a", "b"], max_adapters=lambda names: "b" not in names)
    chosen = q.join(10, frozenset(), busy=False)
    # the first "b" would open the batch alone and does not fit: it fails; the second
    # "b" meets a batch that holds "a", so it only waits
    assert chosen == [calls[1]]
    exc = calls[0].future.exception()
    assert isinstance(exc, ValueError) and "'b'" in str(exc) and "on its own" in str(exc)
    assert list(q._pending) == [calls[2]] and not calls[2].future.done()


def test_a_max_adapters_callable_that_answers_no_bool_fails_that_call(loop):
    q, calls = queue_of(loop, ["a"], max_adapters=lambda names: 1)
    assert q.join(10, frozenset(), busy=False) == []
    exc = calls[0].future.exception()
    assert isinstance(exc, TypeError) and "must return a bool" in str(exc)


def test_a_max_adapters_callable_that_raises_fails_that_call_with_its_exception(loop):
    boom = RuntimeError("no room")

    def rule(names):
        raise boom

    q, calls = queue_of(loop, ["a", None], max_adapters=rule)
    assert q.join(10, frozenset(), busy=False) == [calls[1]]
    assert calls[0].future.exception() is boom


def test_calls_already_done_are_skipped_and_dropped(loop):
    q, calls = queue_of(loop, ["a", "b", "c"])
    calls[0].future.cancel()
    calls[1].future.set_result(None)
    assert q.join(10, frozenset(), busy=False) == [calls[2]]
    assert not q._pending


def test_take_and_discard_leave_the_others_in_order(loop):
    q, calls = queue_of(loop, ["a", "b", "c", "d"])
    q.take([calls[2], calls[0]])
    assert list(q._pending) == [calls[1], calls[3]]
    q.discard(calls[3])
    q.discard(calls[3])  # twice: already gone, nothing happens
    assert list(q._pending) == [calls[1]]


def test_a_zero_limit_takes_nothing(loop):
    q, calls = queue_of(loop, ["a"])
    assert q.join(0, frozenset(), busy=False) == []
    assert list(q._pending) == calls
