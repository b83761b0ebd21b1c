"""lorahook._core.slot_pairs.apply_pairs: stacked LoRA pairs in the rows' dtype, on one thread or a team.

Against numpy in float64, in every dtype and every build of the kernel this
CPU runs; bit-identical at one, two and three threads and from run to run;
rows without a slot and rank rows past a slot's rank never touched.
"""
import ctypes
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from lorahook._core.slot_rows import SlotRows
from lorahook._core.halfconv import set_isa, supported_isas
from lorahook._core.slot_pairs import SlotPairs, apply_pairs, openmp_team

RNG = np.random.default_rng(20261205)
KINDS = [None, "float16", "bfloat16"]
# per element, against the sum of the magnitudes of its terms: float32 sums, then one
# rounding to the output's dtype
TOL = {None: 1e-5, "float16": 1e-3, "bfloat16": 8e-3}


def _team(n):
    """A team on the OpenMP runtime this process has (torch's, else the system's libgomp)."""
    team = openmp_team(n)
    if team is None:
        try:
            import torch  # noqa: F401  (loads its OpenMP runtime)
        except ImportError:
            try:
                ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pytest.skip("no OpenMP runtime on this machine")
        team = openmp_team(n)
    assert team is not None and team.n_threads == n
    return team


@pytest.fixture(params=supported_isas())
def build(request):
    # the kernel's build is the process's instruction-set target's
    old = set_isa(request.param)
    yield request.param
    set_isa(old)


def _cast(arr, half):
    """float64 values as arrays of ``half`` (uint16 patterns), and their exact float64 values."""
    if half is None:
        a = arr.astype(np.float32)
        return a, a.astype(np.float64)
    h = arr.astype(np.float16 if half == "float16" else ml_dtypes.bfloat16)
    return h.view(np.uint16), h.astype(np.float64)


def _problem(half, n_rows, d_in, outs, n_slots=5, rmax=12, pad=np.nan):
    """Stacked pairs whose rank rows past each slot's rank hold ``pad``; rows, an output."""
    a, a64, bt, bt64, ranks = [], [], [], [], []
    for d_out in outs:
        r = RNG.integers(0, rmax + 1, n_slots).astype(np.int32)
        r[0] = rmax  # one slot at the full rank
        ai = RNG.standard_normal((n_slots, rmax, d_in)) * 0.3
        bi = RNG.standard_normal((n_slots, rmax, d_out)) * 0.3
        for s in range(n_slots):
            ai[s, r[s]:], bi[s, r[s]:] = pad, pad
        for src, lo, hi in ((ai, a, a64), (bi, bt, bt64)):
            v, v64 = _cast(src, half)
            lo.append(v)
            hi.append(v64)
        ranks.append(r)
    slots = RNG.integers(-1, n_slots, size=n_rows)
    x, x64 = _cast(RNG.standard_normal((n_rows, d_in)), half)
    wide = RNG.standard_normal((n_rows, sum(outs) + 7))
    wide[slots < 0] = np.nan  # rows without a slot: never written
    y, y64 = _cast(wide, half)
    return SlotPairs(a, bt, ranks, half=half), (a64, bt64, ranks), slots, x, x64, y, y64


def _reference(slots, x64, y64, ref, outs, scale, add, col=3, magnitude=False):
    """The expected output in float64 (or, with ``magnitude``, the sum of its terms' sizes)."""
    a64, bt64, ranks = ref
    if magnitude:
        a64, bt64, x64, y64 = ([abs(v) for v in a64], [abs(v) for v in bt64], abs(x64),
                               abs(y64))
    out = y64.copy()
    off = col
    for i, d_out in enumerate(outs):
        for r, s in enumerate(slots):
            if s < 0:
                continue
            k = ranks[i][s]
            d = scale * (bt64[i][s, :k].T @ (a64[i][s, :k] @ x64[r]))
            out[r, off:off + d_out] = out[r, off:off + d_out] + d if add else d
        off += d_out
    return out


def _assert_near_float64(got, half, slots, x64, y64, ref, outs, scale, add):
    """Every covered row of ``got`` equals float64's to ``TOL`` of its terms' sizes."""
    cov = slots >= 0
    exact = _reference(slots, x64, y64, ref, outs, scale, add)
    mag = _reference(slots, x64, y64, ref, outs, scale, add, magnitude=True)
    err = np.abs(_widen(got, half)[cov] - exact[cov])
    assert np.all(err <= TOL[half] * mag[cov]), (err / mag[cov]).max()


def _widen(y, half):
    if half is None:
        return y.astype(np.float64)
    return y.view(np.float16 if half == "float16" else ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("half", KINDS)
@pytest.mark.parametrize("n_rows, d_in, outs", [(1, 8, [16]), (9, 37, [33, 16, 5]),
                                                 (70, 96, [64]), (301, 203, [77, 129])])
@pytest.mark.parametrize("add", [True, False])
def test_matches_float64_on_every_build_and_team(build, half, n_rows, d_in, outs, add):
    pairs, ref, slots, x, x64, y, y64 = _problem(half, n_rows, d_in, outs)
    groups = SlotRows(slots, pairs.n_slots)
    results = []
    for team in (None, _team(1), _team(2), _team(3), _team(2)):
        got = y.copy()
        apply_pairs(groups, x, got[:, 3:3 + sum(outs)], pairs, 0.75, add=add, half=half,
                    team=team)
        results.append(got)
    for other in results[1:]:  # the same bits on any team, run after run
        assert np.array_equal(other.view(np.uint8), results[0].view(np.uint8))
    got = results[0]
    base = slots < 0
    assert np.array_equal(got[base].view(np.uint8), y[base].view(np.uint8))
    for cols in (slice(0, 3), slice(-4, None)):  # columns outside the output view: untouched
        assert np.array_equal(got[:, cols].view(np.uint8), y[:, cols].view(np.uint8))
    _assert_near_float64(got, half, slots, x64, y64, ref, outs, 0.75, add)


def test_a_slot_costs_its_rank_never_the_padding():
    # padded rank rows hold NaN: a result without NaN shows they were never read; a slot's
    # rank 0 leaves its rows alone (add) or writes zeros (add=False)
    pairs, ref, slots, x, x64, y, y64 = _problem(None, 50, 64, [40], rmax=64)
    ranks = ref[2][0]
    ranks[1] = 0
    slots[:5] = 1
    y = np.nan_to_num(y)  # rows made slot 1's held the NaN of rows without a slot
    groups = SlotRows(slots, pairs.n_slots)
    got = y.copy()
    apply_pairs(groups, x, got[:, 3:43], pairs)
    cov = slots >= 0
    assert np.isfinite(got[cov]).all()
    assert np.array_equal(got[slots == 1], y[slots == 1])
    got = y.copy()
    apply_pairs(groups, x, got[:, 3:43], pairs, add=False)
    assert (got[slots == 1][:, 3:43] == 0).all()


def test_ranks_are_read_at_every_call():
    pairs, ref, slots, x, x64, y, y64 = _problem(None, 20, 16, [8], rmax=4, pad=0.0)
    groups = SlotRows(slots, pairs.n_slots)
    ranks = ref[2][0]
    ranks[:] = 4
    full = y.copy()
    apply_pairs(groups, x, full[:, 3:11], pairs)
    ranks[:] = 0
    none = y.copy()
    apply_pairs(groups, x, none[:, 3:11], pairs)
    assert np.array_equal(none.view(np.uint8), y.view(np.uint8))
    ranks[2] = 5  # past the stack's rank: refused before anything is written
    with pytest.raises(ValueError, match=r"ranks\[0\]\[2\] must be in \[0, 4\], got 5"):
        apply_pairs(groups, x, none[:, 3:11], pairs)
    assert np.array_equal(none.view(np.uint8), y.view(np.uint8))


def test_refusals_name_what_was_wrong():
    a = [np.zeros((3, 4, 10), np.float32)]
    bt = [np.zeros((3, 4, 6), np.float32)]
    r = [np.full(3, 4, np.int32)]
    pairs = SlotPairs(a, bt, r)
    g = SlotRows(np.array([0, 2, -1]), 3)
    x, y = np.zeros((3, 10), np.float32), np.zeros((3, 6), np.float32)
    with pytest.raises(TypeError, match="pairs' dtype"):
        apply_pairs(g, x.astype(np.float16), y, pairs)
    with pytest.raises(ValueError, match="width d_in = 10"):
        apply_pairs(g, np.zeros((3, 11), np.float32), y, pairs)
    with pytest.raises(ValueError, match="width d_out = 6"):
        apply_pairs(g, x, np.zeros((3, 7), np.float32), pairs)
    with pytest.raises(ValueError, match="holds 3 slots|hold 3 slots"):
        apply_pairs(SlotRows(np.array([0, 5, -1]), 6), x, y, pairs)
    with pytest.raises(ValueError, match="overlap"):
        buf = np.zeros((3, 16), np.float32)
        apply_pairs(g, buf[:, :10], buf[:, 4:10], pairs)
    with pytest.raises(ValueError, match="3 rows"):
        apply_pairs(g, x[:2], y[:2], pairs)
    with pytest.raises(TypeError, match=r"ranks\[0\] must be a C-contiguous 1-D int32"):
        SlotPairs(a, bt, [np.full(3, 4, np.int64)])
    with pytest.raises(ValueError, match="share a rank"):
        SlotPairs(a, [np.zeros((3, 5, 6), np.float32)], r)
    with pytest.raises(ValueError, match="same number of slices, 1 to 8"):
        SlotPairs(a * 9, bt * 9, r * 9)
    with pytest.raises(TypeError, match="share one dtype"):
        SlotPairs(a + [np.zeros((3, 4, 10), np.float16)], bt * 2, r * 2, half="float16")
    with pytest.raises(ValueError, match="n_threads must be in"):
        openmp_team(0)
    with pytest.raises(ValueError, match="instruction set must be one of"):
        set_isa("sse9")
    with pytest.raises(TypeError, match="does not pickle"):
        import pickle
        pickle.dumps(pairs)


def test_no_thread_and_no_runtime_unless_asked(tmp_path):
    # a fresh process: importing lorahook and running the kernel on the calling thread
    # loads no OpenMP runtime and starts no thread; openmp_team finds the runtime only
    # once something has loaded it
    code = textwrap.dedent("""
        import os, numpy as np
        def threads():
            return len(os.listdir("/proc/self/task"))
        def omp():
            with open("/proc/self/maps") as f:
                return any(k in f.read() for k in ("libgomp", "libiomp", "libomp"))
        import scipy.linalg.cython_blas
        before = threads()
        import lorahook
        from lorahook._core.slot_rows import SlotRows
        from lorahook._core.slot_pairs import SlotPairs, apply_pairs, openmp_team
        p = SlotPairs([np.ones((2, 3, 8), np.float32)], [np.ones((2, 3, 4), np.float32)],
                      [np.full(2, 3, np.int32)])
        y = np.zeros((4, 4), np.float32)
        apply_pairs(SlotRows(np.array([0, 1, -1, 0]), 2), np.ones((4, 8), np.float32), y, p)
        assert y[0, 0] == 24.0 and y[2, 0] == 0.0
        print(threads() - before, omp(), openmp_team(2) is None)
    """)
    # run beside nothing: the checkout's source tree would shadow the installed package
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "4"}, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    started, loaded, none = out.stdout.split()
    assert started == "0"
    assert none == str(loaded == "False")


@pytest.mark.parametrize("half", KINDS)
@pytest.mark.parametrize("add", [True, False])
def test_tensors_are_read_in_place_as_arrays_are(half, add):
    """apply_pairs_tensors on torch tensors: apply_pairs' bits, float64's values, in place."""
    torch = pytest.importorskip("torch")
    from lorahook._core.slot_pairs import apply_pairs_tensors
    dtype = {None: torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[half]
    outs = [33, 16, 5]
    pairs, ref, slots, x, x64, y, y64 = _problem(half, 9, 37, outs)
    groups = SlotRows(slots, pairs.n_slots)

    def tensor(arr):
        t = torch.from_numpy(arr.copy())
        return t if half is None else t.view(dtype)

    xt, yt = tensor(x), tensor(y)
    assert apply_pairs_tensors(groups, xt, yt[:, 3:3 + sum(outs)], pairs, dtype, 0.75,
                               add=add, team=_team(2))
    want = y.copy()
    apply_pairs(groups, x, want[:, 3:3 + sum(outs)], pairs, 0.75, add=add, half=half)
    got = yt.numpy() if half is None else yt.view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    _assert_near_float64(got, half, slots, x64, y64, ref, outs, 0.75, add)


def test_tensors_of_another_layout_are_left_to_the_caller():
    torch = pytest.importorskip("torch")
    from lorahook._core.slot_pairs import apply_pairs_tensors
    pairs = SlotPairs([np.ones((2, 3, 8), np.float32)], [np.ones((2, 3, 6), np.float32)],
                      [np.full(2, 3, np.int32)])
    g = SlotRows(np.array([0, 1, -1, 0]), 2)
    x, y = torch.ones(4, 8), torch.zeros(4, 6)
    not_served = {
        "another dtype": (x.double(), y.double()),
        "3-D rows": (x.view(2, 2, 8), y),
        "columns apart": (torch.ones(8, 4).t(), y),
        "a written output with columns apart": (x, torch.zeros(6, 4).t()),
        "another width": (x, torch.zeros(4, 7)),
        "not on the CPU": (x.to("meta"), y),
    }
    for what, (xi, yi) in not_served.items():
        before = yi.clone() if yi.is_cpu else None
        assert apply_pairs_tensors(g, xi, yi, pairs, xi.dtype if what == "another dtype"
                                   else torch.float32) is False, what
        if before is not None:
            assert torch.equal(yi, before), what
    assert apply_pairs_tensors(g, x, y, pairs, torch.float16) is False  # not the pairs' dtype
    with pytest.raises(ValueError, match="4 rows"):
        apply_pairs_tensors(g, x[:3], y[:3], pairs, torch.float32)
    buf = torch.zeros(4, 16)
    with pytest.raises(ValueError, match="overlap"):
        apply_pairs_tensors(g, buf[:, :8], buf[:, 5:11], pairs, torch.float32)
    assert torch.count_nonzero(buf) == 0
    assert apply_pairs_tensors(g, x, y, pairs, torch.float32)
    assert torch.equal(y[2], torch.zeros(6)) and torch.equal(y[0], torch.full((6,), 24.0))


def _per_slot(half, stacked, ref):
    """``stacked``'s adapters as per-slot pairs: each slot refers to arrays of its own rank."""
    a64, bt64, ranks = ref
    outs = [b.shape[2] for b in bt64]
    dtype = "float32" if half is None else half
    pairs = SlotPairs.per_slot(stacked.n_slots, stacked.d_in, outs, dtype)
    for i in range(len(outs)):
        for s in range(stacked.n_slots):
            k = ranks[i][s]
            if k:
                a = _cast(a64[i][s, :k], half)[0]
                bt = _cast(bt64[i][s, :k], half)[0]
                pairs.set_slot(i, s, np.ascontiguousarray(a), np.ascontiguousarray(bt))
    return pairs


@pytest.mark.parametrize("half", KINDS)
@pytest.mark.parametrize("add", [True, False])
def test_per_slot_adapters_equal_stacked_slots_and_float64(build, half, add):
    # each slot at its adapter's own rank, its arrays wherever they live: the same bits as
    # the stacked slots padded to the largest rank, on any team
    outs = [33, 16, 5]
    stacked, ref, slots, x, x64, y, y64 = _problem(half, 41, 37, outs, n_slots=7, pad=0.0)
    per = _per_slot(half, stacked, ref)
    assert [list(per.ranks(i)) for i in range(3)] == [list(r) for r in ref[2]]
    groups = SlotRows(slots, 7)
    want = y.copy()
    apply_pairs(groups, x, want[:, 3:3 + sum(outs)], stacked, 0.5, add=add, half=half)
    for team in (None, _team(2)):
        got = y.copy()
        apply_pairs(groups, x, got[:, 3:3 + sum(outs)], per, 0.5, add=add, half=half, team=team)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    _assert_near_float64(got, half, slots, x64, y64, ref, outs, 0.5, add)


def test_a_slot_is_set_again_at_another_rank_and_cleared():
    rng = np.random.default_rng(7)
    d_in, d_out = 24, 40
    pairs = SlotPairs.per_slot(3, d_in, [d_out])
    assert not pairs.used
    x = rng.standard_normal((6, d_in)).astype(np.float32)
    slots = np.array([0, 2, 1, -1, 2, 0])
    groups = SlotRows(slots, 3)

    def delta(a, bt):
        return (bt.astype(np.float64).T @ (a.astype(np.float64) @ x.T.astype(np.float64))).T

    adapters = {}
    for s, k in ((0, 4), (2, 64), (1, 1)):
        a = rng.standard_normal((k, d_in)).astype(np.float32)
        bt = rng.standard_normal((k, d_out)).astype(np.float32)
        pairs.set_slot(0, s, a, bt)
        adapters[s] = (a, bt)
    assert pairs.used and list(pairs.ranks(0)) == [4, 1, 64]
    y = np.zeros((6, d_out), np.float32)
    apply_pairs(groups, x, y, pairs)
    for r, s in enumerate(slots):
        want = delta(*adapters[s])[r] if s >= 0 else np.zeros(d_out)
        assert np.allclose(y[r], want, rtol=1e-4, atol=1e-4), r
    # the slot of rank 64 takes an adapter of rank 2; slot 0 is cleared
    a = rng.standard_normal((2, d_in)).astype(np.float32)
    bt = rng.standard_normal((2, d_out)).astype(np.float32)
    pairs.set_slot(0, 2, a, bt)
    pairs.clear_slot(0, 0)
    assert list(pairs.ranks(0)) == [0, 1, 2]
    y = np.zeros((6, d_out), np.float32)
    apply_pairs(groups, x, y, pairs)
    assert np.allclose(y[1], delta(a, bt)[1], rtol=1e-4, atol=1e-4)
    assert np.array_equal(y[slots == 0], np.zeros((2, d_out), np.float32))
    # the arrays are referred to, not copied: a change of the adapter's values is seen
    bt *= 2
    y2 = np.zeros((6, d_out), np.float32)
    apply_pairs(groups, x, y2, pairs)
    assert np.allclose(y2[1], 2 * y[1], rtol=1e-5)


def test_per_slot_refusals_name_what_was_wrong():
    pairs = SlotPairs.per_slot(2, 8, [6, 4], "bfloat16")
    a, bt = np.zeros((3, 8), np.uint16), np.zeros((3, 6), np.uint16)
    with pytest.raises(TypeError, match=r"pairs' dtype \(bfloat16\), got float32"):
        pairs.set_slot(0, 0, a.astype(np.float32), bt)
    with pytest.raises(ValueError, match=r"bt must be a C-contiguous 2-D array \(rank, 4\)"):
        pairs.set_slot(1, 0, a, bt)
    with pytest.raises(ValueError, match=r"a must be a C-contiguous 2-D array \(rank, 8\)"):
        pairs.set_slot(0, 0, np.zeros((8, 3), np.uint16).T, bt)
    with pytest.raises(ValueError, match="share a rank"):
        pairs.set_slot(0, 0, a[:2], bt)
    with pytest.raises(IndexError, match=r"slice 2 and slot 0 must lie in \[0, 2\)"):
        pairs.set_slot(2, 0, a, bt)
    with pytest.raises(IndexError, match="slot 2"):
        pairs.clear_slot(0, 2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        SlotPairs.per_slot(2, 8, [6], "int8")
    with pytest.raises(ValueError, match="1 to 8 widths"):
        SlotPairs.per_slot(2, 8, [6] * 9)
    with pytest.raises(ValueError, match="d_in and d_outs"):
        SlotPairs.per_slot(2, 0, [6])
    stacked = SlotPairs([np.zeros((2, 3, 8), np.float32)], [np.zeros((2, 3, 6), np.float32)],
                        [np.zeros(2, np.int32)])
    with pytest.raises(TypeError, match="only pairs made by SlotPairs.per_slot"):
        stacked.set_slot(0, 0, np.zeros((3, 8), np.float32), np.zeros((3, 6), np.float32))
    assert list(pairs.ranks(0)) == [0, 0] and not pairs.used  # nothing was half set


def _int8_per_slot(half, stacked, ref):
    """``stacked``'s adapters in int8 per-slot pairs, and the dequantized float64 factors."""
    from lorahook._values import quantized
    a64, bt64, ranks = ref
    outs = [b.shape[2] for b in bt64]
    pairs = SlotPairs.per_slot(stacked.n_slots, stacked.d_in, outs,
                               "float32" if half is None else half, weights="int8")
    qa64 = [np.zeros_like(v) for v in a64]
    qbt64 = [np.zeros_like(v) for v in bt64]
    for i in range(len(outs)):
        for s in range(stacked.n_slots):
            k = ranks[i][s]
            if k:
                a, sa = quantized(a64[i][s, :k], 1)       # a scale per row of A
                bt, sb = quantized(bt64[i][s, :k], 0)     # one per output (column of B^T)
                pairs.set_slot(i, s, a, bt, (sa, sb))
                qa64[i][s, :k] = sa.astype(np.float64)[:, None] * a
                qbt64[i][s, :k] = bt * sb.astype(np.float64)
    return pairs, (qa64, qbt64, ranks)


@pytest.mark.parametrize("half", KINDS)
@pytest.mark.parametrize("add", [True, False])
def test_int8_slots_equal_float64_on_their_dequantized_factors(build, half, add):
    # int8 factors read in place and widened in registers, rows in any dtype: float64 on
    # the dequantized factors, the same bits on any team
    outs = [33, 16, 5]
    stacked, ref, slots, x, x64, y, y64 = _problem(half, 41, 37, outs, n_slots=7, pad=0.0)
    pairs, qref = _int8_per_slot(half, stacked, ref)
    assert pairs.int8 and [list(pairs.ranks(i)) for i in range(3)] == [list(r) for r in ref[2]]
    groups = SlotRows(slots, 7)
    results = []
    for team in (None, _team(2), _team(3)):
        got = y.copy()
        apply_pairs(groups, x, got[:, 3:3 + sum(outs)], pairs, 0.5, add=add, half=half,
                    team=team)
        results.append(got)
    for other in results[1:]:
        assert np.array_equal(other.view(np.uint8), results[0].view(np.uint8))
    got = results[0]
    assert np.array_equal(got[slots < 0].view(np.uint8), y[slots < 0].view(np.uint8))
    _assert_near_float64(got, half, slots, x64, y64, qref, outs, 0.5, add)


def test_int8_slot_refusals_name_what_was_wrong():
    pairs = SlotPairs.per_slot(2, 8, [6], weights="int8")
    a, bt = np.ones((3, 8), np.int8), np.ones((3, 6), np.int8)
    sa, sb = np.ones(3, np.float32), np.ones(6, np.float32)
    with pytest.raises(TypeError, match="scales=\\(a_scale, b_scale\\)"):
        pairs.set_slot(0, 0, a, bt)
    with pytest.raises(TypeError, match="a must be a C-contiguous 2-D int8"):
        pairs.set_slot(0, 0, a.astype(np.float32), bt, (sa, sb))
    with pytest.raises(TypeError, match=r"b_scale must be a C-contiguous float32 array of shape \(6,\)"):
        pairs.set_slot(0, 0, a, bt, (sa, sb[:5].copy()))
    for bad in (np.nan, np.inf, -1.0):
        sb2 = sb.copy()
        sb2[2] = bad
        with pytest.raises(ValueError, match="b_scale must be finite and >= 0"):
            pairs.set_slot(0, 0, a, bt, (sa, sb2))
    assert not pairs.used  # nothing was set
    with pytest.raises(TypeError, match="no scales"):
        SlotPairs.per_slot(2, 8, [6]).set_slot(0, 0, a.astype(np.float32),
                                               bt.astype(np.float32), (sa, sb))
    with pytest.raises(ValueError, match="weights must be None or 'int8'"):
        SlotPairs.per_slot(2, 8, [6], weights="int4")
