# cython: language_level=3
"""The kernels: adapter layers applied to rows of checked buffers, without the GIL.

For ``n`` rows through one adapter layer (``A`` is ``(rank, d_in)``, ``B`` is
``(d_out, rank)``) the update is ``Y += s * (X A^T) B^T``.

* below the crossover (:func:`get_gemm_crossover` rows) each row gets two
  matrix-vector products: ``t = A x`` then ``y += s * B t``;
* at or above it, rows are processed in chunks with two matrix-matrix
  products, ``T = X A^T`` into a per-thread scratch buffer, then
  ``Y += s * T B^T``.  Rows that are not contiguous in the batch (the grouped
  multi-adapter path) are gathered into scratch and scatter-added back.

``B`` is kept in one layout only, ``B^T`` row-major (``(rank, d_out)``), so
both products with it stream memory; ``LoraLayer.b`` is a read-only view of
it.  Every product goes through the row-major helpers of ``_blas.pxd``.
Half-precision rows and 16-bit weights are widened through
``lorahook._halfconv``.  Kernels run on the calling thread with the GIL
released; this module starts no thread.  Different paths may differ in the
last bits of float32 rounding: a row's result can depend on the batch it was
computed in.

Every way in takes buffers the caller has checked with ``lorahook._checks``:
:c:func:`run_segments` (rows of a linear projection) and
:c:func:`run_embedding_segments` (embedding ids) run the kernels; over them,
:c:func:`run_layer` (one layer), :meth:`GroupPlan.run` / ``run_ids`` (a bound
batch's groups) and, from Python, :func:`apply_layer` (which checks first).
"""
cimport cython
cimport numpy as cnp
from libc.limits cimport INT_MAX
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset

from lorahook cimport _blas
from lorahook._checks cimport ROWS_F16, ROWS_F32, as_width, check_buffers
from lorahook._halfconv cimport LORAHOOK_HALF_BF16, LORAHOOK_HALF_F16, active_path
from lorahook._halfconv cimport narrow_on, widen_on
from scipy.linalg.cython_blas cimport sgemm

import numpy as np

cnp.import_array()

cdef extern from "_kernels.h" nogil:
    float *lorahook_scratch_slot(size_t n, int slot, int *owned) noexcept
    size_t LORAHOOK_SCRATCH_CACHE_FLOATS
    char *lorahook_blas_path
    void lorahook_find_blas(void *blas_caller) noexcept
    void lorahook_affine(float *y, const float *m, const float *c, size_t n) noexcept

# Per-thread scratch areas (see _kernels.h).
cdef enum:
    _SCRATCH_F32 = 0     # the float32 kernels
    _SCRATCH_ROWS = 1    # half-precision rows widened to float32
    _SCRATCH_WEIGHTS = 2 # 16-bit adapter weights widened to float32

# Rows at or above which a single adapter segment uses the sgemm pair instead
# of one sgemv pair per row.
cdef Py_ssize_t _gemm_crossover = 32

# Called once, with the GIL, before the first batched (sgemm) kernel of the
# process runs; set by lorahook.threads (its BLAS pool check).
cdef object _first_batched = None
cdef bint _batched_seen = False


#: What a LayerKernel computes (its ``kind``): a linear LoRA layer (DoRA
#: included), an embedding LoRA layer, a saved linear module, a saved embedding.
LORA = KIND_LORA
EMBEDDING = KIND_EMBEDDING
SAVED_LINEAR = KIND_SAVED_LINEAR
SAVED_EMBEDDING = KIND_SAVED_EMBEDDING


def _set_first_batched(fn):
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


def _blas_library_path():
    """The file of the BLAS library the kernels call, or ``None`` when unknown."""
    path = <bytes>lorahook_blas_path
    return path.decode("utf-8", "surrogateescape") if path else None


lorahook_find_blas(<void *>sgemm)


# ---------------------------------------------------------------------------
# adapter layers
# ---------------------------------------------------------------------------

@cython.final
@cython.auto_pickle(False)
cdef class LayerKernel:
    """Typed views of one adapter layer's arrays, made once at construction.

    ``a`` is ``(rank, d_in)``, ``bt`` is ``B^T``, ``(rank, d_out)``, ``bias``
    is ``(d_out,)`` or ``None``; all C-contiguous.  ``bias`` is float32; ``a``
    and ``bt`` are float32, or with ``weights="float16"`` / ``"bfloat16"``
    uint16 arrays of those 16-bit patterns (the bias too), widened to float32
    in per-thread scratch on every call.  The owning :class:`~lorahook.LoraLayer` validates
    values; this class re-checks the shapes it relies on so that no kernel can
    read past an array.
    """

    def __cinit__(self, a, bt, scale, bias=None, weights="float32", *, int kind=KIND_LORA,
                  pre_mul=None, pre_add=None, bint needs_base=False):
        cdef Py_ssize_t rank, d_in, d_out, bt_rank
        if kind not in (KIND_LORA, KIND_EMBEDDING, KIND_SAVED_LINEAR, KIND_SAVED_EMBEDDING):
            raise ValueError(f"kind must be one of the KIND_* values, got {kind}")
        self.kind = kind
        self.needs_base = needs_base
        if kind == KIND_SAVED_LINEAR or kind == KIND_SAVED_EMBEDDING:
            # a module saved whole: bt is W^T (d_in, d_out) or the table E (num_embeddings, dim)
            if a is not None or bias is not None or weights != "float32" or pre_mul is not None:
                raise ValueError("a saved module's kernel takes bt (and pre_add as its bias) only, "
                                 "in float32")
            self.wkind = -1
            self.bt = bt
            d_in, d_out = self.bt.shape[0], self.bt.shape[1]
            if d_in < 1 or d_out < 1 or d_in > INT_MAX or d_out > INT_MAX:
                raise ValueError(f"a saved module's dimensions must be in [1, {INT_MAX}], "
                                 f"got ({d_in}, {d_out})")
            self.rank = <int>d_in
            self.d_in = <int>d_in
            self.d_out = <int>d_out
            self.scale = <float>scale
            self.has_bias = False
            self.pre = 2
            if pre_add is not None:
                self.pre_add = pre_add
                self.has_pre_add = True
                if self.pre_add.shape[0] != d_out:
                    raise ValueError(f"pre_add must have shape ({d_out},), got ({self.pre_add.shape[0]},)")
            return
        if (pre_mul is None) != (pre_add is None):
            raise ValueError("pre_mul and pre_add go together")
        if weights == "float32":
            self.wkind = -1
            self.a = a
            self.bt = bt
            rank, d_in = self.a.shape[0], self.a.shape[1]
            bt_rank, d_out = self.bt.shape[0], self.bt.shape[1]
        elif weights in ("float16", "bfloat16"):
            self.wkind = LORAHOOK_HALF_F16 if weights == "float16" else LORAHOOK_HALF_BF16
            self.a16 = a
            self.bt16 = bt
            rank, d_in = self.a16.shape[0], self.a16.shape[1]
            bt_rank, d_out = self.bt16.shape[0], self.bt16.shape[1]
        else:
            raise ValueError(f"weights must be 'float32', 'float16' or 'bfloat16', got {weights!r}")
        if bt_rank != rank:
            raise ValueError(f"bt must have shape ({rank}, d_out), got {bt_rank, d_out}")
        if d_in < 1 or d_out < 1:
            raise ValueError(f"d_in and d_out must be >= 1, got ({d_in}, {d_out})")
        if rank > INT_MAX or d_in > INT_MAX or d_out > INT_MAX:
            raise ValueError(f"layer dimensions must each be at most {INT_MAX}")
        self.rank = <int>rank
        self.d_in = <int>d_in
        self.d_out = <int>d_out
        self.scale = <float>scale
        self.has_bias = bias is not None
        if self.has_bias and rank == 0:
            raise ValueError("a rank-0 layer cannot carry a bias")
        cdef Py_ssize_t bias_len = 0
        if self.has_bias and self.wkind < 0:
            self.bias = bias
            bias_len = self.bias.shape[0]
        elif self.has_bias:
            self.bias16 = bias
            bias_len = self.bias16.shape[0]
        if self.has_bias and bias_len != d_out:
            raise ValueError(f"bias must have shape ({d_out},), got ({bias_len},)")
        if pre_mul is not None:
            if self.wkind >= 0 or kind != KIND_LORA:
                raise ValueError("pre_mul / pre_add go with float32 linear LoRA kernels only")
            self.pre = 1
            self.pre_mul = pre_mul
            self.pre_add = pre_add
            self.has_pre_add = True
            if self.pre_mul.shape[0] != d_out or self.pre_add.shape[0] != d_out:
                raise ValueError(f"pre_mul and pre_add must have shape ({d_out},)")

    def __reduce__(self):
        raise TypeError("LayerKernel is rebuilt from its LoraLayer and does not pickle")

    cdef void fill(self, Segment *s) noexcept:
        s.wkind = self.wkind
        s.a = NULL
        s.b = NULL
        s.a16 = NULL
        s.b16 = NULL
        s.direct = self.kind == KIND_SAVED_LINEAR or self.kind == KIND_SAVED_EMBEDDING
        if s.direct:
            s.b = &self.bt[0, 0]
        elif self.rank > 0 and self.wkind < 0:
            s.a = &self.a[0, 0]
            s.b = &self.bt[0, 0]
        elif self.rank > 0:
            s.a16 = &self.a16[0, 0]
            s.b16 = &self.bt16[0, 0]
        s.bias = &self.bias[0] if self.has_bias and self.wkind < 0 else NULL
        s.bias16 = &self.bias16[0] if self.has_bias and self.wkind >= 0 else NULL
        s.rank = self.rank
        s.scale = self.scale
        s.rows = NULL
        s.row_scales = NULL
        s.n_rows = 0
        s.pre = self.pre
        s.d_in = self.d_in
        s.pre_mul = &self.pre_mul[0] if self.pre == 1 else NULL
        s.pre_add = &self.pre_add[0] if self.has_pre_add else NULL


# ---------------------------------------------------------------------------
# kernels (no Python objects, no GIL)
# ---------------------------------------------------------------------------

cdef inline bint _rows_consecutive(const int *rows, Py_ssize_t start, Py_ssize_t count) noexcept nogil:
    # rows are strictly ascending, so first/last tell whether they are a run
    if rows == NULL:
        return True
    return rows[start + count - 1] - rows[start] == count - 1


cdef inline Py_ssize_t _row(const Segment *s, Py_ssize_t i) noexcept nogil:
    """The batch row of the segment's ``i``-th row."""
    return s.rows[i] if s.rows != NULL else i


cdef inline float _scale(const Segment *s, Py_ssize_t i) noexcept nogil:
    """The scale of the segment's ``i``-th row."""
    return s.row_scales[i] if s.row_scales != NULL else s.scale


cdef inline void _pre(const Segment *s, float *y, Py_ssize_t o0, Py_ssize_t n) noexcept nogil:
    """What a row becomes before the delta is added (columns ``o0..o0+n`` of it, at ``y``)."""
    if s.pre == 1:  # DoRA: g * y + (1 - g) * b
        lorahook_affine(y, s.pre_mul + o0, s.pre_add + o0, <size_t>n)
    elif s.pre == 2:  # replaced: the saved module's bias, or zeros
        if s.pre_add != NULL:
            memcpy(y, s.pre_add + o0, n * sizeof(float))
        else:
            memset(y, 0, n * sizeof(float))


cdef inline float _down(const Segment *s, Py_ssize_t k, int c, const float *X, int d_in,
                        float *T, const float **tp) noexcept nogil:
    """``T = X A^T`` for the ``c`` rows of ``X`` (the segment's rows ``k..k+c``).

    ``tp`` receives the product's rows: ``T``, or ``X`` itself for a direct
    segment (``A`` is the identity; it has no per-row scales).  Per-row scales
    are folded into ``T``; returns the scale the product with ``B`` then takes
    (1, or the segment's one scale).
    """
    cdef int j
    if s.direct:
        tp[0] = X
        return s.scale
    tp[0] = T
    _blas.gemm(False, True, c, s.rank, d_in, 1.0, X, d_in, s.a, d_in, 0.0, T, s.rank)
    if s.row_scales == NULL:
        return s.scale
    for j in range(c):
        _blas.scal(s.rank, s.row_scales[k + j], T + j * s.rank)
    return 1.0


cdef int _run_segment(const Segment *s, const float *X, float *Y, int d_in, int d_out,
                      Py_ssize_t crossover) noexcept nogil:
    """Apply one segment of float32 weights to float32 rows; -1 without scratch memory."""
    cdef int rank = s.rank
    cdef Py_ssize_t n = s.n_rows
    if rank == 0 or n == 0:
        return 0
    cdef float alpha
    cdef const float *xr
    cdef const float *tp
    cdef float *yr
    cdef float *t
    cdef float *scratch
    cdef float *G
    cdef float *D
    cdef int owned = 0
    cdef Py_ssize_t i, j, k, r, r0, chunk, per_row, cap
    cdef int c
    cdef bint consecutive
    cdef bint gather = s.rows != NULL and not _rows_consecutive(s.rows, 0, n)

    if n < crossover:
        t = lorahook_scratch_slot(<size_t>rank, _SCRATCH_F32, &owned)
        if t == NULL:
            return -1
        for i in range(n):
            r = _row(s, i)
            alpha = _scale(s, i)
            yr = Y + r * d_out
            if s.pre:
                _pre(s, yr, 0, d_out)
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

    # batched: chunks sized so scratch stays within the per-thread cache
    per_row = <Py_ssize_t>rank + (<Py_ssize_t>d_in + d_out if gather else 0)
    cap = <Py_ssize_t>LORAHOOK_SCRATCH_CACHE_FLOATS // per_row
    chunk = n if n < cap else cap
    if chunk < 1:
        chunk = 1
    scratch = lorahook_scratch_slot(<size_t>(chunk * per_row), _SCRATCH_F32, &owned)
    if scratch == NULL:
        return -1
    t = scratch
    G = scratch + chunk * rank
    D = G + chunk * d_in
    k = 0
    while k < n:
        c = <int>(chunk if n - k > chunk else n - k)
        consecutive = _rows_consecutive(s.rows, k, c)
        r0 = _row(s, k)
        if consecutive:
            xr = X + r0 * d_in
        else:
            for j in range(c):
                memcpy(G + j * d_in, X + <Py_ssize_t>s.rows[k + j] * d_in, d_in * sizeof(float))
            xr = G
        alpha = _down(s, k, c, xr, d_in, t, &tp)
        if s.pre:  # each row transformed, then the delta added by one product
            # (transforming blocks in cache between smaller products measured slower:
            # OpenBLAS packs B once per product)
            for j in range(c):
                _pre(s, Y + _row(s, k + j) * d_out, 0, d_out)
        if consecutive:  # Y += alpha T B^T
            _blas.gemm(False, False, c, d_out, rank, alpha, tp, rank, s.b, d_out, 1.0,
                       Y + r0 * d_out, d_out)
        else:
            _blas.gemm(False, False, c, d_out, rank, alpha, tp, rank, s.b, d_out, 0.0, D, d_out)
            for j in range(c):
                _blas.axpy(d_out, 1.0, D + j * d_out, Y + <Py_ssize_t>s.rows[k + j] * d_out)
        if s.bias != NULL:
            for j in range(c):
                _blas.axpy(d_out, _scale(s, k + j), s.bias, Y + _row(s, k + j) * d_out)
        k += c
    if owned:
        free(scratch)
    return 0


cdef inline void _widen_rows(const Segment *s, Py_ssize_t k, int c, const uint16_t *src,
                             int width, float *dst, int hk, int hp) noexcept nogil:
    """Widen the segment's rows ``k..k+c`` of ``src`` (rows of ``width``) into ``dst``, packed."""
    cdef int j
    for j in range(c):
        widen_on(hp, src + _row(s, k + j) * width, dst + j * width, width, hk)


# Half-precision batches: rows per chunk, and the floats of one block of the
# delta (a block of output columns for every row of a chunk), kept in L1/L2.
cdef enum:
    _HALF_CHUNK_ROWS = 32
    _HALF_BLOCK_FLOATS = 4096


cdef int _run_half_batched(const Segment *s, const uint16_t *X, uint16_t *Y, int d_in, int d_out,
                           int hk, int hp) noexcept nogil:
    """Half-precision rows at or above the crossover, the output never widened whole.

    Per chunk of ``_HALF_CHUNK_ROWS`` rows: the input rows are widened into
    scratch and ``T = X A^T`` is one product; then, a block of output columns
    at a time, the rows' block of the output is widened into ``D``,
    ``D += s * T B_block^T`` and each row's block is rounded back once.  ``D``
    stays in L1 (blocks widen with the rank, whose product has more to do);
    ``s`` holds float32 weights.
    """
    cdef int rank = s.rank
    cdef Py_ssize_t n = s.n_rows, k, j, r, o0
    cdef int c, ob, block, owned = 0
    cdef float alpha
    cdef const float *tp
    # more rows per chunk and wider blocks for higher ranks, where each product
    # has more to do; rank 16: 32 rows, blocks of 128 output columns
    cdef int grow = 1 + (rank - 1) // 16
    if grow > 8:
        grow = 8
    cdef Py_ssize_t chunk = _HALF_CHUNK_ROWS * grow
    if chunk > n:
        chunk = n
    block = <int>(_HALF_BLOCK_FLOATS * grow // chunk)
    if block > d_out:
        block = d_out
    if block < 16:
        block = 16 if d_out >= 16 else d_out
    cdef float *G = lorahook_scratch_slot(
        <size_t>chunk * (<size_t>d_in + rank + block), _SCRATCH_ROWS, &owned)
    if G == NULL:
        return -1
    cdef float *T = G + chunk * d_in
    cdef float *D = T + chunk * rank
    k = 0
    while k < n:
        c = <int>(chunk if n - k > chunk else n - k)
        _widen_rows(s, k, c, X, d_in, G, hk, hp)
        alpha = _down(s, k, c, G, d_in, T, &tp)
        o0 = 0
        while o0 < d_out:
            ob = <int>(block if d_out - o0 > block else d_out - o0)
            for j in range(c):  # the block of each output row, widened
                widen_on(hp, Y + _row(s, k + j) * d_out + o0, D + j * ob, ob, hk)
                if s.pre:
                    _pre(s, D + j * ob, o0, ob)
            # D (c, ob) += alpha T B^T[:, o0:o0+ob]
            _blas.gemm(False, False, c, ob, rank, alpha, tp, rank, s.b + o0, d_out, 1.0, D, ob)
            for j in range(c):  # each output row's block rounded once
                r = _row(s, k + j)
                if s.bias != NULL:
                    _blas.axpy(ob, _scale(s, k + j), s.bias + o0, D + j * ob)
                narrow_on(hp, D + j * ob, Y + r * d_out + o0, ob, hk)
            o0 += ob
        k += c
    if owned:
        free(G)
    return 0


cdef int _run_half_rows(const Segment *s, const uint16_t *X, uint16_t *Y, int d_in, int d_out,
                        int hk, int hp) noexcept nogil:
    """Half-precision rows below the crossover: widened, the float32 row loop, rounded once.

    Each chunk's input and output rows are widened into scratch, the float32
    row kernel adds each delta to the widened output, and each output row is
    rounded back once, to nearest even.
    """
    cdef Segment seg = s[0]
    cdef Py_ssize_t n = s.n_rows, k, j, cap, chunk
    cdef int c, owned = 0, rc = 0
    cap = <Py_ssize_t>(1 << 18) // (<Py_ssize_t>d_in + d_out)
    chunk = n if n < cap else cap
    if chunk < 1:
        chunk = 1
    cdef float *G = lorahook_scratch_slot(<size_t>chunk * (<size_t>d_in + d_out), _SCRATCH_ROWS,
                                          &owned)
    if G == NULL:
        return -1
    cdef float *D = G + chunk * d_in
    k = 0
    while k < n:
        c = <int>(chunk if n - k > chunk else n - k)
        _widen_rows(s, k, c, X, d_in, G, hk, hp)
        _widen_rows(s, k, c, Y, d_out, D, hk, hp)
        seg.rows = NULL
        seg.n_rows = c
        seg.row_scales = s.row_scales + k if s.row_scales != NULL else NULL
        rc = _run_segment(&seg, G, D, d_in, d_out, c + 1)  # c + 1: every chunk takes the row loop
        if rc != 0:
            break
        for j in range(c):
            narrow_on(hp, D + j * d_out, Y + _row(s, k + j) * d_out, d_out, hk)
        k += c
    if owned:
        free(G)
    return rc


cdef int _run_segment_any(const Segment *s, const char *X, char *Y, int d_in, int d_out,
                          Py_ssize_t crossover, int kind, int hp) noexcept nogil:
    """Apply one segment to rows of any kind, with weights of any kind.

    16-bit weights are widened once per call into their scratch area.  The
    kernel path (row loop or batched) is chosen by the whole segment's row
    count, for every row kind.  Returns -1 without memory.
    """
    cdef Segment seg = s[0]
    cdef int owned = 0, rc, hk
    cdef float *W = NULL
    if s.rank == 0 or s.n_rows == 0:
        return 0
    if s.wkind >= 0:
        W = lorahook_scratch_slot(<size_t>s.rank * (<size_t>d_in + d_out) + d_out,
                                  _SCRATCH_WEIGHTS, &owned)
        if W == NULL:
            return -1
        widen_on(hp, <const uint16_t *>s.a16, W, <size_t>s.rank * d_in, s.wkind)
        widen_on(hp, <const uint16_t *>s.b16, W + <Py_ssize_t>s.rank * d_in,
                <size_t>s.rank * d_out, s.wkind)
        seg.a = W
        seg.b = W + <Py_ssize_t>s.rank * d_in
        if s.bias16 != NULL:
            seg.bias = W + <Py_ssize_t>s.rank * (d_in + d_out)
            widen_on(hp, <const uint16_t *>s.bias16, <float *>seg.bias, d_out, s.wkind)
    hk = LORAHOOK_HALF_F16 if kind == ROWS_F16 else LORAHOOK_HALF_BF16
    if kind == ROWS_F32:
        rc = _run_segment(&seg, <const float *>X, <float *>Y, d_in, d_out, crossover)
    elif s.n_rows >= crossover:
        rc = _run_half_batched(&seg, <const uint16_t *>X, <uint16_t *>Y, d_in, d_out, hk, hp)
    else:
        rc = _run_half_rows(&seg, <const uint16_t *>X, <uint16_t *>Y, d_in, d_out, hk, hp)
    if owned:
        free(W)
    return rc


# Rows per chunk of an embedding segment.
cdef enum:
    _EMBEDDING_CHUNK_ROWS = 64


cdef int _run_embedding(const Segment *s, const int64_t *ids, char *Y, int num_emb, int d_out,
                        int kind, int hp) noexcept nogil:
    """One embedding segment on the rows of checked ids (each in ``[0, num_emb)``).

    LoRA: ``T = s * A[:, ids]`` is gathered per chunk of rows, ``D = T B^T``
    one product, and each row of ``D`` added to its output row (half rows
    widened, added in float32 and rounded once).  A saved embedding (direct)
    replaces each row with ``E[id]``.  Returns -1 without memory.
    """
    cdef Py_ssize_t n = s.n_rows, k, r, q
    cdef int rank = s.rank, c, j, owned = 0, owned_w = 0, hk
    cdef float alpha, v
    cdef const float *bt = s.b
    cdef float *W = NULL
    cdef float *yr
    cdef int64_t idx
    if n == 0 or rank == 0:
        return 0
    hk = LORAHOOK_HALF_F16 if kind == ROWS_F16 else LORAHOOK_HALF_BF16
    if s.wkind >= 0:  # 16-bit LoRA factors: B widened once, A read per element
        W = lorahook_scratch_slot(<size_t>rank * d_out, _SCRATCH_WEIGHTS, &owned_w)
        if W == NULL:
            return -1
        widen_on(hp, <const uint16_t *>s.b16, W, <size_t>rank * d_out, s.wkind)
        bt = W
    cdef Py_ssize_t chunk = _EMBEDDING_CHUNK_ROWS if n > _EMBEDDING_CHUNK_ROWS else n
    cdef Py_ssize_t t_cols = 0 if s.direct else rank
    cdef float *T = lorahook_scratch_slot(<size_t>chunk * (t_cols + d_out) + d_out, _SCRATCH_F32,
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
                idx = ids[_row(s, k + j)]
                memcpy(D + j * d_out, bt + idx * d_out, d_out * sizeof(float))
                alpha = _scale(s, k + j)
                if alpha != 1.0:
                    _blas.scal(d_out, alpha, D + j * d_out)
        else:
            for j in range(c):
                idx = ids[_row(s, k + j)]
                alpha = _scale(s, k + j)
                for q in range(rank):
                    if s.wkind >= 0:
                        widen_on(hp, <const uint16_t *>s.a16 + q * num_emb + idx, &v, 1, s.wkind)
                    else:
                        v = s.a[q * num_emb + idx]
                    T[j * rank + q] = alpha * v
            _blas.gemm(False, False, c, d_out, rank, 1.0, T, rank, bt, d_out, 0.0, D, d_out)
        for j in range(c):
            r = _row(s, k + j)
            if kind == ROWS_F32:
                yr = <float *>Y + r * d_out
            else:
                yr = R
                widen_on(hp, <const uint16_t *>Y + r * d_out, R, d_out, hk)
            if s.pre:
                _pre(s, yr, 0, d_out)
            _blas.axpy(d_out, 1.0, D + j * d_out, yr)
            if kind != ROWS_F32:
                narrow_on(hp, R, <uint16_t *>Y + r * d_out, d_out, hk)
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
    cdef int hp = active_path()
    cdef const int64_t *I = <const int64_t *>cnp.PyArray_DATA(ids)
    cdef char *Y = <char *>cnp.PyArray_DATA(y)
    with nogil:
        for g in range(ng):
            rc = _run_embedding(&segs[g], I, Y, segs[g].d_in, d_out, kind, hp)
            if rc != 0:
                break
    if rc != 0:
        raise MemoryError("lorahook could not allocate its scratch buffer")
    return 0


cdef int run_layer(LayerKernel layer, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n_rows,
                   int kind) except -1:
    """One layer on buffers already checked to hold ``n_rows`` rows of the layer's widths."""
    cdef Segment seg
    layer.fill(&seg)
    seg.n_rows = n_rows
    return run_segments(&seg, 1, x, y, layer.d_in, layer.d_out, kind)


cdef int run_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray x, cnp.ndarray y,
                      int d_in, int d_out, int kind) except -1:
    """Run segments one after the other on checked buffers, with the GIL released.

    Every linear path into the kernels ends here.  Segments run in order on
    the calling thread, so two updates of one row never race.
    """
    global _batched_seen
    cdef Py_ssize_t g, crossover = _gemm_crossover
    cdef int rc = 0
    cdef int hp = active_path()  # one path for the whole call
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
            rc = _run_segment_any(&segs[g], X, Y, d_in, d_out, crossover, kind, hp)
            if rc != 0:
                break
    if rc != 0:
        raise MemoryError("lorahook could not allocate its scratch buffer")
    return 0


def apply_layer(LayerKernel layer not None, input, output, Py_ssize_t n_rows):
    """Add one layer's delta to ``n_rows`` rows (widths are the layer's)."""
    kind = check_buffers(input, output, n_rows, layer.d_in, layer.d_out)
    run_layer(layer, <cnp.ndarray>input, <cnp.ndarray>output, n_rows, kind)


# ---------------------------------------------------------------------------
# grouped rows: several layers, each on its own rows of one batch
# ---------------------------------------------------------------------------

cdef object private_vector(object obj, int typenum, object dtype, str where, str what,
                           str kind):
    """A private C-contiguous copy of a 1-D array of ``typenum``, or ``None`` for ``None``.

    ``TypeError`` naming ``where`` (``"group 3"``) and ``what`` for anything else.
    """
    if obj is None:
        return None
    if not isinstance(obj, np.ndarray):
        raise TypeError(f"{where}: {what} must be a 1-D {kind} array, got {type(obj).__name__}")
    cdef cnp.ndarray arr = <cnp.ndarray>obj
    if (cnp.PyArray_TYPE(arr) != typenum or cnp.PyArray_NDIM(arr) != 1
            or not cnp.PyArray_ISNOTSWAPPED(arr)):
        raise TypeError(f"{where}: {what} must be a 1-D {kind} array in native byte order")
    return np.array(arr, dtype=dtype, order="C", copy=True, subok=False)


@cython.final
cdef class GroupPlan:
    """The groups of one grouped projection, checked and copied once.

    ``GroupPlan(groups, n_rows, d_in, d_out)``: ``groups`` is a list of
    ``(LayerKernel, scale, rows, row_scales)``, ``rows`` an int32 array of
    strictly ascending row indices in ``[0, n_rows)`` (or ``None`` for every
    row), ``row_scales`` a float32 array with one scale per entry of ``rows``
    (or ``None`` to use ``scale`` for all of them).  Every group is unpacked,
    converted and copied into arrays only the plan holds, then checked;
    :meth:`apply` then runs the kernels on a batch with no further work per
    group.  Rows that no group names are never written.  A plan is immutable
    and may be applied from several threads at once.
    """

    def __cinit__(self, list groups not None, Py_ssize_t n_rows, Py_ssize_t d_in, Py_ssize_t d_out,
                  bint embedding=False):
        cdef Py_ssize_t g, m, i
        cdef LayerKernel layer
        cdef cnp.ndarray rows
        cdef const int *rp
        if n_rows < 0 or d_in < 1 or d_out < 1 or d_in > INT_MAX or d_out > INT_MAX:
            raise ValueError(f"n_rows must be >= 0 and widths in [1, {INT_MAX}], "
                             f"got ({n_rows}, {d_in}, {d_out})")
        self.n_rows = n_rows
        self.d_in = <int>d_in
        self.d_out = <int>d_out
        self._embedding = embedding
        # First pass: everything that can run Python code (unpacking,
        # __float__, copies) happens here, into objects only the plan holds.
        # The second pass then checks and points at those private copies, so
        # nothing done by other code -- in a callback or in another thread
        # once the GIL is released -- can move an index or free an array the
        # kernel uses.
        owned = []
        for g, item in enumerate(tuple(groups)):
            layer_obj, scale, rows_obj, rs_obj = item
            if not isinstance(layer_obj, LayerKernel):
                raise TypeError(f"group {g}: expected a LayerKernel, got {type(layer_obj).__name__}")
            owned.append((layer_obj, float(scale),
                          private_vector(rows_obj, cnp.NPY_INT32, np.int32, f"group {g}", "rows",
                                         "int32"),
                          private_vector(rs_obj, cnp.NPY_FLOAT32, np.float32, f"group {g}",
                                         "row_scales", "float32")))
        self._owned = owned
        self._ng = len(owned)
        self._segs_obj = bytearray(self._ng * sizeof(Segment))
        self._segs = <Segment *><char *>self._segs_obj
        cdef Segment *seg
        for g in range(self._ng):
            layer, scale, rows_obj, rs_obj = owned[g]
            if layer.d_in != d_in or layer.d_out != d_out:
                raise ValueError(
                    f"group {g}: layer shape (d_in, d_out) = ({layer.d_in}, {layer.d_out}) "
                    f"does not match the call's ({d_in}, {d_out})")
            if (layer.kind == KIND_EMBEDDING or layer.kind == KIND_SAVED_EMBEDDING) != embedding:
                raise ValueError(f"group {g}: an {'embedding' if embedding else 'linear'} plan "
                                 f"cannot hold a layer kernel of kind {layer.kind}")
            if rs_obj is not None and (layer.pre or layer.kind == KIND_SAVED_LINEAR
                                       or layer.kind == KIND_SAVED_EMBEDDING):
                raise ValueError(f"group {g}: a DoRA layer or a saved module takes no per-row "
                                 f"scales (its rows all use the layer's own)")
            seg = &self._segs[g]
            layer.fill(seg)
            seg.scale = <float>scale
            if rows_obj is None:
                seg.n_rows = n_rows
                m = n_rows
            else:
                rows = <cnp.ndarray>rows_obj
                m = cnp.PyArray_DIM(rows, 0)
                rp = <const int *>cnp.PyArray_DATA(rows)
                for i in range(m):
                    if rp[i] < 0 or rp[i] >= n_rows or (i > 0 and rp[i] <= rp[i - 1]):
                        raise ValueError(
                            f"group {g}: rows must be strictly ascending indices in [0, {n_rows})")
                seg.rows = rp
                seg.n_rows = m
            if rs_obj is not None:
                if cnp.PyArray_DIM(<cnp.ndarray>rs_obj, 0) != m:
                    raise TypeError(f"group {g}: row_scales must be a 1-D float32 array of {m} values")
                seg.row_scales = <const float *>cnp.PyArray_DATA(<cnp.ndarray>rs_obj)

    def __reduce__(self):
        raise TypeError("GroupPlan belongs to one process and does not pickle")

    def apply(self, input, output):
        """Add every group's delta to the plan's ``n_rows`` rows of ``output`` in place.

        Half-precision rows are rounded once per group: groups that share a
        row round it once each.
        """
        kind = check_buffers(input, output, self.n_rows, self.d_in, self.d_out)
        self.run(<cnp.ndarray>input, <cnp.ndarray>output, kind)

    cdef int run_ids(self, cnp.ndarray ids, cnp.ndarray y, int kind) except -1:
        """Run an embedding plan on private int64 ``ids`` checked to lie in ``[0, d_in)``."""
        if not self._embedding:
            raise ValueError("this plan is for linear rows: use run")
        if cnp.PyArray_SIZE(ids) != self.n_rows or cnp.PyArray_SIZE(y) != self.n_rows * self.d_out:
            raise ValueError(f"this plan is for {self.n_rows} ids and rows of {self.d_out}")
        if self._ng == 0 or self.n_rows == 0:
            return 0
        return run_embedding_segments(self._segs, self._ng, ids, y, self.d_out, kind)

    cdef int run(self, cnp.ndarray x, cnp.ndarray y, int kind) except -1:
        if self._embedding:
            raise ValueError("this plan is for embedding rows: use run_ids")
        if (cnp.PyArray_SIZE(x) != self.n_rows * self.d_in
                or cnp.PyArray_SIZE(y) != self.n_rows * self.d_out):
            raise ValueError(f"this plan is for {self.n_rows} rows of ({self.d_in}, {self.d_out}), "
                             f"got buffers of {cnp.PyArray_SIZE(x)} and {cnp.PyArray_SIZE(y)} values")
        if self._ng == 0 or self.n_rows == 0:
            return 0
        return run_segments(self._segs, self._ng, x, y, self.d_in, self.d_out, kind)
