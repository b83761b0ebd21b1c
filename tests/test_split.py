"""Large batched calls split over lorahook's own threads.

Every result is checked against a float64 numpy reference; the split path is
forced onto small shapes by lowering the split grain, so the tests stay fast.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from lorahook import AdapterSet, LoraAdapter, LoraLayer, _rows, apply_lora_rows, threads

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def split_setup():
    """Split into chunks of 8 rows and no flop floor; restore everything after."""
    old = (threads.get_num_threads(), threads.get_blas_threads(), _rows.get_split_grain(),
           _rows.get_gemm_crossover())
    _rows.set_split_grain(8, 0)
    yield
    threads.set_num_threads(old[0])
    threads.set_blas_threads(old[1])
    _rows.set_split_grain(*old[2])
    _rows.set_gemm_crossover(old[3])


def _layer(rng, d_in, d_out, rank, scale=0.75, bias=False):
    a = rng.standard_normal((rank, d_in)).astype(np.float32)
    b = rng.standard_normal((d_out, rank)).astype(np.float32)
    c = rng.standard_normal(d_out).astype(np.float32) if bias else None
    return LoraLayer(a, b, scale, bias=c)


def _ref(layer, x, y0, scale=None):
    s = layer.scale if scale is None else scale
    d = (x.astype(np.float64) @ layer.a.T.astype(np.float64)) @ layer.b.T.astype(np.float64)
    if layer.bias is not None:
        d = d + layer.bias.astype(np.float64)
    return y0.astype(np.float64) + s * d


def _close(got, ref):
    assert np.max(np.abs(got - ref)) <= 2e-6 * max(np.max(np.abs(ref)), 1.0) * np.sqrt(ref.shape[-1])


def _until_a_helper_works(fn, seconds=30.0):
    """Call ``fn`` until a helper thread has run a work item (True) or ``seconds`` pass.

    A helper joins a call only if it is scheduled before the caller has
    taken every chunk, so on a loaded machine this can take many calls;
    callers give ``fn`` milliseconds of work so that it happens at all.
    """
    j0 = _rows._helper_items()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        fn()
        if _rows._helper_items() > j0:
            return True
    return False


@pytest.mark.parametrize("nthreads", [2, 3, 5])
@pytest.mark.parametrize("rows", [16, 17, 63, 200, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_single_adapter_split_matches_reference(split_setup, nthreads, rows, bias):
    rng = np.random.default_rng(rows * 10 + nthreads)
    layer = _layer(rng, 96, 160, 8, bias=bias)
    hook = LoraAdapter({(2, "up_proj"): layer})
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    y = rng.standard_normal((rows, 160)).astype(np.float32)
    ref = _ref(layer, x, y)
    threads.set_num_threads(nthreads)
    apply_lora_rows(hook, 2, "up_proj", x, y, 96, 160)
    _close(y, ref)


def test_split_actually_runs_on_helper_threads(split_setup):
    rng = np.random.default_rng(0)
    layer = _layer(rng, 1024, 1024, 16)
    hook = LoraAdapter({(0, "q_proj"): layer})
    x = rng.standard_normal((1024, 1024)).astype(np.float32)  # ~67 MFLOP per call
    y0 = rng.standard_normal((1024, 1024)).astype(np.float32)
    y = y0.copy()
    threads.set_num_threads(2)
    assert _until_a_helper_works(lambda: apply_lora_rows(hook, 0, "q_proj", x, y, 1024, 1024))
    y = y0.copy()
    apply_lora_rows(hook, 0, "q_proj", x, y, 1024, 1024)
    _close(y, _ref(layer, x, y0))
    assert _rows._helper_threads() >= 1


def test_chunking_is_the_same_for_every_thread_count_from_two(split_setup):
    rng = np.random.default_rng(1)
    layer = _layer(rng, 128, 384, 16)
    hook = LoraAdapter({(0, "q_proj"): layer})
    x = rng.standard_normal((301, 128)).astype(np.float32)
    y0 = rng.standard_normal((301, 384)).astype(np.float32)
    outs = []
    for n in (2, 3, 4, 7, 2):
        threads.set_num_threads(n)
        y = y0.copy()
        apply_lora_rows(hook, 0, "q_proj", x, y, 128, 384)
        outs.append(y)
    for y in outs[1:]:
        assert np.array_equal(y, outs[0])
    _close(outs[0], _ref(layer, x, y0))


def test_one_thread_never_uses_a_helper(split_setup):
    rng = np.random.default_rng(2)
    hook = LoraAdapter({(0, "q_proj"): _layer(rng, 64, 64, 4)})
    x = rng.standard_normal((256, 64)).astype(np.float32)
    y = np.zeros((256, 64), np.float32)
    threads.set_num_threads(1)
    j0 = _rows._helper_items()
    for _ in range(50):
        apply_lora_rows(hook, 0, "q_proj", x, y, 64, 64)
    assert _rows._helper_items() == j0


def test_multithreaded_blas_turns_splitting_off(split_setup):
    if _rows._blas_threads() == 0:
        pytest.skip("SciPy's BLAS here exports no OpenBLAS thread getter")
    rng = np.random.default_rng(3)
    layer = _layer(rng, 64, 96, 4)
    hook = LoraAdapter({(0, "q_proj"): layer})
    x = rng.standard_normal((256, 64)).astype(np.float32)
    y = rng.standard_normal((256, 96)).astype(np.float32)
    ref = _ref(layer, x, y)
    threads.set_num_threads(4)
    threads.set_blas_threads(2)
    j0 = _rows._helper_items()
    apply_lora_rows(hook, 0, "q_proj", x, y, 64, 96)
    for _ in range(30):
        apply_lora_rows(hook, 0, "q_proj", x, np.zeros_like(y), 64, 96)
    assert _rows._helper_items() == j0
    _close(y, ref)


# 512 -> 512 at rank 4 is 2 * 4 * 1024 = 8192 flops per row: a floor of
# 800_000 flops needs 98 rows per chunk, so two chunks need 196 rows
@pytest.mark.parametrize("min_rows, min_flops, rows, splits", [
    (64, 0, 127, False), (64, 0, 128, True),
    (1, 800_000, 195, False), (1, 800_000, 196, True),
    # exactly 100 rows' worth of flops: two chunks of 100 rows
    (1, 819_200, 199, False), (1, 819_200, 200, True),
    # chunks never go below the gemm crossover (32): 63 rows make one chunk
    (1, 0, 63, False), (1, 0, 64, True),
])
def test_the_grain_decides_when_a_call_splits(split_setup, min_rows, min_flops, rows, splits):
    # the chunk count is a pure function of shape and settings; whether a
    # helper thread gets scheduled in time to take a chunk is not, so the
    # decision is checked directly and the call against the reference
    rng = np.random.default_rng(rows)
    layer = _layer(rng, 512, 512, 4)
    hook = LoraAdapter({(0, "q_proj"): layer})
    threads.set_num_threads(4)
    _rows.set_split_grain(min_rows, min_flops)
    assert _rows._split_chunks(rows, 4, 512, 512) == (2 if splits else 1)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    y0 = rng.standard_normal((rows, 512)).astype(np.float32)
    y = y0.copy()
    j0 = _rows._helper_items()
    apply_lora_rows(hook, 0, "q_proj", x, y, 512, 512)
    _close(y, _ref(layer, x, y0))
    if not splits:
        for _ in range(20):
            apply_lora_rows(hook, 0, "q_proj", x, np.zeros_like(y), 512, 512)
        assert _rows._helper_items() == j0  # never offered to a helper


@pytest.mark.parametrize("crossover", [1, 8, 10**9])
def test_split_chunks_follow_the_gemm_crossover(split_setup, crossover):
    rng = np.random.default_rng(6)
    layer = _layer(rng, 48, 80, 8, bias=True)
    hook = LoraAdapter({(0, "q_proj"): layer})
    x = rng.standard_normal((90, 48)).astype(np.float32)
    y = rng.standard_normal((90, 80)).astype(np.float32)
    ref = _ref(layer, x, y)
    threads.set_num_threads(3)
    _rows.set_gemm_crossover(crossover)
    apply_lora_rows(hook, 0, "q_proj", x, y, 48, 80)
    _close(y, ref)


@pytest.mark.parametrize("nthreads", [1, 2, 4])
def test_mixed_batch_split_matches_reference(split_setup, nthreads):
    rng = np.random.default_rng(7)
    d_in, d_out, n = 64, 112, 240
    layers = {name: _layer(rng, d_in, d_out, 8, scale=0.5 + k, bias=(k == 1))
              for k, name in enumerate(("a", "b", "c"))}
    s = AdapterSet()
    for name, layer in layers.items():
        s.add(name, LoraAdapter({(1, "down_proj"): layer}))
    # interleaved rows (gather/scatter), long runs, and rows with no adapter
    names = [("a", "b", None, "c")[i % 4] if i < 120 else ("a" if i < 200 else "c") for i in range(n)]
    scales = [0.25 + (i % 5) / 4 for i in range(n)]
    bound = s.bind(names, scales=scales)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y = rng.standard_normal((n, d_out)).astype(np.float32)
    ref = y.astype(np.float64).copy()
    for i, name in enumerate(names):
        if name is not None:
            ref[i] = _ref(layers[name], x[i:i + 1], y[i:i + 1], layers[name].scale * scales[i])[0]
    threads.set_num_threads(nthreads)
    apply_lora_rows(bound, 1, "down_proj", x, y, d_in, d_out)
    _close(y, ref)
    unnamed = [i for i, name in enumerate(names) if name is None]
    assert np.array_equal(y[unnamed], ref[unnamed].astype(np.float32))


def test_overlapping_groups_are_applied_one_after_the_other(split_setup):
    # apply_groups allows two groups on the same rows; splitting one group at
    # a time keeps every row's updates from racing
    rng = np.random.default_rng(8)
    d_in, d_out, n = 32, 48, 200
    l1, l2 = _layer(rng, d_in, d_out, 4), _layer(rng, d_in, d_out, 4)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y = rng.standard_normal((n, d_out)).astype(np.float32)
    rows = np.arange(10, 190, dtype=np.int32)
    ref = _ref(l1, x, y)
    ref[10:190] += l2.scale * 2.0 * ((x[10:190].astype(np.float64) @ l2.a.T) @ l2.b.T)
    threads.set_num_threads(3)
    _rows.apply_groups([(l1._kernel, l1.scale, None, None), (l2._kernel, 2.0 * l2.scale, rows, None)],
                       x, y, n, d_in, d_out)
    _close(y, ref)


def test_concurrent_callers_get_correct_results(split_setup):
    # more Python threads than helpers: some calls find the pool busy and run
    # alone, others split; every result must be the same bits as alone
    rng = np.random.default_rng(9)
    layer = _layer(rng, 128, 256, 8, bias=True)
    hook = LoraAdapter({(0, "q_proj"): layer})
    threads.set_num_threads(2)
    jobs = []
    for k in range(6):
        x = rng.standard_normal((100 + 17 * k, 128)).astype(np.float32)
        y0 = rng.standard_normal((100 + 17 * k, 256)).astype(np.float32)
        expect = y0.copy()
        apply_lora_rows(hook, 0, "q_proj", x, expect, 128, 256)
        _close(expect, _ref(layer, x, y0))
        jobs.append((x, y0, expect))
    failures = []
    barrier = threading.Barrier(len(jobs))

    def work(x, y0, expect):
        barrier.wait()
        for _ in range(30):
            y = y0.copy()
            apply_lora_rows(hook, 0, "q_proj", x, y, 128, 256)
            if not np.array_equal(y, expect):
                failures.append(x.shape[0])
                return

    ts = [threading.Thread(target=work, args=job) for job in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts)
    assert failures == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_starts_its_own_helpers():
    # the parent's helpers do not exist in a forked child; a split call there
    # must neither hang nor crash, must give the right answer, and must get
    # help from the child's own helpers -- also when another thread of the
    # parent was inside a lorahook call at the moment of the fork
    code = textwrap.dedent("""
        import os, sys, numpy as np
        from lorahook import LoraAdapter, LoraLayer, _rows, apply_lora_rows, threads
        threads.set_num_threads(2)
        _rows.set_split_grain(8, 0)
        rng = np.random.default_rng(0)
        a = rng.standard_normal((8, 64)).astype(np.float32)
        b = rng.standard_normal((96, 8)).astype(np.float32)
        hook = LoraAdapter({(0, "q_proj"): LoraLayer(a, b, 0.5)})
        x = rng.standard_normal((400, 64)).astype(np.float32)
        ref = 0.5 * (x.astype(np.float64) @ a.T) @ b.T
        def ok():
            y = np.zeros((400, 96), np.float32)
            apply_lora_rows(hook, 0, "q_proj", x, y, 64, 96)
            return np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))
        assert ok() and _rows._helper_threads() >= 1
        import threading
        stop = threading.Event()
        def busy():
            while not stop.is_set():
                ok()
        t = threading.Thread(target=busy)
        t.start()
        codes = []
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                good = all(ok() for _ in range(3)) and _rows._helper_threads() >= 1
                _rows.set_split_grain(64, 0)
                rows = np.zeros((4096, 96), np.float32)
                big = rng.standard_normal((4096, 64)).astype(np.float32)
                n0 = _rows._helper_items()
                import time
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and _rows._helper_items() == n0:
                    apply_lora_rows(hook, 0, "q_proj", big, rows, 64, 96)
                helped = _rows._helper_items() > n0
                os._exit(0 if good and helped else (3 if not good else 4))
            _, status = os.waitpid(pid, 0)
            codes.append(os.waitstatus_to_exitcode(status))
        stop.set()
        t.join()
        assert ok()
        print(" ".join(map(str, codes)))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"] * 5


def test_split_grain_setter_checks_its_arguments(split_setup):
    with pytest.raises(ValueError, match="min_rows"):
        _rows.set_split_grain(0, 0)
    with pytest.raises(TypeError, match="min_rows"):
        _rows.set_split_grain(1.5, 0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="min_flops"):
            _rows.set_split_grain(8, bad)
    assert _rows.set_split_grain(16, 1e6) == (8, 0.0)
    assert _rows.get_split_grain() == (16, 1e6)


def _many_small_groups(rng, n_adapters=8, per=16, d_in=64, d_out=96):
    s = AdapterSet()
    layers = {}
    for k in range(n_adapters):
        layers[f"a{k}"] = _layer(rng, d_in, d_out, 4, scale=0.5 + 0.1 * k, bias=(k % 3 == 0))
        s.add(f"a{k}", LoraAdapter({(0, "o_proj"): layers[f"a{k}"]}))
    names = [f"a{(i // per) % n_adapters}" if i % 5 else f"a{i % n_adapters}"
             for i in range(n_adapters * per)]
    return s, layers, names


def test_many_small_groups_share_the_helpers(split_setup):
    # no group is big enough to split on its own, but together they are, and
    # since their rows are disjoint they run as one job
    rng = np.random.default_rng(10)
    s, layers, names = _many_small_groups(rng)
    n = len(names)
    bound = s.bind(names)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    y0 = rng.standard_normal((n, 96)).astype(np.float32)
    ref = np.stack([_ref(layers[nm], x[i:i + 1], y0[i:i + 1])[0] for i, nm in enumerate(names)])
    _rows.set_split_grain(64, 0)
    outs = []
    for nthreads in (2, 4, 1):
        threads.set_num_threads(nthreads)
        y = y0.copy()
        apply_lora_rows(bound, 0, "o_proj", x, y, 64, 96)
        _close(y, ref)
        outs.append(y)
    assert np.array_equal(outs[0], outs[1])
    # the same layout with milliseconds of work, for a helper to be in time
    s, _, names = _many_small_groups(rng, per=64, d_in=1024, d_out=1024)
    big = s.bind(names)
    xb = rng.standard_normal((len(names), 1024)).astype(np.float32)
    yb = np.zeros((len(names), 1024), np.float32)
    threads.set_num_threads(2)
    assert _until_a_helper_works(lambda: apply_lora_rows(big, 0, "o_proj", xb, yb, 1024, 1024))


def _two_groups(rng, d_in, d_out, n, second_rows):
    """Two layers, the first on every row, the second on ``second_rows``, and the reference."""
    l1, l2 = _layer(rng, d_in, d_out, 4), _layer(rng, d_in, d_out, 4)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y = rng.standard_normal((n, d_out)).astype(np.float32)
    ref = _ref(l1, x, y)
    ref[second_rows] += l2.scale * ((x[second_rows].astype(np.float64) @ l2.a.T) @ l2.b.T)
    return l1, l2, x, y, ref


@pytest.mark.parametrize("first_explicit", [False, True])
@pytest.mark.parametrize("second", ["even", "tail"])
def test_small_groups_sharing_rows_never_run_at_once(split_setup, first_explicit, second):
    # the first group on every row (as None or as explicit indices), the
    # second on some of them: each is too small to split on its own (128 and
    # 64 rows against chunks of 65) but big enough together, and running them
    # as one job would race on the shared rows
    n = 128
    rows2 = (np.arange(0, n, 2) if second == "even" else np.arange(n - 64, n)).astype(np.int32)
    l1, l2, x, y, ref = _two_groups(np.random.default_rng(11), 32, 40, n, rows2)
    rows1 = np.arange(n, dtype=np.int32) if first_explicit else None
    threads.set_num_threads(2)
    _rows.set_split_grain(65, 0)
    n0 = _rows._helper_items()
    for _ in range(50):
        yk = y.copy()
        _rows.apply_groups([(l1._kernel, l1.scale, rows1, None), (l2._kernel, l2.scale, rows2, None)],
                           x, yk, n, 32, 40)
        _close(yk, ref)
    assert _rows._helper_items() == n0


def test_large_groups_sharing_rows_stay_correct(split_setup):
    # groups big enough to split on their own: each is split by itself, one
    # group after the other, so every call adds both deltas exactly once
    n = 512
    tail = np.arange(n - 256, n, dtype=np.int32)
    l1, l2, x, y, ref = _two_groups(np.random.default_rng(13), 64, 256, n, tail)
    every = np.arange(n, dtype=np.int32)
    threads.set_num_threads(2)
    first = None
    for _ in range(100):
        yk = y.copy()
        _rows.apply_groups([(l1._kernel, l1.scale, every, None), (l2._kernel, l2.scale, tail, None)],
                           x, yk, n, 64, 256)
        if first is None:
            _close(yk, ref)
            first = yk
        assert np.array_equal(yk, first)


def test_grouped_calls_do_not_split_under_a_multithreaded_blas(split_setup):
    if _rows._blas_threads() == 0:
        pytest.skip("SciPy's BLAS here exports no OpenBLAS thread getter")
    rng = np.random.default_rng(14)
    s, layers, names = _many_small_groups(rng)
    bound = s.bind(names)
    n = len(names)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    y0 = rng.standard_normal((n, 96)).astype(np.float32)
    ref = np.stack([_ref(layers[nm], x[i:i + 1], y0[i:i + 1])[0] for i, nm in enumerate(names)])
    _rows.set_split_grain(8, 0)
    threads.set_num_threads(4)
    threads.set_blas_threads(2)
    n0 = _rows._helper_items()
    y = y0.copy()
    apply_lora_rows(bound, 0, "o_proj", x, y, 64, 96)
    _close(y, ref)
    for _ in range(30):
        apply_lora_rows(bound, 0, "o_proj", x, y0.copy(), 64, 96)
    assert _rows._helper_items() == n0
