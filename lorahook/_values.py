"""Checks and descriptions of single values, shared by every layer of the package.

The one place that says what an integer argument is (:func:`is_int`: an
``Integral`` that is not a ``bool``), what a finite real is
(:func:`finite_real`) and how a value is shown in an error message
(:func:`short`: a bounded repr; :func:`describe`: its type and that repr; neither
ever raises).
"""
import math
import numbers

import numpy as np

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
