# cython: language_level=3
"""Gathered rows times ``(A, B^T)``: the one chunked routine of every batched kernel.

:c:func:`gemm_rows` adds (or writes) ``scale * (X A^T) B^T`` to the rows of a
:c:type:`Segment`: the linear kernels of ``lorahook._core.segments`` call it for a
layer's rows at or above the crossover, ``lorahook._core.slot_rows`` for each
slot's rows of an engine's stacked factors.  Chunk by chunk, the rows are
gathered (16-bit rows widened) into per-thread scratch when they are not one
run of float32 rows, multiplied by ``A`` then by ``B^T`` with the row-major
BLAS helpers of ``blas.pxd``, and written back: straight into a run of
float32 output rows, else scattered, a 16-bit output row widened, added to in
float32 and rounded once.  Without the GIL, on the calling thread.
"""
from libc.stdint cimport uint16_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

from lorahook._core cimport blas as _blas
from lorahook._core.checks cimport ROWS_BF16, ROWS_F16, ROWS_F32
from lorahook._core.halfconv cimport LORAHOOK_HALF_BF16, LORAHOOK_HALF_F16, narrow_h, widen_h

cdef extern from "scratch.h" nogil:
    float *lorahook_scratch_area(size_t n, int area, int *owned) noexcept
    size_t LORAHOOK_SCRATCH_CACHE_FLOATS
    enum:
        LH_SCRATCH_WIDENED
        LH_SCRATCH_PRODUCTS
        LH_SCRATCH_WEIGHTS
        LH_GATHER_CHUNK_ROWS
        LH_BLOCK_FLOATS
        LH_BLOCK_MIN_COLS

cdef extern from "affine.h" nogil:
    void lorahook_affine(float *y, const float *m, const float *c, size_t n) noexcept


# What a segment's factors are held in (Segment.wkind), besides a halfconv.h
# kind (LORAHOOK_HALF_F16 / BF16, both >= 0) for 16-bit factors.
cdef enum:
    WKIND_F32 = -1    # float32: a, b
    WKIND_INT8 = -2   # int8 with float32 scales: a8, b8, a_scale, b_scale (int8.h)


# What an output row becomes before the delta is added (Segment.pre).
cdef enum:
    PRE_NONE = 0      # y
    PRE_AFFINE = 1    # pre_mul * y + pre_add (DoRA: g * y + (1 - g) * b)
    PRE_REPLACE = 2   # pre_add, or zeros when it is NULL: a module saved whole


cdef struct Segment:
    # One pair of factors applied to a set of rows of one projection.
    const float *a          # (rank, d_in), row-major (NULL with 16-bit weights, or one product)
    const float *b          # B^T: (rank, d_out) row-major; with b_rows, B: (d_out, rank)
    const unsigned short *a16   # the same as 16-bit patterns when wkind >= 0
    const unsigned short *b16
    const signed char *a8   # the same in int8 when wkind is WKIND_INT8: A (rank, d_in),
    const signed char *b8   # B^T (rank, d_out) (never b_rows),
    const float *a_scale    # one scale per row of A (rank,),
    const float *b_scale    # and one per output (d_out,)
    int wkind               # WKIND_F32, WKIND_INT8, or the halfconv.h kind of a16/b16
    const float *bias       # (d_out,) or NULL
    const unsigned short *bias16   # the bias as 16-bit patterns (wkind >= 0), or NULL
    int rank                # the inner width of the product with b (d_in for one product)
    int d_in                # the layer's d_in (num_embeddings for an embedding)
    float scale             # used when row_scales is NULL
    const int *rows         # row indices, ascending; NULL means rows 0..n_rows-1
    const float *row_scales # one scale per entry of rows, or NULL
    Py_ssize_t n_rows
    int pre                 # a PRE_* value
    const float *pre_mul    # (d_out,) or NULL
    const float *pre_add    # (d_out,) or NULL
    bint direct             # one product: x through b alone (A is the identity)
    bint b_rows             # b is B as stored, (d_out, rank), not B^T


cdef inline bint rows_consecutive(const int *rows, Py_ssize_t start,
                                  Py_ssize_t count) noexcept nogil:
    # rows are strictly ascending, so first/last tell whether they are a run
    if rows == NULL:
        return True
    return rows[start + count - 1] - rows[start] == count - 1


cdef inline Py_ssize_t seg_row(const Segment *s, Py_ssize_t i) noexcept nogil:
    """The batch row of the segment's ``i``-th row."""
    return s.rows[i] if s.rows != NULL else i


cdef inline float seg_scale(const Segment *s, Py_ssize_t i) noexcept nogil:
    """The scale of the segment's ``i``-th row."""
    return s.row_scales[i] if s.row_scales != NULL else s.scale


cdef inline int half_of(int rows_kind) noexcept nogil:
    """The ``halfconv.h`` kind of 16-bit rows of ``ROWS_F16`` / ``ROWS_BF16``."""
    return LORAHOOK_HALF_F16 if rows_kind == ROWS_F16 else LORAHOOK_HALF_BF16


cdef inline void seg_pre(const Segment *s, float *y, Py_ssize_t o0, Py_ssize_t n) noexcept nogil:
    """What a row becomes before the delta is added (columns ``o0..o0+n`` of it, at ``y``)."""
    if s.pre == PRE_AFFINE:
        lorahook_affine(y, s.pre_mul + o0, s.pre_add + o0, <size_t>n)
    elif s.pre == PRE_REPLACE:
        if s.pre_add != NULL:
            memcpy(y, s.pre_add + o0, n * sizeof(float))
        else:
            memset(y, 0, n * sizeof(float))


cdef inline float seg_shrink(const Segment *s, Py_ssize_t k, int c, const float *X, int ldx,
                             int d_in, float *T, const float **tp, int *ldt) noexcept nogil:
    """``T = X A^T`` for the ``c`` rows of ``X`` (the segment's rows ``k..k+c``).

    ``tp`` / ``ldt`` receive the product's rows and row stride: ``T``, or
    ``X`` itself for a segment of one product (it has no per-row scales).
    Per-row scales are folded into ``T``; returns the scale the product with
    ``b`` then takes (1, or the segment's one scale).
    """
    cdef int j
    if s.direct:
        tp[0], ldt[0] = X, ldx
        return s.scale
    tp[0], ldt[0] = T, s.rank
    _blas.gemm(False, True, c, s.rank, d_in, 1.0, X, ldx, s.a, d_in, 0.0, T, s.rank)
    if s.row_scales == NULL:
        return s.scale
    for j in range(c):
        _blas.scal(s.rank, s.row_scales[k + j], T + j * s.rank)
    return 1.0


cdef inline void seg_up(const Segment *s, int c, Py_ssize_t o0, int ob, int d_out, float alpha,
                        const float *tp, int ldt, float beta, float *out, int ldo) noexcept nogil:
    """``out = alpha * tp B^T[:, o0:o0+ob] + beta * out`` for ``c`` rows (``out`` row stride ``ldo``).

    Columns ``o0 .. o0+ob`` of the product: a block of ``B^T``'s columns, or of ``B``'s rows.
    """
    if s.b_rows:
        _blas.gemm(False, True, c, ob, s.rank, alpha, tp, ldt, s.b + o0 * s.rank, s.rank, beta,
                   out, ldo)
    else:
        _blas.gemm(False, False, c, ob, s.rank, alpha, tp, ldt, s.b + o0, d_out, beta, out, ldo)


cdef inline int gemm_rows(const Segment *s, const char *X, Py_ssize_t ldx, int xk, char *Y,
                          Py_ssize_t ldy, int yk, int d_in, int d_out, bint add) noexcept nogil:
    """The segment's rows of ``X`` through its float32 factors into ``Y``.

    ``X`` / ``Y`` hold rows of ``d_in`` / ``d_out`` values of kind ``xk`` /
    ``yk`` (``ROWS_*``) with row strides ``ldx`` / ``ldy`` (elements).  For
    each row ``r`` of the segment, its ``pre`` step, then ``y[r] += s_r * b
    (a x[r])`` (``=`` without ``add``; a segment with a ``pre`` step always
    adds), then ``s_r * bias``; each 16-bit output value is rounded once.
    Returns -1 without scratch memory.

    A chunk of rows that is one run of float32 input rows is read in place,
    else gathered (widened) into scratch; its product with ``A`` is one
    matrix product.  Into a run of float32 output rows the product with
    ``B^T`` is one more; else the chunk's output is written back a block of
    columns at a time (``LH_BLOCK_FLOATS`` floats for the chunk), so that a
    block is read (widened), added to by one product and written (rounded)
    while it is in cache.
    """
    cdef Py_ssize_t n = s.n_rows, k, j, r, r0, o0
    cdef int rank = s.rank, q, ob, owned = 0, lx, lt
    if rank == 0 or n == 0:
        return 0
    cdef bint whole = rows_consecutive(s.rows, 0, n)
    cdef bint gather_x = xk != ROWS_F32 or not whole
    cdef bint scatter_y = yk != ROWS_F32 or not whole
    cdef bint reads_y = add or s.pre != PRE_NONE
    # per row of a chunk: G (gathered input), T (the product with A); D, a block of the
    # chunk's output rows
    cdef Py_ssize_t g_cols = d_in if gather_x else 0
    cdef Py_ssize_t t_cols = 0 if s.direct else rank
    cdef Py_ssize_t per_row = g_cols + t_cols
    cdef Py_ssize_t chunk = n, block = 0
    if per_row > 0 and chunk > <Py_ssize_t>LORAHOOK_SCRATCH_CACHE_FLOATS // per_row:
        chunk = <Py_ssize_t>LORAHOOK_SCRATCH_CACHE_FLOATS // per_row
    if (gather_x or scatter_y) and chunk > LH_GATHER_CHUNK_ROWS:
        chunk = LH_GATHER_CHUNK_ROWS
    if chunk < 1:
        chunk = 1
    if scatter_y:
        # wider blocks for higher ranks, whose product has more to do per block
        block = LH_BLOCK_FLOATS * (1 + t_cols // 32) // chunk
        if block < LH_BLOCK_MIN_COLS:
            block = LH_BLOCK_MIN_COLS
        if block > d_out:
            block = d_out
    cdef float *G = lorahook_scratch_area(<size_t>(chunk * (per_row + block)), LH_SCRATCH_PRODUCTS,
                                          &owned)
    if G == NULL:
        return -1
    cdef float *T = G + chunk * g_cols
    cdef float *D = T + chunk * t_cols
    cdef float alpha
    cdef const float *xp
    cdef const float *tp
    cdef float *yr
    cdef int hx = half_of(xk), hy = half_of(yk)
    cdef bint consecutive
    k = 0
    while k < n:
        q = <int>(chunk if n - k > chunk else n - k)
        consecutive = rows_consecutive(s.rows, k, q)
        r0 = seg_row(s, k)
        # the input rows, as float32 with row stride lx
        if xk == ROWS_F32 and consecutive:
            xp, lx = <const float *>X + r0 * ldx, <int>ldx
        else:
            for j in range(q):
                r = seg_row(s, k + j)
                if xk == ROWS_F32:
                    memcpy(G + j * d_in, <const float *>X + r * ldx, d_in * sizeof(float))
                else:
                    widen_h(<const uint16_t *>X + r * ldx, G + j * d_in, <size_t>d_in, hx)
            xp, lx = G, d_in
        alpha = seg_shrink(s, k, q, xp, lx, d_in, T, &tp, &lt)
        if yk == ROWS_F32 and consecutive:
            # straight into a run of float32 output rows, each transformed first
            # (transforming blocks in cache between smaller products measured slower:
            # OpenBLAS packs B once per product)
            yr = <float *>Y + r0 * ldy
            if s.pre != PRE_NONE:
                for j in range(q):
                    seg_pre(s, yr + j * ldy, 0, d_out)
            seg_up(s, q, 0, d_out, d_out, alpha, tp, lt, 1.0 if reads_y else 0.0, yr, <int>ldy)
            if s.bias != NULL:
                for j in range(q):
                    _blas.axpy(d_out, seg_scale(s, k + j), s.bias, yr + j * ldy)
            k += q
            continue
        o0 = 0
        while o0 < d_out:
            ob = <int>(block if d_out - o0 > block else d_out - o0)
            if reads_y:  # the block of each output row, as float32, transformed
                for j in range(q):
                    r = seg_row(s, k + j)
                    if yk == ROWS_F32:
                        memcpy(D + j * ob, <const float *>Y + r * ldy + o0, ob * sizeof(float))
                    else:
                        widen_h(<const uint16_t *>Y + r * ldy + o0, D + j * ob,
                                 <size_t>ob, hy)
                    seg_pre(s, D + j * ob, o0, ob)
            seg_up(s, q, o0, ob, d_out, alpha, tp, lt, 1.0 if reads_y else 0.0, D, ob)
            for j in range(q):  # each row's block written back, a 16-bit one rounded once
                r = seg_row(s, k + j)
                if s.bias != NULL:
                    _blas.axpy(ob, seg_scale(s, k + j), s.bias + o0, D + j * ob)
                if yk == ROWS_F32:
                    memcpy(<float *>Y + r * ldy + o0, D + j * ob, ob * sizeof(float))
                else:
                    narrow_h(D + j * ob, <uint16_t *>Y + r * ldy + o0, <size_t>ob, hy)
            o0 += ob
        k += q
    if owned:
        free(G)
    return 0
