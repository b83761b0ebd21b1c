"""Checks of values and arrays, shared by every layer of the package.

Single values: the one place that says what an integer argument is (:func:`is_int`: an
``Integral`` that is not a ``bool``), what a finite real is
(:func:`finite_real`) and how a value is shown in an error message
(:func:`short`: a bounded repr; :func:`describe`: its type and that repr; neither
ever raises).  Arrays: every array an adapter keeps is a read-only, native,
C-contiguous copy made once here (or adopted as it is when it already is
one); DoRA's base terms are computed here from a layer's factors and its base
weight.
"""

import math
import numbers
import sys

import numpy as np

from ._core.halfconv import narrow, widen

__all__ = ["is_int", "short", "describe", "finite_real"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_int(value):
    """Whether ``value`` is an integer: a ``numbers.Integral`` that is not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def short(value, limit=200):
    """A bounded repr of ``value`` for an error message; never raises.

    A huge integer is given by its bit length, a repr that fails by a phrase,
    and a long one is cut to ``limit`` characters.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() >= 1000:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:
        return f"a {type(value).__name__} that cannot be shown"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(value, limit=80):
    """``"type (bounded repr)"``: what an error message says it found."""
    return f"{type(value).__name__} ({short(value, limit)})"


def finite_real(value, what, *, float32=False, type_error=TypeError, value_error=ValueError):
    """``value`` as a finite ``float``, or an error naming ``what``.

    A real number (numpy scalars and 0-d arrays included; ``bool`` refused)
    that is finite, and with ``float32`` one that fits in float32.  The
    exception classes can be chosen (a file reader raises its format error).
    """
    if type(value) is float and math.isfinite(value) and not float32:
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise type_error(f"{what} must be a real number, got {describe(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        shown = number if not isinstance(value, int) else describe(value)
        raise value_error(f"{what} must be finite, got {shown}")
    if float32 and abs(number) > _FLOAT32_MAX:
        raise value_error(
            f"{what} must fit in float32 (|{what}| <= {_FLOAT32_MAX:.7g}), got {number}")
    return number


def key_order(key):
    """Sort key of ``(layer_idx, module)`` keys: layers in order, model-level (``None``) last."""
    layer_idx, module = key
    return (layer_idx is None, -1 if layer_idx is None else layer_idx, module)


# ----------------------------------------------------------------------------
# arrays: the checks and copies of what adapter layers and saved modules keep
# ----------------------------------------------------------------------------
INT_MAX = 2**31 - 1


def finite_scale(value, name):
    """A scale or weight: a finite real that fits in float32."""
    return finite_real(value, name, float32=True)


WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "int8")
INT8 = np.dtype(np.int8)
_WEIGHT_NAMES = "float32, float16, bfloat16 or int8"


def weight_dtype(dtype):
    """The numpy dtype for ``float32`` / ``float16`` / ``bfloat16`` (ml_dtypes) / ``int8``; TypeError otherwise."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        ml = sys.modules.get("ml_dtypes")
        if ml is None:
            raise TypeError("dtype 'bfloat16' means ml_dtypes.bfloat16: import ml_dtypes first "
                            "(lorahook never imports it) or pass ml_dtypes.bfloat16")
        dtype = ml.bfloat16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be {_WEIGHT_NAMES}, got {dtype!r}") from None
    if dt.name not in WEIGHT_DTYPES or not dt.isnative or (dt.name == "bfloat16" and dt.num < 256):
        raise TypeError(f"dtype must be {_WEIGHT_NAMES}, got {dt}")
    return dt


def as_float32(arr):
    """A float32 array of ``arr``'s float values (``arr`` itself when it is float32); exact.

    int8 factors are not values on their own (they go with their scales):
    :func:`dequantized` reads them.
    """
    if arr.dtype == np.float32:
        return arr
    if arr.dtype == INT8:
        raise TypeError("int8 factors need their scales: dequantize them with their layer")
    return widen(np.ascontiguousarray(arr).view(np.uint16), arr.dtype.name)


def quantized(values, axis):
    """``values`` (2-D, float32) in int8 with a float32 scale per slice along ``axis``.

    Symmetric, round to nearest (ties to even): the scale of a slice is its
    largest magnitude over 127 and ``q = rint(v / scale)``, computed in float64
    and kept in ``[-127, 127]``.  A slice whose scale is zero in float32 (all
    zeros, or every magnitude below about ``1.8e-43``) is all zeros with scale
    zero.  ``axis=1``: one scale per row (``A``); ``axis=0``: one per column
    (``B^T``, one per output).  Returns read-only ``(q, scale)``.
    """
    v = np.asarray(values, dtype=np.float64)
    n = v.shape[1 - axis]
    peak = np.abs(v).max(axis=axis) if v.shape[axis] else np.zeros(n)
    scale = (peak / 127.0).astype(np.float32)
    s64 = np.expand_dims(scale.astype(np.float64), axis)
    q = np.where(s64 > 0, np.rint(v / np.where(s64 > 0, s64, 1.0)), 0.0)
    q = np.ascontiguousarray(np.clip(q, -127, 127).astype(np.int8))
    for arr in (q, scale):
        arr.flags.writeable = False
    return q, scale


def dequantized(q, scale, axis):
    """The float32 values of int8 ``q`` with ``scale`` per slice along ``axis`` (:func:`quantized`).

    Each value is ``q * scale`` computed in float64 and rounded once to float32.
    """
    out = q.astype(np.float64) * np.expand_dims(scale.astype(np.float64), axis)
    return out.astype(np.float32)


def check_int8_scales(a, bt, scales, name="int8 scales"):
    """The scales of int8 factors: float32 ``(rank,)`` and ``(d_out,)``, finite and >= 0."""
    if not isinstance(scales, tuple) or len(scales) != 2:
        raise TypeError(f"{name} must be a pair of arrays (per row of a, per output)")
    for what, arr, n in zip(("a", "b"), scales, (a.shape[0], bt.shape[1])):
        adoptable(arr, f"{what}'s {name}", 1)
        if arr.shape != (n,):
            raise ValueError(f"{what}'s {name} must have shape ({n},), got {arr.shape}")
        if not (np.isfinite(arr).all() and (arr >= 0).all()):
            raise ValueError(f"{what}'s {name} must be finite and >= 0, got "
                             f"{int(np.count_nonzero(~(np.isfinite(arr) & (arr >= 0))))} "
                             f"that are not")


def rounded(arr32, dt):
    """``arr32`` rounded to nearest even in ``dt`` (float16 / bfloat16), read-only."""
    out = narrow(np.ascontiguousarray(arr32, dtype=np.float32), dt.name).view(dt)
    out.flags.writeable = False
    return out


def owned_float32(value, name, ndim, transpose=False):
    """Copy ``value`` (transposed, with ``transpose``) once into a read-only float32 C-contiguous array."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu" or arr.dtype.kind == "b":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {arr.ndim}-D with shape {arr.shape}")
    if any(d > INT_MAX for d in arr.shape):
        raise ValueError(f"{name} dimensions must each be at most {INT_MAX}, got {arr.shape}")
    with np.errstate(over="ignore"):
        out = np.array(arr.T if transpose else arr, dtype=np.float32, order="C", copy=True)
    if not np.isfinite(out).all():
        bad = int(np.size(out) - np.count_nonzero(np.isfinite(out)))
        raise ValueError(
            f"{name} must hold only finite float32 values, got {bad} non-finite "
            f"(NaN, Inf, or out of float32 range)")
    out.flags.writeable = False
    return out


def check_factor_shapes(a, bt):
    if a.shape[0] != bt.shape[0]:
        raise ValueError(
            f"ranks disagree: a has shape {a.shape} (rank {a.shape[0]}), "
            f"b has shape {bt.T.shape} (rank {bt.shape[0]})")
    if a.shape[1] < 1 or bt.shape[1] < 1:
        raise ValueError(
            f"d_in and d_out must be >= 1, got a of shape {a.shape} and b of shape {bt.T.shape}")


def check_bias_shape(a, bt, bias):
    if bias.shape[0] != bt.shape[1]:
        raise ValueError(
            f"bias must have shape ({bt.shape[1]},) to match b's d_out, got {bias.shape}")
    if a.shape[0] == 0:
        raise ValueError("a rank-0 layer cannot carry a bias")


FLOAT32 = np.dtype(np.float32)  # native byte order: equal to no other byte order


def adoptable(arr, name, ndim, dtype=FLOAT32):
    """Check an array a layer may keep as it is: ``dtype`` (native), C-contiguous, read-only."""
    if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
        raise TypeError(f"{name} must be a native {dtype} ndarray, got {type(arr).__name__} "
                        f"{getattr(arr, 'dtype', '')}")
    flags = arr.flags
    if arr.ndim != ndim or not flags.c_contiguous or flags.writeable:
        raise ValueError(f"{name} must be a read-only C-contiguous {ndim}-D array, got "
                         f"{arr.ndim}-D with shape {arr.shape}, c_contiguous={flags.c_contiguous}, "
                         f"writeable={flags.writeable}")
    if max(arr.shape) > INT_MAX:
        raise ValueError(f"{name} dimensions must each be at most {INT_MAX}, got {arr.shape}")


def owned_vector(value, name, length, where):
    """A read-only float32 copy of a finite 1-D ``value`` of ``length`` values."""
    out = owned_float32(value, f"{where}{name}", 1)
    if out.shape != (length,):
        raise ValueError(f"{where}{name} must have shape ({length},), got {out.shape}")
    return out


def dora_terms(a, bt, scale, magnitude, weight, base_bias, where):
    """DoRA's per-row factors for one layer, from its base weight.

    ``g = m / ||W + scale * B @ A||`` (each output row's norm over ``d_in``,
    computed in float64), ``c = (1 - g) * b`` and ``g * B^T`` (the factor the
    kernels use: ``g * (y - b + delta) + b == g * y + c + scale * (g B)(A x)``).
    """
    d_out, d_in = bt.shape[1], a.shape[1]
    w = np.asarray(weight)
    if w.dtype.kind not in "fiu" or w.dtype.kind == "b":
        raise TypeError(f"{where}base weight must hold real numbers, got dtype {w.dtype}")
    if w.shape != (d_out, d_in):
        raise ValueError(f"{where}base weight must have shape (d_out, d_in) = {(d_out, d_in)}, "
                         f"got {w.shape}")
    a64 = as_float32(a).astype(np.float64)
    b64 = as_float32(bt).astype(np.float64).T
    full = w.astype(np.float64) + float(np.float32(scale)) * (b64 @ a64)
    if not np.isfinite(full).all():
        raise ValueError(f"{where}base weight must hold finite values")
    norm = np.sqrt(np.einsum("ij,ij->i", full, full))
    if not (norm > 0).all():
        raise ValueError(f"{where}the adapted weight has a zero row (output "
                         f"{int(np.argmin(norm))}): DoRA's norm would divide by zero")
    g = (magnitude.astype(np.float64) / norm).astype(np.float32)
    if base_bias is None:
        c = np.zeros(d_out, dtype=np.float32)
    else:
        b = owned_vector(base_bias, "base bias", d_out, where)
        c = ((1.0 - g.astype(np.float64)) * b.astype(np.float64)).astype(np.float32)
    if not (np.isfinite(g).all() and np.isfinite(c).all()):
        raise ValueError(f"{where}DoRA's norm factor overflows float32")
    gbt = np.ascontiguousarray(as_float32(bt) * g[None, :], dtype=np.float32)
    a32 = as_float32(a)
    for arr in (g, c, gbt):
        arr.flags.writeable = False
    return g, c, gbt, a32


