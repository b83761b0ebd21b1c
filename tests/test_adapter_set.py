"""AdapterSet in bounded memory (AdapterSet's docstring): capacity, LRU eviction, pinning, resolvers.

Six small adapters are written as PEFT directories; the set has room for
three.  Every applied result is checked against a float64 numpy reference of
the adapter that was written.
"""
import os
import random
import threading
import time
import tracemalloc

import numpy as np
import pytest
from threaded import run_in_threads

from lorahook import (AdapterSet, LlamaConfig, LoraAdapter, LoraCapacityError, LoraFormatError,
                      LoraLayer, LoraValidationError, apply_lora_rows)

D_IN, D_OUT, RANK = 16, 24, 4
KEY = (0, "q_proj")
ONE = 4 * RANK * (D_IN + D_OUT)  # bytes of one adapter: A and B, float32
NAMES = [f"t{i}" for i in range(6)]


def _adapter(seed, rank=RANK, d_out=D_OUT):
    rng = np.random.default_rng(seed)
    return LoraAdapter({KEY: LoraLayer(rng.standard_normal((rank, D_IN)),
                                       rng.standard_normal((d_out, rank)), 0.5 + seed)})


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    written = {}
    for i, name in enumerate(NAMES):
        written[name] = _adapter(i)
        written[name].save_peft(root / name, architecture="llama")
    return root, written


def _apply(hook, x):
    y = np.zeros((len(x), D_OUT), np.float32)
    apply_lora_rows(hook, *KEY, x, y, D_IN, D_OUT)
    return y


def _reference(adapter, x):
    layer = adapter.layers[KEY]
    return layer.scale * (x.astype(np.float64) @ layer.a.T.astype(np.float64)) @ \
        layer.b.T.astype(np.float64)


def _check(got, ref):
    assert np.max(np.abs(got - ref)) <= 1e-5 * max(np.max(np.abs(ref)), 1e-30)


def _check_rows(hook, names, written, x):
    got = _apply(hook, x)
    for i, name in enumerate(names):
        if name is None:
            assert not got[i].any()
        else:
            _check(got[i:i + 1], _reference(written[name], x[i:i + 1]))


# --------------------------------------------------------------------------- nbytes


def test_nbytes_is_within_the_bound_and_covers_what_the_adapter_holds():
    rng = np.random.default_rng(0)
    shapes = [(64, 96, 16), (96, 64, 8), (32, 200, 4)]
    raw = [(rng.standard_normal((r, i)).astype(np.float32),
            rng.standard_normal((o, r)).astype(np.float32)) for i, o, r in shapes]
    LoraAdapter({(0, "q_proj"): LoraLayer(*raw[0])})  # first-use imports are not the adapter's
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        adapter = LoraAdapter({(k, "q_proj"): LoraLayer(a, b) for k, (a, b) in enumerate(raw)})
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    ideal = 4 * sum(r * (i + o) for i, o, r in shapes)
    assert ideal <= adapter.nbytes <= 1.05 * ideal
    # what construction kept (arrays plus small Python objects) is about nbytes, no second B
    assert held <= adapter.nbytes + 64 * 1024, (held, adapter.nbytes)


# --------------------------------------------------------------------------- directory resolver


def test_first_use_loads_lru_evicts_and_results_stay_right(store):
    root, written = store
    s = AdapterSet(capacity_bytes=3 * ONE, resolver=root)
    assert len(s) == 0 and s.names() == []
    x = np.random.default_rng(1).standard_normal((6, D_IN)).astype(np.float32)
    early = s.bind(["t0", "t1", None, "t2", "t0", "t1"])  # three first uses
    assert s.names() == ["t0", "t1", "t2"] and s.stats()["loads"] == 3
    s.get("t0")                                          # t0 is now the most recent
    late = s.bind(["t3"] * 6)                            # evicts t1, the least recent
    assert s.names() == ["t0", "t2", "t3"] and s.stats()["evictions"] == 1
    s.bind(["t4"])                                       # evicts t2
    assert s.names() == ["t0", "t3", "t4"]
    assert s.nbytes <= 3 * ONE and s.stats()["nbytes"] == s.nbytes
    # batches bound before the evictions still apply their adapters
    _check_rows(early, ["t0", "t1", None, "t2", "t0", "t1"], written, x)
    _check_rows(late, ["t3"] * 6, written, x)
    # a removed, resolvable name is only unloaded: the next use loads it again
    s.remove("t4")
    assert "t4" not in s
    s.bind(["t4"])
    stats = s.stats()
    assert stats["loads"] == 6 and stats["resident"] == 3 and stats["capacity_bytes"] == 3 * ONE
    assert stats["hits"] >= 1 and stats["load_seconds"] > 0


def test_pinned_adapters_are_never_evicted(store):
    root, written = store
    s = AdapterSet(capacity_bytes=3 * ONE, resolver=root)
    s.pin("t5")
    s.add("mine", _adapter(99), pin=True)
    assert s.pinned() == ["mine", "t5"]
    for name in NAMES[:5]:
        s.bind([name])
        assert {"t5", "mine"} <= set(s.names()) and s.nbytes <= 3 * ONE
    # two pinned leave room for one: a bind of two others cannot fit
    before = s.names()
    with pytest.raises(LoraCapacityError, match="cannot fit"):
        s.bind(["t0", "t1"])
    assert s.names() == before
    s.unpin("t5")
    s.bind(["t0", "t1"])
    assert s.names() == ["mine", "t0", "t1"]


def test_an_adapter_larger_than_the_capacity_evicts_nothing(store):
    root, _ = store
    s = AdapterSet(capacity_bytes=3 * ONE, resolver=root)
    s.bind(["t0", "t1"])
    big = _adapter(7, rank=3 * RANK + 1)
    with pytest.raises(LoraCapacityError) as info:
        s.add("big", big)
    assert isinstance(info.value, MemoryError)
    assert s.names() == ["t0", "t1"] and s.stats()["evictions"] == 0


def test_one_bind_that_cannot_fit_leaves_the_set_as_it_was(store):
    root, _ = store
    s = AdapterSet(capacity_bytes=3 * ONE, resolver=root)
    s.bind(["t5"])
    with pytest.raises(LoraCapacityError):
        s.bind(["t0", "t1", "t2", "t3"])
    assert s.names() == ["t5"] and s.stats()["loads"] == 1


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".", "..", "/abs", "x\\y", "a\0b"])
def test_unsafe_names_are_key_errors_touching_no_file(store, name, monkeypatch):
    root, _ = store
    _adapter(1).save_peft(root.parent / "x", architecture="llama")  # "../x" exists
    s = AdapterSet(capacity_bytes=3 * ONE, resolver=root)
    touched = []
    for fn in ("lexists", "exists", "isdir", "isfile"):
        real = getattr(os.path, fn)
        monkeypatch.setattr(os.path, fn, lambda p, _real=real, _fn=fn: touched.append(_fn) or _real(p))
    with pytest.raises((KeyError, ValueError)):
        s.bind([name])
    monkeypatch.undo()
    assert touched == [] and len(s) == 0


def test_missing_broken_and_misfit_directories(store):
    root, _ = store
    (root / "plain").write_text("not an adapter")
    (root / "empty").mkdir()
    bad_dir = root / "corrupt"
    _adapter(3).save_peft(bad_dir, architecture="llama")
    (bad_dir / "adapter_model.safetensors").write_bytes(b"\x00" * 20)
    _adapter(4, d_out=D_OUT + 8).save_peft(root / "wide", architecture="llama")
    model = LlamaConfig.from_dict(dict(model_type="llama", hidden_size=D_IN, intermediate_size=40,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=6, vocab_size=10))
    s = AdapterSet(model, capacity_bytes=3 * ONE, resolver=root)
    s.bind(["t0"])
    with pytest.raises(KeyError, match="nothere"):
        s.bind(["nothere"])
    for name in ("plain", "empty", "corrupt"):
        with pytest.raises(LoraFormatError):
            s.get(name)
    with pytest.raises(LoraValidationError, match="q_proj"):
        s.get("wide")
    assert s.names() == ["t0"] and s.stats()["loads"] == 1


# --------------------------------------------------------------------------- callable resolver


def test_a_callable_resolver_returns_adapters_paths_or_none(store):
    root, written = store
    made = _adapter(42)

    def resolve(name):
        return {"obj": made, "path": str(root / "t2"), "pathlike": root / "t3",
                "odd": 3.5}.get(name)

    s = AdapterSet(resolver=resolve)
    assert s.get("obj") is made
    x = np.ones((2, D_IN), np.float32)
    _check(_apply(s.bind(["path", "pathlike"]), x)[:1], _reference(written["t2"], x[:1]))
    with pytest.raises(KeyError, match="ghost"):
        s.get("ghost")
    with pytest.raises(TypeError, match="float"):
        s.get("odd")
    assert s.names() == ["obj", "path", "pathlike"]


def test_add_installs_a_resolvable_name_and_replace_needs_a_resident_one(store):
    root, _ = store
    s = AdapterSet(resolver=root)
    mine = _adapter(50)
    s.add("t0", mine)                      # not resident: installed as given
    assert s.get("t0") is mine and s.stats()["loads"] == 0
    with pytest.raises(ValueError, match="already installed"):
        s.add("t0", mine)
    with pytest.raises(KeyError, match="t1"):
        s.replace("t1", mine)              # resolvable but not resident
    with pytest.raises(TypeError):
        AdapterSet(resolver=42)
    with pytest.raises(ValueError):
        AdapterSet(capacity_bytes=-1)


def test_a_failed_load_reaches_every_waiter_and_the_next_use_tries_again():
    calls = []
    gate = threading.Event()
    healthy = {"ok": False}

    def resolve(name):
        calls.append(name)
        gate.wait(5)
        if not healthy["ok"]:
            raise LoraFormatError(f"{name}: broken on disk")
        return _adapter(1)

    s = AdapterSet(resolver=resolve)
    errors = []

    def use():
        try:
            s.get("flaky")
        except LoraFormatError as exc:
            errors.append(exc)

    workers = [threading.Thread(target=use) for _ in range(4)]
    for w in workers:
        w.start()
    time.sleep(0.2)
    gate.set()
    for w in workers:
        w.join()
    assert calls == ["flaky"] and len(errors) == 4 and len({id(e) for e in errors}) == 1
    assert len(s) == 0 and s.stats()["loads"] == 0
    healthy["ok"] = True
    s.get("flaky")
    assert calls == ["flaky", "flaky"] and s.stats()["loads"] == 1


# --------------------------------------------------------------------------- concurrency


def test_a_slow_resolver_is_called_once_per_name_and_never_blocks_resident_binds(store):
    root, written = store
    started, release = threading.Event(), threading.Event()
    calls = []
    lock = threading.Lock()

    def slow(name):
        with lock:
            calls.append(name)
        if name == "t1":
            started.set()
            release.wait(10)
        return str(root / name)

    s = AdapterSet(capacity_bytes=3 * ONE, resolver=slow)
    s.bind(["t0"])
    waiters = [threading.Thread(target=s.bind, args=(["t1", None],)) for _ in range(6)]
    for w in waiters:
        w.start()
    assert started.wait(5)
    # a bind of a resident adapter finishes while t1's load is held up
    t0 = time.perf_counter()
    x = np.ones((1, D_IN), np.float32)
    _check(_apply(s.bind(["t0"]), x), _reference(written["t0"], x))
    assert time.perf_counter() - t0 < 5 and s.stats()["loading"] == 1
    release.set()
    for w in waiters:
        w.join()
    assert calls.count("t1") == 1 and "t1" in s


def test_eight_threads_binding_six_names_with_room_for_three(store):
    root, written = store
    s = AdapterSet(capacity_bytes=3 * ONE, resolver=root)
    over = []

    def worker(seed):
        rnd = random.Random(seed)
        rng = np.random.default_rng(seed)
        for _ in range(150):
            names = [rnd.choice(NAMES + [None]) for _ in range(rnd.randint(1, 4))]
            if len({n for n in names if n is not None}) > 3:
                continue
            hook = s.bind(names)
            if s.nbytes > 3 * ONE:
                over.append(s.nbytes)
            x = rng.standard_normal((len(names), D_IN)).astype(np.float32)
            _check_rows(hook, names, written, x)

    run_in_threads(worker, [(seed,) for seed in range(8)])
    assert not over
    stats = s.stats()
    assert stats["resident"] <= 3 and stats["evictions"] > 0 and stats["loads"] > 6


def test_a_remove_during_a_loading_bind_is_not_undone(store):
    root, written = store
    started, release = threading.Event(), threading.Event()

    def slow(name):
        if name == "disk":
            started.set()
            release.wait(10)
        return str(root / "t1")

    s = AdapterSet(resolver=slow)
    s.add("manual", written["t0"])
    hooks = []
    worker = threading.Thread(target=lambda: hooks.append(s.bind(["manual", "disk"])))
    worker.start()
    assert started.wait(5)
    s.remove("manual")
    release.set()
    worker.join()
    assert s.names() == ["disk"]  # the removed adapter stays removed
    x = np.ones((2, D_IN), np.float32)
    _check_rows(hooks[0], ["manual", "t1"], {"manual": written["t0"], "t1": written["t1"]}, x)


def test_a_use_between_a_finished_load_and_its_install_shares_that_load(store):
    root, _ = store
    calls = []

    class Paused(AdapterSet):
        __slots__ = ()

        def _run_load(self, name, job):
            super()._run_load(name, job)
            time.sleep(0.3)  # the window between a finished load and its install

    def resolve(name):
        calls.append(name)
        return str(root / "t2")

    s = Paused(resolver=resolve)
    first = threading.Thread(target=s.get, args=("x",))
    first.start()
    time.sleep(0.1)
    s.get("x")
    first.join()
    assert calls == ["x"] and s.stats()["loads"] == 1


def test_empty_names_are_unknown_and_subclasses_with_their_own_hooks_are_refused(store):
    root, written = store
    s = AdapterSet(resolver=root)
    s.add("t0", written["t0"])
    for call in (s.get, s.pin, s.remove, s.unpin, lambda n: s.replace(n, written["t1"])):
        with pytest.raises(KeyError):
            call("")
        with pytest.raises(KeyError):
            call("never-heard-of" if call not in (s.get, s.pin) else "../t0")
        with pytest.raises(TypeError):
            call(b"t0")
    assert "" not in s and 7 not in s and s.names() == ["t0"]
    with pytest.raises(KeyError):
        s.bind([""])

    class Quiet(LoraAdapter):
        def is_active(self, layer_idx, module):
            return False

    with pytest.raises(TypeError, match="own is_active or apply"):
        s.add("quiet", Quiet(dict(written["t0"].layers)))


def test_an_eviction_counts_arrays_shared_with_a_resident_adapter_as_not_freed():
    # "half" shares its arrays with "base": evicting it frees nothing, so the
    # set must evict "base" too (or something else) to make room, never too little
    base = _adapter(1)
    s = AdapterSet(capacity_bytes=2 * ONE)
    s.add("base", base)
    s.add("half", base.scaled(0.5))
    assert s.nbytes == ONE  # shared arrays counted once
    s.add("other", _adapter(2))
    assert s.nbytes <= 2 * ONE and "other" in s
    s.add("third", _adapter(3))
    assert s.nbytes <= 2 * ONE and s.names() == ["other", "third"]


# --------------------------------------------------------------------------- hardening


def test_a_bind_refused_for_its_scales_loads_evicts_and_counts_nothing(store):
    root, written = store
    calls = []

    def resolve(name):
        calls.append(name)
        return str(root / name)

    s = AdapterSet(capacity_bytes=2 * ONE, resolver=resolve)
    s.bind(["t0", "t1"])
    before = (s.stats(), s.names(), list(calls))
    bad = [[1.0, float("nan")], [1.0], {"t2": float("inf")}, {"t5": 1.0}, "x", [1.0, "y"]]
    for scales in bad:
        with pytest.raises((ValueError, TypeError, KeyError)):
            s.bind(["t2", "t3"], scales)
    after = s.stats()
    for key in ("loads", "evictions", "resident", "hits", "nbytes"):
        assert after[key] == before[0][key], key
    assert s.names() == before[1] and calls == before[2]


def test_the_set_forgets_names_it_evicted():
    # room for one: 4,000 distinct names come and go; the set's own memory stays flat
    def resolve(name):
        return _adapter(int(name[1:]) % 7)

    s = AdapterSet(capacity_bytes=ONE, resolver=resolve)
    for i in range(200):  # warm up every code path and cache
        s.get(f"n{i}")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200, 4200):
            s.get(f"n{i}")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert s.stats()["evictions"] == 4199 and len(s) == 1
    assert grown < 64 * 1024, grown  # remembering 4,000 names costs far more than this


def test_an_interrupted_load_stays_in_its_thread_and_the_waiters_load_again(store):
    root, written = store
    started, go = threading.Event(), threading.Event()
    calls = []

    def resolve(name):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            started.set()
            go.wait(10)
            raise KeyboardInterrupt
        return str(root / name)

    s = AdapterSet(resolver=resolve)
    caught, results = [], []

    def first():
        try:
            s.get("t1")
        except KeyboardInterrupt as exc:
            caught.append(exc)

    owner = threading.Thread(target=first, name="owner")
    owner.start()
    assert started.wait(5)
    waiters = [threading.Thread(target=lambda: results.append(s.bind(["t1"])), name=f"w{i}")
               for i in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.2)  # the waiters are waiting on the owner's load
    go.set()
    owner.join()
    for w in waiters:
        w.join()
    assert len(caught) == 1 and len(results) == 3
    assert calls[0] == "owner" and len(calls) == 2 and calls[1] != "owner"
    assert s.stats()["loads"] == 1 and s.names() == ["t1"]
    x = np.ones((1, D_IN), np.float32)
    for hook in results:
        _check_rows(hook, ["t1"], written, x)


def test_arrays_shared_with_a_pinned_adapter_count_once_in_the_capacity_check():
    base = _adapter(1)
    s = AdapterSet(capacity_bytes=ONE + ONE // 2)
    s.add("base", base, pin=True)
    s.add("half", base.scaled(0.5))  # the same arrays: fits beside its pinned twin
    assert s.names() == ["base", "half"] and s.nbytes == ONE
    with pytest.raises(LoraCapacityError):
        s.add("other", _adapter(2))  # its own arrays do not fit beside the pinned one
    assert s.names() == ["base", "half"]


def test_stats_add_up_with_interrupted_and_failing_loads_pins_and_binds(store):
    root, written = store
    counts = {"resolved": 0}
    lock = threading.Lock()
    chance = random.Random(7)

    def resolve(name):
        if name == "broken":
            raise LoraFormatError("broken on purpose")
        with lock:
            interrupt = chance.random() < 0.05
            counts["resolved"] += not interrupt
        if interrupt:
            raise KeyboardInterrupt
        time.sleep(0.001)  # a window in which other threads bind, evict and wait
        return str(root / name)

    s = AdapterSet(capacity_bytes=3 * ONE, resolver=resolve)

    def worker(seed):
        rnd = random.Random(seed)
        rng = np.random.default_rng(seed)
        for _ in range(150):
            op = rnd.random()
            try:
                if op < 0.7:
                    names = rnd.sample(NAMES, rnd.randint(1, 3)) + [None]
                    _check_rows(s.bind(names), names, written,
                                rng.standard_normal((len(names), D_IN)).astype(np.float32))
                elif op < 0.8:
                    s.get("broken")
                else:
                    name = rnd.choice(NAMES)
                    s.pin(name)
                    s.unpin(name)
            except (KeyboardInterrupt, LoraFormatError, LoraCapacityError, KeyError):
                pass  # an interrupted or refused call; a KeyError: unpinned after an eviction

    run_in_threads(worker, [(seed,) for seed in range(8)])
    stats = s.stats()
    assert stats["loading"] == 0 and stats["evictions"] > 0
    assert stats["resident"] == stats["loads"] - stats["evictions"]
    assert counts["resolved"] == stats["loads"]


def test_a_call_that_fails_after_a_load_installs_it_and_leaves_nothing_claimed(store):
    # A call that loads one name and then fails on another (an error, or an
    # interrupt in the resolver) installs what it loaded -- one resolver call,
    # one load -- and leaves no load claimed ("loading" back to 0).
    root, written = store
    calls = []

    def resolve(name):
        calls.append(name)
        if name == "v-broken":
            raise LoraFormatError("broken on purpose")
        if name == "t5" and calls.count("t5") == 1:
            raise KeyboardInterrupt
        return str(root / name)

    s = AdapterSet(resolver=resolve)
    with pytest.raises(LoraFormatError):
        s.bind(["t0", "v-broken"])  # t0 is loaded first (sorted), then v-broken fails
    assert s.stats()["loading"] == 0 and "t0" in s
    with pytest.raises(KeyboardInterrupt):
        s.bind(["t1", "t5"])  # t1 is loaded first (sorted), then t5 is interrupted
    assert s.stats()["loading"] == 0 and "t1" in s
    names = ["t0", "t1", "t5"]
    _check_rows(s.bind(names), names, written,
                np.random.default_rng(0).standard_normal((3, D_IN)).astype(np.float32))
    assert calls == ["t0", "v-broken", "t1", "t5", "t5"]
    assert s.stats()["loads"] == 3 and s.stats()["loading"] == 0


# --------------------------------------------------------------------------- dtype


def _rounded_reference(adapter, dtype, x):
    """The float64 delta of ``adapter``'s weights rounded to ``dtype`` by numpy / ml_dtypes."""
    layer = adapter.layers[KEY]
    a = layer.a.astype(dtype).astype(np.float64)
    b = layer.b.astype(dtype).astype(np.float64)
    return layer.scale * (x.astype(np.float64) @ a.T) @ b.T


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_set_with_a_dtype_holds_added_and_loaded_adapters_in_it(store, dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    root, written = store
    # room for three float32 adapters holds six 16-bit ones
    s = AdapterSet(capacity_bytes=3 * ONE, resolver=root, dtype=dtype)
    assert s.dtype == np.dtype(np_dtype)
    s.add("byhand", _adapter(9))
    for name in NAMES[:5]:
        assert s.get(name).dtype == np.dtype(np_dtype)  # read from its directory in dtype
    assert s.get("byhand").dtype == np.dtype(np_dtype)
    assert s.stats()["evictions"] == 0 and len(s) == 6
    assert s.nbytes == 6 * ONE // 2
    x = np.random.default_rng(1).standard_normal((5, D_IN)).astype(np.float32)
    got = _apply(s.bind(NAMES[:5]), x)
    for i, name in enumerate(NAMES[:5]):
        ref = _rounded_reference(written[name], np_dtype, x[i:i + 1])
        _check(got[i:i + 1], ref)
    # an adapter already in the dtype is held as it is, not copied
    held = _adapter(10).astype(np_dtype)
    s.add("same", held)
    assert s.get("same").layers[KEY].a is held.layers[KEY].a


def test_a_set_dtype_is_float32_float16_bfloat16_or_int8():
    for bad in ("float64", "uint8", np.int16, "f32"):
        with pytest.raises(TypeError, match="dtype"):
            AdapterSet(dtype=bad)
    s = AdapterSet(dtype=np.float32)
    s.add("a", _adapter(0).astype(np.float16))
    assert s.get("a").dtype == np.float32
    assert AdapterSet().dtype is None
