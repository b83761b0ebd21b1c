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
  over that slot's rows;
* :func:`apply_pairs` does the same for a projection's pairs in the rows' own
  dtype, on an OpenMP team (:class:`SlotPairs`, :func:`openmp_team`), and
  :func:`apply_pairs_tensors` on PyTorch tensors read where they lie.

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
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

from lorahook cimport _blas
from lorahook._checks cimport ROWS_BF16, ROWS_F16, ROWS_F32, check_type, refuse_overlap
from lorahook._halfconv cimport LORAHOOK_HALF_BF16, LORAHOOK_HALF_F16, active_path
from lorahook._halfconv cimport narrow_on, widen_on

import numpy as np

cnp.import_array()

cdef extern from "_scratch.h" nogil:
    float *lorahook_scratch_slot(size_t n, int slot, int *owned) noexcept
    size_t LORAHOOK_SCRATCH_CACHE_FLOATS

# Per-thread scratch areas of this module (see _scratch.h).
cdef enum:
    _SCRATCH_ROWS = 0      # gathered / widened rows and the products' results
    _SCRATCH_WEIGHTS = 1   # one slot's 16-bit factors widened to float32
    _SCRATCH_PAIRS = 2     # apply_pairs' first products (t), on the calling thread


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
    cdef readonly Py_ssize_t n_rows
    cdef readonly Py_ssize_t n_slots
    cdef readonly Py_ssize_t n_covered   # rows that have a slot
    cdef readonly Py_ssize_t max_slot    # the highest slot with rows, -1 when none
    cdef object _order_obj
    cdef object _starts_obj
    cdef const int *_order               # rows by slot: slot s holds order[starts[s]:starts[s+1]]
    cdef const Py_ssize_t *_starts

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

cdef int _half_kind(object half) except -2:
    """The 16-bit kind uint16 arrays are read as: ``ROWS_F16``, ``ROWS_BF16`` or -1 (none)."""
    if half is None:
        return -1
    if half == "float16":
        return ROWS_F16
    if half == "bfloat16":
        return ROWS_BF16
    raise ValueError(f"half must be None, 'float16' or 'bfloat16', got {half!r}")


cdef int _rows_kind(object arr, str name, int bits, bint writable, Py_ssize_t n,
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


cdef int _weights_kind(object arr, str name, int bits) except -1:
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

cdef struct _Call:
    const int *order
    const Py_ssize_t *starts
    Py_ssize_t n_slots
    const char *X
    Py_ssize_t ldx
    int xk              # ROWS_* kind of x
    char *Y
    Py_ssize_t ldy
    int yk
    const char *A       # (slots, rank, d_in) or NULL
    const char *B       # (slots, d_out, rank) or NULL
    int ak
    int bk
    bint b_t            # B is given transposed: (slots, rank, d_out)
    int rank
    int d_in
    int d_out
    float scale
    bint add


cdef inline int _hk(int kind) noexcept nogil:
    return LORAHOOK_HALF_F16 if kind == ROWS_F16 else LORAHOOK_HALF_BF16


cdef inline const float *_factor(const char *base, int kind, Py_ssize_t s, Py_ssize_t size,
                                 float *dst, int hp) noexcept nogil:
    """Slot ``s`` of a stack of ``size``-value factors, as float32 (widened into ``dst``)."""
    if kind == ROWS_F32:
        return <const float *>base + s * size
    widen_on(hp, <const uint16_t *>base + s * size, dst, <size_t>size, _hk(kind))
    return dst


cdef int _run(const _Call *c, int hp) noexcept nogil:
    """Every slot's rows, chunk by chunk; -1 without scratch memory."""
    cdef Py_ssize_t s, k, m, j, r, r0
    cdef Py_ssize_t a_size = <Py_ssize_t>c.rank * c.d_in if c.A != NULL else 0
    cdef Py_ssize_t b_size = <Py_ssize_t>c.d_out * c.rank if c.B != NULL else 0
    cdef Py_ssize_t w_floats = (a_size if c.ak != ROWS_F32 else 0) + \
        (b_size if c.bk != ROWS_F32 else 0)
    cdef int q, owned_w = 0, owned = 0, lx, lt, lw, kw, lo
    cdef float alpha
    cdef const int *rows
    cdef const float *Wa = NULL
    cdef const float *Wb = NULL
    cdef const float *Wl = NULL  # the last product's factor: B (or A alone)
    cdef bint tw
    cdef const float *xp
    cdef const float *tp
    cdef float *W = NULL
    cdef float *yr
    cdef float *out
    cdef float beta
    cdef bint consecutive, direct
    # per chunk of rows: G (gathered input), T (the product with A), D (the output rows), R (one row)
    cdef Py_ssize_t t_cols = c.rank if (c.A != NULL and c.B != NULL) else 0
    cdef Py_ssize_t per_row = <Py_ssize_t>c.d_in + t_cols + c.d_out
    cdef Py_ssize_t chunk = <Py_ssize_t>LORAHOOK_SCRATCH_CACHE_FLOATS // per_row
    if chunk > 256:
        chunk = 256
    if chunk < 1:
        chunk = 1
    if w_floats:
        W = lorahook_scratch_slot(<size_t>w_floats, _SCRATCH_WEIGHTS, &owned_w)
        if W == NULL:
            return -1
    cdef float *G = lorahook_scratch_slot(<size_t>(chunk * per_row + c.d_out), _SCRATCH_ROWS,
                                          &owned)
    if G == NULL:
        if owned_w:
            free(W)
        return -1
    cdef float *T = G + chunk * c.d_in
    cdef float *D = T + chunk * t_cols
    cdef float *R = D + chunk * c.d_out
    cdef int hx = _hk(c.xk), hy = _hk(c.yk)

    for s in range(c.n_slots):
        m = c.starts[s + 1] - c.starts[s]
        if m == 0:
            continue
        if c.A != NULL:
            Wa = _factor(c.A, c.ak, s, a_size, W, hp)
        if c.B != NULL:
            Wb = _factor(c.B, c.bk, s, b_size,
                         W + (a_size if c.ak != ROWS_F32 else 0), hp)
            Wl, tw, kw, lw = Wb, not c.b_t, c.rank, (c.d_out if c.b_t else c.rank)
        else:
            Wl, tw, kw, lw = Wa, True, c.d_in, c.d_in
        k = 0
        while k < m:
            q = <int>(chunk if m - k > chunk else m - k)
            rows = c.order + c.starts[s] + k
            consecutive = rows[q - 1] - rows[0] == q - 1
            r0 = rows[0]
            # the input rows, as float32 with row stride lx
            if c.xk == ROWS_F32 and consecutive:
                xp = <const float *>c.X + r0 * c.ldx
                lx = <int>c.ldx
            else:
                for j in range(q):
                    r = rows[j]
                    if c.xk == ROWS_F32:
                        memcpy(G + j * c.d_in, <const float *>c.X + r * c.ldx,
                               c.d_in * sizeof(float))
                    else:
                        widen_on(hp, <const uint16_t *>c.X + r * c.ldx, G + j * c.d_in,
                                 <size_t>c.d_in, hx)
                xp = G
                lx = c.d_in
            # the first product: T = scale X A^T, or the input itself
            if c.A != NULL and c.B != NULL:
                _blas.gemm(False, True, q, c.rank, c.d_in, c.scale, xp, lx, Wa, c.d_in, 0.0,
                           T, c.rank)
                tp = T
                lt = c.rank
                alpha = 1.0
            else:
                tp = xp
                lt = lx
                alpha = c.scale
            # the last product, straight into float32 output rows that follow each
            # other, else into D to be scattered
            direct = c.yk == ROWS_F32 and consecutive
            if direct:
                out, lo, beta = <float *>c.Y + r0 * c.ldy, <int>c.ldy, (1.0 if c.add else 0.0)
            else:
                out, lo, beta = D, c.d_out, 0.0
            _blas.gemm(False, tw, q, c.d_out, kw, alpha, tp, lt, Wl, lw, beta, out, lo)
            if direct:
                k += q
                continue
            for j in range(q):
                r = rows[j]
                if c.yk == ROWS_F32:
                    yr = <float *>c.Y + r * c.ldy
                    if c.add:
                        _blas.axpy(c.d_out, 1.0, D + j * c.d_out, yr)
                    else:
                        memcpy(yr, D + j * c.d_out, c.d_out * sizeof(float))
                elif c.add:  # widened, added in float32, rounded once
                    widen_on(hp, <const uint16_t *>c.Y + r * c.ldy, R, <size_t>c.d_out, hy)
                    _blas.axpy(c.d_out, 1.0, D + j * c.d_out, R)
                    narrow_on(hp, R, <uint16_t *>c.Y + r * c.ldy, <size_t>c.d_out, hy)
                else:
                    narrow_on(hp, D + j * c.d_out, <uint16_t *>c.Y + r * c.ldy,
                              <size_t>c.d_out, hy)
            k += q
    if owned:
        free(G)
    if owned_w:
        free(W)
    return 0


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
    cdef int bits = _half_kind(half)
    cdef _Call c
    cdef Py_ssize_t d_in, d_out, rank = 0
    if bt is not None and b is not None:
        raise ValueError("give b or bt, not both")
    c.b_t = bt is not None
    if c.b_t:
        b = bt
    if a is None and b is None:
        raise ValueError("apply_slots needs a, b or both")
    c.xk = _rows_kind(x, "x", bits, False, groups.n_rows, &d_in, &c.ldx)
    c.yk = _rows_kind(y, "y", bits, True, groups.n_rows, &d_out, &c.ldy)
    c.A = NULL
    c.B = NULL
    c.ak = c.bk = ROWS_F32
    if a is not None:
        c.ak = _weights_kind(a, "a", bits)
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
        c.bk = _weights_kind(b, bn, bits)
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
    c.scale = <float>float(scale)
    c.add = add
    c.order = groups._order
    c.starts = groups._starts
    c.n_slots = groups.max_slot + 1  # slots past the highest with rows have none
    c.X = <const char *>cnp.PyArray_DATA(<cnp.ndarray>x)
    c.Y = <char *>cnp.PyArray_DATA(<cnp.ndarray>y)
    c.A = <const char *>cnp.PyArray_DATA(<cnp.ndarray>a) if a is not None else NULL
    c.B = <const char *>cnp.PyArray_DATA(<cnp.ndarray>b) if b is not None else NULL
    c.rank = <int>rank
    c.d_in = <int>d_in
    c.d_out = <int>d_out
    if c.n_slots == 0:
        return
    cdef int hp = active_path(), rc
    # a reference to every buffer is held by this frame while the kernel runs
    with nogil:
        rc = _run(&c, hp)
    if rc != 0:
        raise MemoryError("lorahook could not allocate its scratch buffer")


# ---------------------------------------------------------------------------
# LoRA pairs in the rows' own dtype, on an OpenMP team (_pairs.h)
# ---------------------------------------------------------------------------

cdef extern from "_pairs.h" nogil:
    int LH_P_MAX_SLICES
    enum: LH_P_MAX_SLICES_ "LH_P_MAX_SLICES"
    int LH_P_COLS
    ctypedef struct lh_slice:
        const char *const *A
        const char *const *Bt
        const int *ranks
        int rmax
        int d_out
        Py_ssize_t col
        Py_ssize_t t_off
        Py_ssize_t blocks
    ctypedef struct lh_pairs:
        const int *order
        const Py_ssize_t *starts
        Py_ssize_t n_slots
        Py_ssize_t n_covered
        const char *X
        Py_ssize_t ldx
        char *Y
        Py_ssize_t ldy
        int d_in
        int kind
        int add
        float scale
        int n_slices
        lh_slice slices[LH_P_MAX_SLICES_]
        float *T
    ctypedef struct lh_team:
        int n
        char library[512]
    ctypedef void (*lh_part_fn)(const lh_pairs *, int, int, void (*)() noexcept nogil) noexcept
    int lh_team_find(lh_team *t) noexcept
    lh_part_fn lh_pairs_choose() noexcept
    const char *lh_pairs_isa_name(lh_part_fn f) noexcept
    void lh_pairs_run(const lh_pairs *call, const lh_team *team, lh_part_fn part) noexcept

cdef extern from *:
    """
    /* the builds this CPU can run, best first (the x86 builds exist only on x86-64) */
    static int lh_pairs_builds(lh_part_fn *out) {
        int n = 0;
        lh_part_fn best = lh_pairs_choose();
    #if LORAHOOK_HALF_X86
        int rank = best == lh_pairs_part_avx512bf16 ? 3 : best == lh_pairs_part_avx512 ? 2
                   : best == lh_pairs_part_avx2 ? 1 : 0;
        if (rank >= 3) out[n++] = lh_pairs_part_avx512bf16;
        if (rank >= 2) out[n++] = lh_pairs_part_avx512;
        if (rank >= 1) out[n++] = lh_pairs_part_avx2;
    #endif
        out[n++] = lh_pairs_part_portable;
        return n;
    }
    """
    int lh_pairs_builds(lh_part_fn *out) noexcept

cdef lh_part_fn _pairs_build = lh_pairs_choose()


def pairs_builds():
    """The builds of the pairs kernel this CPU can run, best first.

    ``'avx512bf16'`` (bfloat16 first products as the CPU's bfloat16 dot
    products, float32 sums), ``'avx512'``, ``'avx2'`` (with FMA and F16C),
    ``'portable'``.
    """
    cdef lh_part_fn found[4]
    cdef int n = lh_pairs_builds(found), i
    return tuple(lh_pairs_isa_name(found[i]).decode() for i in range(n))


def pairs_build(name=None):
    """The build :func:`apply_pairs` runs; ``name`` makes another one it (tests, benchmarks).

    Returns the build in force before the call.  ``ValueError`` for a build
    this CPU cannot run.
    """
    global _pairs_build
    old = lh_pairs_isa_name(_pairs_build).decode()
    if name is None:
        return old
    cdef lh_part_fn found[4]
    cdef int n = lh_pairs_builds(found), i
    for i in range(n):
        if lh_pairs_isa_name(found[i]).decode() == name:
            _pairs_build = found[i]
            return old
    raise ValueError(f"build must be one of {pairs_builds()} on this CPU, got {name!r}")


@cython.final
@cython.auto_pickle(False)
cdef class Team:
    """An OpenMP team already running in this process, for :func:`apply_pairs`.

    Made by :func:`openmp_team`; ``n_threads`` threads of that runtime's pool
    (the pool of the thread that calls) run each call.
    """
    cdef lh_team t

    @property
    def n_threads(self):
        return self.t.n

    @property
    def library(self):
        """The OpenMP runtime's file."""
        return self.t.library.decode(errors="replace")

    def __repr__(self):
        return f"Team(n_threads={self.t.n}, library={self.library!r})"


def openmp_team(int n_threads):
    """A :class:`Team` of ``n_threads`` on the OpenMP runtime this process has loaded.

    The runtime in the global scope is preferred (vLLM preloads PyTorch's
    libgomp into its workers); else one a library loaded (``libgomp.so.1``,
    ``libiomp5.so``, ``libomp.so``).  Nothing is loaded and no thread is
    started here: ``None`` when no OpenMP runtime is loaded.
    """
    if n_threads < 1 or n_threads > 4096:
        raise ValueError(f"n_threads must be in [1, 4096], got {n_threads}")
    cdef Team team = Team.__new__(Team)
    if lh_team_find(&team.t) != 0:
        return None
    team.t.n = n_threads
    return team


cdef dict _PAIR_KINDS = {"float32": ROWS_F32, "float16": ROWS_F16, "bfloat16": ROWS_BF16}


@cython.final
@cython.auto_pickle(False)
cdef class SlotPairs:
    """A projection's LoRA pairs in slots, one per output slice, in one dtype.

    Two ways to make one:

    * ``SlotPairs(a, bt, ranks, half=None)``: an engine's stacked slots.
      Three sequences of one to eight arrays each, slice by slice: ``a[i]`` is
      ``(slots, rmax_i, d_in)``, ``bt[i]`` is ``B`` transposed, ``(slots,
      rmax_i, d_out_i)``, both C-contiguous, and ``ranks[i]`` an int32 array of
      ``slots`` values, slot ``s``'s rank ``k`` (its first ``k`` rows of
      ``a[i][s]`` and ``bt[i][s]`` are used, the rest are never read; ``0``: no
      adapter in that slice).  Arrays are float32, float16, or uint16 read as
      ``half``; every array has the same kind.  The arrays are referred to, not
      copied: their owner may rewrite them between calls (ranks are checked at
      every call), never reshape them.
    * :meth:`per_slot` ``(n_slots, d_in, d_outs, dtype)``: slots that refer to
      each adapter's own arrays, set one slot and slice at a time
      (:meth:`set_slot`, :meth:`clear_slot`) at that adapter's rank: a slot
      costs what its adapter holds, whatever the largest rank.

    Slice ``i`` writes columns ``[sum(d_out_0 .. d_out_{i-1}), ... + d_out_i)``
    of the output.
    """
    cdef readonly int kind
    cdef readonly Py_ssize_t n_slots
    cdef readonly Py_ssize_t d_in
    cdef readonly Py_ssize_t d_out
    cdef readonly int n_slices
    cdef object _refs          # what the pointers point into, kept alive
    cdef object _ranks         # per slice: the int32 ranks array the kernel reads
    cdef const char **_ptrs    # per slice: n_slots pointers into A, then n_slots into Bt
    cdef lh_slice slices[LH_P_MAX_SLICES_]
    cdef Py_ssize_t t_floats   # sum of rmax: t's floats per row
    cdef bint _settable        # made by per_slot
    cdef int _busy             # calls running (set_slot refuses to change a slot under one)

    def __cinit__(self, *args, **kwargs):
        self._ptrs = NULL

    def __init__(self, a, bt, ranks, half=None):
        cdef int bits = _half_kind(half), i, kind = -1
        cdef Py_ssize_t s
        a, bt, ranks = list(a), list(bt), list(ranks)
        if not 1 <= len(a) <= LH_P_MAX_SLICES or len(bt) != len(a) or len(ranks) != len(a):
            raise ValueError(f"a, bt and ranks must hold the same number of slices, 1 to "
                             f"{LH_P_MAX_SLICES}; got {len(a)}, {len(bt)} and {len(ranks)}")
        n_slots = d_in = 0
        for i in range(len(a)):
            ai, bi = a[i], bt[i]
            ka = _weights_kind(ai, f"a[{i}]", bits)
            kb = _weights_kind(bi, f"bt[{i}]", bits)
            if i == 0:
                kind = ka
                n_slots, d_in = ai.shape[0], ai.shape[2]
            if ka != kind or kb != kind:
                raise TypeError(f"a and bt must share one dtype; a[0] is {a[0].dtype}, a[{i}] "
                                f"{ai.dtype}, bt[{i}] {bi.dtype}")
            if ai.shape[0] != n_slots or bi.shape[0] != n_slots:
                raise ValueError(f"a[{i}] of shape {ai.shape} and bt[{i}] of shape {bi.shape} "
                                 f"must hold {n_slots} slots (a[0]'s)")
            if ai.shape[2] != d_in:
                raise ValueError(f"a[{i}] of shape {ai.shape} must have shape[2] == d_in = "
                                 f"{d_in} (a[0]'s)")
            if bi.shape[1] != ai.shape[1]:
                raise ValueError(f"a[{i}] of shape {ai.shape} and bt[{i}] of shape {bi.shape} "
                                 f"must share a rank (a.shape[1] == bt.shape[1])")
            if ai.shape[1] < 1 or bi.shape[2] < 1 or d_in < 1:
                raise ValueError(f"a[{i}] of shape {ai.shape} and bt[{i}] of shape {bi.shape} "
                                 f"must have no empty dimension but slots")
            r = ranks[i]
            if (not isinstance(r, np.ndarray) or r.dtype != np.int32 or r.ndim != 1
                    or r.shape[0] != n_slots or not r.flags.c_contiguous):
                raise TypeError(f"ranks[{i}] must be a C-contiguous 1-D int32 array of "
                                f"{n_slots} values, got {type(r).__name__} "
                                f"{getattr(r, 'dtype', '')} {getattr(r, 'shape', '')}")
        self._layout(kind, n_slots, d_in, [b.shape[2] for b in bt], ranks)
        cdef const char *base
        cdef Py_ssize_t step
        for i in range(self.n_slices):
            self.slices[i].rmax = <int>a[i].shape[1]
            base = <const char *>cnp.PyArray_DATA(<cnp.ndarray>a[i])
            step = cnp.PyArray_STRIDE(<cnp.ndarray>a[i], 0)
            for s in range(n_slots):
                self._ptrs[2 * i * n_slots + s] = base + s * step
            base = <const char *>cnp.PyArray_DATA(<cnp.ndarray>bt[i])
            step = cnp.PyArray_STRIDE(<cnp.ndarray>bt[i], 0)
            for s in range(n_slots):
                self._ptrs[(2 * i + 1) * n_slots + s] = base + s * step
        self._offsets()
        self._refs = list(zip(a, bt))

    @staticmethod
    def per_slot(Py_ssize_t n_slots, Py_ssize_t d_in, d_outs, dtype="float32"):
        """Empty slots (every rank 0) that :meth:`set_slot` fills with adapters' own arrays.

        ``d_outs``: each slice's output width (one to eight); ``dtype``:
        ``'float32'``, ``'float16'`` or ``'bfloat16'`` (16-bit arrays may be
        uint16 patterns).
        """
        if dtype not in _PAIR_KINDS:
            raise ValueError(f"dtype must be one of {sorted(_PAIR_KINDS)}, got {dtype!r}")
        d_outs = [int(d) for d in d_outs]
        if not 1 <= len(d_outs) <= LH_P_MAX_SLICES:
            raise ValueError(f"d_outs must hold 1 to {LH_P_MAX_SLICES} widths, got {len(d_outs)}")
        if n_slots < 0 or d_in < 1 or d_in > INT_MAX or min(d_outs) < 1 or max(d_outs) > INT_MAX:
            raise ValueError(f"n_slots must be >= 0 and d_in and d_outs in [1, {INT_MAX}], got "
                             f"n_slots={n_slots}, d_in={d_in}, d_outs={d_outs}")
        cdef SlotPairs p = SlotPairs.__new__(SlotPairs)
        p._layout(_PAIR_KINDS[dtype], n_slots, d_in, d_outs,
                  [np.zeros(n_slots, np.int32) for _ in d_outs])
        p._settable = True
        p._refs = [[None] * n_slots for _ in d_outs]
        for i in range(p.n_slices):
            p.slices[i].rmax = 1
        p._offsets()
        return p

    cdef int _layout(self, int kind, Py_ssize_t n_slots, Py_ssize_t d_in, list d_outs,
                     list ranks) except -1:
        """The slices' widths, columns and ranks arrays, and the pointer table (all NULL)."""
        cdef int i
        if self._ptrs != NULL:
            raise TypeError("SlotPairs is made once")
        self.kind = kind
        self.n_slots, self.d_in = n_slots, d_in
        self.n_slices = len(d_outs)
        self._ranks = ranks
        self._ptrs = <const char **>calloc(max(1, 2 * self.n_slices * n_slots), sizeof(char *))
        if self._ptrs == NULL:
            raise MemoryError("lorahook could not allocate a slot table")
        self.d_out = 0
        for i in range(self.n_slices):
            self.slices[i].A = self._ptrs + 2 * i * n_slots
            self.slices[i].Bt = self._ptrs + (2 * i + 1) * n_slots
            self.slices[i].ranks = <const int *>cnp.PyArray_DATA(<cnp.ndarray>ranks[i])
            self.slices[i].d_out = <int>d_outs[i]
            self.slices[i].col = self.d_out
            self.slices[i].blocks = (d_outs[i] + LH_P_COLS - 1) // LH_P_COLS
            self.d_out += d_outs[i]
        return 0

    cdef void _offsets(self) noexcept:
        """Each slice's place in the first products' scratch (times the rows covered, per call)."""
        cdef int i
        self.t_floats = 0
        for i in range(self.n_slices):
            self.slices[i].t_off = self.t_floats
            self.t_floats += self.slices[i].rmax

    def __dealloc__(self):
        free(self._ptrs)

    def set_slot(self, int i, Py_ssize_t slot, a, bt):
        """Slot ``slot`` of slice ``i`` refers to ``a`` ``(k, d_in)`` and ``bt`` ``(k, d_out_i)``.

        Both C-contiguous, in the pairs' dtype (16-bit arrays may be uint16
        patterns), with one rank ``k >= 1``; they are referred to, not copied,
        and kept alive until the slot is set again or cleared.  Costs nothing
        per other slot.  ``RuntimeError`` while a call runs on these pairs.
        """
        self._check_settable(i, slot)
        bits = -1 if self.kind == ROWS_F32 else self.kind
        for arr, name, width in ((a, "a", self.d_in), (bt, "bt", self.slices[i].d_out)):
            if check_type(arr, name, bits) != self.kind:
                raise TypeError(f"{name} must have the pairs' dtype "
                                f"({['float32', 'float16', 'bfloat16'][self.kind]}), got "
                                f"{arr.dtype}")
            if arr.ndim != 2 or not arr.flags.c_contiguous or arr.shape[1] != width:
                raise ValueError(f"{name} must be a C-contiguous 2-D array (rank, {width}), got "
                                 f"shape {arr.shape} with strides {arr.strides}")
        if a.shape[0] != bt.shape[0] or not 1 <= a.shape[0] <= INT_MAX:
            raise ValueError(f"a of shape {a.shape} and bt of shape {bt.shape} must share a "
                             f"rank of at least 1 (a.shape[0] == bt.shape[0])")
        cdef int k = <int>a.shape[0]
        self._ptrs[2 * i * self.n_slots + slot] = <const char *>cnp.PyArray_DATA(<cnp.ndarray>a)
        self._ptrs[(2 * i + 1) * self.n_slots + slot] = \
            <const char *>cnp.PyArray_DATA(<cnp.ndarray>bt)
        self._refs[i][slot] = (a, bt)
        if k > self.slices[i].rmax:
            self.slices[i].rmax = k
            self._offsets()
        self._ranks[i][slot] = k

    def clear_slot(self, int i, Py_ssize_t slot):
        """Slot ``slot`` of slice ``i`` holds no adapter (rank 0); its arrays are let go."""
        self._check_settable(i, slot)
        self._ranks[i][slot] = 0
        self._ptrs[2 * i * self.n_slots + slot] = NULL
        self._ptrs[(2 * i + 1) * self.n_slots + slot] = NULL
        self._refs[i][slot] = None

    cdef int _check_settable(self, int i, Py_ssize_t slot) except -1:
        if not self._settable:
            raise TypeError("only pairs made by SlotPairs.per_slot have slots to set")
        if not 0 <= i < self.n_slices or not 0 <= slot < self.n_slots:
            raise IndexError(f"slice {i} and slot {slot} must lie in [0, {self.n_slices}) and "
                             f"[0, {self.n_slots})")
        if self._busy:
            raise RuntimeError("a slot cannot change while a call runs on these pairs")
        return 0

    def ranks(self, int i):
        """Slice ``i``'s ranks, slot by slot (a copy)."""
        if not 0 <= i < self.n_slices:
            raise IndexError(f"slice {i} must lie in [0, {self.n_slices})")
        return np.array(self._ranks[i], copy=True)

    @property
    def used(self):
        """Whether any slot of any slice holds an adapter."""
        return any(bool(r.any()) for r in self._ranks)

    def __reduce__(self):
        raise TypeError("SlotPairs refers to arrays of one process and does not pickle")

    def __repr__(self):
        return (f"SlotPairs(slices={self.n_slices}, slots={self.n_slots}, d_in={self.d_in}, "
                f"d_out={self.d_out})")


def apply_pairs(SlotRows groups not None, x, y, SlotPairs pairs not None, scale=1.0, *,
                bint add=True, half=None, Team team=None):
    """Add each row's slot delta for every slice of ``pairs`` to ``y`` in place.

    For every slice ``i`` and row ``r`` of slot ``s`` with rank ``k``:
    ``y[r, cols_i] += scale * bt[i][s][:k].T @ (a[i][s][:k] @ x[r])`` (or
    ``=`` with ``add=False``, also for ``k == 0``).  Rows without a slot are
    never read or written.  ``x`` is ``(n, d_in)``, ``y`` ``(n, d_out)``,
    each with contiguous rows (any row stride), in the pairs' dtype: values
    are read and written in that dtype, products run in float32, and each
    output element is rounded once.

    ``team`` (:func:`openmp_team`) runs the call on that many threads of an
    OpenMP runtime's pool; without one the call runs on the calling thread.
    The result does not depend on the team's size and is the same from run
    to run.  The GIL is released while the kernel runs.  ``TypeError`` /
    ``ValueError`` for bad arguments, raised before anything is written.
    """
    cdef int bits = _half_kind(half)
    cdef Py_ssize_t d_in, d_out, ldx, ldy
    cdef int xk = _rows_kind(x, "x", bits, False, groups.n_rows, &d_in, &ldx)
    cdef int yk = _rows_kind(y, "y", bits, True, groups.n_rows, &d_out, &ldy)
    if xk != pairs.kind or yk != pairs.kind:
        raise TypeError(f"x ({x.dtype}) and y ({y.dtype}) must have the pairs' dtype")
    if d_in != pairs.d_in:
        raise ValueError(f"x of shape {x.shape} must have width d_in = {pairs.d_in} (the pairs')")
    if d_out != pairs.d_out:
        raise ValueError(f"y of shape {y.shape} must have width d_out = {pairs.d_out} (the "
                         f"pairs' slices together)")
    refuse_overlap(<cnp.ndarray>x, <cnp.ndarray>y, "x", "y")
    _run_pairs(groups, pairs, <const char *>cnp.PyArray_DATA(<cnp.ndarray>x), ldx,
               <char *>cnp.PyArray_DATA(<cnp.ndarray>y), ldy, scale, add, team)


def apply_pairs_tensors(SlotRows groups not None, x, y, SlotPairs pairs not None, dtype,
                        scale=1.0, *, bint add=True, Team team=None):
    """:func:`apply_pairs` on two tensors of an array library with no NumPy view made.

    ``x`` and ``y`` are read through ``dtype``, ``itemsize``, ``is_cpu``,
    ``shape``, ``stride()`` and ``data_ptr()`` (PyTorch's tensor attributes,
    strides in elements); ``dtype`` is the element type the pairs were made
    for, in that library's terms (its size is checked against the pairs').
    Making NumPy views of 16-bit tensors costs more than the kernel on a
    decode step's few rows; this reads their layout as it is.

    Returns ``False``, having read and written nothing, when ``x`` or ``y``
    is not a 2-D CPU tensor of ``dtype`` (of the pairs' element size) with
    rows of adjacent elements and the pairs' widths (``d_in``, ``d_out``):
    the caller's other path serves it.  ``ValueError`` (before anything is
    written) for rows that do not match ``groups`` or for ``x`` and ``y``
    sharing memory; else ``True``.
    """
    cdef Py_ssize_t item = 4 if pairs.kind == ROWS_F32 else 2
    cdef Py_ssize_t ldx, ldy, nx, ny
    if (x.dtype is not dtype or y.dtype is not dtype or x.itemsize != item
            or y.itemsize != item or not x.is_cpu or not y.is_cpu):
        return False
    xs, ys = x.shape, y.shape
    if len(xs) != 2 or len(ys) != 2 or xs[1] != pairs.d_in or ys[1] != pairs.d_out:
        return False
    xst, yst = x.stride(), y.stride()
    if (xs[1] > 1 and xst[1] != 1) or (ys[1] > 1 and yst[1] != 1):
        return False
    nx, ny = xs[0], ys[0]
    if nx != groups.n_rows or ny != groups.n_rows:
        raise ValueError(f"x of shape {tuple(xs)} and y of shape {tuple(ys)} must have "
                         f"{groups.n_rows} rows (the SlotRows' n_rows)")
    ldx = xst[0] if nx > 1 else xs[1]
    ldy = yst[0] if ny > 1 else ys[1]
    if ldx < xs[1] or ldy < ys[1]:
        return False
    cdef size_t xa = <size_t>x.data_ptr(), ya = <size_t>y.data_ptr()
    cdef size_t xe = xa + <size_t>(((nx - 1) * ldx + xs[1]) * item) if nx else xa
    cdef size_t ye = ya + <size_t>(((ny - 1) * ldy + ys[1]) * item) if ny else ya
    if nx and xa < ye and ya < xe:
        raise ValueError("x and y must not overlap (they share memory)")
    _run_pairs(groups, pairs, <const char *>xa, ldx, <char *>ya, ldy, scale, add, team)
    return True


cdef int _run_pairs(SlotRows groups, SlotPairs pairs, const char *X, Py_ssize_t ldx, char *Y,
                    Py_ssize_t ldy, scale, bint add, Team team) except -1:
    """The checks of the slots and ranks, then the kernel on rows whose layout is checked."""
    cdef lh_pairs c
    cdef Py_ssize_t s
    cdef int i
    cdef const int *rk
    if groups.max_slot >= pairs.n_slots:
        raise ValueError(f"the pairs hold {pairs.n_slots} slots but a row uses slot "
                         f"{groups.max_slot}")
    for i in range(pairs.n_slices):  # the slots the rows use: a step's cost, not the table's
        rk = pairs.slices[i].ranks
        for s in range(groups.max_slot + 1):
            if rk[s] < 0 or rk[s] > pairs.slices[i].rmax:
                raise ValueError(f"ranks[{i}][{s}] must be in [0, {pairs.slices[i].rmax}], "
                                 f"got {rk[s]}")
    if groups.max_slot < 0:
        return 0
    c.order = groups._order
    c.starts = groups._starts
    c.n_slots = groups.max_slot + 1
    c.n_covered = groups._starts[c.n_slots]
    c.X = X
    c.ldx = ldx
    c.Y = Y
    c.ldy = ldy
    c.d_in = <int>pairs.d_in
    c.kind = pairs.kind
    c.add = add
    c.scale = <float>float(scale)
    c.n_slices = pairs.n_slices
    for i in range(pairs.n_slices):
        c.slices[i] = pairs.slices[i]
        c.slices[i].t_off = pairs.slices[i].t_off * c.n_covered
    cdef const lh_team *tp = &team.t if team is not None else NULL
    cdef lh_part_fn part = _pairs_build
    cdef int own = 0
    pairs._busy += 1
    with nogil:
        c.T = lorahook_scratch_slot(<size_t>(c.n_covered * pairs.t_floats), _SCRATCH_PAIRS,
                                    &own)
        if c.T != NULL:
            lh_pairs_run(&c, tp, part)
            if own:
                free(c.T)
    pairs._busy -= 1
    if c.T == NULL:
        raise MemoryError("lorahook could not allocate its scratch buffer")
    return 0
