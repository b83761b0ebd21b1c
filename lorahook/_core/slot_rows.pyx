# cython: language_level=3
"""LoRA over stacked slot weights: the layout serving engines keep their adapters in.

An engine that serves many adapters at once keeps, for every projection, one
tensor per factor holding every adapter slot: ``A`` stacked as
``(slots, rank, d_in)`` and ``B`` as ``(slots, d_out, rank)`` (both the PEFT
layout of one adapter, row-major, one after the other), and tells which slot
each row of a step uses.  This module runs lorahook's kernels on those
tensors as they are, with no copy of any weight per row:

* :class:`SlotRows` is the grouping of one step's rows by slot, computed once
  per step (a counting sort of the rows; a row of slot ``-1`` has no adapter);
* :func:`apply_slots` adds, for every row ``r`` of slot ``s``,
  ``scale * B[s] @ (A[s] @ x[r])`` to ``y[r]`` -- or, with one factor only,
  ``scale * A[s] @ x[r]`` (the shrink of a split product) or
  ``scale * B[s] @ x[r]`` (its expand) -- per slot, as two matrix products
  over that slot's rows (:c:func:`~lorahook._core.gemm_rows.gemm_rows`).

``lorahook._core.slot_pairs`` runs a projection's pairs in the rows' own dtype on
an OpenMP team over the same :class:`SlotRows`.

Rows with no slot are never read or written.  Rows, ``x`` and ``y``, may be
views with a row stride (a slice of columns of a wider output); weights must
be C-contiguous.  Any of them may hold float32, or float16 / bfloat16 as
16-bit patterns (uint16 arrays, read as ``half``); every product runs in
float32 and a 16-bit output row is rounded once, to nearest even.  The
checks run with the GIL, before anything is written; the kernel runs with
the GIL released, on the calling thread.  This module knows rows, slots and
factors, never an engine.
"""
cimport cython
cimport numpy as cnp
from libc.limits cimport INT_MAX
from libc.stdint cimport uint16_t
from libc.stdlib cimport free

from lorahook._core.checks cimport ROWS_BF16, ROWS_F16, ROWS_F32, check_type, refuse_overlap
from lorahook._core.halfconv cimport isa_cell, lh_isa_attach, widen_h
from lorahook._core.gemm_rows cimport LH_SCRATCH_WEIGHTS, PRE_NONE, Segment, gemm_rows, half_of
from lorahook._core.gemm_rows cimport lorahook_scratch_area

import numpy as np

cnp.import_array()
lh_isa_attach(isa_cell())  # the process's instruction-set target (isa.h)

@cython.final
@cython.auto_pickle(False)
cdef class SlotRows:
    """The rows of one step grouped by adapter slot, made once and never changed.

    ``SlotRows(slots, n_slots)``: ``slots`` is a 1-D integer array (any
    integer dtype) with one entry per row, a slot in ``[0, n_slots)`` or
    ``-1`` for a row without an adapter.  Any other value is a
    ``ValueError`` naming the row.  The rows of each slot are kept in
    ascending order.  A ``SlotRows`` may be used from several threads.
    """
    def __cinit__(self, slots, Py_ssize_t n_slots):
        if n_slots < 0 or n_slots > INT_MAX:
            raise ValueError(f"n_slots must be in [0, {INT_MAX}], got {n_slots}")
        arr = np.asarray(slots)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"slots must be a 1-D integer array, got {arr.ndim}-D {arr.dtype}")
        if arr.shape[0] > INT_MAX:
            raise ValueError(f"slots must have at most {INT_MAX} rows, got {arr.shape[0]}")
        cdef cnp.ndarray[cnp.int64_t, ndim=1] s = np.array(arr, dtype=np.int64, copy=True)
        cdef Py_ssize_t n = s.shape[0], i, v
        cdef cnp.ndarray[cnp.intp_t, ndim=1] starts = np.zeros(n_slots + 1, dtype=np.intp)
        cdef cnp.ndarray[cnp.int32_t, ndim=1] order
        self.max_slot = -1
        for i in range(n):
            v = s[i]
            if v < -1 or v >= n_slots:
                raise ValueError(f"slots[{i}] must be -1 (no adapter) or a slot in "
                                 f"[0, {n_slots}), got {v}")
            if v >= 0:
                starts[v + 1] += 1
                if v > self.max_slot:
                    self.max_slot = v
        for i in range(n_slots):
            starts[i + 1] += starts[i]
        self.n_covered = starts[n_slots]
        order = np.empty(max(self.n_covered, 1), dtype=np.int32)
        cdef cnp.ndarray[cnp.intp_t, ndim=1] fill = starts[:n_slots].copy() if n_slots else starts
        for i in range(n):  # a stable counting sort: each slot's rows stay ascending
            v = s[i]
            if v >= 0:
                order[fill[v]] = <int>i
                fill[v] += 1
        self.n_rows = n
        self.n_slots = n_slots
        self._order_obj = order
        self._starts_obj = starts
        self._order = <const int *>cnp.PyArray_DATA(order)
        self._starts = <const Py_ssize_t *>cnp.PyArray_DATA(starts)

    def __reduce__(self):
        raise TypeError("SlotRows belongs to one step of one process and does not pickle")

    def rows(self, Py_ssize_t slot):
        """The rows of ``slot``, ascending (an int32 array, a copy)."""
        if slot < 0 or slot >= self.n_slots:
            raise ValueError(f"slot must be in [0, {self.n_slots}), got {slot}")
        return np.array(self._order_obj[self._starts[slot]:self._starts[slot + 1]], copy=True)

    def counts(self):
        """The number of rows of each slot (an int64 array of ``n_slots`` values)."""
        return np.diff(self._starts_obj).astype(np.int64)

    def __repr__(self):
        return (f"SlotRows(n_rows={self.n_rows}, n_slots={self.n_slots}, "
                f"covered={self.n_covered})")



# ---------------------------------------------------------------------------
# checks (with the GIL)
# ---------------------------------------------------------------------------

cdef int half_bits(object half) except -2:
    """The 16-bit kind uint16 arrays are read as: ``ROWS_F16``, ``ROWS_BF16`` or -1 (none)."""
    if half is None:
        return -1
    if half == "float16":
        return ROWS_F16
    if half == "bfloat16":
        return ROWS_BF16
    raise ValueError(f"half must be None, 'float16' or 'bfloat16', got {half!r}")


cdef int rows_kind(object arr, str name, int bits, bint writable, Py_ssize_t n,
                    Py_ssize_t *width, Py_ssize_t *ld) except -1:
    """A 2-D rows buffer of ``n`` rows with unit column stride; its kind, width and row stride."""
    cdef int kind = check_type(arr, name, bits)
    cdef cnp.ndarray a = <cnp.ndarray>arr
    cdef Py_ssize_t item = cnp.PyArray_ITEMSIZE(a)
    if cnp.PyArray_NDIM(a) != 2:
        raise ValueError(f"{name} must be 2-D (rows, width), got shape {(<object>a).shape}")
    if writable and not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{name} must be writable, got a read-only array")
    cdef Py_ssize_t rows = cnp.PyArray_DIM(a, 0), w = cnp.PyArray_DIM(a, 1)
    cdef Py_ssize_t s0 = cnp.PyArray_STRIDE(a, 0), s1 = cnp.PyArray_STRIDE(a, 1)
    if rows != n:
        raise ValueError(f"{name} must have {n} rows (the SlotRows' n_rows), got shape "
                         f"{(<object>a).shape}")
    if w < 1 or w > INT_MAX:
        raise ValueError(f"{name} must have a width in [1, {INT_MAX}], got shape {(<object>a).shape}")
    if (w > 1 and s1 != item) or (rows > 1 and (s0 % item != 0 or s0 < w * item)):
        raise ValueError(f"{name} must have contiguous rows (column stride {item} bytes, row "
                         f"stride a multiple of it and at least the row), got strides "
                         f"{(<object>a).strides} for shape {(<object>a).shape}")
    width[0] = w
    ld[0] = s0 // item if rows > 1 else w
    return kind


cdef int weights_kind(object arr, str name, int bits) except -1:
    """A C-contiguous 3-D stack of factors; its kind."""
    cdef int kind = check_type(arr, name, bits)
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if cnp.PyArray_NDIM(a) != 3 or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{name} must be a C-contiguous 3-D array (slots, rows, columns), got "
                         f"shape {(<object>a).shape} with strides {(<object>a).strides}")
    if cnp.PyArray_DIM(a, 1) > INT_MAX or cnp.PyArray_DIM(a, 2) > INT_MAX:
        raise ValueError(f"{name} must have dimensions of at most {INT_MAX}, got shape "
                         f"{(<object>a).shape}")
    return kind


# ---------------------------------------------------------------------------
# the kernel (no Python objects, no GIL)
# ---------------------------------------------------------------------------

cdef struct _Stacks:
    # one projection's stacked factors, slot after slot
    const char *A       # (slots, rank, d_in) or NULL
    const char *B       # (slots, d_out, rank), with b_t (slots, rank, d_out), or NULL
    int ak              # ROWS_* kind of A and of B
    int bk
    bint b_t
    int rank
    int d_in
    int d_out


cdef inline const float *_factor(const char *base, int kind, Py_ssize_t s, Py_ssize_t size,
                                 float *dst) noexcept nogil:
    """Slot ``s`` of a stack of ``size``-value factors, as float32 (widened into ``dst``)."""
    if kind == ROWS_F32:
        return <const float *>base + s * size
    widen_h(<const uint16_t *>base + s * size, dst, <size_t>size, half_of(kind))
    return dst


cdef int _run(const _Stacks *w, SlotRows groups, const char *X, Py_ssize_t ldx, int xk, char *Y,
              Py_ssize_t ldy, int yk, float scale, bint add) noexcept nogil:
    """Every slot's rows through that slot's factors; -1 without scratch memory."""
    cdef Py_ssize_t s, m
    cdef Py_ssize_t a_size = <Py_ssize_t>w.rank * w.d_in if w.A != NULL else 0
    cdef Py_ssize_t b_size = <Py_ssize_t>w.d_out * w.rank if w.B != NULL else 0
    cdef Py_ssize_t a_wide = a_size if w.ak != ROWS_F32 else 0
    cdef Py_ssize_t b_wide = b_size if w.bk != ROWS_F32 else 0
    cdef int owned = 0, rc = 0
    cdef float *W = NULL
    cdef const float *Wa = NULL
    cdef const float *Wb = NULL
    cdef Segment seg
    if a_wide + b_wide:
        W = lorahook_scratch_area(<size_t>(a_wide + b_wide), LH_SCRATCH_WEIGHTS, &owned)
        if W == NULL:
            return -1
    seg.a16 = seg.b16 = seg.bias16 = NULL
    seg.bias = seg.row_scales = seg.pre_mul = seg.pre_add = NULL
    seg.wkind = -1
    seg.pre = PRE_NONE
    seg.scale = scale
    seg.d_in = w.d_in
    # two products (x A^T) B^T, or one: x A^T (A's rows are the output's) or x B^T
    seg.direct = w.A == NULL or w.B == NULL
    seg.rank = w.d_in if seg.direct else w.rank
    seg.b_rows = (not w.b_t) if w.B != NULL else True
    for s in range(groups.max_slot + 1):
        m = groups._starts[s + 1] - groups._starts[s]
        if m == 0:
            continue
        if w.A != NULL:
            Wa = _factor(w.A, w.ak, s, a_size, W)
        if w.B != NULL:
            Wb = _factor(w.B, w.bk, s, b_size, W + a_wide)
        if seg.direct:
            seg.a = NULL
            seg.b = Wb if w.B != NULL else Wa
        else:
            seg.a, seg.b = Wa, Wb
        seg.rows = groups._order + groups._starts[s]
        seg.n_rows = m
        rc = gemm_rows(&seg, X, ldx, xk, Y, ldy, yk, w.d_in, w.d_out, add)
        if rc != 0:
            break
    if owned:
        free(W)
    return rc


def apply_slots(SlotRows groups not None, x, y, a=None, b=None, scale=1.0, *, bint add=True,
                half=None, bt=None):
    """Add each row's slot delta to ``y`` in place; rows without a slot are left alone.

    ``x`` is ``(n, d_in)`` and ``y`` ``(n, d_out)``, ``n`` the groups'
    ``n_rows``, each with contiguous rows (any row stride).  ``a`` is
    ``(slots, rank, d_in)``, ``b`` ``(slots, d_out, rank)``, C-contiguous, with
    more slots than the highest slot that has rows.  With both factors each
    row ``r`` of slot ``s`` gets ``scale * b[s] @ (a[s] @ x[r])``; with ``a``
    alone (then ``d_out`` is its rank) ``scale * a[s] @ x[r]``; with ``b``
    alone (``d_in`` is its rank) ``scale * b[s] @ x[r]``.  ``add=False``
    writes the delta instead of adding it (still only the rows with a slot).
    ``bt`` in place of ``b`` gives ``B`` transposed, ``(slots, rank, d_out)``:
    the same result, faster where a slot has few rows (OpenBLAS multiplies a
    few rows by a transposed ``(d_out, rank)`` operand several times slower).

    Arrays are float32, float16, or uint16 read as the 16-bit patterns of
    ``half`` (``"float16"`` or ``"bfloat16"``); they need not share a dtype.
    ``TypeError`` for a wrong type or dtype, ``ValueError`` for shapes,
    strides, slots and overlapping ``x`` and ``y``, each raised before
    anything is written.
    """
    cdef int bits = half_bits(half), xk, yk
    cdef _Stacks c
    cdef Py_ssize_t d_in, d_out, ldx, ldy, rank = 0
    if bt is not None and b is not None:
        raise ValueError("give b or bt, not both")
    c.b_t = bt is not None
    if c.b_t:
        b = bt
    if a is None and b is None:
        raise ValueError("apply_slots needs a, b or both")
    xk = rows_kind(x, "x", bits, False, groups.n_rows, &d_in, &ldx)
    yk = rows_kind(y, "y", bits, True, groups.n_rows, &d_out, &ldy)
    c.A = NULL
    c.B = NULL
    c.ak = c.bk = ROWS_F32
    if a is not None:
        c.ak = weights_kind(a, "a", bits)
        if cnp.PyArray_DIM(<cnp.ndarray>a, 2) != d_in:
            raise ValueError(f"a of shape {a.shape} must have shape[2] == d_in = {d_in} (x's width)")
        rank = cnp.PyArray_DIM(<cnp.ndarray>a, 1)
        if b is None and rank != d_out:
            raise ValueError(f"a of shape {a.shape} alone must have shape[1] == d_out = {d_out} "
                             f"(y's width)")
    cdef str bn = "bt" if c.b_t else "b"
    cdef int out_axis = 2 if c.b_t else 1
    cdef int rank_axis = 1 if c.b_t else 2
    if b is not None:
        c.bk = weights_kind(b, bn, bits)
        if cnp.PyArray_DIM(<cnp.ndarray>b, out_axis) != d_out:
            raise ValueError(f"{bn} of shape {b.shape} must have shape[{out_axis}] == d_out = "
                             f"{d_out} (y's width)")
        if a is None:
            rank = cnp.PyArray_DIM(<cnp.ndarray>b, rank_axis)
            if rank != d_in:
                raise ValueError(f"{bn} of shape {b.shape} alone must have shape[{rank_axis}] == "
                                 f"d_in = {d_in} (x's width)")
        elif cnp.PyArray_DIM(<cnp.ndarray>b, rank_axis) != rank:
            raise ValueError(f"a of shape {a.shape} and {bn} of shape {b.shape} must share a "
                             f"rank (a.shape[1] == {bn}.shape[{rank_axis}])")
    for name, w in (("a", a), (bn, b)):
        if w is not None and groups.max_slot >= w.shape[0]:
            raise ValueError(f"{name} of shape {w.shape} holds {w.shape[0]} slots but a row uses "
                             f"slot {groups.max_slot}")
    if rank < 1:
        raise ValueError(f"the factors' rank must be >= 1, got {rank}")
    refuse_overlap(<cnp.ndarray>x, <cnp.ndarray>y, "x", "y")
    cdef float fscale = <float>float(scale)
    cdef const char *X = <const char *>cnp.PyArray_DATA(<cnp.ndarray>x)
    cdef char *Y = <char *>cnp.PyArray_DATA(<cnp.ndarray>y)
    c.A = <const char *>cnp.PyArray_DATA(<cnp.ndarray>a) if a is not None else NULL
    c.B = <const char *>cnp.PyArray_DATA(<cnp.ndarray>b) if b is not None else NULL
    c.rank = <int>rank
    c.d_in = <int>d_in
    c.d_out = <int>d_out
    if groups.max_slot < 0:  # slots past the highest with rows have none
        return
    # a reference to every buffer is held by this frame while the kernel runs
    with nogil:
        rc = _run(&c, groups, X, ldx, xk, Y, ldy, yk, fscale, add)
    if rc != 0:
        raise MemoryError("lorahook could not allocate its scratch buffer")

