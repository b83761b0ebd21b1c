# cython: language_level=3
"""The compiled core of lorahook: call checks and the GIL-free BLAS row kernels.

The core knows kernels and rows, never adapters, file formats or names.  Its
public entry point is ``apply_lora_rows`` (re-exported by :mod:`lorahook`).
The loaders use one more private function, ``_read_plan``: a plan of byte
offsets read from a file descriptor into a float32 buffer, widened,
transposed and checked for non-finite values without the GIL.

What the core runs
------------------
A hook reaches the kernels through :class:`KernelSource`, the one interface
between Python hooks and the core.  A kernel source is either

* a **kernel table**: ``(layer_idx, module) -> LayerKernel``, each kernel
  applied to every row of any batch (what :class:`lorahook.LoraAdapter` is);
* **unit groups**: the rows of a call are ``units`` equal blocks (a block is
  one row of a bound batch, or all the rows of one sequence), and for each
  part -- a kernel table with, per layer scale, the blocks it applies to and
  their scales -- the core runs that table's kernel on those blocks' rows
  (what :meth:`lorahook.AdapterSet.bind` and ``bind_sequences`` return).

Any other :class:`lorahook.LoraHook`, registered virtual subclasses included,
gets the generic path: ``is_active`` (taken as ``True`` when missing), then
one ``apply`` per row.

Kernels
-------
For ``n`` rows through one adapter layer (``A`` is ``(rank, d_in)``, ``B`` is
``(d_out, rank)``) the update is ``Y += s * (X A^T) B^T``.

* below the crossover (``get_gemm_crossover()`` rows) each row gets two
  ``sgemv`` calls: ``t = A x`` then ``y += s * B t``;
* at or above it, rows are processed in chunks with two ``sgemm`` calls,
  ``T = X A^T`` into a per-thread scratch buffer, then ``Y += s * T B^T``
  (beta = 1).  Rows that are not contiguous in the batch (the grouped
  multi-adapter path) are gathered into scratch and scatter-added back.

Row-major ``(m, n)`` data is column-major ``(n, m)`` for BLAS.  ``A`` is read
with ``'T'`` and its row length as the leading dimension.  ``B`` is kept in
one layout only, ``B^T`` row-major (``(rank, d_out)``, i.e. ``B``
column-major), so both products with it use ``'N'`` and stream memory;
``LoraLayer.b`` is a read-only view of it.  Kernels run on the calling thread
with the GIL released; the core starts no thread of its own.  Different paths
may differ in the last bits of float32 rounding: a row's result can depend on
the batch it was computed in.
"""

cimport cython
cimport numpy as cnp
from libc.string cimport memcpy
from libc.limits cimport INT_MAX
from libc.stdlib cimport free
from cpython.type cimport PyType_IsSubtype
from scipy.linalg.cython_blas cimport sgemm, sgemv, saxpy, sscal
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

import operator
import sys

import numpy as np

cnp.import_array()

cdef extern from *:
    """
    #include <pthread.h>
    #include <stdlib.h>
    #include <string.h>
    #include <dlfcn.h>

    /* A per-thread scratch buffer, reused across calls so that the batched
       kernels do not page-fault on a fresh temporary every projection.  Freed
       by the pthread key destructor when the thread exits.  (Thread-local
       storage only: no thread is started here.) */
    #define LORAHOOK_SCRATCH_CACHE_FLOATS ((size_t)1 << 20)

    /* Three independent areas per thread: 0 for the float32 kernels, 1 for
       half-precision rows widened to float32, 2 for half-precision adapter
       weights widened to float32. */
    #define LORAHOOK_SCRATCH_SLOTS 3
    typedef struct { float *data[LORAHOOK_SCRATCH_SLOTS]; size_t len[LORAHOOK_SCRATCH_SLOTS]; } lorahook_buf;
    static pthread_key_t lorahook_key;
    static pthread_once_t lorahook_once = PTHREAD_ONCE_INIT;
    static int lorahook_key_ok = 0;

    static void lorahook_buf_free(void *p) {
        lorahook_buf *b = (lorahook_buf *)p;
        int i;
        if (b != NULL) {
            for (i = 0; i < LORAHOOK_SCRATCH_SLOTS; i++) free(b->data[i]);
            free(b);
        }
    }
    static void lorahook_make_key(void) {
        lorahook_key_ok = (pthread_key_create(&lorahook_key, lorahook_buf_free) == 0);
    }
    /* Returns a buffer of at least n floats, or NULL when out of memory.
       *owned is set to 1 when the caller must free() it (requests larger
       than the cache, or no thread-local storage available). */
    static float *lorahook_scratch_slot(size_t n, int slot, int *owned) {
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
        if (b->len[slot] < n) {
            float *p = (float *)malloc(n * sizeof(float));
            if (p == NULL) return NULL;
            free(b->data[slot]);
            b->data[slot] = p;
            b->len[slot] = n;
        }
        return b->data[slot];
    }
    static float *lorahook_scratch(size_t n, int *owned) { return lorahook_scratch_slot(n, 0, owned); }

    /* The file of the BLAS library the kernels call ("" when unknown): the
       dynamic loader says which file holds a function of the module that
       calls BLAS (scipy.linalg.cython_blas); a symbol lookup through that
       file's handle searches it and the libraries it links, and the file
       holding sgemm is the BLAS.  Read-only: nothing is changed. */
    static char lorahook_blas_path[4096] = "";
    static void lorahook_find_blas(void *blas_caller) {
        static const char *sgemms[] = {
            "scipy_sgemm_", "sgemm_", "sgemm", "scipy_sgemm_64_", "sgemm_64_", NULL};
        Dl_info caller, lib;
        void *handle, *sym;
        int i;
        if (blas_caller == NULL || !dladdr(blas_caller, &caller) || caller.dli_fname == NULL)
            return;
        handle = dlopen(caller.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (handle == NULL)
            return;
        for (i = 0; sgemms[i] != NULL; i++) {
            sym = dlsym(handle, sgemms[i]);
            if (sym != NULL && dladdr(sym, &lib) && lib.dli_fname != NULL
                    && strcmp(lib.dli_fname, caller.dli_fname) != 0
                    && strlen(lib.dli_fname) < sizeof(lorahook_blas_path)) {
                strcpy(lorahook_blas_path, lib.dli_fname);
                break;
            }
        }
        dlclose(handle);  /* RTLD_NOLOAD took a reference; give it back */
    }
    #ifndef LORAHOOK_DEBUG_BUILD
    #define LORAHOOK_DEBUG_BUILD 0
    #endif
    """
    float *lorahook_scratch(size_t n, int *owned) noexcept nogil
    float *lorahook_scratch_slot(size_t n, int slot, int *owned) noexcept nogil
    size_t LORAHOOK_SCRATCH_CACHE_FLOATS
    int LORAHOOK_DEBUG_BUILD
    char *lorahook_blas_path
    void lorahook_find_blas(void *blas_caller) noexcept nogil

#: True when the extension was built with bounds checking (LORAHOOK_CYTHON_DEBUG=1).
DEBUG_BUILD = bool(LORAHOOK_DEBUG_BUILD)

# Rows at or above which a single adapter segment uses the sgemm pair instead
# of one sgemv pair per row.
cdef Py_ssize_t _gemm_crossover = 32

# Set by lorahook.hook at import: the abstract base every hook derives from
# or is registered with.
cdef object _hook_base = None

# Called once, with the GIL, before the first batched (sgemm) kernel of the
# process runs; set by lorahook.threads (its BLAS pool check).
cdef object _first_batched = None
cdef bint _batched_seen = False


def _set_hook_base(cls):
    global _hook_base
    _hook_base = cls


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
    n = _as_width(n, "n")
    old = _gemm_crossover
    _gemm_crossover = n
    return old


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


# The dtypes rows may have.  bfloat16 is ml_dtypes' numpy dtype, recognised by
# its type number once the caller has imported ml_dtypes (lorahook never
# imports it: that registers a dtype with numpy for the whole process).
cdef enum:
    ROWS_F32 = 0
    ROWS_F16 = 1
    ROWS_BF16 = 2

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


cdef int _check_type(object arr, str name, int bits=-1) except -1:
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


cdef int _check_types(object input, object output, int bits=-1) except -1:
    """Both buffers' types; they must share one dtype.  Returns the row kind."""
    cdef int kx = _check_type(input, "input", bits)
    cdef int ky = _check_type(output, "output", bits)
    if kx != ky:
        raise TypeError(f"input and output must share one dtype, got input {input.dtype} and "
                        f"output {output.dtype}")
    return kx


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


cdef int _refuse_overlap(cnp.ndarray x, cnp.ndarray y) except -1:
    """``ValueError`` when two C-contiguous buffers share any byte."""
    cdef char *xs = <char *>cnp.PyArray_DATA(x)
    cdef char *ys = <char *>cnp.PyArray_DATA(y)
    cdef Py_ssize_t xb = cnp.PyArray_NBYTES(x)
    cdef Py_ssize_t yb = cnp.PyArray_NBYTES(y)
    if xb > 0 and yb > 0 and xs < ys + yb and ys < xs + xb:
        raise ValueError(
            f"input and output must not overlap in memory, got overlapping buffers "
            f"(input {xb} bytes at {<size_t>xs:#x}, output {yb} bytes at {<size_t>ys:#x})")
    return 0


cdef Py_ssize_t _check_call(object input, object output, object input_row_width,
                            object output_row_width, Py_ssize_t *widths=NULL,
                            int *kind=NULL, int bits=-1, object float32_only=None) except -1:
    """The spec's call checks in order; returns the row count.

    ``widths``, when given, receives ``(input_row_width, output_row_width)``
    as checked ints; ``kind`` the row kind.  ``float32_only`` names a hook
    that takes float32 rows only (a Python hook): half rows are then a
    ``TypeError``, with the other type checks.
    """
    cdef int k = _check_types(input, output, bits)
    if k != ROWS_F32 and float32_only is not None:
        raise TypeError(f"{float32_only} is a Python hook (one apply() per row): it takes "
                        f"float32 rows only, got {input.dtype} rows")
    if kind != NULL:
        kind[0] = k
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
    _refuse_overlap(x, y)
    if widths != NULL:
        widths[0] = d_in
        widths[1] = d_out
    return n_in


def check_rows(input, output, input_row_width, output_row_width):
    """Run ``apply_lora_rows``' buffer checks and return the row count."""
    return _check_call(input, output, input_row_width, output_row_width)


# ---------------------------------------------------------------------------
# the interface between hooks and the core
# ---------------------------------------------------------------------------

# How apply_lora_rows treats a kernel source (KernelSource._mode).
cdef enum:
    MODE_KERNELS = 0   # the kernels answer is_active and do the work
    MODE_ASK = 1       # ask the hook's own is_active first, then the kernels
    MODE_ROWS = 2      # the hook's own apply, once per row (generic path)

# Row-per-unit counts whose plans a unit-group source keeps (a generation
# loop needs two: the prefill length and 1 for decode steps).
cdef enum:
    _MAX_PLAN_LENGTHS = 4


@cython.auto_pickle(False)
cdef class KernelSource:
    """The compiled side of a hook: which layer kernels run on which rows.

    Not made directly: :class:`lorahook.LoraAdapter` is a kernel table and
    the hooks of :meth:`lorahook.AdapterSet.bind` / ``bind_sequences`` are
    unit groups (see the module docstring).  Both are filled once, when the
    hook is built, through the private ``_set_table`` / ``_set_units``, and
    never change afterwards, so a source may be used from several threads.
    """
    cdef dict _table          # table: key -> LayerKernel, for every row
    cdef int _mode
    cdef bint _grouped
    cdef tuple _parts         # groups: ((label, KernelSource, {scale: (s, units, scales)}), ...)
    cdef Py_ssize_t _units    # groups: a call has a multiple of _units rows ...
    cdef bint _exact          # ... or exactly _units rows
    cdef dict _resolved       # groups: key -> tuple of (label, kernel, s, units, scales)
    cdef dict _plans          # groups: rows per unit -> {key: GroupPlan}
    cdef bint _filled         # set once: a source never changes afterwards

    cdef int _fill_once(self) except -1:
        if self._filled:
            raise TypeError(f"{type(self).__name__} is immutable: its kernels are set once, "
                            f"when it is made")
        self._filled = True
        return 0

    def _set_table(self, table, int mode):
        """Make this a kernel table: ``table`` maps keys to LayerKernels (rank > 0).

        The table is copied (the caller's dict may change afterwards); a source
        is filled once.
        """
        table = dict(table)
        for key, kernel in table.items():
            if type(kernel) is not LayerKernel or (<LayerKernel>kernel).rank == 0:
                raise TypeError(f"kernel for {key!r} must be a LayerKernel of rank > 0")
        if mode < MODE_KERNELS or mode > MODE_ROWS:
            raise ValueError(f"mode must be 0, 1 or 2, got {mode}")
        self._fill_once()
        self._table = table
        self._mode = mode
        self._grouped = False

    def _set_units(self, parts, Py_ssize_t units, bint exact):
        """Make this unit groups over ``units`` blocks of rows.

        ``parts`` is a sequence of ``(label, source, by_scale)``: ``source`` a
        kernel table, ``by_scale`` maps a kernel's ``scale`` (as a Python
        float) to ``(scale, unit_indices, unit_scales)`` -- strictly
        ascending int32 block indices in ``[0, units)`` (``None``: every
        block) and one float32 scale each (``None``: ``scale`` for all).
        Blocks no part names are never written.
        """
        if units < 0:
            raise ValueError(f"units must be >= 0, got {units}")
        checked = []
        for label, source, by_scale in parts:
            if not isinstance(source, KernelSource) or (<KernelSource>source)._grouped:
                raise TypeError(f"part {label!r}: the source must be a kernel table")
            groups = {}
            for s, (scale, idx, scales) in dict(by_scale).items():
                idx = _private_vector(idx, cnp.NPY_INT32, np.int32, 0, "unit indices", "int32")
                scales = _private_vector(scales, cnp.NPY_FLOAT32, np.float32, 0, "unit scales",
                                         "float32")
                m = units if idx is None else len(idx)
                if idx is not None and m and (idx[0] < 0 or idx[m - 1] >= units
                                              or (m > 1 and not (np.diff(idx) > 0).all())):
                    raise ValueError(f"part {label!r}: unit indices must be strictly "
                                     f"ascending in [0, {units})")
                if scales is not None and len(scales) != m:
                    raise ValueError(f"part {label!r}: {len(scales)} unit scales for {m} units")
                groups[float(s)] = (float(scale), idx, scales)
            checked.append((str(label), source, groups))
        self._fill_once()
        self._parts = tuple(checked)
        self._units = units
        self._exact = exact
        self._mode = MODE_KERNELS
        self._grouped = True
        self._resolved = {}
        self._plans = {}

    def is_active(self, layer_idx, module):
        """True when some kernel covers ``(layer_idx, module)`` (for some row)."""
        key = (layer_idx, module)
        if self._grouped:
            return bool(self._groups(key))
        return self._table is not None and key in self._table

    cdef Py_ssize_t _check_rows(self, Py_ssize_t n) except -1:
        if self._exact:
            if n != self._units:
                raise ValueError(f"this hook was bound for a batch of {self._units} rows, "
                                 f"got {n} rows")
            return 1 if n else 0
        if self._units == 0:
            if n != 0:
                raise ValueError(f"this hook was bound for 0 sequences and serves only "
                                 f"0-row calls, got {n} rows")
            return 0
        if n % self._units != 0:
            raise ValueError(
                f"this hook was bound for {self._units} sequences: the row count must be a "
                f"multiple of {self._units}, got {n} rows ({n % self._units} left over)")
        return n // self._units

    cdef tuple _groups(self, tuple key):
        found = self._resolved.get(key)
        if found is None:
            items = []
            for label, source, by_scale in self._parts:
                kernel = (<KernelSource>source)._table.get(key)
                if kernel is None:
                    continue
                group = (<dict>by_scale).get(<double>(<LayerKernel?>kernel).scale)
                if group is not None:
                    items.append((label, kernel) + group)
            found = tuple(items)
            # Concurrent fills compute the same value; the last one wins.
            self._resolved[key] = found
        return <tuple>found

    cdef GroupPlan _plan(self, tuple key, Py_ssize_t n, Py_ssize_t per_unit, int d_in, int d_out):
        """The plan of a checked call, or ``None`` when nothing covers ``key``.

        Widths are checked even for a zero-row call (``ValueError`` before any
        write).  Plans are kept per rows-per-unit count, at most
        ``_MAX_PLAN_LENGTHS`` counts (the oldest is dropped).
        """
        cdef GroupPlan plan
        per = self._plans.get(per_unit)
        if per is not None:
            found = (<dict>per).get(key)
            if found is not None:
                plan = <GroupPlan>found
                if plan.d_in == d_in and plan.d_out == d_out:
                    return plan
        groups = self._groups(key)
        if not groups:
            return None
        for label, kernel, _, _, _ in groups:
            _check_kernel_widths(<LayerKernel?>kernel, key, label, d_in, d_out)
        if n == 0:
            return None
        plan = GroupPlan([(kernel, scale, _expand_units(idx, per_unit),
                           None if scales is None else np.repeat(scales, per_unit))
                          for _, kernel, scale, idx, scales in groups], n, d_in, d_out)
        if per is None:
            while len(self._plans) >= _MAX_PLAN_LENGTHS:
                try:
                    del self._plans[next(iter(self._plans))]
                except (KeyError, StopIteration, RuntimeError):
                    break
            per = self._plans.setdefault(per_unit, {})
        (<dict>per)[key] = plan
        return plan


cdef object _expand_units(object idx, Py_ssize_t per_unit):
    """Row indices of the blocks ``idx`` (``None``: every row), ``per_unit`` rows each."""
    if idx is None:
        return None
    if per_unit == 1:
        return idx
    return (np.asarray(idx, dtype=np.int64)[:, None] * per_unit
            + np.arange(per_unit, dtype=np.int64)).astype(np.int32).ravel()


cdef int _check_kernel_widths(LayerKernel kernel, tuple key, str label, Py_ssize_t d_in,
                              Py_ssize_t d_out) except -1:
    if kernel.d_in != d_in or kernel.d_out != d_out:
        who = f"adapter {label!r} layer" if label else "adapter layer"
        raise ValueError(
            f"{who} ({key[0]}, {key[1]!r}) has (d_in, d_out) = ({kernel.d_in}, {kernel.d_out}) "
            f"but the call's row widths are (input_row_width, output_row_width) = "
            f"({d_in}, {d_out})")
    return 0


cdef int _apply_each_row(object hook, object layer_idx, object module, cnp.ndarray x,
                         cnp.ndarray y, Py_ssize_t d_in, Py_ssize_t d_out,
                         Py_ssize_t n) except -1:
    """The generic path: one ``apply`` per row, on views of the caller's arrays."""
    rows_in = (<object>x).reshape(n, d_in).view()
    rows_in.flags.writeable = False
    rows_out = (<object>y).reshape(n, d_out)
    apply = hook.apply
    cdef Py_ssize_t i
    for i in range(n):
        apply(layer_idx, module, rows_in[i], rows_out[i])
    return 0


def apply_lora_rows(hook, layer_idx, module, input, output, input_row_width, output_row_width):
    """Add ``hook``'s LoRA delta to every row of ``output`` in place.

    ``input`` holds the rows given to the base projection and ``output`` its
    result, each a C-contiguous ``ndarray``, either flattened 1-D
    (``len == rows * width``) or 2-D ``(rows, width)``, both of one dtype:
    float32, float16 or bfloat16 (an ``ml_dtypes.bfloat16`` array; lorahook
    recognises the dtype once the caller has imported ml_dtypes, and never
    imports it itself).  Half-precision rows are widened to float32, the
    delta is added to the widened output and the sum is rounded once to the
    output dtype (to nearest even); generic Python hooks get float32 rows
    only (``TypeError`` for half rows).  The call is checked
    first, whatever the hook (``TypeError`` for the hook's type, types,
    dtypes and non-integer widths; ``ValueError`` for ndim, contiguity,
    writability, widths, row counts, overlapping buffers and a bound hook's
    row count); nothing is written when a check fails.  Then
    ``hook.is_active(layer_idx, module)`` is asked once (a registered virtual
    subclass without ``is_active`` counts as active); an inactive hook returns
    at once.  The widths of the layers that cover the projection are checked
    against the call's, for zero-row calls too.  A
    :class:`~lorahook.LoraAdapter` or a bound :class:`~lorahook.AdapterSet`
    batch runs in the compiled core with the GIL released, on the calling
    thread; any other hook gets one ``apply`` call per row, in row order.
    """
    return _apply(hook, layer_idx, module, input, output, input_row_width, output_row_width, -1)


def _apply_lora_bits(hook, layer_idx, module, input, output, input_row_width,
                     output_row_width, bfloat16):
    """``apply_lora_rows`` for uint16 arrays holding float16 (or, with ``bfloat16``, bfloat16) bits.

    How lorahook.torch passes half-precision tensors without a copy (torch
    tensors view as uint16; numpy has no bfloat16 of its own).  Arrays of a
    float dtype are taken as they are.
    """
    return _apply(hook, layer_idx, module, input, output, input_row_width, output_row_width,
                  ROWS_BF16 if bfloat16 else ROWS_F16)


cdef object _apply(hook, layer_idx, module, input, output, input_row_width, output_row_width,
                   int bits):
    cdef type t = type(hook)
    cdef KernelSource src = None
    cdef int mode = MODE_ROWS
    # Subtype tests on the MRO first (isinstance through ABCMeta costs ~0.4
    # us of a ~1 us inactive call); registered virtual subclasses last.
    if PyType_IsSubtype(t, KernelSource):
        src = <KernelSource>hook
        mode = src._mode
    elif _hook_base is None or not (PyType_IsSubtype(t, <type>_hook_base)
                                    or isinstance(hook, _hook_base)):
        raise TypeError(f"hook must be a lorahook.LoraHook, got {type(hook).__name__}")
    cdef Py_ssize_t widths[2]
    cdef int kind = ROWS_F32
    cdef Py_ssize_t n = _check_call(input, output, input_row_width, output_row_width, widths,
                                    &kind, bits,
                                    type(hook).__name__ if src is None or mode == MODE_ROWS
                                    else None)
    cdef Py_ssize_t per_unit = 0
    if src is not None and src._grouped:
        per_unit = src._check_rows(n)
    if type(layer_idx) is not int:
        layer_idx = _as_int(layer_idx, "layer_idx")
    if layer_idx < 0:
        raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")
    if type(module) is not str:
        raise TypeError(f"module must be a str, got {type(module).__name__}")
    cdef tuple key
    cdef GroupPlan plan
    if mode != MODE_KERNELS:
        is_active = getattr(hook, "is_active", None)
        if is_active is not None and not is_active(layer_idx, module):
            return
    if src is None or mode == MODE_ROWS:
        if src is not None and not src._grouped:
            found = src._table.get((layer_idx, module))
            if found is not None:
                _check_kernel_widths(<LayerKernel?>found, (layer_idx, module), "",
                                     widths[0], widths[1])
        if n:
            _apply_each_row(hook, layer_idx, module, <cnp.ndarray>input, <cnp.ndarray>output,
                            widths[0], widths[1], n)
        return
    key = (layer_idx, module)
    if not src._grouped:
        found = src._table.get(key)
        if found is None:
            return
        _check_kernel_widths(<LayerKernel?>found, key, "", widths[0], widths[1])
        if n:
            _run_layer(<LayerKernel?>found, <cnp.ndarray>input, <cnp.ndarray>output, n, kind)
        return
    plan = src._plan(key, n, per_unit, <int>widths[0], <int>widths[1])
    if plan is not None:
        plan._run(<cnp.ndarray>input, <cnp.ndarray>output, kind)


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

    def __cinit__(self, a, bt, scale, bias=None, weights="float32"):
        cdef Py_ssize_t rank, d_in, d_out, bt_rank
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

    def __reduce__(self):
        raise TypeError("LayerKernel is rebuilt from its LoraLayer and does not pickle")

    cdef void fill(self, Segment *s) noexcept:
        s.wkind = self.wkind
        s.a = NULL
        s.b = NULL
        s.a16 = NULL
        s.b16 = NULL
        if self.rank > 0 and self.wkind < 0:
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


# Half-precision batches: rows per chunk, and the floats of one block of the
# delta (a block of output columns for every row of a chunk), kept in L1/L2.
cdef enum:
    _HALF_CHUNK_ROWS = 32
    _HALF_BLOCK_FLOATS = 4096


cdef int _run_half_batched(const Segment *s, const int *rows, const float *row_scales,
                           const uint16_t *X, uint16_t *Y, int d_in, int d_out,
                           int hk) noexcept nogil:
    """Half-precision rows at or above the crossover, the output never widened whole.

    Per chunk of ``_HALF_CHUNK_ROWS`` rows: the input rows are widened into
    scratch area 1 and ``T = A X^T`` is one ``sgemm``; then, a block of output
    columns at a time, the rows' block of the output is widened into ``D``,
    ``D += s * B_block T`` (``sgemm``) and each row's block is rounded back
    once.  ``D`` stays in L1 (blocks widen with the rank, whose ``sgemm`` has
    more to do); ``s`` holds float32 weights.
    """
    cdef int rank = s.rank
    cdef Py_ssize_t n = s.n_rows, k, j, r, o0
    cdef int c, ob, block, owned = 0
    cdef char tr = b'T'
    cdef char nt = b'N'
    cdef int one_i = 1
    cdef float one = 1.0
    cdef float zero = 0.0
    cdef float alpha, a_j
    cdef float *A = <float *>s.a
    cdef float *B = <float *>s.b
    cdef float *bias = <float *>s.bias
    # more rows per chunk and wider blocks for higher ranks, where each sgemm
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
        <size_t>chunk * (<size_t>d_in + rank + block), 1, &owned)
    if G == NULL:
        return -1
    cdef float *T = G + chunk * d_in
    cdef float *D = T + chunk * rank
    k = 0
    while k < n:
        c = <int>(chunk if n - k > chunk else n - k)
        for j in range(c):
            r = rows[k + j] if rows != NULL else k + j
            lorahook_half_widen(X + r * d_in, G + j * d_in, d_in, hk)
        # T^T (rank x c, column-major) = A X^T
        sgemm(&tr, &nt, &rank, &c, &d_in, &one, A, &d_in, G, &d_in, &zero, T, &rank)
        if row_scales != NULL:
            for j in range(c):
                a_j = row_scales[k + j]
                sscal(&rank, &a_j, T + j * rank, &one_i)
            alpha = one
        else:
            alpha = s.scale
        o0 = 0
        while o0 < d_out:
            ob = <int>(block if d_out - o0 > block else d_out - o0)
            for j in range(c):  # the block of each output row, widened
                r = rows[k + j] if rows != NULL else k + j
                lorahook_half_widen(Y + r * d_out + o0, D + j * ob, ob, hk)
            # D (ob x c, column-major) += alpha * B[o0:o0+ob, :] T^T; B column-major, ld d_out
            sgemm(&nt, &nt, &ob, &c, &rank, &alpha, B + o0, &d_out, T, &rank, &one, D, &ob)
            for j in range(c):  # each output row's block rounded once
                r = rows[k + j] if rows != NULL else k + j
                if bias != NULL:
                    a_j = row_scales[k + j] if row_scales != NULL else s.scale
                    saxpy(&ob, &a_j, bias + o0, &one_i, D + j * ob, &one_i)
                lorahook_half_narrow(D + j * ob, Y + r * d_out + o0, ob, hk)
            o0 += ob
        k += c
    if owned:
        free(G)
    return 0


cdef int _run_segment_any(const Segment *s, const char *X, char *Y, int d_in, int d_out,
                          Py_ssize_t crossover, int kind) noexcept nogil:
    """``_run_segment`` for rows of any kind and adapters with 16-bit weights.

    16-bit weights are widened once per call into scratch area 2.  Half rows
    (``kind`` F16/BF16) take :func:`_run_half_batched` at or above the
    crossover; below it, each chunk's input and output rows are widened into
    scratch area 1, the float32 row kernel adds each delta to the widened
    output, and each output row is rounded back once, to nearest even.  The kernel path (row loop or sgemm) is chosen by the whole
    segment's row count, as for float32 rows.  Returns -1 without memory.
    """
    cdef Segment seg = s[0]
    cdef Py_ssize_t n = s.n_rows, k, j, r, chunk, cap
    cdef int owned_w = 0, owned_r = 0, rc = 0, c, hk
    cdef float *W = NULL
    cdef float *G
    cdef float *D
    cdef float *R = NULL
    if s.rank == 0 or n == 0:
        return 0
    if s.wkind >= 0:
        W = lorahook_scratch_slot(<size_t>s.rank * (<size_t>d_in + d_out) + d_out, 2, &owned_w)
        if W == NULL:
            return -1
        lorahook_half_widen(<const uint16_t *>s.a16, W, <size_t>s.rank * d_in, s.wkind)
        lorahook_half_widen(<const uint16_t *>s.b16, W + <Py_ssize_t>s.rank * d_in,
                            <size_t>s.rank * d_out, s.wkind)
        seg.a = W
        seg.b = W + <Py_ssize_t>s.rank * d_in
        if s.bias16 != NULL:
            seg.bias = W + <Py_ssize_t>s.rank * (d_in + d_out)
            lorahook_half_widen(<const uint16_t *>s.bias16, <float *>seg.bias, d_out, s.wkind)
    if kind == ROWS_F32:
        rc = _run_segment(&seg, <const float *>X, <float *>Y, d_in, d_out, crossover)
    elif n >= crossover:
        rc = _run_half_batched(&seg, s.rows, s.row_scales, <const uint16_t *>X,
                               <uint16_t *>Y, d_in, d_out,
                               LORAHOOK_HALF_F16 if kind == ROWS_F16 else LORAHOOK_HALF_BF16)
    else:
        # the row loop (below the crossover): rows widened into scratch, the
        # float32 row kernel computes each delta, each output row rounded once
        hk = LORAHOOK_HALF_F16 if kind == ROWS_F16 else LORAHOOK_HALF_BF16
        cap = <Py_ssize_t>(1 << 18) // (<Py_ssize_t>d_in + d_out)
        chunk = n if n < cap else cap
        if chunk < 1:
            chunk = 1
        R = lorahook_scratch_slot(<size_t>chunk * (<size_t>d_in + d_out), 1, &owned_r)
        if R == NULL:
            rc = -1
        else:
            G = R
            D = R + chunk * d_in
            crossover = n + 1  # every chunk takes the row loop, as the whole segment does
            k = 0
            while k < n:
                c = <int>(chunk if n - k > chunk else n - k)
                for j in range(c):
                    r = s.rows[k + j] if s.rows != NULL else k + j
                    lorahook_half_widen(<const uint16_t *>X + r * d_in, G + j * d_in, d_in, hk)
                    lorahook_half_widen(<const uint16_t *>Y + r * d_out, D + j * d_out, d_out, hk)
                seg.rows = NULL
                seg.n_rows = c
                seg.row_scales = s.row_scales + k if s.row_scales != NULL else NULL
                rc = _run_segment(&seg, G, D, d_in, d_out, crossover)
                if rc != 0:
                    break
                for j in range(c):
                    r = s.rows[k + j] if s.rows != NULL else k + j
                    lorahook_half_narrow(D + j * d_out, <uint16_t *>Y + r * d_out, d_out, hk)
                k += c
    if owned_r:
        free(R)
    if owned_w:
        free(W)
    return rc


cdef inline cnp.ndarray _checked_rows_buffer(object arr, Py_ssize_t n, Py_ssize_t width,
                                             str name, bint writable):
    _check_type(arr, name)
    cdef cnp.ndarray a = <cnp.ndarray>arr
    _check_layout(a, name, writable)
    if (n < 0 or width < 1 or cnp.PyArray_SIZE(a) % width != 0 or cnp.PyArray_SIZE(a) // width != n
            or (cnp.PyArray_NDIM(a) == 2 and cnp.PyArray_DIM(a, 1) != width)):
        raise ValueError(f"{name} must hold {n} rows of width {width}, got shape {_shape_str(a)}")
    return a


cdef inline int _checked_output(object input, object output, Py_ssize_t n,
                                Py_ssize_t d_in, Py_ssize_t d_out) except -1:
    """Check a kernel call's buffers; returns their row kind."""
    cdef int kind = _check_types(input, output)
    cdef cnp.ndarray x = _checked_rows_buffer(input, n, d_in, "input", False)
    cdef cnp.ndarray y = _checked_rows_buffer(output, n, d_out, "output", True)
    _refuse_overlap(x, y)
    return kind


def apply_layer(LayerKernel layer not None, input, output, Py_ssize_t n_rows):
    """Add one layer's delta to ``n_rows`` rows (widths are the layer's)."""
    kind = _checked_output(input, output, n_rows, layer.d_in, layer.d_out)
    _run_layer(layer, <cnp.ndarray>input, <cnp.ndarray>output, n_rows, kind)


cdef int _run_layer(LayerKernel layer, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n_rows,
                    int kind) except -1:
    """The kernel on buffers already checked to hold ``n_rows`` rows of the layer's widths."""
    cdef Segment seg
    layer.fill(&seg)
    seg.n_rows = n_rows
    return _run_segments(&seg, 1, x, y, layer.d_in, layer.d_out, kind)


cdef int _run_segments(const Segment *segs, Py_ssize_t ng, cnp.ndarray x, cnp.ndarray y,
                       int d_in, int d_out, int kind) except -1:
    """Run segments one after the other on checked buffers, with the GIL released.

    The one way into the kernels.  Segments run in order on the calling
    thread, so two updates of one row never race.
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
        cdef Segment *seg
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
        kind = _checked_output(input, output, self.n_rows, self.d_in, self.d_out)
        self._run(<cnp.ndarray>input, <cnp.ndarray>output, kind)

    cdef int _run(self, cnp.ndarray x, cnp.ndarray y, int kind) except -1:
        if (cnp.PyArray_SIZE(x) != self.n_rows * self.d_in
                or cnp.PyArray_SIZE(y) != self.n_rows * self.d_out):
            raise ValueError(f"this plan is for {self.n_rows} rows of ({self.d_in}, {self.d_out}), "
                             f"got buffers of {cnp.PyArray_SIZE(x)} and {cnp.PyArray_SIZE(y)} values")
        if self._ng == 0 or self.n_rows == 0:
            return 0
        return _run_segments(self._segs, self._ng, x, y, self.d_in, self.d_out, kind)


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
    kind = _checked_output(input, output, n_rows, d_in, d_out)
    (<GroupPlan>GroupPlan(groups, n_rows, d_in, d_out))._run(<cnp.ndarray>input,
                                                             <cnp.ndarray>output, kind)


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
    and becomes quiet (bit 22 set).  The GIL is released during the
    conversion.
    """
    cdef int k = _half_kind(kind)
    cdef cnp.ndarray a = _half_array(src, np.uint16, "src")
    out = np.empty((<object>a).shape, dtype=np.float32)
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


# ============================================================================
# Reading tensors from a file descriptor (the loaders' one copy per value)
# ============================================================================

from posix.uio cimport iovec, preadv
from libc.errno cimport errno, EINTR
from libc.stdlib cimport malloc

cdef extern from "_load.h" nogil:
    size_t lorahook_count_nonfinite(const float *x, size_t n) noexcept
    void lorahook_transpose(const float *src, size_t rows, size_t cols, float *dst, size_t ld) noexcept
    void lorahook_advise_hugepages(void *p, size_t n) noexcept

# Columns of a read plan, one row per tensor (see _read_plan).
cdef enum:
    _P_OFFSET = 0
    _P_COUNT = 1
    _P_START = 2
    _P_ROWS = 3
    _P_COLS = 4
    _P_KIND = 5
    _P_FLIP = 6
    _P_WIDTH = 7
    _MAX_IOV = 1024

ctypedef struct _Piece:
    Py_ssize_t t        # tensor (plan row)
    Py_ssize_t u0       # first unit (element, or file row when transposed)
    Py_ssize_t take     # units in this piece
    Py_ssize_t boff     # byte offset in the bounce buffer, -1: read in place


cdef void _finish_piece(const cnp.int64_t *row, float *buffer, const char *bounce,
                        float *conv, const _Piece *p, cnp.int64_t *bad) noexcept nogil:
    """Convert one piece (plan row ``row``) into place, counting non-finite values."""
    cdef int kind = <int>row[_P_KIND]
    cdef size_t rows = <size_t>row[_P_ROWS]
    cdef size_t cols = <size_t>row[_P_COLS]
    cdef float *dst = buffer + row[_P_START]
    cdef size_t n
    cdef const float *src
    cdef int hk = LORAHOOK_HALF_F16 if kind == 1 else LORAHOOK_HALF_BF16
    if p.boff < 0:  # float32 read in place
        bad[0] += <cnp.int64_t>lorahook_count_nonfinite(dst + p.u0, <size_t>p.take)
        return
    if row[_P_FLIP] == 0:  # a half tensor, widened into place
        lorahook_half_widen(<const uint16_t *>(bounce + p.boff), dst + p.u0, <size_t>p.take, hk)
        bad[0] += <cnp.int64_t>lorahook_count_nonfinite(dst + p.u0, <size_t>p.take)
        return
    n = <size_t>p.take * cols
    if kind == 0:
        src = <const float *>(bounce + p.boff)
    else:
        lorahook_half_widen(<const uint16_t *>(bounce + p.boff), conv, n, hk)
        src = conv
    bad[0] += <cnp.int64_t>lorahook_count_nonfinite(src, n)
    lorahook_transpose(src, <size_t>p.take, cols, dst + p.u0, rows)


from libc.stdint cimport uintptr_t, INT64_MAX
from cpython.pyport cimport PY_SSIZE_T_MAX
from posix.stdlib cimport posix_memalign

cdef extern from "Python.h":
    int PyTraceMalloc_Track(unsigned int domain, uintptr_t ptr, size_t size)
    int PyTraceMalloc_Untrack(unsigned int domain, uintptr_t ptr)


# numpy's own tracemalloc domain (``numpy.lib.tracemalloc_domain``): the
# blocks are counted with numpy's arrays by tracemalloc.
cdef unsigned int _NUMPY_TRACE_DOMAIN = 389047


cdef class _AlignedBlock:
    """The memory of one :func:`_aligned_floats` array, freed with the last view of it."""
    cdef void *ptr

    def __dealloc__(self):
        if self.ptr != NULL:
            PyTraceMalloc_Untrack(_NUMPY_TRACE_DOMAIN, <uintptr_t>self.ptr)
            free(self.ptr)
            self.ptr = NULL

    def __reduce__(self):
        raise TypeError("an aligned block is not pickled (its arrays are)")


def _aligned_floats(Py_ssize_t n, bint hugepages):
    """A new, uninitialised float32 array of ``n`` values starting on a 64-byte boundary.

    What :func:`_read_plan` fills: transposed tensors are written a whole cache
    line at a time, past the cache, only when their lines are aligned.  With
    ``hugepages`` the whole pages of a large block are advised as huge pages,
    as numpy does for its own large arrays.  The array's bytes are exactly
    ``4 * n``; the block is traced by ``tracemalloc`` in numpy's domain.
    """
    cdef void *ptr = NULL
    cdef size_t size
    cdef cnp.npy_intp dims[1]
    if n < 0 or n > PY_SSIZE_T_MAX // <Py_ssize_t>sizeof(float):
        raise ValueError(f"n must be in 0..{PY_SSIZE_T_MAX // <Py_ssize_t>sizeof(float)}, got {n}")
    size = <size_t>(n if n > 0 else 1) * sizeof(float)
    if posix_memalign(&ptr, 64, size) != 0:
        raise MemoryError(f"cannot allocate {size} bytes")
    block = _AlignedBlock()
    block.ptr = ptr
    PyTraceMalloc_Track(_NUMPY_TRACE_DOMAIN, <uintptr_t>ptr, size)
    if hugepages and size >= (<size_t>1 << 22):
        lorahook_advise_hugepages(ptr, size)
    dims[0] = n
    arr = cnp.PyArray_SimpleNewFromData(1, dims, cnp.NPY_FLOAT32, ptr)
    cnp.set_array_base(arr, block)
    return arr


def _read_plan(int fd, const cnp.int64_t[:, ::1] plan not None, float[::1] buffer not None,
               cnp.int64_t[::1] bad not None, Py_ssize_t bounce_bytes, Py_ssize_t run_bytes,
               int max_run):
    """Read tensors from ``fd`` into ``buffer``, one copy per value, without the GIL.

    ``plan`` has one row per tensor, in file order: ``(file offset, count,
    start, rows, cols, kind, flip)``.  The tensor's ``count`` values of kind 0
    (float32), 1 (float16) or 2 (bfloat16), little-endian, start at byte
    ``file offset``; they become float32 values at ``buffer[start : start +
    count]``, widened exactly (as :func:`_half_widen`) and, with ``flip``, as
    the ``(cols, rows)`` transpose of the file's ``(rows, cols)`` layout.
    ``bad[t]`` receives the number of NaNs and infinities of tensor ``t``.

    Runs of tensors that follow each other in the file are read with one
    ``preadv`` each, at most ``max_run`` pieces and about ``run_bytes`` bytes,
    so that each run is checked and converted while it is in cache.  Float32
    values read in place go straight from the file into ``buffer``; the others
    pass through a bounce buffer of ``bounce_bytes`` (grown to one file row if
    a row is larger).  The plan is checked against ``buffer`` first: nothing is
    written outside it.

    Returns ``(0, 0)`` when every byte was read, ``(1, t)`` when the file ended
    inside tensor ``t``, ``(2, errno)`` when a read failed.
    """
    cdef Py_ssize_t n = plan.shape[0], size = buffer.shape[0], t
    cdef cnp.int64_t count, rows, cols, start
    if plan.shape[1] != _P_WIDTH:
        raise ValueError(f"plan must have {_P_WIDTH} columns, found {plan.shape[1]}")
    if bad.shape[0] != n:
        raise ValueError(f"bad must have one entry per tensor ({n}), found {bad.shape[0]}")
    if not 1 <= max_run <= _MAX_IOV or bounce_bytes < 64 or run_bytes < 1:
        raise ValueError(f"limits out of range: max_run={max_run} (1..{_MAX_IOV}), "
                         f"bounce_bytes={bounce_bytes} (>= 64), run_bytes={run_bytes} (>= 1)")
    for t in range(n):
        count, start = plan[t, _P_COUNT], plan[t, _P_START]
        rows, cols = plan[t, _P_ROWS], plan[t, _P_COLS]
        if (plan[t, _P_OFFSET] < 0 or count < 0 or rows < 0 or cols < 0
                or not 0 <= plan[t, _P_KIND] <= 2 or not 0 <= plan[t, _P_FLIP] <= 1
                or (count != 0 if cols == 0 else (rows != count // cols or count % cols))
                or start < 0 or start > size or count > size - start
                # count <= size < 2**61: the byte count cannot overflow, the end offset could
                or plan[t, _P_OFFSET] > INT64_MAX - count * (4 if plan[t, _P_KIND] == 0 else 2)):
            raise ValueError(f"plan row {t} is not a tensor inside a buffer of {size} values: "
                             f"{list(plan[t])}")
        bad[t] = 0
    cdef float *out = &buffer[0] if size else NULL
    cdef cnp.int64_t *nbad = &bad[0] if n else NULL
    cdef const cnp.int64_t *P = &plan[0, 0] if n else NULL
    cdef const cnp.int64_t *row
    cdef size_t cap = <size_t>bounce_bytes
    cdef char *bounce = <char *>malloc(cap)
    cdef float *conv = NULL
    cdef iovec *iov = <iovec *>malloc(<size_t>max_run * sizeof(iovec))
    cdef _Piece *pieces = <_Piece *>malloc(<size_t>max_run * sizeof(_Piece))
    cdef int status = 0, np_, i
    cdef Py_ssize_t detail = 0, u = 0, units, unit_bytes, take, used, boff, room
    cdef long long pos, run_start = 0, run_end = 0, got
    cdef bint direct
    cdef char *grown
    if bounce == NULL or iov == NULL or pieces == NULL:
        free(bounce); free(iov); free(pieces)
        raise MemoryError("no memory for the read's buffers")
    t = 0
    with nogil:
        while t < n and status == 0:
            np_, used, boff = 0, 0, 0
            # gather one run: pieces that follow each other in the file
            while t < n and np_ < max_run:
                row = P + t * _P_WIDTH
                # a unit is one element, or one file row of a tensor read transposed
                units = row[_P_ROWS] if row[_P_FLIP] else row[_P_COUNT]
                unit_bytes = ((row[_P_COLS] if row[_P_FLIP] else 1)
                              * (4 if row[_P_KIND] == 0 else 2))
                if units == 0 or unit_bytes == 0:
                    t, u = t + 1, 0
                    continue
                pos = row[_P_OFFSET] + u * unit_bytes
                if np_ and pos != run_end:
                    break
                direct = row[_P_KIND] == 0 and row[_P_FLIP] == 0
                room = run_bytes - used
                if not direct and <Py_ssize_t>cap - boff < room:
                    room = <Py_ssize_t>cap - boff
                take = room // unit_bytes
                if take > units - u:
                    take = units - u
                elif row[_P_FLIP] and take > 16:
                    take -= take % 16  # whole blocks: transposed pieces keep whole cache lines
                if take <= 0:
                    if np_:
                        break
                    take = 1  # one unit larger than the limits
                    if not direct and <size_t>unit_bytes > cap:
                        grown = <char *>malloc(<size_t>unit_bytes)
                        if grown == NULL:
                            status = 3
                            break
                        free(bounce)
                        free(conv)
                        conv = NULL
                        bounce, cap = grown, <size_t>unit_bytes
                if row[_P_KIND] != 0 and row[_P_FLIP] and conv == NULL:
                    conv = <float *>malloc(cap * 2)  # widened: twice the bytes
                    if conv == NULL:
                        status = 3
                        break
                if np_ == 0:
                    run_start = pos
                pieces[np_].t, pieces[np_].u0, pieces[np_].take = t, u, take
                if direct:
                    pieces[np_].boff = -1
                    iov[np_].iov_base = <void *>(out + row[_P_START] + u)
                else:
                    pieces[np_].boff = boff
                    iov[np_].iov_base = <void *>(bounce + boff)
                    boff += (take * unit_bytes + 63) & ~(<Py_ssize_t>63)  # pieces 64-byte aligned
                iov[np_].iov_len = <size_t>(take * unit_bytes)
                used += take * unit_bytes
                run_end = pos + take * unit_bytes
                np_ += 1
                u += take
                if u == units:
                    t, u = t + 1, 0
            if status or np_ == 0:
                break
            # read the run: preadv until every piece is full
            pos, i = run_start, 0
            while i < np_:
                got = preadv(fd, iov + i, np_ - i, pos)
                if got < 0:
                    if errno == EINTR:
                        continue
                    status, detail = 2, errno
                    break
                if got == 0:
                    status, detail = 1, pieces[i].t
                    break
                pos += got
                while i < np_ and <size_t>got >= iov[i].iov_len:
                    got -= <long long>iov[i].iov_len
                    i += 1
                if got:
                    iov[i].iov_base = <void *>(<char *>iov[i].iov_base + got)
                    iov[i].iov_len -= <size_t>got
            if status:
                break
            for i in range(np_):
                _finish_piece(P + pieces[i].t * _P_WIDTH, out, bounce, conv, pieces + i,
                              nbad + pieces[i].t)
    free(bounce)
    free(conv)
    free(iov)
    free(pieces)
    if status == 3:
        raise MemoryError("no memory for the read's bounce buffer")
    return status, detail
