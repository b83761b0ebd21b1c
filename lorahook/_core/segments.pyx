# cython: language_level=3
"""The segment kernels: adapter factors applied to rows of checked buffers, without the GIL.

A :c:type:`~lorahook._core.gemm_rows.Segment` is one layer's factors on a set of
rows of one projection.  For ``n`` rows through it (``A`` is ``(rank,
d_in)``, ``B`` is ``(d_out, rank)``) the update is ``Y += s * (X A^T) B^T``:

* below the crossover (:func:`get_gemm_crossover` rows) each row gets two
  matrix-vector products: ``t = A x`` then ``y += s * B t``;
* at or above it, the rows go through :c:func:`~lorahook._core.gemm_rows.gemm_rows`,
  float32 and 16-bit rows alike: two matrix-matrix products a chunk of rows
  at a time, rows that are not one run of float32 rows gathered (widened)
  into scratch, and their output written back a block of columns at a time,
  each 16-bit value rounded once;
* 16-bit rows below the crossover are widened a chunk at a time into
  float32 rows for the row loop, and rounded back once (:c:func:`_run_half_rows`);
* an embedding segment gathers columns of ``A`` by id (:c:func:`run_embedding_segments`);
* int8 factors (``int8.h``) are read in place, a few rows at a time, at every
  row count (:c:func:`_run_int8`): each value is widened in a register, never
  into a copy of the factor.

``B`` is kept in one layout only, ``B^T`` row-major (``(rank, d_out)``), so
both products with it stream memory.  Every product goes through the
row-major helpers of ``blas.pxd``; 16-bit rows and weights are widened
through ``lorahook._core.halfconv``.  Kernels run on the calling thread with the
GIL released; this module starts no thread.  Different paths may differ in
the last bits of float32 rounding: a row's result can depend on the batch it
was computed in.  The callers (``lorahook._core.plans``: a layer, a plan of
groups) check every buffer first, with ``lorahook._core.checks``.
"""
cimport numpy as cnp
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

from lorahook._core cimport blas as _blas
from lorahook._core.checks cimport ROWS_F32, as_width
from lorahook._core.halfconv cimport isa_cell, lh_isa_attach, narrow_h, widen_h
from lorahook._core.gemm_rows cimport LH_SCRATCH_PRODUCTS, LH_SCRATCH_WEIGHTS, LH_SCRATCH_WIDENED
from lorahook._core.gemm_rows cimport PRE_NONE, WKIND_INT8, Segment, gemm_rows, half_of
from lorahook._core.gemm_rows cimport lorahook_scratch_area
from lorahook._core.gemm_rows cimport seg_shrink, seg_pre, seg_row, seg_scale
from scipy.linalg.cython_blas cimport sgemm

cnp.import_array()
lh_isa_attach(isa_cell())  # the process's instruction-set target (isa.h)

cdef extern from "int8.h" nogil:
    enum:
        LH_I8_ROWS
    void lorahook_i8_shrink(const signed char *a8, const float *sa, int rank, int d_in,
                          const float *const *x, int nx, const float *alpha, float *t) noexcept
    void lorahook_i8_expand(const signed char *bt8, const float *sb, int rank, int d_out,
                        const float *t, int nx, float *const *y) noexcept

cdef extern from "blas_path.h" nogil:
    char *lorahook_blas_path
    void lorahook_find_blas(void *blas_caller) noexcept

# Rows at or above which a single adapter segment uses the sgemm pair instead
# of one sgemv pair per row.
cdef Py_ssize_t _gemm_crossover = 32

# Called once, with the GIL, before the first batched (sgemm) kernel of the
# process runs; set by lorahook.threads (its BLAS pool check).
cdef object _first_batched = None
cdef bint _batched_seen = False

def set_first_batched(fn):
    """Set the callable run once before the process's first batched kernel."""
    global _first_batched
    _first_batched = fn


def get_gemm_crossover():
    """Rows from which a batch through one adapter layer uses ``sgemm``."""
    return _gemm_crossover


def set_gemm_crossover(n):
    """Set the row count from which the ``sgemm`` path is used (``n >= 1``).

    ``1`` forces the batched path for every batch, a huge value forces the
    row loop.  Returns the previous value.
    """
    global _gemm_crossover
    n = as_width(n, "n")
    old = _gemm_crossover
    _gemm_crossover = n
    return old


def blas_library_path():
    """The file of the BLAS library the kernels call, or ``None`` when unknown."""
    path = <bytes>lorahook_blas_path
    return path.decode("utf-8", "surrogateescape") if path else None


lorahook_find_blas(<void *>sgemm)


# ---------------------------------------------------------------------------
# kernels (no Python objects, no GIL)
# ---------------------------------------------------------------------------

cdef int _row_loop(const Segment *s, const float *X, float *Y, int d_in, int d_out) noexcept nogil:
    """One segment of float32 weights on float32 rows, two ``sgemv`` a row; -1 without memory."""
    cdef int rank = s.rank, owned = 0
    cdef Py_ssize_t n = s.n_rows, i, r
    cdef float alpha
    cdef float *yr
    cdef float *t = NULL
    if not s.direct:  # t = A x; a saved module's rows are one product and need none
        t = lorahook_scratch_area(<size_t>rank, LH_SCRATCH_PRODUCTS, &owned)
        if t == NULL:
            return -1
    for i in range(n):
        r = seg_row(s, i)
        alpha = seg_scale(s, i)
        yr = Y + r * d_out
        seg_pre(s, yr, 0, d_out)
        if s.direct:  # y += a W x
            _blas.gemv(True, rank, d_out, alpha, s.b, d_out, X + r * d_in, 1.0, yr)
            continue
        _blas.gemv(False, rank, d_in, 1.0, s.a, d_in, X + r * d_in, 0.0, t)   # t = A x
        _blas.gemv(True, rank, d_out, alpha, s.b, d_out, t, 1.0, yr)        # y += a B t
        if s.bias != NULL:
            _blas.axpy(d_out, alpha, s.bias, yr)
    if owned:
        free(t)
    return 0


cdef inline void _widen_rows(const Segment *s, Py_ssize_t k, int c, const uint16_t *src,
                             int width, float *dst, int hk) noexcept nogil:
    """Widen the segment's rows ``k..k+c`` of ``src`` (rows of ``width``) into ``dst``, packed."""
    cdef int j
    for j in range(c):
        widen_h(src + seg_row(s, k + j) * width, dst + j * width, width, hk)


# Half-precision rows below the crossover: the floats of one chunk's widened
# input and output rows.
cdef enum:
    _HALF_ROWS_CHUNK_FLOATS = 1 << 18


cdef int _run_half_rows(const Segment *s, const uint16_t *X, uint16_t *Y, int d_in, int d_out,
                        int hk) noexcept nogil:
    """Half-precision rows below the crossover: widened, the float32 row loop, rounded once.

    Each chunk's input and output rows are widened into scratch, the float32
    row kernel adds each delta to the widened output, and each output row is
    rounded back once, to nearest even.
    """
    cdef Segment seg = s[0]
    cdef Py_ssize_t n = s.n_rows, k, j, cap, chunk
    cdef int c, owned = 0, rc = 0
    cap = <Py_ssize_t>_HALF_ROWS_CHUNK_FLOATS // (<Py_ssize_t>d_in + d_out)
    chunk = n if n < cap else cap
    if chunk < 1:
        chunk = 1
    cdef float *G = lorahook_scratch_area(<size_t>chunk * (<size_t>d_in + d_out), LH_SCRATCH_WIDENED,
                                          &owned)
    if G == NULL:
        return -1
    cdef float *D = G + chunk * d_in
    k = 0
    while k < n:
        c = <int>(chunk if n - k > chunk else n - k)
        _widen_rows(s, k, c, X, d_in, G, hk)
        _widen_rows(s, k, c, Y, d_out, D, hk)
        seg.rows = NULL
        seg.n_rows = c
        seg.row_scales = s.row_scales + k if s.row_scales != NULL else NULL
        rc = _row_loop(&seg, G, D, d_in, d_out)
        if rc != 0:
            break
        for j in range(c):
            narrow_h(D + j * d_out, Y + seg_row(s, k + j) * d_out, d_out, hk)
        k += c
    if owned:
        free(G)
    return rc


cdef int _run_int8(const Segment *s, const char *X, char *Y, int d_in, int d_out, int kind) noexcept nogil:
    """One segment of int8 factors on rows of any kind, ``LH_I8_ROWS`` rows per step.

    float32 rows are read and written in place; 16-bit rows are widened into
    scratch and rounded back once.  Each step reads the factors once for its
    rows (``int8.h``).  An int8 segment has no ``pre`` step (LayerKernel
    takes one with float32 factors only).  Returns -1 without memory.
    """
    cdef Py_ssize_t n = s.n_rows, k, r
    cdef int rank = s.rank, c, j, owned = 0, hk = half_of(kind)
    cdef const float *xs[LH_I8_ROWS]
    cdef float *ys[LH_I8_ROWS]
    cdef float alphas[LH_I8_ROWS]
    cdef size_t widened = 0 if kind == ROWS_F32 else <size_t>LH_I8_ROWS * (d_in + d_out)
    cdef float *T = lorahook_scratch_area(<size_t>LH_I8_ROWS * rank + widened, LH_SCRATCH_PRODUCTS,
                                          &owned)
    if T == NULL:
        return -1
    cdef float *G = T + LH_I8_ROWS * rank
    cdef float *D = G + LH_I8_ROWS * d_in
    k = 0
    while k < n:
        c = <int>(LH_I8_ROWS if n - k > LH_I8_ROWS else n - k)
        for j in range(c):
            r = seg_row(s, k + j)
            alphas[j] = seg_scale(s, k + j)
            if kind == ROWS_F32:
                xs[j] = <const float *>X + r * d_in
                ys[j] = <float *>Y + r * d_out
            else:
                widen_h(<const uint16_t *>X + r * d_in, G + j * d_in, d_in, hk)
                widen_h(<const uint16_t *>Y + r * d_out, D + j * d_out, d_out, hk)
                xs[j] = G + j * d_in
                ys[j] = D + j * d_out
        lorahook_i8_shrink(s.a8, s.a_scale, rank, d_in, xs, c, alphas, T)
        lorahook_i8_expand(s.b8, s.b_scale, rank, d_out, T, c, ys)
        for j in range(c):
            if s.bias != NULL:
                _blas.axpy(d_out, alphas[j], s.bias, ys[j])
            if kind != ROWS_F32:
                narrow_h(ys[j], <uint16_t *>Y + seg_row(s, k + j) * d_out, d_out, hk)
        k += c
    if owned:
        free(T)
    return 0


cdef int _run_segment_any(const Segment *s, const char *X, char *Y, int d_in, int d_out,
                          Py_ssize_t crossover, int kind) noexcept nogil:
    """Apply one segment to rows of any kind, with weights of any kind.

    16-bit weights are widened once per call into their scratch area.  The
    kernel path (row loop or batched) is chosen by the whole segment's row
    count, for every row kind.  Returns -1 without memory.
    """
    cdef Segment seg = s[0]
    cdef int owned = 0, rc
    cdef float *W = NULL
    if s.rank == 0 or s.n_rows == 0:
        return 0
    if s.wkind == WKIND_INT8:  # read in place at every row count
        return _run_int8(s, X, Y, d_in, d_out, kind)
    if s.wkind >= 0:
        W = lorahook_scratch_area(<size_t>s.rank * (<size_t>d_in + d_out) + d_out,
                                  LH_SCRATCH_WEIGHTS, &owned)
        if W == NULL:
            return -1
        widen_h(<const uint16_t *>s.a16, W, <size_t>s.rank * d_in, s.wkind)
        widen_h(<const uint16_t *>s.b16, W + <Py_ssize_t>s.rank * d_in,
                <size_t>s.rank * d_out, s.wkind)
        seg.a = W
        seg.b = W + <Py_ssize_t>s.rank * d_in
        if s.bias16 != NULL:
            seg.bias = W + <Py_ssize_t>s.rank * (d_in + d_out)
            widen_h(<const uint16_t *>s.bias16, <float *>seg.bias, d_out, s.wkind)
    if s.n_rows >= crossover:  # any rows: the one batched routine
        rc = gemm_rows(&seg, X, d_in, kind, Y, d_out, kind, d_in, d_out, True)
    elif kind == ROWS_F32:
        rc = _row_loop(&seg, <const float *>X, <float *>Y, d_in, d_out)
    else:
        rc = _run_half_rows(&seg, <const uint16_t *>X, <uint16_t *>Y, d_in, d_out,
                            half_of(kind))
    if owned:
        free(W)
    return rc


# Rows per chunk of an embedding segment.
cdef enum:
    _EMBEDDING_CHUNK_ROWS = 64


cdef int _run_embedding(const Segment *s, const int64_t *ids, char *Y, int num_emb, int d_out,
                        int kind) noexcept nogil:
    """One embedding segment on the rows of checked ids (each in ``[0, num_emb)``).

    LoRA: ``T = s * A[:, ids]`` is gathered per chunk of rows, ``D = T B^T``
    one product, and each row of ``D`` added to its output row (half rows
    widened, added in float32 and rounded once).  A saved embedding (direct)
    replaces each row with ``E[id]``.  int8 factors: ``A``'s values are read
    by id and ``D`` is made by ``int8.h``'s product, ``B`` read in place.
    Returns -1 without memory.
    """
    cdef Py_ssize_t n = s.n_rows, k, r, q
    cdef int rank = s.rank, c, j, owned = 0, owned_w = 0, hk
    cdef float alpha, v
    cdef const float *bt = s.b
    cdef float *W = NULL
    cdef float *yr
    cdef int64_t idx
    cdef float *ys[LH_I8_ROWS]
    cdef Py_ssize_t i
    if n == 0 or rank == 0:
        return 0
    hk = half_of(kind)
    if s.wkind >= 0:  # 16-bit LoRA factors: B widened once, A read per element
        W = lorahook_scratch_area(<size_t>rank * d_out, LH_SCRATCH_WEIGHTS, &owned_w)
        if W == NULL:
            return -1
        widen_h(<const uint16_t *>s.b16, W, <size_t>rank * d_out, s.wkind)
        bt = W
    cdef Py_ssize_t chunk = _EMBEDDING_CHUNK_ROWS if n > _EMBEDDING_CHUNK_ROWS else n
    cdef Py_ssize_t t_cols = 0 if s.direct else rank
    cdef float *T = lorahook_scratch_area(<size_t>chunk * (t_cols + d_out) + d_out, LH_SCRATCH_PRODUCTS,
                                          &owned)
    if T == NULL:
        if owned_w:
            free(W)
        return -1
    cdef float *D = T + chunk * t_cols
    cdef float *R = D + chunk * d_out
    k = 0
    while k < n:
        c = <int>(chunk if n - k > chunk else n - k)
        if s.direct:
            for j in range(c):
                idx = ids[seg_row(s, k + j)]
                memcpy(D + j * d_out, bt + idx * d_out, d_out * sizeof(float))
                alpha = seg_scale(s, k + j)
                if alpha != 1.0:
                    _blas.scal(d_out, alpha, D + j * d_out)
        else:
            for j in range(c):
                idx = ids[seg_row(s, k + j)]
                alpha = seg_scale(s, k + j)
                for q in range(rank):
                    if s.wkind == WKIND_INT8:
                        v = s.a_scale[q] * <float>s.a8[q * num_emb + idx]
                    elif s.wkind >= 0:
                        widen_h(<const uint16_t *>s.a16 + q * num_emb + idx, &v, 1, s.wkind)
                    else:
                        v = s.a[q * num_emb + idx]
                    T[j * rank + q] = alpha * v
            if s.wkind == WKIND_INT8:  # D = T B^T, B read in place a few rows at a time
                memset(D, 0, c * d_out * sizeof(float))
                j = 0
                while j < c:
                    q = c - j if c - j < LH_I8_ROWS else LH_I8_ROWS
                    for i in range(q):
                        ys[i] = D + (j + i) * d_out
                    lorahook_i8_expand(s.b8, s.b_scale, rank, d_out, T + j * rank, <int>q, ys)
                    j += <int>q
            else:
                _blas.gemm(False, False, c, d_out, rank, 1.0, T, rank, bt, d_out, 0.0, D, d_out)
        for j in range(c):
            r = seg_row(s, k + j)
            if kind == ROWS_F32:
                yr = <float *>Y + r * d_out
            else:
                yr = R
                widen_h(<const uint16_t *>Y + r * d_out, R, d_out, hk)
            seg_pre(s, yr, 0, d_out)
            _blas.axpy(d_out, 1.0, D + j * d_out, yr)
            if kind != ROWS_F32:
                narrow_h(R, <uint16_t *>Y + r * d_out, d_out, hk)
        k += c
    if owned:
        free(T)
    if owned_w:
        free(W)
    return 0


cdef int run_embedding_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray ids,
                                cnp.ndarray y, int d_out, int kind) except -1:
    """Run embedding segments one after the other, with the GIL released.

    ``ids`` is a private int64 array whose values were checked against every
    segment's ``num_embeddings`` (its ``d_in``); ``y`` a checked output buffer.
    """
    cdef Py_ssize_t g
    cdef int rc = 0
    cdef const int64_t *I = <const int64_t *>cnp.PyArray_DATA(ids)
    cdef char *Y = <char *>cnp.PyArray_DATA(y)
    with nogil:
        for g in range(ng):
            rc = _run_embedding(&segs[g], I, Y, segs[g].d_in, d_out, kind)
            if rc != 0:
                break
    if rc != 0:
        raise MemoryError("lorahook could not allocate its scratch buffer")
    return 0


cdef int run_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray x, cnp.ndarray y,
                      int d_in, int d_out, int kind) except -1:
    """Run segments one after the other on checked buffers, with the GIL released.

    Every linear path into the kernels ends here.  Segments run in order on
    the calling thread, so two updates of one row never race.
    """
    global _batched_seen
    cdef Py_ssize_t g, crossover = _gemm_crossover
    cdef int rc = 0
    if not _batched_seen:
        # the one-time BLAS check (a warning, lorahook.threads) runs before the
        # buffers' addresses are taken; under -W error it refuses this call,
        # with nothing written
        for g in range(ng):
            if segs[g].rank > 0 and segs[g].n_rows >= crossover:
                _batched_seen = True
                if _first_batched is not None:
                    _first_batched()
                break
    cdef const char *X = <const char *>cnp.PyArray_DATA(x)
    cdef char *Y = <char *>cnp.PyArray_DATA(y)
    with nogil:
        for g in range(ng):
            rc = _run_segment_any(&segs[g], X, Y, d_in, d_out, crossover, kind)
            if rc != 0:
                break
    if rc != 0:
        raise MemoryError("lorahook could not allocate its scratch buffer")
    return 0


