# cython: language_level=3
"""The compiled core of lorahook: call checks and the GIL-free BLAS row kernels.

Everything here works on raw float32 rows and adapter layers; it knows nothing
about files, model geometry or adapter names.  The public entry point is
``apply_lora_rows`` (re-exported by :mod:`lorahook`).

Kernels
-------
For ``n`` rows through one adapter layer (``A`` is ``(rank, d_in)``, ``B`` is
``(d_out, rank)``, both row-major) the update is ``Y += s * (X A^T) B^T``.

* below the crossover (``get_gemm_crossover()`` rows) each row gets two
  ``sgemv`` calls: ``t = A x`` then ``y += s * B t``;
* at or above it, rows are processed in chunks with two ``sgemm`` calls,
  ``T = X A^T`` into a per-thread scratch buffer, then ``Y += s * T B^T``
  (beta = 1).  Rows that are not contiguous in the batch (the grouped
  multi-adapter path) are gathered into scratch and scatter-added back.

Row-major ``(m, n)`` data is column-major ``(n, m)`` for BLAS.  ``A`` is
read with ``'T'`` and its row length as the leading dimension; ``B`` is kept
transposed (``LayerKernel.bt``, one extra copy of ``B``) so that it is
column-major ``(d_out, rank)`` and both products with it use ``'N'``.
Different paths may differ in the last bits of float32 rounding: a row's
result can depend on the batch it was computed in.
"""

cimport cython
cimport numpy as cnp
from libc.string cimport memcpy
from libc.limits cimport INT_MAX
from cpython.type cimport PyType_IsSubtype
from scipy.linalg.cython_blas cimport sgemm, sgemv, saxpy, sscal

import operator

import numpy as np

cnp.import_array()

cdef extern from *:
    """
    #include <pthread.h>
    #include <stdlib.h>

    /* A per-thread scratch buffer, reused across calls so that the batched
       kernels do not page-fault on a fresh temporary every projection.  Freed
       by the pthread key destructor when the thread exits. */
    #define LORAHOOK_SCRATCH_CACHE_FLOATS ((size_t)1 << 20)

    typedef struct { float *data; size_t len; } lorahook_buf;
    static pthread_key_t lorahook_key;
    static pthread_once_t lorahook_once = PTHREAD_ONCE_INIT;
    static int lorahook_key_ok = 0;

    static void lorahook_buf_free(void *p) {
        lorahook_buf *b = (lorahook_buf *)p;
        if (b != NULL) { free(b->data); free(b); }
    }
    static void lorahook_make_key(void) {
        lorahook_key_ok = (pthread_key_create(&lorahook_key, lorahook_buf_free) == 0);
    }
    /* Returns a buffer of at least n floats, or NULL when out of memory.
       *owned is set to 1 when the caller must free() it (requests larger
       than the cache, or no thread-local storage available). */
    static float *lorahook_scratch(size_t n, int *owned) {
        lorahook_buf *b;
        *owned = 0;
        if (n == 0) n = 1;
        pthread_once(&lorahook_once, lorahook_make_key);
        if (!lorahook_key_ok || n > LORAHOOK_SCRATCH_CACHE_FLOATS) {
            *owned = 1;
            return (float *)malloc(n * sizeof(float));
        }
        b = (lorahook_buf *)pthread_getspecific(lorahook_key);
        if (b == NULL) {
            b = (lorahook_buf *)calloc(1, sizeof(lorahook_buf));
            if (b == NULL) return NULL;
            if (pthread_setspecific(lorahook_key, b) != 0) { free(b); *owned = 1;
                return (float *)malloc(n * sizeof(float)); }
        }
        if (b->len < n) {
            float *p = (float *)malloc(n * sizeof(float));
            if (p == NULL) return NULL;
            free(b->data);
            b->data = p;
            b->len = n;
        }
        return b->data;
    }
    #ifndef LORAHOOK_DEBUG_BUILD
    #define LORAHOOK_DEBUG_BUILD 0
    #endif
    """
    float *lorahook_scratch(size_t n, int *owned) noexcept nogil
    size_t LORAHOOK_SCRATCH_CACHE_FLOATS
    int LORAHOOK_DEBUG_BUILD

from libc.stdlib cimport free

cdef extern from "_pool.h":
    ctypedef void (*lorahook_task)(void *arg) noexcept nogil
    int lorahook_pool_run(lorahook_task caller_task, lorahook_task helper_task,
                          void *arg, int want) noexcept nogil
    void lorahook_enter() noexcept nogil
    void lorahook_leave() noexcept nogil
    Py_ssize_t lorahook_calls_in_flight() noexcept nogil
    int lorahook_pool_started() noexcept nogil
    Py_ssize_t lorahook_helper_items_done() noexcept nogil
    void lorahook_count_helper_item() noexcept nogil
    Py_ssize_t lorahook_next_chunk(Py_ssize_t *counter) noexcept nogil
    void lorahook_store_int(int *p, int v) noexcept nogil
    void lorahook_find_blas(void *blas_caller) noexcept nogil
    char *lorahook_blas_path
    int lorahook_blas_threads() noexcept nogil
    int lorahook_blas_threads_known() noexcept nogil
    int LORAHOOK_POOL_MAX

#: True when the extension was built with bounds checking (LORAHOOK_CYTHON_DEBUG=1).
DEBUG_BUILD = bool(LORAHOOK_DEBUG_BUILD)

# Rows at or above which a single adapter segment uses the sgemm pair instead
# of one sgemv pair per row.
cdef Py_ssize_t _gemm_crossover = 32

# Threads one batched call may use (the caller plus lorahook's helpers); set
# through lorahook.set_num_threads.  1 keeps every call on the calling thread.
cdef int _num_threads = 1

# A batched segment is split into chunks of at least this many rows and this
# many flops, and only when that gives two chunks or more; at most
# _MAX_CHUNKS chunks (see lorahook.threads for how these were measured).
cdef Py_ssize_t _split_min_rows = 64
cdef double _split_min_flops = 4e6
cdef enum:
    _MAX_CHUNKS = 16

# Set by lorahook.hook at import: the abstract base every hook must derive from.
cdef object _hook_base = None


def _set_hook_base(cls):
    global _hook_base
    _hook_base = cls


def get_gemm_crossover():
    """Rows from which a batch through one adapter layer uses ``sgemm``."""
    return _gemm_crossover


def set_gemm_crossover(n):
    """Set the row count from which the ``sgemm`` path is used (``n >= 1``).

    ``1`` forces the batched path for every batch, a huge value forces the
    row loop.  Returns the previous value.
    """
    global _gemm_crossover
    n = _as_width(n, "n")
    old = _gemm_crossover
    _gemm_crossover = n
    return old


def _get_num_threads():
    return _num_threads


def _set_num_threads(n):
    """Set the threads one batched call may use (``1 <= n <= 64``); returns the old value."""
    global _num_threads
    n = _as_width(n, "n")
    if n > LORAHOOK_POOL_MAX:
        raise ValueError(f"n must be at most {LORAHOOK_POOL_MAX}, got {n}")
    old = _num_threads
    _num_threads = <int>n
    return old


def get_split_grain():
    """``(min_rows, min_flops)`` of one chunk when a batched call is split over threads."""
    return _split_min_rows, _split_min_flops


def set_split_grain(min_rows, min_flops):
    """Set the smallest chunk a split batched call hands to a thread; returns the old pair.

    A segment of ``n`` rows is split into ``min(16, n // rows_per_chunk)``
    chunks, where ``rows_per_chunk`` is the largest of ``min_rows``, the
    gemm crossover and the rows holding ``min_flops`` flops (rounded up);
    fewer than two chunks means no split.
    """
    global _split_min_rows, _split_min_flops
    rows = _as_width(min_rows, "min_rows")
    flops = float(min_flops)
    if not (flops >= 0.0) or flops == float("inf"):
        raise ValueError(f"min_flops must be a finite number >= 0, got {min_flops!r}")
    old = (_split_min_rows, _split_min_flops)
    _split_min_rows = rows
    _split_min_flops = flops
    return old


def _split_chunks(Py_ssize_t n_rows, int rank, int d_in, int d_out):
    """The chunks a segment of this shape is cut into under the current settings (1: none)."""
    cdef Segment seg
    cdef Plan plan
    seg.rank = rank
    seg.n_rows = n_rows
    _plan(&plan)
    return _chunks_for(&seg, d_in, d_out, &plan)


def _helper_threads():
    """lorahook's helper threads alive in this process."""
    return lorahook_pool_started()


def _helper_items():
    """Work items lorahook's helper threads have run in this process."""
    return lorahook_helper_items_done()


def _blas_threads():
    """Threads of the BLAS the kernels call as the core sees them (0: it cannot tell)."""
    return lorahook_blas_threads_known()


def _blas_library_path():
    """The file of the BLAS library the kernels call, or ``None`` when unknown."""
    path = <bytes>lorahook_blas_path
    return path.decode("utf-8", "surrogateescape") if path else None


lorahook_find_blas(<void *>sgemm)


# ---------------------------------------------------------------------------
# argument checks (with the GIL; explicit, so messages say what to fix)
# ---------------------------------------------------------------------------

cdef inline str _shape_str(cnp.ndarray arr):
    return str((<object>arr).shape)


cdef int _check_type(object arr, str name) except -1:
    if not cnp.PyArray_Check(arr):
        raise TypeError(
            f"{name} must be a numpy.ndarray of dtype float32, got {type(arr).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32 or not cnp.PyArray_ISNOTSWAPPED(a):
        raise TypeError(
            f"{name} must have dtype float32 in native byte order, got {a.dtype.str} ({a.dtype})")
    return 0


cdef int _check_layout(cnp.ndarray a, str name, bint writable) except -1:
    cdef int nd = cnp.PyArray_NDIM(a)
    if nd != 1 and nd != 2:
        raise ValueError(
            f"{name} must be 1-D (flattened rows) or 2-D (rows, width), "
            f"got {nd}-D with shape {_shape_str(a)}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(
            f"{name} must be C-contiguous, got shape {_shape_str(a)} with strides {(<object>a).strides}")
    if writable and not cnp.PyArray_ISWRITEABLE(a):
        raise ValueError(f"{name} must be writable, got a read-only array")
    return 0


cdef object _as_int(object v, str name):
    """``operator.index(v)`` for integer-like objects other than bool, else TypeError naming ``name``."""
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")


cdef Py_ssize_t _as_width(object w, str name) except -1:
    cdef Py_ssize_t v
    if type(w) is not int:
        w = _as_int(w, name)
    if w <= 0:
        raise ValueError(f"{name} must be > 0, got {w}")
    if w > INT_MAX:
        raise ValueError(f"{name} must be at most {INT_MAX} (a BLAS int), got {w}")
    v = w
    return v


cdef Py_ssize_t _row_count(cnp.ndarray a, Py_ssize_t width, str name, str wname) except -1:
    cdef Py_ssize_t size
    if cnp.PyArray_NDIM(a) == 2:
        if cnp.PyArray_DIM(a, 1) != width:
            raise ValueError(
                f"{name} of shape {_shape_str(a)} must have shape[1] == {wname} = {width}, "
                f"got {cnp.PyArray_DIM(a, 1)}")
        return cnp.PyArray_DIM(a, 0)
    size = cnp.PyArray_DIM(a, 0)
    if size % width != 0:
        raise ValueError(
            f"{name} must hold whole rows of {wname} = {width} values, "
            f"got {size} values ({size // width} rows and {size % width} left over)")
    return size // width


cdef Py_ssize_t _check_call(object input, object output, object input_row_width,
                            object output_row_width, Py_ssize_t *widths=NULL) except -1:
    """The spec's call checks in order; returns the row count.

    ``widths``, when given, receives ``(input_row_width, output_row_width)``
    as checked ints.
    """
    _check_type(input, "input")
    _check_type(output, "output")
    cdef cnp.ndarray x = <cnp.ndarray>input
    cdef cnp.ndarray y = <cnp.ndarray>output
    _check_layout(x, "input", False)
    _check_layout(y, "output", True)
    cdef Py_ssize_t d_in = _as_width(input_row_width, "input_row_width")
    cdef Py_ssize_t d_out = _as_width(output_row_width, "output_row_width")
    cdef Py_ssize_t n_in = _row_count(x, d_in, "input", "input_row_width")
    cdef Py_ssize_t n_out = _row_count(y, d_out, "output", "output_row_width")
    if n_in != n_out:
        raise ValueError(
            f"input and output row counts must match: input has {n_in} rows of width {d_in}, "
            f"output has {n_out} rows of width {d_out}")
    cdef char *xs = <char *>cnp.PyArray_DATA(x)
    cdef char *ys = <char *>cnp.PyArray_DATA(y)
    cdef Py_ssize_t xb = n_in * d_in * <Py_ssize_t>sizeof(float)
    cdef Py_ssize_t yb = n_out * d_out * <Py_ssize_t>sizeof(float)
    if xb > 0 and yb > 0 and xs < ys + yb and ys < xs + xb:
        raise ValueError("input and output must not overlap in memory, got overlapping buffers")
    if widths != NULL:
        widths[0] = d_in
        widths[1] = d_out
    return n_in


def check_rows(input, output, input_row_width, output_row_width):
    """Run ``apply_lora_rows``' buffer checks and return the row count."""
    return _check_call(input, output, input_row_width, output_row_width)


def apply_lora_rows(hook, layer_idx, module, input, output, input_row_width, output_row_width):
    """Add ``hook``'s LoRA delta to every row of ``output`` in place.

    ``input`` holds the rows given to the base projection and ``output`` its
    result, each a float32 C-contiguous ``ndarray``, either flattened 1-D
    (``len == rows * width``) or 2-D ``(rows, width)``.  The call is checked
    first, whatever the hook (``TypeError`` for types, dtypes and non-integer
    widths; ``ValueError`` for ndim, contiguity, writability, widths, row
    counts and a bound hook's row count); nothing is written when a check
    fails.  Then ``hook.is_active(layer_idx, module)`` is asked once; an
    inactive hook returns at once.  A :class:`~lorahook.LoraAdapter` or a bound
    :class:`~lorahook.AdapterSet` batch runs in the compiled core with the GIL
    released; any other hook gets one ``apply`` call per row, in row order.
    """
    # A subtype test on the MRO: LoraHook is an ABC, and isinstance() through
    # ABCMeta cost ~0.4 us of a ~1 us inactive call.  Virtual subclasses
    # (ABC.register) are refused on purpose: a hook must inherit the base.
    if _hook_base is None or not PyType_IsSubtype(type(hook), <type>_hook_base):
        raise TypeError(f"hook must be a lorahook.LoraHook, got {type(hook).__name__}")
    cdef Py_ssize_t widths[2]
    cdef Py_ssize_t n = _check_call(input, output, input_row_width, output_row_width, widths)
    bound = hook._bound_rows
    if bound is not None and bound != n:
        raise ValueError(
            f"this hook was bound for a batch of {bound} rows, got {n} rows")
    if type(layer_idx) is not int:
        layer_idx = _as_int(layer_idx, "layer_idx")
    if layer_idx < 0:
        raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")
    if type(module) is not str:
        raise TypeError(f"module must be a str, got {type(module).__name__}")
    cdef LayerKernel kernel
    if hook._fused:
        # A LoraAdapter whose hook methods are its own: its is_active is
        # "the key has a kernel", so one lookup answers it and gives the
        # kernel, and the buffers checked above go straight to the core.
        found = (<dict>hook._kernels).get((layer_idx, module))
        if found is None or n == 0:
            return
        kernel = <LayerKernel>found
        if kernel.d_in == widths[0] and kernel.d_out == widths[1]:
            _run_layer(kernel, <cnp.ndarray>input, <cnp.ndarray>output, n)
            return
        # a width mismatch: the adapter's own path raises the precise error
    elif not hook.is_active(layer_idx, module):
        return
    if n == 0:
        return
    hook._apply_rows(layer_idx, module, input, output, widths[0], widths[1], n)


# ---------------------------------------------------------------------------
# adapter layers
# ---------------------------------------------------------------------------

@cython.final
cdef class LayerKernel:
    """Typed views of one adapter layer's arrays, made once at construction.

    ``a`` is ``(rank, d_in)``, ``b`` is ``(d_out, rank)``, ``bias`` is
    ``(d_out,)`` or ``None``; all float32 C-contiguous.  The owning
    :class:`~lorahook.LoraLayer` validates values; this class re-checks the
    shapes it relies on so that no kernel can read past an array.
    """

    def __cinit__(self, a, b, scale, bias=None):
        self.a = a
        self.b = b
        cdef Py_ssize_t rank = self.a.shape[0]
        cdef Py_ssize_t d_in = self.a.shape[1]
        cdef Py_ssize_t d_out = self.b.shape[0]
        if self.b.shape[1] != rank:
            raise ValueError(f"b must have shape (d_out, {rank}), got {self.b.shape[0], self.b.shape[1]}")
        if d_in < 1 or d_out < 1:
            raise ValueError(f"d_in and d_out must be >= 1, got ({d_in}, {d_out})")
        if rank > INT_MAX or d_in > INT_MAX or d_out > INT_MAX:
            raise ValueError(f"layer dimensions must each be at most {INT_MAX}")
        self.rank = <int>rank
        self.d_in = <int>d_in
        self.d_out = <int>d_out
        # The kernels read B transposed: y += s * B t is then an sgemv over
        # rank columns of length d_out ('N'), which streams memory, instead
        # of d_out dot products of length rank ('T'): 2-3x faster at rank 16.
        bt = np.ascontiguousarray(np.asarray(self.b).T)
        bt.flags.writeable = False
        self.bt = bt
        self.scale = <float>scale
        self.has_bias = bias is not None
        if self.has_bias and rank == 0:
            raise ValueError("a rank-0 layer cannot carry a bias")
        if self.has_bias:
            self.bias = bias
            if self.bias.shape[0] != d_out:
                raise ValueError(f"bias must have shape ({d_out},), got ({self.bias.shape[0]},)")

    def __reduce__(self):
        raise TypeError("LayerKernel is rebuilt from its LoraLayer and does not pickle")

    cdef void fill(self, Segment *s) noexcept:
        s.a = &self.a[0, 0] if self.rank > 0 else NULL
        s.b = &self.bt[0, 0] if self.rank > 0 else NULL
        s.bias = &self.bias[0] if self.has_bias else NULL
        s.rank = self.rank
        s.scale = self.scale
        s.rows = NULL
        s.row_scales = NULL
        s.n_rows = 0


# ---------------------------------------------------------------------------
# kernels (no Python objects, no GIL)
# ---------------------------------------------------------------------------

cdef inline bint _rows_consecutive(const int *rows, Py_ssize_t start, Py_ssize_t count) noexcept nogil:
    # rows are strictly ascending, so first/last tell whether they are a run
    if rows == NULL:
        return True
    return rows[start + count - 1] - rows[start] == count - 1


cdef int _run_segment(const Segment *s, const float *X, float *Y, int d_in, int d_out,
                      Py_ssize_t crossover) noexcept nogil:
    """Apply one segment; returns -1 when scratch memory cannot be had."""
    cdef int rank = s.rank
    cdef Py_ssize_t n = s.n_rows
    if rank == 0 or n == 0:
        return 0
    cdef char tr = b'T'
    cdef char nt = b'N'
    cdef int one_i = 1
    cdef float one = 1.0
    cdef float zero = 0.0
    cdef float alpha
    cdef float *A = <float *>s.a  # BLAS signatures are not const-qualified; never written
    cdef float *B = <float *>s.b
    cdef float *bias = <float *>s.bias
    cdef float *xr
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
        scratch = lorahook_scratch(<size_t>rank, &owned)
        if scratch == NULL:
            return -1
        t = scratch
        for i in range(n):
            r = s.rows[i] if s.rows != NULL else i
            xr = <float *>(X + r * d_in)
            yr = Y + r * d_out
            alpha = s.row_scales[i] if s.row_scales != NULL else s.scale
            sgemv(&tr, &d_in, &rank, &one, A, &d_in, xr, &one_i, &zero, t, &one_i)
            sgemv(&nt, &d_out, &rank, &alpha, B, &d_out, t, &one_i, &one, yr, &one_i)
            if bias != NULL:
                saxpy(&d_out, &alpha, bias, &one_i, yr, &one_i)
        if owned:
            free(scratch)
        return 0

    # batched: chunks sized so scratch stays within the per-thread cache
    per_row = <Py_ssize_t>rank + (<Py_ssize_t>d_in + d_out if gather else 0)
    cap = <Py_ssize_t>LORAHOOK_SCRATCH_CACHE_FLOATS // per_row
    chunk = n if n < cap else cap
    if chunk < 1:
        chunk = 1
    scratch = lorahook_scratch(<size_t>(chunk * per_row), &owned)
    if scratch == NULL:
        return -1
    t = scratch
    G = scratch + chunk * rank
    D = G + chunk * d_in
    k = 0
    while k < n:
        c = <int>(chunk if n - k > chunk else n - k)
        consecutive = _rows_consecutive(s.rows, k, c)
        r0 = s.rows[k] if s.rows != NULL else k
        if consecutive:
            xr = <float *>(X + r0 * d_in)
        else:
            for j in range(c):
                memcpy(G + j * d_in, X + <Py_ssize_t>s.rows[k + j] * d_in, d_in * sizeof(float))
            xr = G
        # T^T (rank x c, column-major) = A X^T
        sgemm(&tr, &nt, &rank, &c, &d_in, &one, A, &d_in, xr, &d_in, &zero, t, &rank)
        if s.row_scales != NULL:
            for j in range(c):
                alpha = s.row_scales[k + j]
                sscal(&rank, &alpha, t + j * rank, &one_i)
            alpha = one
        else:
            alpha = s.scale
        if consecutive:
            # Y^T (d_out x c) += alpha * B T^T
            yr = Y + r0 * d_out
            sgemm(&nt, &nt, &d_out, &c, &rank, &alpha, B, &d_out, t, &rank, &one, yr, &d_out)
        else:
            sgemm(&nt, &nt, &d_out, &c, &rank, &alpha, B, &d_out, t, &rank, &zero, D, &d_out)
            for j in range(c):
                yr = Y + <Py_ssize_t>s.rows[k + j] * d_out
                saxpy(&d_out, &one, D + j * d_out, &one_i, yr, &one_i)
        if bias != NULL:
            for j in range(c):
                r = s.rows[k + j] if s.rows != NULL else k + j
                alpha = s.row_scales[k + j] if s.row_scales != NULL else s.scale
                saxpy(&d_out, &alpha, bias, &one_i, Y + r * d_out, &one_i)
        k += c
    if owned:
        free(scratch)
    return 0


ctypedef struct Plan:
    # the settings one call runs with, read once with the GIL held
    Py_ssize_t crossover
    Py_ssize_t min_rows
    double min_flops
    int nthreads


cdef inline void _plan(Plan *p) noexcept:
    p.crossover = _gemm_crossover
    p.min_rows = _split_min_rows
    p.min_flops = _split_min_flops
    p.nthreads = _num_threads


ctypedef struct WorkItem:
    # rows [k0, k1) of one segment's rows
    const Segment *s
    Py_ssize_t k0
    Py_ssize_t k1


ctypedef struct SplitJob:
    const WorkItem *items
    Py_ssize_t n_items
    const float *X
    float *Y
    int d_in
    int d_out
    Py_ssize_t crossover
    Py_ssize_t next     # next item to take (atomic)
    int rc


cdef void _split_caller(void *arg) noexcept nogil:
    _run_items(<SplitJob *>arg, False)


cdef void _split_helper(void *arg) noexcept nogil:
    _run_items(<SplitJob *>arg, True)


cdef void _run_items(SplitJob *job, bint helper) noexcept nogil:
    """Run work items until none is left.

    The caller always runs to the end; a helper stops taking items as soon
    as another kernel call is running anywhere in the process.  Items of one
    job never share an output row, so their order does not matter.
    """
    cdef Py_ssize_t c
    cdef const WorkItem *it
    cdef Segment sub
    cdef const float *X
    cdef float *Y
    while True:
        if helper and lorahook_calls_in_flight() > 1:
            return
        c = lorahook_next_chunk(&job.next)
        if c >= job.n_items:
            return
        it = &job.items[c]
        sub = it.s[0]
        sub.n_rows = it.k1 - it.k0
        X = job.X
        Y = job.Y
        if it.s.rows == NULL:
            X = X + it.k0 * job.d_in
            Y = Y + it.k0 * job.d_out
        else:
            sub.rows = it.s.rows + it.k0
        if it.s.row_scales != NULL:
            sub.row_scales = it.s.row_scales + it.k0
        if _run_segment(&sub, X, Y, job.d_in, job.d_out, job.crossover) != 0:
            lorahook_store_int(&job.rc, -1)
        if helper:
            lorahook_count_helper_item()


cdef inline double _segment_flops(const Segment *s, int d_in, int d_out) noexcept nogil:
    return 2.0 * s.rank * (<double>d_in + d_out) * s.n_rows


cdef Py_ssize_t _chunks_for(const Segment *s, int d_in, int d_out, const Plan *p) noexcept nogil:
    """Chunks a segment is cut into when split: 1 means it stays whole.

    Depends only on the segment's shape and the call's plan, never on the
    thread count or on timing, so results are reproducible.  Every chunk has
    at least ``crossover`` rows, so it takes the same kernel as the whole.
    """
    cdef Py_ssize_t n = s.n_rows
    cdef double row_flops, need
    cdef Py_ssize_t rows_per_chunk, n_chunks
    if s.rank == 0 or n < p.crossover or n < 2 * p.min_rows:
        return 1
    row_flops = 2.0 * s.rank * (<double>d_in + d_out)
    rows_per_chunk = p.min_rows if p.min_rows > p.crossover else p.crossover
    need = p.min_flops / row_flops
    if need > <double>n:
        return 1  # (also keeps the cast below in range)
    if <double>rows_per_chunk < need:
        rows_per_chunk = <Py_ssize_t>need
        if <double>rows_per_chunk < need:
            rows_per_chunk += 1
    n_chunks = n // rows_per_chunk
    if n_chunks > _MAX_CHUNKS:
        n_chunks = _MAX_CHUNKS
    return n_chunks if n_chunks >= 2 else 1


cdef inline bint _may_split(int nthreads) noexcept nogil:
    return nthreads > 1 and lorahook_blas_threads() <= 1


cdef Py_ssize_t _fill_items(const Segment *s, Py_ssize_t n_chunks, WorkItem *items) noexcept nogil:
    cdef Py_ssize_t c, n = s.n_rows
    for c in range(n_chunks):
        items[c].s = s
        items[c].k0 = n * c // n_chunks
        items[c].k1 = n * (c + 1) // n_chunks
    return n_chunks


cdef int _run_job(const WorkItem *items, Py_ssize_t n_items, const float *X, float *Y,
                  int d_in, int d_out, const Plan *p) noexcept nogil:
    cdef SplitJob job
    job.items = items
    job.n_items = n_items
    job.X = X
    job.Y = Y
    job.d_in = d_in
    job.d_out = d_out
    job.crossover = p.crossover
    job.next = 0
    job.rc = 0
    lorahook_pool_run(_split_caller, _split_helper, &job,
                      p.nthreads - 1 if p.nthreads - 1 < n_items - 1 else <int>(n_items - 1))
    return job.rc


cdef int _run_segment_threads(const Segment *s, const float *X, float *Y, int d_in, int d_out,
                              const Plan *p) noexcept nogil:
    """``_run_segment``, with a large batched segment split over lorahook's threads.

    With ``nthreads == 1`` (or a multi-threaded BLAS underneath) this is
    exactly ``_run_segment``.  Otherwise the chunking depends only on the
    segment's shape, so every ``nthreads >= 2`` gives the same bits, and a
    call that finds the helpers busy runs the same chunks on its own thread.
    """
    cdef WorkItem items[_MAX_CHUNKS]
    cdef Py_ssize_t n_chunks = _chunks_for(s, d_in, d_out, p)
    if n_chunks < 2 or not _may_split(p.nthreads):
        return _run_segment(s, X, Y, d_in, d_out, p.crossover)
    _fill_items(s, n_chunks, items)
    return _run_job(items, n_chunks, X, Y, d_in, d_out, p)


cdef int _run_groups(const Segment *segs, Py_ssize_t ng, bint disjoint, WorkItem *items,
                     const float *X, float *Y, int d_in, int d_out, const Plan *p) noexcept nogil:
    """Run every segment of a grouped call.

    When no two segments share a row, all of them (large ones cut into their
    chunks) form one job, so a batch of many small adapter groups still uses
    the helpers.  Otherwise segments run one after the other, each split on
    its own, so two updates of one row never race.  ``items`` has room for
    ``ng * _MAX_CHUNKS`` entries.
    """
    cdef Py_ssize_t g, n_items = 0, rows = 0
    cdef double flops = 0.0
    cdef int rc = 0
    if disjoint and _may_split(p.nthreads):
        for g in range(ng):
            n_items += _fill_items(&segs[g], _chunks_for(&segs[g], d_in, d_out, p),
                                   items + n_items)
            rows += segs[g].n_rows
            flops += _segment_flops(&segs[g], d_in, d_out)
        if n_items >= 2 and rows >= 2 * p.min_rows and flops >= 2.0 * p.min_flops:
            return _run_job(items, n_items, X, Y, d_in, d_out, p)
    for g in range(ng):
        rc = _run_segment_threads(&segs[g], X, Y, d_in, d_out, p)
        if rc != 0:
            return rc
    return 0


cdef inline cnp.ndarray _checked_rows_buffer(object arr, Py_ssize_t n, Py_ssize_t width,
                                             str name, bint writable):
    _check_type(arr, name)
    cdef cnp.ndarray a = <cnp.ndarray>arr
    _check_layout(a, name, writable)
    if n < 0 or width < 1 or cnp.PyArray_SIZE(a) % width != 0 or cnp.PyArray_SIZE(a) // width != n:
        raise ValueError(f"{name} must hold {n} rows of width {width}, got shape {_shape_str(a)}")
    return a


def apply_layer(LayerKernel layer not None, input, output, Py_ssize_t n_rows):
    """Add one layer's delta to ``n_rows`` rows (widths are the layer's)."""
    _run_layer(layer, _checked_rows_buffer(input, n_rows, layer.d_in, "input", False),
               _checked_rows_buffer(output, n_rows, layer.d_out, "output", True), n_rows)


cdef int _run_layer(LayerKernel layer, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n_rows) except -1:
    """The kernel on buffers already checked to hold ``n_rows`` rows of the layer's widths."""
    cdef Segment seg
    layer.fill(&seg)
    seg.n_rows = n_rows
    return _run_segments(&seg, 1, True, x, y, layer.d_in, layer.d_out)


cdef int _run_segments(const Segment *segs, Py_ssize_t ng, bint disjoint, cnp.ndarray x,
                       cnp.ndarray y, int d_in, int d_out) except -1:
    """Run segments on checked buffers with the GIL released (the one way into the kernels)."""
    # work items are per call, so concurrent calls over the same segments share nothing
    cdef WorkItem one[_MAX_CHUNKS]
    cdef WorkItem *items = one
    items_obj = None
    if ng > 1:
        items_obj = bytearray(ng * _MAX_CHUNKS * sizeof(WorkItem))
        items = <WorkItem *><char *>items_obj
    cdef const float *X = <const float *>cnp.PyArray_DATA(x)
    cdef float *Y = <float *>cnp.PyArray_DATA(y)
    cdef int rc
    cdef Plan plan
    _plan(&plan)
    with nogil:
        lorahook_enter()
        rc = _run_groups(segs, ng, disjoint, items, X, Y, d_in, d_out, &plan)
        lorahook_leave()
    if rc != 0:
        raise MemoryError("lorahook could not allocate its scratch buffer")
    return 0


cdef object _private_vector(object obj, int typenum, object dtype, Py_ssize_t g, str what,
                            str kind):
    """A private C-contiguous copy of a 1-D array of ``typenum``, or ``None`` for ``None``."""
    if obj is None:
        return None
    cdef cnp.ndarray arr = <cnp.ndarray?>obj
    if (cnp.PyArray_TYPE(arr) != typenum or cnp.PyArray_NDIM(arr) != 1
            or not cnp.PyArray_ISNOTSWAPPED(arr)):
        raise TypeError(f"group {g}: {what} must be a 1-D {kind} array in native byte order")
    return np.array(arr, dtype=dtype, order="C", copy=True, subok=False)


@cython.final
cdef class GroupPlan:
    """The groups of one grouped projection, checked and copied once.

    ``GroupPlan(groups, n_rows, d_in, d_out)`` takes the ``groups`` list
    :func:`apply_groups` takes.  Every group is unpacked, converted and copied
    into arrays only the plan holds, then checked; :meth:`apply` then runs
    the kernels on a batch with no further work per group.  A plan is
    immutable and may be applied from several threads at once.
    """
    cdef object _owned        # the private copies the segments point into
    cdef object _segs_obj     # bytearray of Segment
    cdef Segment *_segs
    cdef Py_ssize_t _ng
    cdef readonly Py_ssize_t n_rows
    cdef readonly int d_in
    cdef readonly int d_out
    cdef bint _disjoint

    def __cinit__(self, list groups not None, Py_ssize_t n_rows, Py_ssize_t d_in, Py_ssize_t d_out):
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
                          _private_vector(rows_obj, cnp.NPY_INT32, np.int32, g, "rows", "int32"),
                          _private_vector(rs_obj, cnp.NPY_FLOAT32, np.float32, g, "row_scales",
                                          "float32")))
        self._owned = owned
        self._ng = len(owned)
        self._segs_obj = bytearray(self._ng * sizeof(Segment))
        self._segs = <Segment *><char *>self._segs_obj
        # which rows some group already claimed: groups on disjoint rows may
        # run on several threads at once
        claimed_obj = bytearray(n_rows)
        cdef unsigned char *claimed = <unsigned char *><char *>claimed_obj
        cdef Segment *seg
        self._disjoint = True
        for g in range(self._ng):
            layer, scale, rows_obj, rs_obj = owned[g]
            if layer.d_in != d_in or layer.d_out != d_out:
                raise ValueError(
                    f"group {g}: layer shape (d_in, d_out) = ({layer.d_in}, {layer.d_out}) "
                    f"does not match the call's ({d_in}, {d_out})")
            seg = &self._segs[g]
            layer.fill(seg)
            seg.scale = <float>scale
            if rows_obj is None:
                seg.n_rows = n_rows
                m = n_rows
                self._disjoint = self._disjoint and self._ng == 1
            else:
                rows = <cnp.ndarray>rows_obj
                m = cnp.PyArray_DIM(rows, 0)
                rp = <const int *>cnp.PyArray_DATA(rows)
                for i in range(m):
                    if rp[i] < 0 or rp[i] >= n_rows or (i > 0 and rp[i] <= rp[i - 1]):
                        raise ValueError(
                            f"group {g}: rows must be strictly ascending indices in [0, {n_rows})")
                    if claimed[rp[i]]:
                        self._disjoint = False
                    claimed[rp[i]] = 1
                seg.rows = rp
                seg.n_rows = m
            if rs_obj is not None:
                if cnp.PyArray_DIM(<cnp.ndarray>rs_obj, 0) != m:
                    raise TypeError(f"group {g}: row_scales must be a 1-D float32 array of {m} values")
                seg.row_scales = <const float *>cnp.PyArray_DATA(<cnp.ndarray>rs_obj)

    def __reduce__(self):
        raise TypeError("GroupPlan belongs to one process and does not pickle")

    def apply(self, input, output):
        """Add every group's delta to the plan's ``n_rows`` rows of ``output`` in place."""
        self._run(_checked_rows_buffer(input, self.n_rows, self.d_in, "input", False),
                  _checked_rows_buffer(output, self.n_rows, self.d_out, "output", True))

    cdef int _run(self, cnp.ndarray x, cnp.ndarray y) except -1:
        if self._ng == 0 or self.n_rows == 0:
            return 0
        return _run_segments(self._segs, self._ng, self._disjoint, x, y, self.d_in, self.d_out)


def apply_groups(list groups not None, input, output, Py_ssize_t n_rows,
                 Py_ssize_t d_in, Py_ssize_t d_out):
    """Apply several layers, each to its own rows of one batch.

    ``groups`` is a list of ``(LayerKernel, scale, rows, row_scales)``: ``rows``
    an int32 array of strictly ascending row indices in ``[0, n_rows)`` (or
    ``None`` for every row), ``row_scales`` a float32 array with one scale per
    entry of ``rows`` (or ``None`` to use ``scale`` for all of them).  Rows
    that no group names are never written.  The same as
    ``GroupPlan(groups, n_rows, d_in, d_out).apply(input, output)``, with the
    buffers checked first.
    """
    cdef cnp.ndarray x = _checked_rows_buffer(input, n_rows, d_in, "input", False)
    cdef cnp.ndarray y = _checked_rows_buffer(output, n_rows, d_out, "output", True)
    (<GroupPlan>GroupPlan(groups, n_rows, d_in, d_out))._run(x, y)


# ============================================================================
# Half-precision row conversions (lorahook/_half.h)
#
# float16 and bfloat16 rows are 16-bit patterns (uint16); the C functions widen
# them to float32 and narrow float32 back with round-to-nearest-even, on the
# fastest path this CPU supports (AVX-512 BF16, AVX2 + F16C) or on a portable
# path that gives the same bits.  The functions below are private: they expose
# the conversions to the tests and benchmarks; the kernels call the C functions
# directly.  The bit-level rules are documented in _half.h and in
# _half_widen / _half_narrow.
#
# LORAHOOK_HALF_PORTABLE=1 in the environment forces the portable path; it is
# read once, when this module is imported, and changes nothing but the choice
# of conversion path inside lorahook.
# ============================================================================

from libc.stdint cimport uint16_t

cdef extern from "_half.h" nogil:
    int LORAHOOK_HALF_F16
    int LORAHOOK_HALF_BF16
    int LORAHOOK_HALF_PORTABLE
    int LORAHOOK_HALF_AVX2
    int LORAHOOK_HALF_AVX512
    int lorahook_half_supported() noexcept
    int lorahook_half_best_path() noexcept
    int lorahook_half_path() noexcept
    int lorahook_half_set_path(int path) noexcept
    void lorahook_half_widen(const uint16_t *src, float *dst, size_t n, int kind) noexcept
    void lorahook_half_narrow(const float *src, uint16_t *dst, size_t n, int kind) noexcept

cdef extern from *:
    """
    /* For a test: whether the fast paths leave the upper halves of the vector
       registers in use (XINUSE bits 2 and 6, read with XGETBV ECX=1), which
       would slow every later SSE instruction of the thread. */
    #if LORAHOOK_HALF_X86
    #include <cpuid.h>
    static int lorahook_half_xinuse_upper(void) {
        unsigned int a, b, c, d, lo, hi;
        if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))  /* OSXSAVE */
            return -1;
        if (!__get_cpuid_count(0xD, 1, &a, &b, &c, &d) || !(a & 4u))  /* XGETBV ECX=1 */
            return -1;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
        (void)hi;
        return (lo & 0x44u) != 0;
    }
    __attribute__((target("avx"))) static void lorahook_half_clear_upper(void) {
        _mm256_zeroupper();
    }
    /* -1: cannot tell; else whether the upper halves are in use after a widen
       and a narrow of n values on the active path (clean before). */
    static int lorahook_half_upper_after(const float *f, uint16_t *h, float *w, size_t n, int kind) {
        if (lorahook_half_supported() == (1 << LORAHOOK_HALF_PORTABLE))
            return -1;
        lorahook_half_clear_upper();
        if (lorahook_half_xinuse_upper() != 0)
            return -1;
        lorahook_half_narrow(f, h, n, kind);
        lorahook_half_widen(h, w, n, kind);
        return lorahook_half_xinuse_upper();
    }
    #else
    static int lorahook_half_upper_after(const float *f, uint16_t *h, float *w, size_t n, int kind) {
        (void)f; (void)h; (void)w; (void)n; (void)kind;
        return -1;
    }
    #endif
    """
    int lorahook_half_upper_after(const float *f, uint16_t *h, float *w, size_t n, int kind) noexcept nogil

import os as _half_os
import warnings as _half_warnings

_HALF_KINDS = {"float16": LORAHOOK_HALF_F16, "bfloat16": LORAHOOK_HALF_BF16}
_HALF_PATHS = {"portable": LORAHOOK_HALF_PORTABLE, "avx2": LORAHOOK_HALF_AVX2,
               "avx512": LORAHOOK_HALF_AVX512}
_HALF_PATH_NAMES = {v: k for k, v in _HALF_PATHS.items()}
_HALF_PATH_NEEDS = {"portable": "nothing", "avx2": "avx2, f16c",
                    "avx512": "avx512f, avx512vl, avx512bf16"}
_HALF_ENV = "LORAHOOK_HALF_PORTABLE"


cdef int _half_kind(object kind) except -1:
    if not isinstance(kind, str):
        raise TypeError(f"kind must be 'float16' or 'bfloat16', got {type(kind).__name__}")
    if kind not in _HALF_KINDS:
        raise ValueError(f"kind must be 'float16' or 'bfloat16', got {kind!r}")
    return _HALF_KINDS[kind]


cdef cnp.ndarray _half_array(object arr, object dtype, str name):
    # C-contiguous array of exactly `dtype` (native byte order); read-only is fine
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of {np.dtype(dtype)}, "
                        f"got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype) or not arr.dtype.isnative:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)} (native byte order), "
                        f"got {arr.dtype.str}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got a strided array "
                         f"of shape {arr.shape}")
    return arr


def _half_widen(src, kind):
    """Widen 16-bit patterns to float32: a new array of ``src``'s shape.

    ``src`` is a C-contiguous ``uint16`` array holding ``float16`` or
    ``bfloat16`` bit patterns, ``kind`` is ``'float16'`` or ``'bfloat16'``.
    Exact for every value.  bfloat16: the float32 bits are ``h << 16``, NaNs
    included.  float16: a NaN keeps its sign and payload (shifted left by 13)
    and becomes quiet (bit 22 set).  The GIL is released during the conversion.
    """
    cdef int k = _half_kind(kind)
    cdef cnp.ndarray a = _half_array(src, np.uint16, "src")
    cdef cnp.ndarray out = np.empty((<object>a).shape, dtype=np.float32)
    cdef size_t n = <size_t>a.size
    cdef const uint16_t *s
    cdef float *d
    if n:
        s = <const uint16_t *>cnp.PyArray_DATA(a)
        d = <float *>cnp.PyArray_DATA(out)
        with nogil:
            lorahook_half_widen(s, d, n, k)
    return out


def _half_narrow(src, kind):
    """Narrow float32 to 16-bit patterns: a new ``uint16`` array of ``src``'s shape.

    ``src`` is a C-contiguous ``float32`` array, ``kind`` is ``'float16'`` or
    ``'bfloat16'``.  Rounding is to nearest, ties to even, whatever the
    floating-point environment; subnormal results are kept (never flushed);
    values that round past the largest finite value become infinities of their
    sign.  NaNs stay NaN, keep their sign and their top payload bits and become
    quiet: float16 ``sign | 0x7E00 | ((bits >> 13) & 0x3FF)``, bfloat16
    ``(bits >> 16) | 0x0040``.  Every path gives the same bits.  The GIL is
    released during the conversion.
    """
    cdef int k = _half_kind(kind)
    cdef cnp.ndarray a = _half_array(src, np.float32, "src")
    cdef cnp.ndarray out = np.empty((<object>a).shape, dtype=np.uint16)
    cdef size_t n = <size_t>a.size
    cdef const float *s
    cdef uint16_t *d
    if n:
        s = <const float *>cnp.PyArray_DATA(a)
        d = <uint16_t *>cnp.PyArray_DATA(out)
        with nogil:
            lorahook_half_narrow(s, d, n, k)
    return out


def _half_repeat(src, out, kind, Py_ssize_t loops):
    """Convert ``src`` into ``out`` ``loops`` times without the GIL (for the benchmark).

    A ``float32`` ``src`` is narrowed into a ``uint16`` ``out``; a ``uint16``
    ``src`` is widened into a ``float32`` ``out``.  Both C-contiguous, of one
    size, not overlapping; ``out`` writable.  Timing this call measures the
    conversion as the kernels see it, without a Python call per row.
    """
    cdef int k = _half_kind(kind)
    cdef bint narrow = isinstance(src, np.ndarray) and src.dtype == np.float32
    cdef cnp.ndarray a = _half_array(src, np.float32 if narrow else np.uint16, "src")
    cdef cnp.ndarray b = _half_array(out, np.uint16 if narrow else np.float32, "out")
    if not b.flags.writeable:
        raise ValueError("out must be writable, got a read-only array")
    if a.size != b.size:
        raise ValueError(f"out must have {a.size} values like src, got {b.size}")
    if np.may_share_memory(a, b):
        raise ValueError("src and out must not overlap")
    if loops < 0:
        raise ValueError(f"loops must be >= 0, got {loops}")
    cdef size_t n = <size_t>a.size
    cdef Py_ssize_t i
    cdef void *s = cnp.PyArray_DATA(a)
    cdef void *d = cnp.PyArray_DATA(b)
    if n == 0:
        return
    with nogil:
        for i in range(loops):
            if narrow:
                lorahook_half_narrow(<const float *>s, <uint16_t *>d, n, k)
            else:
                lorahook_half_widen(<const uint16_t *>s, <float *>d, n, k)


def _half_upper_state_after(kind):
    """Whether a widen and a narrow on the active path leave the vector registers' upper halves in use.

    ``None`` when this CPU cannot tell (or has no vector path).  ``True`` is a
    performance bug: every later SSE instruction of the thread pays for it.
    """
    cdef int k = _half_kind(kind)
    cdef cnp.ndarray f = np.linspace(-3, 3, 100, dtype=np.float32)
    cdef cnp.ndarray h = np.empty(100, dtype=np.uint16)
    cdef cnp.ndarray w = np.empty(100, dtype=np.float32)
    cdef int r = lorahook_half_upper_after(<const float *>cnp.PyArray_DATA(f),
                                           <uint16_t *>cnp.PyArray_DATA(h),
                                           <float *>cnp.PyArray_DATA(w), 100, k)
    return None if r < 0 else bool(r)


def _half_set_path(name):
    """Make the named conversion path active; return the name of the previous one.

    ``name`` is ``'portable'``, ``'avx2'`` or ``'avx512'``; a path this build
    or CPU cannot run is a ``ValueError`` and changes nothing.  For tests and
    benchmarks: every path gives the same bits, only the speed differs.
    """
    if name not in _HALF_PATHS:
        raise ValueError(f"path must be one of {sorted(_HALF_PATHS)}, got {name!r}")
    old = lorahook_half_set_path(_HALF_PATHS[name])
    if old < 0:
        raise ValueError(f"the {name!r} conversion path is not available here "
                         f"(it needs an x86-64 build and a CPU with {_HALF_PATH_NEEDS[name]})")
    return _HALF_PATH_NAMES[old]


def _half_set_portable(flag):
    """Force the portable path (``True``) or go back to the fastest one (``False``).

    Returns whether the portable path was active before.
    """
    cdef int old = lorahook_half_path()
    if flag:
        lorahook_half_set_path(LORAHOOK_HALF_PORTABLE)
    else:
        lorahook_half_set_path(lorahook_half_best_path())
    return old == LORAHOOK_HALF_PORTABLE


def _half_paths():
    """Which conversion path is active and which ones this build and CPU can run.

    A dict: ``active`` and ``best`` (path names), ``supported`` (a tuple of
    names, slowest first), ``needs`` (the CPU features each path requires) and
    ``env_portable`` (whether ``LORAHOOK_HALF_PORTABLE=1`` was set at import).
    """
    cdef int mask = lorahook_half_supported()
    return {
        "active": _HALF_PATH_NAMES[lorahook_half_path()],
        "best": _HALF_PATH_NAMES[lorahook_half_best_path()],
        "supported": tuple(_HALF_PATH_NAMES[p] for p in sorted(_HALF_PATH_NAMES)
                           if mask & (1 << p)),
        "needs": dict(_HALF_PATH_NEEDS),
        "env_portable": _half_env_portable,
    }


def _half_portable_from_env(value):
    """Read a value of ``LORAHOOK_HALF_PORTABLE``: whether it forces the portable path.

    Unset, empty or ``'0'``: no (the default); ``'1'``: yes.  Anything else is
    a ``RuntimeWarning`` naming the variable and the default, which then applies.
    """
    if value is None:
        return False
    v = value.strip()
    if v in ("", "0"):
        return False
    if v == "1":
        return True
    _half_warnings.warn(
        f"{_HALF_ENV}={value!r} is not '0' or '1'; using the default "
        f"({_HALF_ENV}=0: the fastest conversion path this CPU supports)",
        RuntimeWarning, stacklevel=2)
    return False


_half_env_portable = _half_portable_from_env(_half_os.environ.get(_HALF_ENV))
if _half_env_portable:
    lorahook_half_set_path(LORAHOOK_HALF_PORTABLE)

# ============================================================================
# End of half-precision row conversions
# ============================================================================
