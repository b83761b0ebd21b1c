# cython: language_level=3
"""The call checks of the compiled core, run with the GIL before any kernel.

Every entry point into the kernels checks its buffers here first, in this
order: the hook's type; the input's and output's types and dtype; ndim,
contiguity and the output's writability; both widths are ints > 0; each
buffer holds whole rows of its width; the row counts match; a bound hook's
row count; the buffers do not overlap.  A failed check raises before anything
is written, and every message names the argument, what was expected and what
was found.  ``TypeError`` for types and dtypes (and non-integer widths),
``ValueError`` for ndim, contiguity, writability, widths, row counts and
overlapping buffers.
"""
cimport numpy as cnp
from libc.limits cimport INT_MAX

import operator
import sys

import numpy as np

cnp.import_array()


cdef str shape_str(cnp.ndarray arr):
    return str((<object>arr).shape)


# The dtypes rows may have.  bfloat16 is ml_dtypes' numpy dtype, recognised by
# its type number once the caller has imported ml_dtypes (lorahook never
# imports it: that registers a dtype with numpy for the whole process).
cdef int _bf16_typenum = -1
_ROW_DTYPES = "float32, float16 or bfloat16 (ml_dtypes)"


cdef int _bfloat16_typenum():
    global _bf16_typenum
    if _bf16_typenum < 0:
        ml = sys.modules.get("ml_dtypes")
        bf = None if ml is None else getattr(ml, "bfloat16", None)
        if bf is not None:
            _bf16_typenum = np.dtype(bf).num
    return _bf16_typenum


cdef inline int _row_kind(cnp.ndarray a):
    """ROWS_F32 / ROWS_F16 / ROWS_BF16 for a native-order array of that dtype, else -1."""
    cdef int t = cnp.PyArray_TYPE(a)
    if not cnp.PyArray_ISNOTSWAPPED(a):
        return -1
    if t == cnp.NPY_FLOAT32:
        return ROWS_F32
    if t == cnp.NPY_FLOAT16:
        return ROWS_F16
    if t >= 256 and t == _bfloat16_typenum():  # NPY_USERDEF: user dtypes number from 256
        return ROWS_BF16
    return -1


cdef int check_type(object arr, str name, int bits=-1) except -1:
    """The row kind of ``arr``; ``TypeError`` for anything but a native float32/16, bfloat16 array.

    With ``bits`` (a half row kind), native uint16 arrays are taken as the
    16-bit patterns of rows of that kind (how lorahook.torch passes tensors).
    """
    if not cnp.PyArray_Check(arr):
        raise TypeError(
            f"{name} must be a numpy.ndarray of dtype {_ROW_DTYPES}, got {type(arr).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if bits >= 0 and cnp.PyArray_TYPE(a) == cnp.NPY_UINT16 and cnp.PyArray_ISNOTSWAPPED(a):
        return bits
    cdef int kind = _row_kind(a)
    if kind < 0:
        raise TypeError(
            f"{name} must have dtype {_ROW_DTYPES} in native byte order, "
            f"got {a.dtype.str} ({a.dtype})")
    return kind


cdef int check_types(object input, object output, int bits=-1) except -1:
    """Both buffers' types; they must share one dtype.  Returns the row kind."""
    cdef int kx = check_type(input, "input", bits)
    cdef int ky = check_type(output, "output", bits)
    if kx != ky:
        raise TypeError(f"input and output must share one dtype, got input {input.dtype} and "
                        f"output {output.dtype}")
    return kx


cdef int check_layout(cnp.ndarray a, str name, bint writable) except -1:
    cdef int nd = cnp.PyArray_NDIM(a)
    if nd != 1 and nd != 2:
        raise ValueError(
            f"{name} must be 1-D (flattened rows) or 2-D (rows, width), "
            f"got {nd}-D with shape {shape_str(a)}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(
            f"{name} must be C-contiguous, got shape {shape_str(a)} with strides {(<object>a).strides}")
    if writable and not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{name} must be writable, got a read-only array")
    return 0


cdef object as_int(object v, str name):
    """``operator.index(v)`` for integer-like objects other than bool, else TypeError naming ``name``."""
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")


cdef Py_ssize_t as_width(object w, str name) except -1:
    cdef Py_ssize_t v
    if type(w) is not int:
        w = as_int(w, name)
    if w <= 0:
        raise ValueError(f"{name} must be > 0, got {w}")
    if w > INT_MAX:
        raise ValueError(f"{name} must be at most {INT_MAX} (a BLAS int), got {w}")
    v = w
    return v


cdef Py_ssize_t row_count(cnp.ndarray a, Py_ssize_t width, str name, str wname) except -1:
    cdef Py_ssize_t size
    if cnp.PyArray_NDIM(a) == 2:
        if cnp.PyArray_DIM(a, 1) != width:
            raise ValueError(
                f"{name} of shape {shape_str(a)} must have shape[1] == {wname} = {width}, "
                f"got {cnp.PyArray_DIM(a, 1)}")
        return cnp.PyArray_DIM(a, 0)
    size = cnp.PyArray_DIM(a, 0)
    if size % width != 0:
        raise ValueError(
            f"{name} must hold whole rows of {wname} = {width} values, "
            f"got {size} values ({size // width} rows and {size % width} left over)")
    return size // width


cdef bint _extent(cnp.ndarray a, char **lo, char **hi) noexcept:
    """The first and one past the last byte ``a`` spans, from its strides; False when empty."""
    cdef int d
    cdef Py_ssize_t step
    lo[0] = hi[0] = <char *>cnp.PyArray_DATA(a)
    if cnp.PyArray_SIZE(a) == 0:
        return False
    for d in range(cnp.PyArray_NDIM(a)):
        step = (cnp.PyArray_DIM(a, d) - 1) * cnp.PyArray_STRIDE(a, d)
        if step < 0:
            lo[0] += step
        else:
            hi[0] += step
    hi[0] += cnp.PyArray_ITEMSIZE(a)
    return True


cdef int refuse_overlap(cnp.ndarray x, cnp.ndarray y, str xname="input",
                        str yname="output") except -1:
    """``ValueError`` when the memory spans of two buffers (any strides) meet."""
    cdef char *xs
    cdef char *xe
    cdef char *ys
    cdef char *ye
    if _extent(x, &xs, &xe) and _extent(y, &ys, &ye) and xs < ye and ys < xe:
        raise ValueError(
            f"{xname} and {yname} must not overlap in memory, got overlapping buffers "
            f"({xname} {xe - xs} bytes at {<size_t>xs:#x}, {yname} {ye - ys} bytes at "
            f"{<size_t>ys:#x})")
    return 0


cdef object _given_width(cnp.ndarray a, object width, str name):
    """``width``, or for ``None`` the ``shape[1]`` of a 2-D ``a`` (``TypeError`` for 1-D)."""
    if width is not None:
        return width
    if cnp.PyArray_NDIM(a) == 2:
        return cnp.PyArray_DIM(a, 1)
    raise TypeError(f"{name}_row_width is required for a 1-D {name} (it is taken from "
                    f"shape[1] of a 2-D array only), got shape {shape_str(a)}")


cdef Py_ssize_t check_call(object input, object output, object input_row_width,
                            object output_row_width, Py_ssize_t *widths=NULL,
                            int *kind=NULL, int bits=-1, object float32_only=None) except -1:
    """The spec's call checks in order; returns the row count.

    A width of ``None`` is the ``shape[1]`` of its 2-D buffer.

    ``widths``, when given, receives ``(input_row_width, output_row_width)``
    as checked ints; ``kind`` the row kind.  ``float32_only`` names a hook
    that takes float32 rows only (a Python hook): half rows are then a
    ``TypeError``, with the other type checks.
    """
    cdef int k = check_types(input, output, bits)
    if k != ROWS_F32 and float32_only is not None:
        raise TypeError(f"{float32_only} is a Python hook (one apply() per row): it takes "
                        f"float32 rows only, got {input.dtype} rows")
    if kind != NULL:
        kind[0] = k
    cdef cnp.ndarray x = <cnp.ndarray>input
    cdef cnp.ndarray y = <cnp.ndarray>output
    check_layout(x, "input", False)
    check_layout(y, "output", True)
    cdef Py_ssize_t d_in = as_width(_given_width(x, input_row_width, "input"), "input_row_width")
    cdef Py_ssize_t d_out = as_width(_given_width(y, output_row_width, "output"),
                                     "output_row_width")
    cdef Py_ssize_t n_in = row_count(x, d_in, "input", "input_row_width")
    cdef Py_ssize_t n_out = row_count(y, d_out, "output", "output_row_width")
    if n_in != n_out:
        raise ValueError(
            f"input and output row counts must match: input has {n_in} rows of width {d_in}, "
            f"output has {n_out} rows of width {d_out}")
    refuse_overlap(x, y)
    if widths != NULL:
        widths[0] = d_in
        widths[1] = d_out
    return n_in


def check_rows(input, output, input_row_width, output_row_width):
    """Run ``apply_lora_rows``' buffer checks and return the row count."""
    return check_call(input, output, input_row_width, output_row_width)



cdef inline cnp.ndarray _checked_rows_buffer(object arr, Py_ssize_t n, Py_ssize_t width,
                                             str name, bint writable):
    check_type(arr, name)
    cdef cnp.ndarray a = <cnp.ndarray>arr
    check_layout(a, name, writable)
    if (n < 0 or width < 1 or cnp.PyArray_SIZE(a) % width != 0 or cnp.PyArray_SIZE(a) // width != n
            or (cnp.PyArray_NDIM(a) == 2 and cnp.PyArray_DIM(a, 1) != width)):
        raise ValueError(f"{name} must hold {n} rows of width {width}, got shape {shape_str(a)}")
    return a


cdef int check_buffers(object input, object output, Py_ssize_t n,
                                Py_ssize_t d_in, Py_ssize_t d_out) except -1:
    """Check a kernel call's buffers; returns their row kind."""
    cdef int kind = check_types(input, output)
    cdef cnp.ndarray x = _checked_rows_buffer(input, n, d_in, "input", False)
    cdef cnp.ndarray y = _checked_rows_buffer(output, n, d_out, "output", True)
    refuse_overlap(x, y)
    return kind
