"""Property tests: every kernel path equals a float64 reference and writes only its output rows.

Each property draws shapes, ranks (0 to above ``min(d_in, d_out)``), row counts, buffer
layouts, scales (0 and negative included) and bias on/off, computes the expected rows in
float64 numpy, and checks the result to the contract's accuracy:
``max|got - ref| <= 1e-5 * max|ref|`` (``1e-6`` absolute when the reference is all zero).
Output buffers are views into a larger array whose guard regions hold a NaN sentinel; the
guards must be bit-identical afterwards.
"""
import contextlib

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from lorahook import AdapterSet, LoraAdapter, LoraHook, LoraLayer, apply_lora_rows
from lorahook._core import segments as _segments
from testing_core import core as _testing

MODULE = "q_proj"
LAYER = 3
GUARD = 37  # floats of sentinel on each side (odd, so views start unaligned to 16 bytes)
SENTINEL = np.uint32(0x7FC0DEAD)  # a quiet NaN with a payload nothing computes


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def crossover(n):
    old = _segments.set_gemm_crossover(n)
    try:
        yield
    finally:
        _segments.set_gemm_crossover(old)


CROSSOVER_AT_IMPORT = _segments.get_gemm_crossover()
PATHS = {"default": None, "row_loop": 2**30, "batched": 1}


def path_ctx(path):
    n = PATHS[path]
    return contextlib.nullcontext() if n is None else crossover(n)


class Guarded:
    """``n`` rows of ``width`` floats inside a larger buffer with sentinel guards."""

    def __init__(self, values, two_d, writable=True):
        n, width = values.shape
        self.size = n * width
        self.buf = np.empty(GUARD + self.size + GUARD, dtype=np.float32)
        self.buf.view(np.uint32)[:] = SENTINEL
        body = self.buf[GUARD:GUARD + self.size]
        body[:] = values.reshape(-1)
        self.view = body.reshape(n, width) if two_d else body
        if not writable:
            self.view = self.view.view()
            self.view.flags.writeable = False
        self.initial = values.astype(np.float32).copy()

    def rows(self):
        return self.buf[GUARD:GUARD + self.size].reshape(self.initial.shape)

    def assert_guards_intact(self):
        bits = self.buf.view(np.uint32)
        assert (bits[:GUARD] == SENTINEL).all(), "bytes before the rows were written"
        assert (bits[GUARD + self.size:] == SENTINEL).all(), "bytes after the rows were written"


def _peak(arr):
    return float(np.max(np.abs(arr))) if np.size(arr) else 0.0


def assert_output_close(got, y, delta, what="output"):
    """``got`` against ``y + delta`` (float64).

    float32 rounds the terms it adds, so where the delta cancels the output
    (y = -0.2757, delta = 0.2689) the bound is relative to the larger term.
    """
    assert_close(got, np.asarray(y, dtype=np.float64) + delta, what,
                 peak_floor=max(_peak(y), _peak(delta)))


def assert_close(got, ref, what="output", peak_floor=0.0):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape
    if got.size == 0:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err = float(np.max(np.abs(got - ref)))
    peak = max(float(np.max(np.abs(ref))), peak_floor)
    # relative to the largest value, with an absolute floor far below any
    # normal float32 value: inputs this strategy draws can make the float64
    # reference smaller than float32 can hold (1e-47), where float32 rounds
    # to zero and no relative bound applies
    tol = max(1e-5 * peak, 1e-30) if peak > 0 else 1e-6
    assert err <= tol, f"{what}: max error {err:.3g} > tolerance {tol:.3g} (max|ref| = {peak:.3g})"


def ref_delta(layer, x, scale=None):
    """float64 ``scale * (B (A x) + bias)`` for the rows of ``x``."""
    s = layer.scale if scale is None else scale
    if layer.rank == 0:
        return np.zeros((x.shape[0], layer.d_out))
    a = layer.a.astype(np.float64)
    b = layer.b.astype(np.float64)
    d = (x.astype(np.float64) @ a.T) @ b.T
    if layer.bias is not None:
        d = d + layer.bias.astype(np.float64)
    return np.asarray(s, dtype=np.float64).reshape(-1, 1) * d


SCALES = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 0.5, -2.5, 1e-3, 7.0]),
    st.floats(-8.0, 8.0, allow_nan=False, allow_infinity=False, width=32),
)


@st.composite
def shapes(draw, max_rows=300):
    d_in = draw(st.integers(1, 70))
    d_out = draw(st.integers(1, 70))
    rank = draw(st.integers(0, min(80, min(d_in, d_out) + 8)))
    n = draw(st.one_of(st.integers(0, 12), st.integers(0, max_rows)))
    return d_in, d_out, rank, n


def make_layer(rng, d_in, d_out, rank, scale, bias):
    a = rng.standard_normal((rank, d_in)).astype(np.float32)
    b = rng.standard_normal((d_out, rank)).astype(np.float32)
    bv = rng.standard_normal(d_out).astype(np.float32) if (bias and rank > 0) else None
    return LoraLayer(a, b, scale=scale, bias=bv)


def make_rows(rng, n, width, zero):
    if zero:
        return np.zeros((n, width), dtype=np.float32)
    return rng.standard_normal((n, width)).astype(np.float32)


def run_and_check(hook, layer_idx, module, x_vals, y_vals, expected_delta, two_d_in, two_d_out,
                  readonly_in, untouched_rows=None):
    n, d_in = x_vals.shape
    d_out = y_vals.shape[1]
    gx = Guarded(x_vals, two_d_in, writable=not readonly_in)
    gy = Guarded(y_vals, two_d_out)
    apply_lora_rows(hook, layer_idx, module, gx.view, gy.view, d_in, d_out)
    gx.assert_guards_intact()
    gy.assert_guards_intact()
    assert np.array_equal(gx.rows().view(np.uint32), x_vals.view(np.uint32)), "input was written"
    got = gy.rows()
    assert_output_close(got, y_vals, expected_delta)
    if untouched_rows is not None and len(untouched_rows):
        assert np.array_equal(got[untouched_rows].view(np.uint32),
                              y_vals[untouched_rows].view(np.uint32)), "rows without an adapter changed"
    return got


# --------------------------------------------------------------------------- single adapter


@given(shape=shapes(), scale=SCALES, bias=st.booleans(), two_d_in=st.booleans(),
       two_d_out=st.booleans(), readonly_in=st.booleans(), zero_base=st.booleans(),
       path=st.sampled_from(sorted(PATHS)), seed=st.integers(0, 2**32 - 1))
def test_adapter_matches_reference(shape, scale, bias, two_d_in, two_d_out, readonly_in,
                                   zero_base, path, seed):
    d_in, d_out, rank, n = shape
    rng = np.random.default_rng(seed)
    layer = make_layer(rng, d_in, d_out, rank, scale, bias)
    adapter = LoraAdapter({(LAYER, MODULE): layer})
    x = make_rows(rng, n, d_in, False)
    y = make_rows(rng, n, d_out, zero_base)
    with path_ctx(path):
        run_and_check(adapter, LAYER, MODULE, x, y, ref_delta(layer, x), two_d_in, two_d_out,
                      readonly_in)


@given(shape=shapes(), scale=SCALES, seed=st.integers(0, 2**32 - 1))
def test_uncovered_projection_is_untouched(shape, scale, seed):
    d_in, d_out, rank, n = shape
    rng = np.random.default_rng(seed)
    adapter = LoraAdapter({(LAYER, MODULE): make_layer(rng, d_in, d_out, rank, scale, False)})
    x = make_rows(rng, n, d_in, False)
    y = make_rows(rng, n, d_out, False)
    for layer_idx, module in ((LAYER, "k_proj"), (LAYER + 1, MODULE)):
        got = run_and_check(adapter, layer_idx, module, x, y, np.zeros((n, d_out)), False, True, False)
        assert np.array_equal(got.view(np.uint32), y.view(np.uint32))


@given(shape=shapes(max_rows=40), scale=SCALES, bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_single_row_apply_matches_reference(shape, scale, bias, seed):
    """adapter.apply() called row by row equals the reference."""
    d_in, d_out, rank, n = shape
    rng = np.random.default_rng(seed)
    layer = make_layer(rng, d_in, d_out, rank, scale, bias)
    adapter = LoraAdapter({(LAYER, MODULE): layer})
    x = make_rows(rng, n, d_in, False)
    y = make_rows(rng, n, d_out, False)
    out = y.copy()
    for i in range(n):
        adapter.apply(LAYER, MODULE, x[i], out[i])
    assert_output_close(out, y, ref_delta(layer, x), "adapter.apply")


# --------------------------------------------------------------------------- pure-Python hooks


class NumpyHook(LoraHook):
    """A hook written in Python: numpy for one row at a time."""

    def __init__(self, layer, key):
        self.layer = layer
        self.key = key
        self.calls = 0

    def is_active(self, layer_idx, module):
        return (layer_idx, module) == self.key

    def apply(self, layer_idx, module, x, output):
        assert (layer_idx, module) == self.key
        assert isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype == np.float32
        assert not x.flags.writeable
        assert output.ndim == 1 and output.flags.writeable and output.dtype == np.float32
        self.calls += 1
        L = self.layer
        if L.rank == 0:
            return
        # float64 inside, rounded once: this hook checks how rows reach apply(),
        # so its own arithmetic must not eat the tolerance
        d = L.b.astype(np.float64) @ (L.a.astype(np.float64) @ x.astype(np.float64))
        if L.bias is not None:
            d = d + L.bias
        output[:] = (output + L.scale * d).astype(np.float32)


class OverridingAdapter(LoraAdapter):
    """A LoraAdapter subclass with its own apply(): served by the generic row loop."""

    def apply(self, layer_idx, module, x, output):
        assert not x.flags.writeable
        LoraAdapter.apply(self, layer_idx, module, x, output)


@given(shape=shapes(), scale=SCALES, bias=st.booleans(), two_d_in=st.booleans(),
       two_d_out=st.booleans(), readonly_in=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_python_hook_matches_reference(shape, scale, bias, two_d_in, two_d_out, readonly_in, seed):
    d_in, d_out, rank, n = shape
    rng = np.random.default_rng(seed)
    layer = make_layer(rng, d_in, d_out, rank, scale, bias)
    hook = NumpyHook(layer, (LAYER, MODULE))
    x = make_rows(rng, n, d_in, False)
    y = make_rows(rng, n, d_out, False)
    run_and_check(hook, LAYER, MODULE, x, y, ref_delta(layer, x), two_d_in, two_d_out, readonly_in)
    assert hook.calls == n
    sub = OverridingAdapter({(LAYER, MODULE): layer})
    run_and_check(sub, LAYER, MODULE, x, y, ref_delta(layer, x), two_d_in, two_d_out, readonly_in)


# --------------------------------------------------------------------------- grouped kernel


@st.composite
def grouped_cases(draw):
    d_in, d_out, _, n = draw(shapes())
    n_groups = draw(st.integers(1, 4))
    ranks = [draw(st.integers(0, min(80, min(d_in, d_out) + 8))) for _ in range(n_groups)]
    # each row goes to one group or to none (-1)
    owner = draw(st.lists(st.integers(-1, n_groups - 1), min_size=n, max_size=n))
    whole = draw(st.lists(st.booleans(), min_size=n_groups, max_size=n_groups))
    per_row = draw(st.lists(st.booleans(), min_size=n_groups, max_size=n_groups))
    scales = [draw(SCALES) for _ in range(n_groups)]
    biases = [draw(st.booleans()) for _ in range(n_groups)]
    return d_in, d_out, n, ranks, owner, whole, per_row, scales, biases


@given(case=grouped_cases(), two_d=st.booleans(), path=st.sampled_from(sorted(PATHS)),
       seed=st.integers(0, 2**32 - 1))
def test_apply_groups_matches_reference(case, two_d, path, seed):
    d_in, d_out, n, ranks, owner, whole, per_row, scales, biases = case
    rng = np.random.default_rng(seed)
    owner = np.asarray(owner, dtype=np.int64)
    x = make_rows(rng, n, d_in, False)
    y = make_rows(rng, n, d_out, False)
    expected = np.zeros((n, d_out))
    groups = []
    touched = np.zeros(n, dtype=bool)
    for g, rank in enumerate(ranks):
        layer = make_layer(rng, d_in, d_out, rank, 1.0, biases[g])
        if whole[g] and g == 0 and len(ranks) == 1:
            rows = None
            idx = np.arange(n)
        else:
            idx = np.flatnonzero(owner == g)
            rows = idx.astype(np.int32)
        if per_row[g]:
            rs = (rng.standard_normal(len(idx)) * scales[g]).astype(np.float32)
            rs[::3] = 0.0
            scale_col = rs.astype(np.float64)
        else:
            rs = None
            scale_col = np.full(len(idx), np.float32(scales[g]), dtype=np.float64)
        groups.append((layer._kernel, scales[g], rows, rs))
        if len(idx):
            expected[idx] += ref_delta(layer, x[idx], scale_col)
            if rank > 0:
                touched[idx] = True
    untouched = np.flatnonzero(~touched)
    note(f"groups={[(len(g[2]) if g[2] is not None else 'all') for g in groups]}")
    gx = Guarded(x, two_d)
    gy = Guarded(y, two_d)
    with path_ctx(path):
        _testing.apply_groups(groups, gx.view, gy.view, n, d_in, d_out)
    gx.assert_guards_intact()
    gy.assert_guards_intact()
    got = gy.rows()
    assert_output_close(got, y, expected)
    assert np.array_equal(got[untouched].view(np.uint32), y[untouched].view(np.uint32))


# --------------------------------------------------------------------------- AdapterSet.bind


@st.composite
def bound_cases(draw):
    d_in, d_out, _, n = draw(shapes())
    n_adapters = draw(st.integers(1, 3))
    ranks = [draw(st.integers(0, min(80, min(d_in, d_out) + 8))) for _ in range(n_adapters)]
    names = [f"ad{i}" for i in range(n_adapters)]
    row_names = draw(st.lists(st.sampled_from(names + [None]), min_size=n, max_size=n))
    kind = draw(st.sampled_from(["none", "one", "per_row", "mapping"]))
    if kind == "none":
        scales = None
    elif kind == "one":
        scales = draw(SCALES)
    elif kind == "per_row":
        scales = draw(st.lists(SCALES, min_size=n, max_size=n))
    else:
        scales = {nm: draw(SCALES) for nm in names if draw(st.booleans())}
    layer_scales = [draw(SCALES) for _ in range(n_adapters)]
    biases = [draw(st.booleans()) for _ in range(n_adapters)]
    return d_in, d_out, n, names, ranks, row_names, scales, layer_scales, biases


@given(case=bound_cases(), two_d_in=st.booleans(), two_d_out=st.booleans(),
       path=st.sampled_from(sorted(PATHS)), seed=st.integers(0, 2**32 - 1))
def test_bound_batch_matches_reference(case, two_d_in, two_d_out, path, seed):
    d_in, d_out, n, names, ranks, row_names, scales, layer_scales, biases = case
    rng = np.random.default_rng(seed)
    aset = AdapterSet()
    layers = {}
    for name, rank, ls, bias in zip(names, ranks, layer_scales, biases):
        layers[name] = make_layer(rng, d_in, d_out, rank, ls, bias)
        aset.add(name, LoraAdapter({(LAYER, MODULE): layers[name]}))
    hook = aset.bind(row_names, scales)
    x = make_rows(rng, n, d_in, False)
    y = make_rows(rng, n, d_out, False)
    expected = np.zeros((n, d_out))
    untouched = []
    for i, name in enumerate(row_names):
        if name is None:
            untouched.append(i)
            continue
        if scales is None:
            f = 1.0
        elif isinstance(scales, dict):
            f = scales.get(name, 1.0)
        elif isinstance(scales, list):
            f = scales[i]
        else:
            f = scales
        layer = layers[name]
        eff = float(np.float32(f * layer.scale))
        if eff == 0.0 or layer.rank == 0:
            untouched.append(i)
            continue
        expected[i] = ref_delta(layer, x[i:i + 1], eff)[0]
    active = len(untouched) < n
    assert hook.is_active(LAYER, MODULE) == active
    assert not hook.is_active(LAYER, "k_proj")
    with path_ctx(path):
        run_and_check(hook, LAYER, MODULE, x, y, expected, two_d_in, two_d_out, False,
                      untouched_rows=np.asarray(untouched, dtype=np.int64))


# --------------------------------------------------------------------------- chunked batches


@pytest.mark.parametrize("grouped", [False, True])
def test_batches_larger_than_one_scratch_chunk(grouped):
    """Batches that need several scratch chunks (per-thread cache of 2**20 floats)."""
    rng = np.random.default_rng(7)
    if grouped:
        d_in, d_out, rank, n = 300, 200, 48, 5000  # gather path: per row rank + d_in + d_out
    else:
        d_in, d_out, rank, n = 16, 12, 1500, 2100  # per row: rank floats
    layer = make_layer(rng, d_in, d_out, rank, -0.75, True)
    x = make_rows(rng, n, d_in, False)
    y = make_rows(rng, n, d_out, False)
    if grouped:
        rows = np.flatnonzero(rng.random(n) < 0.7).astype(np.int32)
        expected = np.zeros((n, d_out))
        expected[rows] = ref_delta(layer, x[rows], np.float32(-0.75))
        gy = Guarded(y, True)
        with crossover(1):
            _testing.apply_groups([(layer._kernel, -0.75, rows, None)], x, gy.view, n, d_in, d_out)
        gy.assert_guards_intact()
        assert_output_close(gy.rows(), y, expected)
        others = np.setdiff1d(np.arange(n), rows)
        assert np.array_equal(gy.rows()[others], y[others])
    else:
        adapter = LoraAdapter({(LAYER, MODULE): layer})
        with crossover(1):
            run_and_check(adapter, LAYER, MODULE, x, y, ref_delta(layer, x), True, False, True)


def test_crossover_restored():
    """The tests above leave the crossover as this module found it."""
    assert _segments.get_gemm_crossover() == CROSSOVER_AT_IMPORT
