"""Half-precision row conversions: float16 / bfloat16 bit patterns to float32 and back.

Every conversion test runs on each path this CPU can run (portable, AVX2 +
F16C, AVX-512 BF16), so the paths are held to the same references and
therefore to the same bits.  References: numpy's float16 (round to nearest
even) for float16; for bfloat16 the bit rule ``h << 16`` when widening and,
when narrowing, a float64 reference written here plus ``ml_dtypes.bfloat16``
when it is installed.  NaNs are compared with the documented bit rules (numpy
and ml_dtypes choose their own NaN bits).

LORAHOOK_HALF_EXHAUSTIVE=1 adds a run over all 2**32 float32 inputs (minutes).
"""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from lorahook._core import halfconv as _halfconv
from testing_core import core as _testing

try:
    import ml_dtypes
except ImportError:  # the comparisons with it are skipped
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")

PATHS = ("portable", "avx2", "avx512", "avx512bf16")  # the instruction-set targets (isa.h)
SUPPORTED = _halfconv.isas()["supported"]
KINDS = ("float16", "bfloat16")


@pytest.fixture(params=PATHS)
def path(request):
    """Make one instruction-set target active for the test, and restore the previous one."""
    name = request.param
    if name not in SUPPORTED:
        need = _halfconv.isas()["needs"][name]
        pytest.skip(f"the {name} instruction set is not available (it needs x86-64 and {need})")
    old = _halfconv.set_isa(name)
    yield name
    _halfconv.set_isa(old)


def bits32(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def floats(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def hexes(a):
    return [hex(int(v)) for v in np.ravel(a)[:8]]


# ---------------------------------------------------------------------------
# The documented NaN rules (also in _half.h)

def f16_nan_widened(h):
    h = h.astype(np.uint32)
    return ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x3FF) << 13)


def widen_reference(h, kind):
    """float32 bits of 16-bit patterns ``h`` by numpy alone (the documented NaN rule for float16)."""
    if kind == "bfloat16":
        return h.astype(np.uint32) << 16
    out = h.view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(h.view(np.float16))
    out[nan] = f16_nan_widened(h[nan])
    return out


def f16_nan_narrowed(u):
    return (((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)).astype(np.uint16)


def bf16_nan_narrowed(u):
    return ((u >> 16) | 0x0040).astype(np.uint16)


# ---------------------------------------------------------------------------
# Independent references for narrowing

def f16_reference(u):
    """float16 bits of float32 bits ``u``: numpy's round to nearest even, NaNs by the rule."""
    f = floats(u)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = f.astype(np.float16).view(np.uint16)
    nan = np.isnan(f)
    return np.where(nan, f16_nan_narrowed(u), ref).astype(np.uint16)


def bf16_reference(u):
    """bfloat16 bits of float32 bits ``u``, from float64 distances (no bit tricks).

    The two candidates are the float32 value with its low 16 bits cleared
    (toward zero) and the next bfloat16 away from zero (2**128 past the largest
    finite one, which is infinity); the nearer wins, a tie goes to the even
    pattern.
    """
    u = np.asarray(u, dtype=np.uint32)
    sign = (u >> 16) & 0x8000
    mag = u & 0x7FFFFFFF
    lo = (mag >> 16).astype(np.uint32)
    hi = lo + 1
    with np.errstate(invalid="ignore"):  # casting signalling NaNs
        x = floats(mag).astype(np.float64)
        lo_val = floats(lo << 16).astype(np.float64)
        hi_val = np.where(hi == 0x7F80, 2.0 ** 128, floats((hi << 16) & 0x7FFFFFFF).astype(np.float64))
        d_lo = x - lo_val
        d_hi = hi_val - x
        up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo & 1 == 1))
    out = np.where(up, hi, lo) | sign
    finite_or_inf = mag <= 0x7F800000
    out = np.where(finite_or_inf, out, bf16_nan_narrowed(u))
    out = np.where(mag == 0x7F800000, sign | 0x7F80, out)  # inf stays inf
    return out.astype(np.uint16)


def check_narrow(u, kind):
    """Narrow float32 bits ``u`` on the active path and compare with the references."""
    u = np.ascontiguousarray(u, dtype=np.uint32)
    f = floats(u)
    got = _halfconv.narrow(f, kind)
    assert got.dtype == np.uint16 and got.shape == f.shape
    ref = f16_reference(u) if kind == "float16" else bf16_reference(u)
    bad = got != ref
    assert not bad.any(), (kind, hexes(u[bad]), hexes(got[bad]), hexes(ref[bad]))
    if kind == "bfloat16" and ml_dtypes is not None:
        nan = np.isnan(f)
        with np.errstate(invalid="ignore"):
            theirs = f.astype(ml_dtypes.bfloat16).view(np.uint16)
        bad = (got != theirs) & ~nan
        assert not bad.any(), (hexes(u[bad]), hexes(got[bad]), hexes(theirs[bad]))
        assert np.isnan(got.view(ml_dtypes.bfloat16).astype(np.float32)[nan]).all()
    if kind == "float16":
        widened_back = got.view(np.float16)
        assert np.array_equal(np.isnan(widened_back), np.isnan(f))
    return got


def random_bits(rng, n):
    return rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)


def random_bits_in_exponents(rng, n, lo, hi):
    """Random signs and mantissas, biased exponents in [lo, hi]."""
    sign = rng.integers(0, 2, size=n, dtype=np.uint32) << 31
    exp = rng.integers(lo, hi + 1, size=n, dtype=np.uint32) << 23
    man = rng.integers(0, 1 << 23, size=n, dtype=np.uint32)
    return sign | exp | man


def with_neighbours(u):
    """Each float32 pattern, and the patterns one below and one above it."""
    u = np.asarray(u, dtype=np.int64)
    return (np.concatenate([u - 1, u, u + 1]) & 0xFFFFFFFF).astype(np.uint32)


# ---------------------------------------------------------------------------
# Widening: every 16-bit pattern

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_widen_float16_every_pattern(path):
    got = _halfconv.widen(ALL16, "float16")
    assert got.dtype == np.float32 and got.shape == ALL16.shape
    ref = ALL16.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert nan.sum() == 2 * 1023  # both signs, every non-zero payload
    g = got.view(np.uint32)
    assert np.array_equal(g[~nan], ref.view(np.uint32)[~nan])  # exact, signed zeros too
    assert np.array_equal(g[nan], f16_nan_widened(ALL16[nan]))  # quiet, sign and payload kept


def test_widen_bfloat16_every_pattern(path):
    got = _halfconv.widen(ALL16, "bfloat16")
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), ALL16.astype(np.uint32) << 16)
    if ml_dtypes is not None:
        theirs = ALL16.view(ml_dtypes.bfloat16).astype(np.float32)
        nan = np.isnan(theirs)
        assert np.array_equal(got.view(np.uint32)[~nan], theirs.view(np.uint32)[~nan])
        assert np.isnan(got[nan]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_widen_then_narrow_is_the_identity_except_for_nan_quieting(path, kind):
    back = _halfconv.narrow(_halfconv.widen(ALL16, kind), kind)
    if kind == "float16":
        nan = ((ALL16 & 0x7C00) == 0x7C00) & ((ALL16 & 0x3FF) != 0)
        expect = np.where(nan, ALL16 | 0x200, ALL16)
    else:
        nan = ((ALL16 & 0x7F80) == 0x7F80) & ((ALL16 & 0x7F) != 0)
        expect = np.where(nan, ALL16 | 0x40, ALL16)
    assert np.array_equal(back, expect.astype(np.uint16))


# ---------------------------------------------------------------------------
# Narrowing to float16

def f16_ties():
    """Every midpoint between neighbouring float16 values, of both signs, with its neighbours.

    Includes the midpoint between 0 and the smallest subnormal and the one
    between 65504 and 65536 (65520, the overflow threshold).
    """
    h = np.arange(0, 0x7C00, dtype=np.uint16)  # every finite non-negative float16
    lo = h.view(np.float16).astype(np.float64)
    hi = np.append(lo[1:], 65536.0)
    mid = ((lo + hi) / 2).astype(np.float32)  # 12 significant bits: exact in float32
    assert np.array_equal(mid.astype(np.float64), (lo + hi) / 2)
    u = bits32(mid)
    return with_neighbours(np.concatenate([u, u | 0x80000000]))


def test_narrow_float16_every_tie(path):
    got = check_narrow(f16_ties(), "float16")
    assert got.size == 6 * 0x7C00


def test_narrow_float16_random_in_range(path):
    rng = np.random.default_rng(1601)
    # biased exponents 98 .. 145: below the smallest subnormal up to past 65504
    check_narrow(random_bits_in_exponents(rng, 1 << 20, 98, 145), "float16")


def test_narrow_float16_random_bits(path):
    rng = np.random.default_rng(1602)
    check_narrow(random_bits(rng, 1 << 20), "float16")


F16_EDGES = [
    # (float32 bits, float16 bits, what)
    (0x00000000, 0x0000, "+0"),
    (0x80000000, 0x8000, "-0"),
    (0x7F800000, 0x7C00, "+inf"),
    (0xFF800000, 0xFC00, "-inf"),
    (0x3F800000, 0x3C00, "1"),
    (0x3F801000, 0x3C00, "1 + 2**-11: tie, to even"),
    (0x3F803000, 0x3C02, "1 + 3 * 2**-11: tie, to even"),
    (0x477FE000, 0x7BFF, "65504, the largest finite"),
    (0x477FEFFF, 0x7BFF, "just below 65520"),
    (0x477FF000, 0x7C00, "65520: tie, to even is inf"),
    (0xC77FF000, 0xFC00, "-65520"),
    (0x7F7FFFFF, 0x7C00, "float32 max"),
    (0xFF7FFFFF, 0xFC00, "-float32 max"),
    (0x38800000, 0x0400, "2**-14, the smallest normal"),
    (0x387FE000, 0x0400, "2**-14 - 2**-25: tie between 0x3FF and 0x400, to even"),
    (0x387FC000, 0x03FF, "the largest subnormal"),
    (0x33800000, 0x0001, "2**-24, the smallest subnormal"),
    (0x33000000, 0x0000, "2**-25: tie, to even is zero"),
    (0xB3000000, 0x8000, "-2**-25: keeps the sign"),
    (0x33000001, 0x0001, "just above 2**-25"),
    (0x33C00000, 0x0002, "3 * 2**-25: tie, to even"),
    (0x34200000, 0x0002, "5 * 2**-25: tie, to even"),
    (0x00000001, 0x0000, "the smallest float32 subnormal"),
    (0x807FFFFF, 0x8000, "the largest negative float32 subnormal"),
    (0x7FC00000, 0x7E00, "quiet NaN"),
    (0xFFC00000, 0xFE00, "negative quiet NaN"),
    (0x7F800001, 0x7E00, "signalling NaN, payload below float16's: made quiet"),
    (0x7FA5A5A5, 0x7F2D, "signalling NaN: quiet, top payload bits kept"),
    (0xFFFFFFFF, 0xFFFF, "all ones"),
]


@pytest.mark.parametrize("u, h, what", F16_EDGES, ids=[e[2] for e in F16_EDGES])
def test_narrow_float16_edges(path, u, h, what):
    # at every position of a 40-value row, so vector bodies and scalar tails both see it
    for pos in (0, 7, 8, 15, 16, 31, 39):
        row = np.full(40, 1.0, dtype=np.float32)
        row.view(np.uint32)[pos] = u
        got = _halfconv.narrow(row, "float16")
        assert hex(got[pos]) == hex(h), (what, pos)
        assert (np.delete(got, pos) == 0x3C00).all()
    check_narrow(np.array([u], dtype=np.uint32), "float16")


# ---------------------------------------------------------------------------
# Narrowing to bfloat16

def bf16_ties():
    """For every bfloat16 pattern: the tie above it, its neighbours, and nearby values."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    return (hi[:, None] | lows[None, :]).ravel()


def test_narrow_bfloat16_every_tie(path):
    u = bf16_ties()
    got = check_narrow(u, "bfloat16")
    # spot checks on the rule itself
    tie = (u & 0xFFFF) == 0x8000
    finite = (u & 0x7F800000) != 0x7F800000
    sel = tie & finite & ((u >> 16) & 1 == 0) & ((u >> 16) != 0x7F7F)
    assert np.array_equal(got[sel], (u[sel] >> 16).astype(np.uint16))  # even: stays


def test_narrow_bfloat16_random_bits(path):
    rng = np.random.default_rng(1603)
    check_narrow(random_bits(rng, 1 << 20), "bfloat16")


def test_narrow_bfloat16_random_subnormals_between_normals(path):
    # float32 subnormals scattered among normal values and NaNs, so that vectors
    # mix lanes the AVX-512 path must correct with lanes it must not touch
    rng = np.random.default_rng(1604)
    u = random_bits_in_exponents(rng, 1 << 18, 1, 254)
    sub = rng.random(u.size) < 0.2
    u[sub] &= 0x807FFFFF
    nan = rng.random(u.size) < 0.05
    u[nan] |= 0x7F800001
    check_narrow(u, "bfloat16")


BF16_EDGES = [
    (0x00000000, 0x0000, "+0"),
    (0x80000000, 0x8000, "-0"),
    (0x7F800000, 0x7F80, "+inf"),
    (0xFF800000, 0xFF80, "-inf"),
    (0x3F800000, 0x3F80, "1"),
    (0x3F808000, 0x3F80, "tie, to even (down)"),
    (0x3F818000, 0x3F82, "tie, to even (up)"),
    (0x3F808001, 0x3F81, "just above a tie"),
    (0x7F7F7FFF, 0x7F7F, "just below the tie under the largest finite"),
    (0x7F7F8000, 0x7F80, "tie above the (odd) largest finite: inf"),
    (0x7F7FFFFF, 0x7F80, "float32 max rounds to inf"),
    (0xFF7FFFFF, 0xFF80, "-float32 max rounds to -inf"),
    (0x00000001, 0x0000, "the smallest float32 subnormal"),
    (0x00008000, 0x0000, "subnormal tie, to even (zero)"),
    (0x00008001, 0x0001, "subnormal just above a tie"),
    (0x00018000, 0x0002, "subnormal tie, to even (up)"),
    (0x007FFFFF, 0x0080, "the largest subnormal rounds up to the smallest normal"),
    (0x807FFFFF, 0x8080, "negative, too"),
    (0x00400000, 0x0040, "an exact subnormal"),
    (0x7FC00000, 0x7FC0, "quiet NaN"),
    (0xFFC00000, 0xFFC0, "negative quiet NaN"),
    (0x7F800001, 0x7FC0, "signalling NaN, payload below bfloat16's: made quiet"),
    (0x7F810000, 0x7FC1, "signalling NaN: quiet, top payload bits kept"),
    (0x7FFFFFFF, 0x7FFF, "NaN whose rounding would carry into the sign"),
    (0xFFFFFFFF, 0xFFFF, "all ones"),
]


@pytest.mark.parametrize("u, h, what", BF16_EDGES, ids=[e[2] for e in BF16_EDGES])
def test_narrow_bfloat16_edges(path, u, h, what):
    for pos in (0, 7, 8, 15, 16, 31, 39):
        row = np.full(40, 1.0, dtype=np.float32)
        row.view(np.uint32)[pos] = u
        got = _halfconv.narrow(row, "bfloat16")
        assert hex(got[pos]) == hex(h), (what, pos)
        assert (np.delete(got, pos) == 0x3F80).all()
    check_narrow(np.array([u], dtype=np.uint32), "bfloat16")


# ---------------------------------------------------------------------------
# The paths against each other; lengths, offsets and shapes

@pytest.mark.parametrize("kind", KINDS)
def test_every_path_gives_the_same_bits(kind):
    if len(SUPPORTED) < 2:
        pytest.skip("only the portable path is available here")
    rng = np.random.default_rng(1605)
    u = np.concatenate([random_bits(rng, 1 << 18), bf16_ties(), f16_ties()])
    h = rng.integers(0, 1 << 16, size=1 << 18, dtype=np.uint32).astype(np.uint16)
    old = _halfconv.set_isa("portable")
    try:
        results = {}
        for name in SUPPORTED:
            _halfconv.set_isa(name)
            results[name] = (_halfconv.narrow(floats(u), kind).tobytes(),
                             _halfconv.widen(h, kind).tobytes())
    finally:
        _halfconv.set_isa(old)
    first = results["portable"]
    for name, res in results.items():
        assert res == first, name


@pytest.mark.parametrize("kind", KINDS)
def test_every_length_and_offset(path, kind):
    # lengths around the vector widths, starting at unaligned addresses: the
    # vector bodies and the scalar tails give the same bits as whole rows
    rng = np.random.default_rng(1606)
    u = random_bits_in_exponents(rng, 200, 100, 150)
    u[::7] = 0x7FA5A5A5
    u[3::11] &= 0x807FFFFF
    f = floats(u)
    h = rng.integers(0, 1 << 16, size=200, dtype=np.uint32).astype(np.uint16)
    narrow_ref = check_narrow(u, kind)
    widen_ref = widen_reference(h, kind)
    for off in (0, 1, 3, 8):
        for n in range(0, 50):
            assert np.array_equal(_halfconv.narrow(f[off:off + n], kind), narrow_ref[off:off + n])
            assert np.array_equal(_halfconv.widen(h[off:off + n], kind).view(np.uint32),
                                  widen_ref[off:off + n])


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_are_kept(path, kind):
    for shape in [(), (0,), (3, 0), (5, 7), (2, 3, 17)]:
        f = np.full(shape, 1.5, dtype=np.float32)
        h = _halfconv.narrow(f, kind)
        assert h.shape == shape and h.dtype == np.uint16
        w = _halfconv.widen(h, kind)
        assert w.shape == shape and w.dtype == np.float32
        assert (w == 1.5).all()


def test_read_only_input_is_fine(path):
    f = np.linspace(-3, 3, 33, dtype=np.float32)
    f.flags.writeable = False
    h = _halfconv.narrow(f, "bfloat16")
    h.flags.writeable = False
    assert np.array_equal(_halfconv.widen(h, "bfloat16"), f.astype(np.float32))


def test_flush_to_zero_and_denormals_are_zero_change_nothing(path):
    # a host (torch.set_flush_denormal, -ffast-math libraries) may set FTZ/DAZ
    # on the thread that calls lorahook; subnormals must still convert exactly
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1607)
    u = np.concatenate([f16_ties(), bf16_ties()[: 6 * 0x100], random_bits(rng, 1 << 16)])
    sub16 = np.arange(0, 0x400, dtype=np.uint16)
    expect = {k: check_narrow(u, k) for k in KINDS}
    expect_w = _halfconv.widen(sub16, "float16").view(np.uint32)
    if not torch.set_flush_denormal(True):
        pytest.skip("torch cannot set flush-denormal on this CPU")
    try:
        got = {k: _halfconv.narrow(floats(u), k) for k in KINDS}
        got_w = _halfconv.widen(sub16, "float16").view(np.uint32)
    finally:
        torch.set_flush_denormal(False)
    for k in KINDS:
        assert np.array_equal(got[k], expect[k]), k
    assert np.array_equal(got_w, expect_w)
    assert (expect_w[1:] != 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_vector_registers_are_left_clean(path, kind):
    # AVX code must end with VZEROUPPER, or every later SSE instruction of the
    # thread (numpy's, the interpreter's) runs several times slower
    dirty = _testing.half_upper_state_after(kind)
    if dirty is None:
        pytest.skip("this CPU cannot report whether the upper register halves are in use")
    assert dirty is False


def test_threads_converting_while_the_path_changes():
    # the path is chosen per call; switching it while other threads convert is
    # harmless because every path gives the same bits
    rng = np.random.default_rng(1608)
    f = floats(random_bits(rng, 1 << 16))
    expect = {k: _halfconv.narrow(f, k) for k in KINDS}
    errors = []
    stop = threading.Event()

    def work():
        try:
            while not stop.is_set():
                for k in KINDS:
                    if not np.array_equal(_halfconv.narrow(f, k), expect[k]):
                        errors.append(k)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    old = _halfconv.set_isa("portable")
    try:
        for t in threads:
            t.start()
        for i in range(200):
            _halfconv.set_isa(SUPPORTED[i % len(SUPPORTED)])
    finally:
        stop.set()
        for t in threads:
            t.join()
        _halfconv.set_isa(old)
    assert errors == []


# ---------------------------------------------------------------------------
# Arguments, path selection, the environment variable

def test_bad_arguments():
    f = np.zeros(4, dtype=np.float32)
    h = np.zeros(4, dtype=np.uint16)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        _halfconv.narrow([1.0, 2.0], "float16")
    with pytest.raises(TypeError, match="float32.*got <f8"):
        _halfconv.narrow(np.zeros(4), "float16")
    with pytest.raises(TypeError, match="float32"):
        _halfconv.narrow(f.astype(">f4"), "float16")
    with pytest.raises(TypeError, match="uint16.*got <f2"):
        _halfconv.widen(np.zeros(4, dtype=np.float16), "float16")
    with pytest.raises(TypeError, match="uint16"):
        _halfconv.widen(h.astype(">u2"), "bfloat16")
    with pytest.raises(ValueError, match="C-contiguous"):
        _halfconv.narrow(np.zeros(8, dtype=np.float32)[::2], "float16")
    with pytest.raises(ValueError, match="C-contiguous"):
        _halfconv.widen(np.zeros((4, 4), dtype=np.uint16).T, "float16")
    with pytest.raises(ValueError, match="'float16' or 'bfloat16'.*'half'"):
        _halfconv.narrow(f, "half")
    with pytest.raises(TypeError, match="'float16' or 'bfloat16'"):
        _halfconv.widen(h, np.float16)
    with pytest.raises(ValueError, match="one of"):
        _halfconv.set_isa("sse")


@pytest.mark.parametrize("kind", KINDS)
def test_repeat_loop_converts_like_the_array_functions(path, kind):
    rng = np.random.default_rng(1609)
    f = floats(random_bits(rng, 1000))
    h = np.empty(1000, dtype=np.uint16)
    w = np.empty(1000, dtype=np.float32)
    _testing.half_repeat(f, h, kind, 3)
    assert np.array_equal(h, _halfconv.narrow(f, kind))
    _testing.half_repeat(h, w, kind, 2)
    assert np.array_equal(w.view(np.uint32), _halfconv.widen(h, kind).view(np.uint32))
    _testing.half_repeat(f[:0], h[:0], kind, 5)
    with pytest.raises(ValueError, match="overlap"):
        _testing.half_repeat(f, f.view(np.uint16)[:1000], kind, 1)
    with pytest.raises(ValueError, match="1000 values"):
        _testing.half_repeat(f, h[:10], kind, 1)
    with pytest.raises(TypeError, match="out must have dtype uint16"):
        _testing.half_repeat(f, w, kind, 1)
    h.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        _testing.half_repeat(f, h, kind, 1)


def test_paths_report():
    info = _halfconv.isas()
    assert info["supported"][0] == "portable"
    assert set(info["supported"]) <= set(PATHS)
    assert info["active"] in info["supported"] and info["best"] == info["supported"][-1]
    assert set(info["needs"]) == set(PATHS)
    assert info["env"] is None or info["env"] in info["supported"]


def test_unsupported_path_is_refused_and_changes_nothing():
    missing = [p for p in PATHS if p not in SUPPORTED]
    if not missing:
        pytest.skip("every instruction set is available here")
    before = _halfconv.isas()["active"]
    with pytest.raises(ValueError, match="not available"):
        _halfconv.set_isa(missing[0])
    assert _halfconv.isas()["active"] == before


def test_set_isa_returns_the_old_target_and_none_is_the_best():
    old = _halfconv.set_isa("portable")
    try:
        assert _halfconv.set_isa(None) == "portable"
        assert _halfconv.isas()["active"] == _halfconv.isas()["best"]
        assert _halfconv.set_isa("portable") == _halfconv.isas()["best"]
        assert _halfconv.isas()["active"] == "portable"
    finally:
        _halfconv.set_isa(old)


@pytest.mark.parametrize("value, old, isa", [(None, None, None), ("", None, None),
                                             (" portable ", None, "portable"),
                                             ("portable", "0", "portable"),
                                             (None, "0", None), ("", "", None),
                                             (None, " 1 ", "portable"), ("", "1", "portable")])
def test_environment_values(value, old, isa, recwarn):
    assert _halfconv.isa_from_env(value, old) == isa
    assert len(recwarn) == 0


def test_every_target_this_cpu_runs_is_a_valid_environment_value(recwarn):
    for name in SUPPORTED:
        assert _halfconv.isa_from_env(name) == name
    assert len(recwarn) == 0


@pytest.mark.parametrize("value", ["yes", "AVX2", "sse", "1"])
def test_invalid_environment_value_warns_and_keeps_the_default(value):
    with pytest.warns(RuntimeWarning, match=r"LORAHOOK_ISA=.*is not one of.*default"):
        assert _halfconv.isa_from_env(value) is None


def test_a_target_this_cpu_lacks_warns_and_keeps_the_default():
    missing = [p for p in PATHS if p not in SUPPORTED]
    if not missing:
        pytest.skip("every instruction set is available here")
    with pytest.warns(RuntimeWarning, match=r"LORAHOOK_ISA=.*not available on this CPU.*default"):
        assert _halfconv.isa_from_env(missing[0]) is None


@pytest.mark.parametrize("old", ["yes", "2", "portable"])
def test_invalid_older_variable_warns_and_keeps_the_default(old):
    with pytest.warns(RuntimeWarning, match=r"LORAHOOK_HALF_PORTABLE=.*default"):
        assert _halfconv.isa_from_env(None, old) is None


def _child(env, code):
    full = dict(os.environ)
    full.pop("LORAHOOK_ISA", None)
    full.pop("LORAHOOK_HALF_PORTABLE", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=120, cwd=os.path.dirname(__file__))


# the target every compiled module reads: halfconv's, the pairs kernel's and the int8 kernel's
_REPORT = ("import sys, lorahook, lorahook._core.halfconv as r; p = r.isas(); "
           "print(p['active'], p['best'], p['env'], 'ml_dtypes' in sys.modules)")


@pytest.mark.parametrize("env", [{"LORAHOOK_ISA": "portable"}, {"LORAHOOK_HALF_PORTABLE": "1"}])
def test_the_environment_chooses_the_target_at_import(env):
    out = _child(env, _REPORT)
    assert out.returncode == 0, out.stderr
    active, best, chosen, ml = out.stdout.split()
    assert (active, chosen, ml) == ("portable", "portable", "False")
    assert "Warning" not in out.stderr


def test_environment_variable_invalid_value_is_a_warning_not_an_error():
    out = _child({"LORAHOOK_ISA": "fast"}, _REPORT)
    assert out.returncode == 0, out.stderr
    active, best, chosen, ml = out.stdout.split()
    assert (active, chosen, ml) == (best, "None", "False")
    assert "RuntimeWarning" in out.stderr and "LORAHOOK_ISA='fast'" in out.stderr
    assert "default" in out.stderr


def test_without_the_variable_the_best_target_is_used():
    out = _child({}, _REPORT)
    assert out.returncode == 0, out.stderr
    active, best, chosen, ml = out.stdout.split()
    assert (active, chosen, ml) == (best, "None", "False")


# ---------------------------------------------------------------------------
# Opt-in: all 2**32 float32 inputs

@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LORAHOOK_HALF_EXHAUSTIVE", "") in ("", "0"),
                    reason="set LORAHOOK_HALF_EXHAUSTIVE=1 to narrow all 2**32 float32 values")
@pytest.mark.parametrize("kind", KINDS)
def test_narrow_every_float32(kind):
    chunk = 1 << 24
    old = _halfconv.set_isa("portable")
    try:
        for start in range(0, 1 << 32, chunk):
            u = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32)
            _halfconv.set_isa("portable")
            ref = check_narrow(u, kind)
            for name in SUPPORTED[1:]:
                _halfconv.set_isa(name)
                assert np.array_equal(_halfconv.narrow(floats(u), kind), ref), (name, hex(start))
    finally:
        _halfconv.set_isa(old)
