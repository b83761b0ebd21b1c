"""Hostile arguments to apply_lora_rows (and the core's entry points): refused, nothing written.

Every bad call must raise ``TypeError`` (wrong type, dtype, non-integer width) or
``ValueError`` (ndim, contiguity, writability, widths, row counts, overlap), before the hook is
asked anything and before a byte of the output changes.
"""
import array
import os
import fractions
import decimal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lorahook import LoraAdapter, LoraHook, LoraLayer, NoopLoraHook, apply_lora_rows
from lorahook._core import plans as _kernels, segments as _segments
from testing_core import core as _testing

D_IN, D_OUT, RANK, N = 6, 5, 3, 4
KEY = (2, "v_proj")


def _layer(d_in=D_IN, d_out=D_OUT, rank=RANK, seed=0):
    rng = np.random.default_rng(seed)
    return LoraLayer(rng.standard_normal((rank, d_in)), rng.standard_normal((d_out, rank)), scale=1.5)


ADAPTER = LoraAdapter({KEY: _layer()})


class SpyHook(LoraHook):
    """A Python hook that records whether it was asked anything."""

    def __init__(self):
        self.asked = []

    def is_active(self, layer_idx, module):
        self.asked.append(("is_active", layer_idx, module))
        return True

    def apply(self, layer_idx, module, x, output):
        self.asked.append(("apply", layer_idx, module))
        output += 1.0


def _hooks():
    from lorahook import AdapterSet
    aset = AdapterSet()
    aset.add("a", ADAPTER)
    return {
        "adapter": ADAPTER,
        "spy": SpyHook(),
        "noop": NoopLoraHook(),
        "bound": aset.bind(["a"] * N),
    }


HOOK_NAMES = ["adapter", "spy", "noop", "bound"]


def good_input(n=N, d=D_IN):
    return np.random.default_rng(1).standard_normal((n, d)).astype(np.float32)


def good_output(n=N, d=D_OUT):
    return np.random.default_rng(2).standard_normal((n, d)).astype(np.float32)


def assert_applied(got, inp, out0):
    """``got`` equals ``out0`` plus ADAPTER's delta for ``inp``, computed in float64."""
    layer = ADAPTER.layers[KEY]
    x = np.asarray(inp, np.float64).reshape(-1, D_IN)
    a, b = layer.a.astype(np.float64), layer.b.astype(np.float64)
    ref = np.asarray(out0, np.float64).reshape(-1, D_OUT) + layer.scale * (x @ a.T @ b.T)
    err = np.max(np.abs(np.asarray(got, np.float64).reshape(ref.shape) - ref))
    assert err <= 1e-5 * np.max(np.abs(ref)), err


def snapshot(arr):
    try:
        return bytes(np.ascontiguousarray(arr).view(np.uint8).reshape(-1))
    except Exception:  # not a numeric ndarray
        return None


def assert_refused(exc_type, hook, inp, out, w_in=D_IN, w_out=D_OUT, layer_idx=KEY[0],
                   module=KEY[1], match=None):
    before_out = snapshot(out)
    before_in = snapshot(inp)
    with pytest.raises(exc_type, match=match) as info:
        apply_lora_rows(hook, layer_idx, module, inp, out, w_in, w_out)
    assert str(info.value), "error message is empty"
    assert snapshot(out) == before_out, "output changed by a refused call"
    assert snapshot(inp) == before_in, "input changed by a refused call"
    if isinstance(hook, SpyHook):
        assert hook.asked == [], "the hook was consulted before the call checks finished"
    return info.value


# --------------------------------------------------------------------------- the hook argument


@pytest.mark.parametrize("hook", [None, object(), "adapter", 3, _layer(), LoraAdapter, SpyHook,
                                  lambda *a: None, {"q": 1}],
                         ids=lambda h: type(h).__name__)
def test_not_a_hook(hook):
    err = assert_refused(TypeError, hook, good_input(), good_output())
    assert "hook" in str(err)


def test_bad_hook_checked_before_bad_buffers():
    with pytest.raises(TypeError, match="hook"):
        apply_lora_rows(None, 0, "q_proj", "not an array", None, -1, 0)


# --------------------------------------------------------------------------- buffer types / dtypes


BAD_DTYPES = [np.float64, np.float16, np.int32, np.int64, np.uint8, np.complex64, np.bool_,
              ">f4", object]


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
@pytest.mark.parametrize("which", ["input", "output"])
def test_wrong_dtype(hook_name, dtype, which):
    hook = _hooks()[hook_name]
    inp, out = good_input(), good_output()
    if which == "input":
        inp = inp.astype(dtype)
    else:
        out = out.astype(dtype)
    err = assert_refused(TypeError, hook, inp, out)
    assert which in str(err) and "float32" in str(err)


def test_big_endian_float32_is_named():
    out = good_output().astype(">f4")
    err = assert_refused(TypeError, ADAPTER, good_input(), out)
    assert "native byte order" in str(err) and ">f4" in str(err)


NOT_ARRAYS = [
    lambda a: a.tolist(),
    lambda a: memoryview(a),
    lambda a: bytearray(a.tobytes()),
    lambda a: array.array("f", a.reshape(-1).tolist()),
    lambda a: None,
    lambda a: 1.0,
    lambda a: "rows",
]


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("make", NOT_ARRAYS, ids=["list", "memoryview", "bytearray", "array",
                                                  "None", "float", "str"])
@pytest.mark.parametrize("which", ["input", "output"])
def test_not_an_ndarray(hook_name, make, which):
    hook = _hooks()[hook_name]
    inp, out = good_input(), good_output()
    keep = out
    if which == "input":
        inp = make(inp)
    else:
        out = make(out)
    before = snapshot(keep)
    with pytest.raises(TypeError, match=which):
        apply_lora_rows(hook, KEY[0], KEY[1], inp, out, D_IN, D_OUT)
    assert snapshot(keep) == before


def test_torch_tensor_refused():
    torch = pytest.importorskip("torch")
    out = torch.zeros(N, D_OUT)
    with pytest.raises(TypeError, match="output"):
        apply_lora_rows(ADAPTER, KEY[0], KEY[1], good_input(), out, D_IN, D_OUT)
    assert not out.any()


# --------------------------------------------------------------------------- ndim, layout, flags


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("which", ["input", "output"])
@pytest.mark.parametrize("shape", ["0d", "3d", "4d"])
def test_wrong_ndim(hook_name, which, shape):
    hook = _hooks()[hook_name]
    inp, out = good_input(), good_output()
    def reshape(a, d):
        if shape == "0d":
            return np.array(a.reshape(-1)[0], dtype=np.float32)
        if shape == "3d":
            return a.reshape(N, 1, d)
        return a.reshape(1, N, 1, d)
    if which == "input":
        inp = reshape(inp, D_IN)
    else:
        out = reshape(out, D_OUT)
    err = assert_refused(ValueError, hook, inp, out)
    assert which in str(err)


def _strided(a):
    big = np.zeros((a.shape[0], 2 * a.shape[1]), dtype=np.float32)
    big[:, ::2] = a
    return big[:, ::2]


LAYOUTS = {
    "strided_2d": _strided,
    "strided_1d": lambda a: np.repeat(a.reshape(-1), 2)[::2],
    "fortran_2d": lambda a: np.asfortranarray(a),
    "reversed_1d": lambda a: a.reshape(-1)[::-1],
    "row_step": lambda a: np.repeat(a, 2, axis=0)[::2],
}


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("which", ["input", "output"])
def test_non_contiguous(hook_name, layout, which):
    hook = _hooks()[hook_name]
    inp, out = good_input(), good_output()
    if which == "input":
        inp = LAYOUTS[layout](inp)
        assert not inp.flags.c_contiguous
    else:
        out = LAYOUTS[layout](out)
        assert not out.flags.c_contiguous
    err = assert_refused(ValueError, hook, inp, out)
    assert "contiguous" in str(err)


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_read_only_output(hook_name):
    out = good_output()
    out.flags.writeable = False
    err = assert_refused(ValueError, _hooks()[hook_name], good_input(), out)
    assert "writable" in str(err)


def test_read_only_output_from_bytes():
    out = np.frombuffer(good_output().tobytes(), dtype=np.float32)
    assert_refused(ValueError, ADAPTER, good_input(), out)


def test_read_only_input_is_fine():
    inp = good_input()
    inp.flags.writeable = False
    out = good_output()
    apply_lora_rows(ADAPTER, KEY[0], KEY[1], inp, out, D_IN, D_OUT)
    assert_applied(out, inp, good_output())


# --------------------------------------------------------------------------- widths


BAD_WIDTH_VALUES = [0, -1, -6, -(2**63), 2**31, 2**40, 2**63, 2**64 + 6, 10**30]
BAD_WIDTH_TYPES = [6.0, True, False, "6", b"6", np.float32(6), np.float64(6.0), 6 + 0j,
                   fractions.Fraction(6), decimal.Decimal(6), [6],
                   pytest.param(np.array([6]), id="ndarray-1d"),
                   pytest.param(np.array([[6]]), id="ndarray-2d")]


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("value", BAD_WIDTH_VALUES)
@pytest.mark.parametrize("which", ["input_row_width", "output_row_width"])
def test_bad_width_values(hook_name, value, which):
    kwargs = {"w_in": value} if which == "input_row_width" else {"w_out": value}
    err = assert_refused(ValueError, _hooks()[hook_name], good_input(), good_output(), **kwargs)
    assert which in str(err)


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("value", BAD_WIDTH_TYPES, ids=lambda v: f"{type(v).__name__}-{v!r}")
@pytest.mark.parametrize("which", ["input_row_width", "output_row_width"])
def test_bad_width_types(hook_name, value, which):
    kwargs = {"w_in": value} if which == "input_row_width" else {"w_out": value}
    err = assert_refused(TypeError, _hooks()[hook_name], good_input(), good_output(), **kwargs)
    assert which in str(err)


@pytest.mark.parametrize("hook_name", ["adapter", "bound"])
def test_widths_taken_from_two_d_arrays(hook_name):
    hook = _hooks()[hook_name]
    inp = good_input()
    for widths in ((), (D_IN,)):  # both left out, or the output's alone
        got = good_output()
        apply_lora_rows(hook, KEY[0], KEY[1], inp, got, *widths)
        assert_applied(got, inp, good_output())


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_widths_left_out_need_two_d_arrays_and_given_ones_are_checked(hook_name):
    hook = _hooks()[hook_name]
    err = assert_refused(TypeError, hook, good_input().ravel(), good_output(), w_in=None,
                         w_out=None)
    assert "input_row_width is required for a 1-D input" in str(err)
    err = assert_refused(TypeError, hook, good_input(), good_output().ravel(), w_in=None,
                         w_out=None)
    assert "output_row_width is required for a 1-D output" in str(err)
    err = assert_refused(ValueError, hook, good_input(), good_output(), w_in=None, w_out=D_OUT + 1)
    assert "output_row_width" in str(err) and str(D_OUT + 1) in str(err)


@pytest.mark.parametrize("int_type", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32,
                                      np.uint64, np.intp])
def test_numpy_integer_widths_accepted(int_type):
    inp, out = good_input(), good_output()
    ref = good_output().copy()
    apply_lora_rows(ADAPTER, KEY[0], KEY[1], inp, out, int_type(D_IN), int_type(D_OUT))
    exp = good_output()
    apply_lora_rows(ADAPTER, KEY[0], KEY[1], inp, exp, D_IN, D_OUT)
    assert np.array_equal(out, exp) and not np.array_equal(out, ref)


# --------------------------------------------------------------------------- row counts


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("case", ["partial_in", "partial_out", "mismatch", "shape1_in",
                                  "shape1_out", "one_d_mismatch", "empty_vs_rows"])
def test_row_counts(hook_name, case):
    inp, out = good_input(), good_output()
    if case == "partial_in":
        inp = inp.reshape(-1)[:-1].copy()
    elif case == "partial_out":
        out = np.ascontiguousarray(out.reshape(-1)[: D_OUT * N - 2])
    elif case == "mismatch":
        out = good_output(N + 1)
    elif case == "shape1_in":
        inp = good_input(N, D_IN + 1)
    elif case == "shape1_out":
        out = good_output(N, D_OUT - 1)
    elif case == "one_d_mismatch":
        inp = good_input(N - 1).reshape(-1)
    else:
        inp = np.zeros((0, D_IN), dtype=np.float32)
    assert_refused(ValueError, _hooks()[hook_name], inp, out)


def test_widths_that_swap_roles_refused():
    inp = np.zeros(D_IN * D_OUT, dtype=np.float32)
    out = np.ones(D_IN * D_OUT, dtype=np.float32)
    assert_refused(ValueError, SpyHook(), inp, out)


def test_bound_hook_row_count():
    hooks = _hooks()
    bound = hooks["bound"]
    for n in (N - 1, N + 1, 0):
        assert_refused(ValueError, bound, good_input(n), good_output(n), match="bound")


# --------------------------------------------------------------------------- overlap


@pytest.mark.parametrize("hook_name", ["adapter", "spy", "bound"])
@pytest.mark.parametrize("shift", [0, 1, D_IN, N * D_OUT - 1, -(N * D_IN - 1)])
def test_overlapping_input_and_output(hook_name, shift):
    size_in, size_out = N * D_IN, N * D_OUT
    buf = np.random.default_rng(5).standard_normal(3 * (size_in + size_out)).astype(np.float32)
    base = size_in + size_out
    out = buf[base:base + size_out]
    inp = buf[base + shift:base + shift + size_in]
    before = buf.tobytes()
    hook = _hooks()[hook_name]
    with pytest.raises(ValueError, match="overlap"):
        apply_lora_rows(hook, KEY[0], KEY[1], inp, out, D_IN, D_OUT)
    assert buf.tobytes() == before


def test_same_array_as_input_and_output():
    buf = np.ones((N, D_IN), dtype=np.float32)
    before = buf.tobytes()
    ad = LoraAdapter({KEY: _layer(D_IN, D_IN)})
    with pytest.raises(ValueError, match="overlap"):
        apply_lora_rows(ad, KEY[0], KEY[1], buf, buf, D_IN, D_IN)
    ro = buf.view()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="overlap"):
        apply_lora_rows(ad, KEY[0], KEY[1], ro, buf, D_IN, D_IN)
    assert buf.tobytes() == before


def test_adjacent_buffers_are_fine():
    buf = np.zeros(N * D_IN + N * D_OUT, dtype=np.float32)
    inp = buf[:N * D_IN]
    inp[:] = 1.0
    out = buf[N * D_IN:]
    apply_lora_rows(ADAPTER, KEY[0], KEY[1], inp, out, D_IN, D_OUT)
    assert_applied(out, np.ones(N * D_IN), np.zeros(N * D_OUT))


# --------------------------------------------------------------------------- layer_idx / module


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
@pytest.mark.parametrize("layer_idx,module,exc", [
    ("2", "v_proj", TypeError), (2.0, "v_proj", TypeError),
    (True, "v_proj", TypeError), ((2,), "v_proj", TypeError), (-1, "v_proj", ValueError),
    (2, b"v_proj", TypeError), (2, None, TypeError), (2, 3, TypeError), (2, ["v_proj"], TypeError),
])
def test_bad_layer_idx_and_module(hook_name, layer_idx, module, exc):
    assert_refused(exc, _hooks()[hook_name], good_input(), good_output(), layer_idx=layer_idx,
                   module=module)


def test_none_layer_idx_is_a_model_level_key():
    # layer_idx=None addresses model-level modules (lm_head, embeddings, heads): a valid
    # key the adapter does not hold, so nothing is written
    out = good_output()
    before = out.copy()
    apply_lora_rows(ADAPTER, None, KEY[1], good_input(), out, D_IN, D_OUT)
    assert np.array_equal(out, before)


def test_numpy_layer_idx_accepted():
    a, b = good_output(), good_output()
    apply_lora_rows(ADAPTER, np.int64(KEY[0]), KEY[1], good_input(), a, D_IN, D_OUT)
    apply_lora_rows(ADAPTER, KEY[0], KEY[1], good_input(), b, D_IN, D_OUT)
    assert np.array_equal(a, b)
    assert_applied(a, good_input(), good_output())


# --------------------------------------------------------------------------- layer geometry


@pytest.mark.parametrize("widths", [(D_IN + 1, D_OUT), (D_IN, D_OUT + 1), (D_OUT, D_IN), (1, 1)])
@pytest.mark.parametrize("hook_name", ["adapter", "bound_fresh"])
def test_layer_shape_must_match_widths(widths, hook_name):
    w_in, w_out = widths
    inp = np.ones((N, w_in), dtype=np.float32)
    out = np.ones((N, w_out), dtype=np.float32)
    if hook_name == "adapter":
        hook = ADAPTER
    else:
        from lorahook import AdapterSet
        aset = AdapterSet()
        aset.add("a", ADAPTER)
        hook = aset.bind(["a", None, "a", "a"])
    err = assert_refused(ValueError, hook, inp, out, w_in=w_in, w_out=w_out)
    assert str(D_IN) in str(err) and str(D_OUT) in str(err)


@pytest.mark.parametrize("shape", [(D_IN - 1, D_OUT), (D_IN, D_OUT + 1), (2 * D_IN, D_OUT)])
def test_adapter_apply_one_row_checks_lengths(shape):
    x = np.ones(shape[0], dtype=np.float32)
    out = np.ones(shape[1], dtype=np.float32)
    before = out.tobytes()
    with pytest.raises(ValueError):
        ADAPTER.apply(KEY[0], KEY[1], x, out)
    assert out.tobytes() == before


def test_bound_apply_is_a_type_error():
    with pytest.raises(TypeError, match="apply_lora_rows"):
        _hooks()["bound"].apply(KEY[0], KEY[1], np.ones(D_IN, np.float32), np.ones(D_OUT, np.float32))


# --------------------------------------------------------------------------- the core's own entry points


def test_apply_layer_refuses_bad_row_counts():
    k = _layer()._kernel
    e = np.zeros(0, dtype=np.float32)
    for n in (-1, 1, 2**62, 2**61 + 1):
        out = e.copy()
        with pytest.raises((ValueError, OverflowError)):
            _kernels.apply_layer(k, e, out, n)
    out = good_output()
    before = out.tobytes()
    with pytest.raises(ValueError):
        _kernels.apply_layer(k, good_input(), out, N + 1)
    assert out.tobytes() == before


def test_huge_row_count_with_empty_buffers_does_not_crash():
    """A row count whose product with the width wraps must be refused (in a child, in case it crashes)."""
    code = textwrap.dedent("""
        import numpy as np
        from lorahook import LoraLayer
        from lorahook._core import plans as _kernels
        from testing_core import core as _testing
        k = LoraLayer(np.ones((2, 4), np.float32), np.ones((4, 2), np.float32))._kernel
        e = np.zeros(0, np.float32)
        for n in (2**62, 2**63 - 1, 2**62 + 2**61):
            try:
                _kernels.apply_layer(k, e, e.copy(), n)
            except (ValueError, OverflowError):
                pass
            else:
                raise SystemExit("accepted n=%d" % n)
            try:
                _testing.apply_groups([(k, 1.0, None, None)], e, e.copy(), n, 4, 4)
            except (ValueError, OverflowError):
                pass
            else:
                raise SystemExit("apply_groups accepted n=%d" % n)
        for d in (0, -4):
            try:
                _testing.apply_groups([(k, 1.0, None, None)], e, e.copy(), 3, d, d)
            except (ValueError, ZeroDivisionError):
                pass
            else:
                raise SystemExit("apply_groups accepted width %d" % d)
        print("ok")
    """)
    # run where the tests' compiled entry points are importable (tests/support)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("rows,rs,exc", [
    (np.array([0, 0], np.int32), None, ValueError),
    (np.array([2, 1], np.int32), None, ValueError),
    (np.array([-1], np.int32), None, ValueError),
    (np.array([N], np.int32), None, ValueError),
    (np.array([2**31 - 1], np.int32), None, ValueError),
    (np.array([0, 1], np.int64), None, TypeError),
    (np.array([[0, 1]], np.int32), None, TypeError),
    (np.array([0, 1], np.int32), np.ones(3, np.float32), TypeError),
    (np.array([0, 1], np.int32), np.ones(2, np.float64), TypeError),
    (None, np.ones(N - 1, np.float32), TypeError),
    ([0, 1], None, TypeError),
])
def test_apply_groups_refuses_bad_rows(rows, rs, exc):
    k = _layer()._kernel
    good = (k, 1.0, np.array([1], np.int32), None)
    out = good_output()
    before = out.tobytes()
    with pytest.raises(exc):
        _testing.apply_groups([good, (k, 1.0, rows, rs)], good_input(), out, N, D_IN, D_OUT)
    assert out.tobytes() == before, "an earlier valid group was applied before a later one was refused"


def test_apply_groups_wrong_layer_shape():
    out = good_output()
    before = out.tobytes()
    with pytest.raises(ValueError):
        _testing.apply_groups([(_layer(D_IN + 1)._kernel, 1.0, None, None)],
                           good_input(), out, N, D_IN, D_OUT)
    with pytest.raises(TypeError):
        _testing.apply_groups([("not a kernel", 1.0, None, None)], good_input(), out, N, D_IN, D_OUT)
    assert out.tobytes() == before


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8", None, 2**40])
def test_set_gemm_crossover_refuses(value):
    old = _segments.get_gemm_crossover()
    with pytest.raises((TypeError, ValueError)):
        _segments.set_gemm_crossover(value)
    assert _segments.get_gemm_crossover() == old


def test_apply_groups_is_safe_against_callbacks_that_change_its_arguments():
    """A scale's __float__ that rewrites rows, empties the group list or frees layers cannot
    make the kernel write out of bounds or read freed memory (run in a child: a crash fails)."""
    code = textwrap.dedent("""
        import gc
        import numpy as np
        from lorahook._core import plans as _kernels, segments as _segments
        from testing_core import core as _testing
        x = np.ones((4, 8), np.float32)
        k = _kernels.LayerKernel(np.ones((2, 8), np.float32), np.ones((2, 8), np.float32), 1.0)
        rows = np.array([0, 1], np.int32)
        groups = []

        class Rewrite:
            def __float__(self):
                rows[1] = 10_000_000
                groups.clear()
                gc.collect()
                return 1.0

        _segments.set_gemm_crossover(1)
        for layer in (k, _kernels.LayerKernel(np.ones((2, 8), np.float32), np.ones((2, 8), np.float32), 1.0)):
            y = np.zeros((4, 8), np.float32)
            groups[:] = [(layer, 1.0, rows, None), (layer, Rewrite(), None, None)]
            layer = None
            _testing.apply_groups(groups, x, y, 4, 8, 8)
            # rows were taken as they were when the call started: 0 and 1 get both groups
            assert (y[:2] == 32).all() and (y[2:] == 16).all(), y
            rows[1] = 1
        print("ok")
    """)
    # run where the tests' compiled entry points are importable (tests/support)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
