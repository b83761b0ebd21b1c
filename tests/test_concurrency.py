"""Threads applying adapters while others add, replace and remove them.

Every output must equal the result of exactly one installed version of each adapter (a bound
batch is a snapshot; nothing tears), rows without an adapter stay bit-identical, and the
resident set size stays flat over thousands of calls (no leak in the extension, including
the per-thread scratch buffers of threads that exit).
"""
import gc
import os
import threading
import time

import numpy as np
import pytest

from lorahook import AdapterSet, LoraAdapter, LoraLayer, apply_lora_rows
from lorahook._core import segments as _segments

KEY = (1, "o_proj")
D_IN, D_OUT, RANK = 48, 40, 8
N_ROWS = 24
VERSIONS = 4
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def make_adapter(seed, d_in=D_IN, d_out=D_OUT, rank=RANK):
    rng = np.random.default_rng(seed)
    return LoraAdapter({KEY: LoraLayer(rng.standard_normal((rank, d_in)),
                                       rng.standard_normal((d_out, rank)),
                                       scale=float(rng.uniform(0.5, 2.0)),
                                       bias=rng.standard_normal(d_out))})


def ref_delta(adapter, x):
    layer = adapter.layers[KEY]
    d = (x.astype(np.float64) @ layer.a.T.astype(np.float64)) @ layer.b.T.astype(np.float64)
    return layer.scale * (d + layer.bias.astype(np.float64))


def close(got, ref):
    peak = float(np.max(np.abs(ref))) if ref.size else 0.0
    return float(np.max(np.abs(got - ref))) <= (1e-5 * peak if peak else 1e-6)


def which_version(got, base, refs):
    """Index of the version whose delta ``got - base`` equals, or -1."""
    got = got.astype(np.float64)
    for i, d in enumerate(refs):
        if close(got, base.astype(np.float64) + d):
            return i
    return -1


@pytest.fixture(autouse=True)
def _restore_crossover():
    old = _segments.get_gemm_crossover()
    yield
    _segments.set_gemm_crossover(old)


@pytest.mark.parametrize("path", ["row_loop", "batched"])
def test_apply_while_swapping(path):
    _segments.set_gemm_crossover(2**30 if path == "row_loop" else 1)
    rng = np.random.default_rng(0)
    versions = {name: [make_adapter(100 * k + v) for v in range(VERSIONS)]
                for k, name in enumerate(["a", "b", "c"])}
    x = rng.standard_normal((N_ROWS, D_IN)).astype(np.float32)
    x.flags.writeable = False
    base = rng.standard_normal((N_ROWS, D_OUT)).astype(np.float32)
    # rows: a mix of a, b, None, and c (which comes and goes)
    names = ["a", "b", None, "a", "c", "a", None, "b"] * (N_ROWS // 8)
    rows_of = {n: [i for i, m in enumerate(names) if m == n] for n in ("a", "b", "c", None)}
    refs = {n: [ref_delta(ad, x[rows_of[n]]) for ad in vs] for n, vs in versions.items()}
    solo = versions["a"][0]
    solo_ref = base.astype(np.float64) + ref_delta(solo, x)

    aset = AdapterSet()
    for n in ("a", "b", "c"):
        aset.add(n, versions[n][0])

    stop = threading.Event()
    errors = []
    counts = {"bound": 0, "solo": 0, "swaps": 0, "c_missing": 0}
    lock = threading.Lock()

    def record(exc):
        with lock:
            errors.append(exc)
        stop.set()

    def writer(seed):
        r = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                n = ("a", "b")[int(r.integers(0, 2))]
                aset.replace(n, versions[n][int(r.integers(0, VERSIONS))])
                try:
                    aset.remove("c")
                except KeyError:
                    pass
                try:
                    aset.add("c", versions["c"][int(r.integers(0, VERSIONS))])
                except ValueError:
                    pass
                with lock:
                    counts["swaps"] += 1
        except BaseException as exc:  # noqa: BLE001
            record(exc)

    def reader():
        try:
            for _ in range(600):
                if stop.is_set():
                    return
                try:
                    hook = aset.bind(names)
                except KeyError:
                    with lock:
                        counts["c_missing"] += 1
                    hook = aset.bind([m if m != "c" else None for m in names])
                    have_c = False
                else:
                    have_c = True
                out = base.copy()
                apply_lora_rows(hook, KEY[0], KEY[1], x, out, D_IN, D_OUT)
                for n in ("a", "b", "c"):
                    idx = rows_of[n]
                    if n == "c" and not have_c:
                        assert np.array_equal(out[idx], base[idx])
                        continue
                    v = which_version(out[idx], base[idx], refs[n])
                    assert v >= 0, f"rows of {n!r} match no single version (torn or mixed)"
                    assert hook.adapters[n] is versions[n][v]
                assert np.array_equal(out[rows_of[None]], base[rows_of[None]])
                # the lone adapter, shared between all threads
                out2 = base.copy()
                apply_lora_rows(solo, KEY[0], KEY[1], x, out2, D_IN, D_OUT)
                assert close(out2.astype(np.float64), solo_ref)
                with lock:
                    counts["bound"] += 1
                    counts["solo"] += 1
        except BaseException as exc:  # noqa: BLE001
            record(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads[2:]:
        t.join(timeout=60)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not errors, errors[0]
    assert counts["bound"] >= 2000, counts
    assert counts["swaps"] > 0, counts
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("path", ["row_loop", "batched"])
def test_rss_flat_over_many_calls(path):
    _segments.set_gemm_crossover(2**30 if path == "row_loop" else 1)
    rng = np.random.default_rng(1)
    ad = make_adapter(7)
    aset = AdapterSet()
    aset.add("a", ad)
    aset.add("b", make_adapter(8))
    x = rng.standard_normal((N_ROWS, D_IN)).astype(np.float32)
    out = np.zeros((N_ROWS, D_OUT), dtype=np.float32)
    names = ["a", None, "b", "a"] * (N_ROWS // 4)

    def burst(k):
        for _ in range(k):
            apply_lora_rows(ad, KEY[0], KEY[1], x, out, D_IN, D_OUT)
            hook = aset.bind(names, {"a": 0.5})
            apply_lora_rows(hook, KEY[0], KEY[1], x, out, D_IN, D_OUT)
            aset.replace("b", ad)
            with pytest.raises(ValueError, match="row counts"):  # refused calls must not leak either
                apply_lora_rows(ad, KEY[0], KEY[1], x, out[:-1], D_IN, D_OUT)
            out[:] = 0.0

    burst(500)
    gc.collect()
    before = rss_bytes()
    burst(5000)
    gc.collect()
    growth = rss_bytes() - before
    assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 5000 iterations"


def test_scratch_of_exited_threads_is_freed():
    """Each thread gets a multi-megabyte scratch buffer; threads that exit must give it back."""
    _segments.set_gemm_crossover(1)
    d_in, d_out, rank, n = 256, 256, 64, 1500
    ad = make_adapter(9, d_in, d_out, rank)
    aset = AdapterSet()
    aset.add("a", ad)
    names = ["a", None] * (n // 2)  # gathered rows: scratch of rank + d_in + d_out floats per row
    hook = aset.bind(names)
    x = np.ones((n, d_in), dtype=np.float32)

    def work():
        out = np.zeros((n, d_out), dtype=np.float32)
        apply_lora_rows(hook, KEY[0], KEY[1], x, out, d_in, d_out)
        apply_lora_rows(ad, KEY[0], KEY[1], x, out, d_in, d_out)

    def wave(k):
        for _ in range(k):
            ts = [threading.Thread(target=work) for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

    wave(5)
    gc.collect()
    before = rss_bytes()
    wave(30)  # 120 threads x ~3.4 MiB scratch each if it leaked
    gc.collect()
    growth = rss_bytes() - before
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 120 short-lived threads"
