"""lorahook._core.slot_rows: LoRA over stacked slot factors, against numpy in float64."""
import threading

import ml_dtypes
import numpy as np
import pytest

from lorahook._core.slot_rows import SlotRows, apply_slots

RNG = np.random.default_rng(20261204)


def _half(arr, half):
    """float32 values as the 16-bit patterns of ``half`` (uint16), and their exact float64 values."""
    if half is None:
        return arr.astype(np.float32), arr.astype(np.float32).astype(np.float64)
    dt = np.float16 if half == "float16" else ml_dtypes.bfloat16
    h = arr.astype(dt)
    return h.view(np.uint16), h.astype(np.float64)


def _reference(slots, x, y, a, b, scale, add):
    """The expected output in float64: each row with a slot gets its delta."""
    out = y.copy()
    for r, s in enumerate(slots):
        if s < 0:
            continue
        if a is not None and b is not None:
            d = scale * (b[s] @ (a[s] @ x[r]))
        elif a is not None:
            d = scale * (a[s] @ x[r])
        else:
            d = scale * (b[s] @ x[r])
        out[r] = out[r] + d if add else d
    return out


def _close(got, ref, tol):
    err = np.max(np.abs(got - ref)) if got.size else 0.0
    assert err <= tol * max(np.max(np.abs(ref)), 1e-30), (err, np.max(np.abs(ref)))


@pytest.mark.parametrize("mode", ["both", "a", "b", "both-bt", "b-bt"])
@pytest.mark.parametrize("half", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("n_rows", [1, 7, 64, 600])
def test_matches_float64_reference(mode, half, n_rows):
    mode, _, layout = mode.partition("-")
    n_slots, rank, d_in, d_out = 5, 6, 40, 24
    if mode == "a":
        d_out = rank
    if mode == "b":
        d_in = rank
    slots = RNG.integers(-1, n_slots, size=n_rows)
    if n_rows >= 64:
        slots[: n_rows // 2] = 2  # a long run of one slot (consecutive rows, chunked)
    x16, x = _half(RNG.standard_normal((n_rows, d_in)), half)
    # y: a slice of columns of a wider output (a row stride), rows without a slot hold NaN
    wide = RNG.standard_normal((n_rows, d_out + 9))
    wide[slots < 0] = np.nan
    wide16, wide64 = _half(wide, half)
    y16 = wide16[:, 3:3 + d_out]
    before = wide16.copy()
    a16, a = _half(RNG.standard_normal((n_slots + 1, rank, d_in)) * 0.1, half)
    b16, b = _half(RNG.standard_normal((n_slots + 1, d_out, rank)) * 0.1, half)
    args = dict(a=a16 if mode != "b" else None, b=b16 if mode != "a" else None)
    if layout == "bt":  # B given transposed, (slots, rank, d_out)
        args["bt"] = np.ascontiguousarray(args.pop("b").transpose(0, 2, 1))
    apply_slots(SlotRows(slots, n_slots), x16, y16, scale=0.75, half=half, **args)
    ref = _reference(slots, x, wide64[:, 3:3 + d_out], a if mode != "b" else None,
                     b if mode != "a" else None, 0.75, True)
    got = (y16.astype(np.float64) if half is None
           else y16.view(np.float16 if half == "float16" else ml_dtypes.bfloat16).astype(np.float64))
    covered = slots >= 0
    tol = 1e-5 if half is None else (2e-3 if half == "float16" else 1.6e-2)
    _close(got[covered], ref[covered], tol)
    # rows without a slot, and the columns outside the slice, are untouched bit for bit
    assert np.array_equal(wide16[~covered].view(np.uint8), before[~covered].view(np.uint8))
    assert np.array_equal(wide16[:, :3].view(np.uint8), before[:, :3].view(np.uint8))
    assert np.array_equal(wide16[:, 3 + d_out:].view(np.uint8), before[:, 3 + d_out:].view(np.uint8))


@pytest.mark.parametrize("half", [None, "bfloat16"])
def test_mixed_kinds_and_assign(half):
    # float32 products (a shrink's buffer) expanded into 16-bit rows, written not added
    n_slots, rank, d_out, n = 3, 4, 16, 9
    slots = np.array([0, -1, 2, 2, 1, -1, 0, 0, 2])
    t = RNG.standard_normal((n, rank)).astype(np.float32)
    b16, b = _half(RNG.standard_normal((n_slots, d_out, rank)), half)
    y16, y = _half(RNG.standard_normal((n, d_out)), half)
    keep = y16.copy()
    apply_slots(SlotRows(slots, n_slots), t, y16, b=b16, add=False, half=half)
    ref = _reference(slots, t.astype(np.float64), y, None, b, 1.0, False)
    got = y16.astype(np.float64) if half is None else y16.view(ml_dtypes.bfloat16).astype(np.float64)
    _close(got[slots >= 0], ref[slots >= 0], 1e-5 if half is None else 8e-3)
    assert np.array_equal(y16[slots < 0], keep[slots < 0])


def test_slot_rows_grouping():
    g = SlotRows(np.array([3, -1, 0, 3, 3, -1, 0], dtype=np.int32), 4)
    assert (g.n_rows, g.n_slots, g.n_covered, g.max_slot) == (7, 4, 5, 3)
    assert g.rows(0).tolist() == [2, 6]
    assert g.rows(1).tolist() == []
    assert g.rows(3).tolist() == [0, 3, 4]
    assert g.counts().tolist() == [2, 0, 0, 3]
    assert SlotRows(np.full(5, -1), 2).max_slot == -1
    assert SlotRows(np.zeros(0, dtype=np.int64), 0).n_rows == 0


def test_no_covered_row_writes_nothing():
    x = np.ones((4, 8), np.float32)
    y = np.full((4, 8), np.nan, np.float32)
    a = np.ones((2, 2, 8), np.float32)
    b = np.ones((2, 8, 2), np.float32)
    apply_slots(SlotRows(np.full(4, -1), 2), x, y, a, b)
    assert np.isnan(y).all()


def _good():
    slots = SlotRows(np.array([0, 1, -1]), 2)
    return (slots, np.ones((3, 8), np.float32), np.zeros((3, 6), np.float32),
            np.ones((2, 4, 8), np.float32), np.ones((2, 6, 4), np.float32))


@pytest.mark.parametrize("change, error, words", [
    (lambda g, x, y, a, b: (g, x.astype(np.float64), y, a, b), TypeError, "x must have dtype"),
    (lambda g, x, y, a, b: (g, x, y, a.astype(np.int32), b), TypeError, "a must have dtype"),
    (lambda g, x, y, a, b: (g, x[:2], y, a, b), ValueError, "x must have 3 rows"),
    (lambda g, x, y, a, b: (g, x, y[:, :5], a, b), ValueError, "b of shape (2, 6, 4) must have shape[1] == d_out = 5"),
    (lambda g, x, y, a, b: (g, x, y, a[:, :3], b), ValueError, "C-contiguous"),
    (lambda g, x, y, a, b: (g, x, y, np.ones((2, 3, 8), np.float32), b), ValueError, "share a rank"),
    (lambda g, x, y, a, b: (g, x, y, a[:1], b), ValueError, "holds 1 slots but a row uses slot 1"),
    (lambda g, x, y, a, b: (g, x[:, ::2].copy()[:, :4], y, a, b), ValueError, "shape[2] == d_in = 4"),
    (lambda g, x, y, a, b: (g, np.ones((3, 16), np.float32)[:, ::2], y, a, b), ValueError, "contiguous rows"),
    (lambda g, x, y, a, b: (g, x, y.reshape(-1), a, b), ValueError, "y must be 2-D"),
])
def test_refusals_write_nothing(change, error, words):
    g, x, y, a, b = change(*_good())
    y_before = y.copy()
    with pytest.raises(error) as info:
        apply_slots(g, x, y, a, b)
    assert words in str(info.value)
    assert np.array_equal(y, y_before)


def test_refusals_of_calls():
    g, x, y, a, b = _good()
    with pytest.raises(ValueError, match="needs a, b or both"):
        apply_slots(g, x, y)
    with pytest.raises(ValueError, match="give b or bt, not both"):
        apply_slots(g, x, y, a, b, bt=b)
    with pytest.raises(ValueError, match=r"bt of shape \(2, 6, 4\) must have shape\[2\] == d_out"):
        apply_slots(g, x, y, a, bt=b)
    y.flags.writeable = False
    with pytest.raises(ValueError, match="y must be writable"):
        apply_slots(g, x, y, a, b)
    both = np.zeros((3, 14), np.float32)
    with pytest.raises(ValueError, match="must not overlap"):
        apply_slots(g, both[:, :8], both[:, 8:], a, b)
    with pytest.raises(ValueError, match="half must be"):
        apply_slots(g, x, np.zeros((3, 6), np.float32), a, b, half="float8")
    with pytest.raises(ValueError, match=r"slots\[1\] must be -1"):
        SlotRows(np.array([0, 5]), 2)
    with pytest.raises(ValueError, match=r"slots\[0\] must be -1"):
        SlotRows(np.array([-2]), 2)
    with pytest.raises(TypeError, match="1-D integer array"):
        SlotRows(np.zeros(3, np.float32), 2)
    with pytest.raises(TypeError, match="does not pickle"):
        import pickle
        pickle.dumps(g)


def test_threads_share_groups_and_weights():
    n_slots, rank, d_in, d_out, n = 4, 8, 64, 48, 96
    slots = RNG.integers(-1, n_slots, size=n)
    g = SlotRows(slots, n_slots)
    a = (RNG.standard_normal((n_slots, rank, d_in)) * 0.1).astype(np.float32)
    b = (RNG.standard_normal((n_slots, d_out, rank)) * 0.1).astype(np.float32)
    xs = [RNG.standard_normal((n, d_in)).astype(np.float32) for _ in range(4)]
    ys = [np.zeros((n, d_out), np.float32) for _ in range(4)]

    def work(i):
        for _ in range(20):
            apply_slots(g, xs[i], ys[i], a, b)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, y in zip(xs, ys):
        ref = 20 * _reference(slots, x.astype(np.float64), np.zeros((n, d_out)), a.astype(np.float64),
                              b.astype(np.float64), 1.0, True)
        _close(y.astype(np.float64), ref, 1e-5)
