# cython: language_level=3
"""A projection's LoRA pairs in slots, in the rows' own dtype, on an OpenMP team.

For the rows of one step grouped by slot (:class:`~lorahook._core.slot_rows.SlotRows`),
:func:`apply_pairs` adds every slice's ``scale * B[s] @ (A[s] @ x[r])`` to its
columns of ``y[r]`` with the pairs kernel of ``pairs.h``: values read and
written in the rows' dtype (float32, float16 or bfloat16), products in
float32, each output element rounded once, the rows shared by a team of an
OpenMP runtime's threads (:func:`openmp_team`) or run on the calling thread.
:func:`apply_pairs_tensors` does the same on PyTorch tensors read where they
lie.  :class:`SlotPairs` holds the pairs: an engine's stacked slots, or slots
that refer to each adapter's own arrays at its own rank.  The kernel is built
once per instruction-set target and runs the process's (``isa.h``,
:func:`lorahook._core.halfconv.set_isa`); the GIL is released while it runs.  This module knows rows, slots and factors, never an engine.
"""
cimport cython
cimport numpy as cnp
from libc.limits cimport INT_MAX
from libc.stdlib cimport calloc, free

from lorahook._core.halfconv cimport isa_cell, lh_isa_attach
from lorahook._core.checks cimport ROWS_BF16, ROWS_F16, ROWS_F32, check_type, refuse_overlap
from lorahook._core.gemm_rows cimport LH_SCRATCH_PRODUCTS, lorahook_scratch_area
from lorahook._core.slot_rows cimport SlotRows, half_bits, rows_kind, weights_kind

import numpy as np

cnp.import_array()
lh_isa_attach(isa_cell())  # the process's instruction-set target (isa.h)

# The most threads a team may ask for.
cdef enum:
    _MAX_TEAM_THREADS = 4096

cdef extern from "pairs.h" nogil:
    enum: LH_P_MAX_SLICES
    int LH_P_COLS
    ctypedef struct lh_slice:
        const char *const *A
        const char *const *Bt
        const float *const *SA
        const float *const *SB
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
        int w8
        int add
        float scale
        int n_slices
        lh_slice slices[LH_P_MAX_SLICES]
        float *T
    ctypedef struct lh_team:
        int n
        char library[512]
    ctypedef void (*lh_part_fn)(const lh_pairs *, int, int, void (*)() noexcept nogil) noexcept
    int lh_team_find(lh_team *t) noexcept
    void lh_pairs_run(const lh_pairs *call, const lh_team *team) noexcept

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
    if n_threads < 1 or n_threads > _MAX_TEAM_THREADS:
        raise ValueError(f"n_threads must be in [1, {_MAX_TEAM_THREADS}], got {n_threads}")
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
    * :meth:`per_slot` ``(n_slots, d_in, d_outs, dtype, weights=None)``: slots
      that refer to each adapter's own arrays, set one slot and slice at a
      time (:meth:`set_slot`, :meth:`clear_slot`) at that adapter's rank: a
      slot costs what its adapter holds, whatever the largest rank.  With
      ``weights="int8"`` the factors are int8 with float32 scales, whatever
      the rows' dtype, and the kernel widens them in registers.

    Slice ``i`` writes columns ``[sum(d_out_0 .. d_out_{i-1}), ... + d_out_i)``
    of the output.
    """
    cdef readonly int kind
    cdef readonly Py_ssize_t n_slots
    cdef readonly Py_ssize_t d_in
    cdef readonly Py_ssize_t d_out
    cdef readonly int n_slices
    cdef readonly bint int8    # int8 factors with their scales (per_slot's weights="int8")
    cdef const float **_scales # per slice: n_slots pointers to a's scales, then n_slots to b's
    cdef object _refs          # what the pointers point into, kept alive
    cdef object _ranks         # per slice: the int32 ranks array the kernel reads
    cdef const char **_ptrs    # per slice: n_slots pointers into A, then n_slots into Bt
    cdef lh_slice slices[LH_P_MAX_SLICES]
    cdef Py_ssize_t t_floats   # sum of rmax: t's floats per row
    cdef bint _settable        # made by per_slot
    cdef int _busy             # calls running (set_slot refuses to change a slot under one)

    def __cinit__(self, *args, **kwargs):
        self._ptrs = NULL
        self._scales = NULL

    def __init__(self, a, bt, ranks, half=None):
        cdef int bits = half_bits(half), i, kind = -1
        cdef Py_ssize_t s
        a, bt, ranks = list(a), list(bt), list(ranks)
        if not 1 <= len(a) <= LH_P_MAX_SLICES or len(bt) != len(a) or len(ranks) != len(a):
            raise ValueError(f"a, bt and ranks must hold the same number of slices, 1 to "
                             f"{LH_P_MAX_SLICES}; got {len(a)}, {len(bt)} and {len(ranks)}")
        n_slots = d_in = 0
        for i in range(len(a)):
            ai, bi = a[i], bt[i]
            ka = weights_kind(ai, f"a[{i}]", bits)
            kb = weights_kind(bi, f"bt[{i}]", bits)
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
    def per_slot(Py_ssize_t n_slots, Py_ssize_t d_in, d_outs, dtype="float32", weights=None):
        """Empty slots (every rank 0) that :meth:`set_slot` fills with adapters' own arrays.

        ``d_outs``: each slice's output width (one to eight); ``dtype``:
        ``'float32'``, ``'float16'`` or ``'bfloat16'``, the rows' (16-bit
        arrays may be uint16 patterns); ``weights``: ``None`` (factors in
        ``dtype``) or ``'int8'`` (int8 factors with float32 scales).
        """
        if dtype not in _PAIR_KINDS:
            raise ValueError(f"dtype must be one of {sorted(_PAIR_KINDS)}, got {dtype!r}")
        if weights not in (None, "int8"):
            raise ValueError(f"weights must be None or 'int8', got {weights!r}")
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
        p.int8 = weights == "int8"
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
        self._scales = <const float **>calloc(max(1, 2 * self.n_slices * n_slots),
                                              sizeof(float *))
        if self._ptrs == NULL or self._scales == NULL:
            raise MemoryError("lorahook could not allocate a slot table")
        self.d_out = 0
        for i in range(self.n_slices):
            self.slices[i].A = self._ptrs + 2 * i * n_slots
            self.slices[i].Bt = self._ptrs + (2 * i + 1) * n_slots
            self.slices[i].SA = self._scales + 2 * i * n_slots
            self.slices[i].SB = self._scales + (2 * i + 1) * n_slots
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
        free(self._scales)

    def set_slot(self, int i, Py_ssize_t slot, a, bt, scales=None):
        """Slot ``slot`` of slice ``i`` refers to ``a`` ``(k, d_in)`` and ``bt`` ``(k, d_out_i)``.

        Both C-contiguous, in the pairs' dtype (16-bit arrays may be uint16
        patterns), with one rank ``k >= 1``; they are referred to, not copied,
        and kept alive until the slot is set again or cleared.  int8 pairs
        take int8 ``a`` and ``bt`` and ``scales=(a_scale, b_scale)``: float32,
        ``(k,)`` and ``(d_out_i,)``, finite and ``>= 0`` (``A = a_scale[:,
        None] * a``, ``B^T = bt * b_scale``).  Costs nothing per other slot.
        ``RuntimeError`` while a call runs on these pairs.
        """
        self._check_settable(i, slot)
        if self.int8:
            scales = _int8_scales(a, bt, scales, self.d_in, self.slices[i].d_out)
        elif scales is not None:
            raise TypeError("these pairs hold factors in their rows' dtype: no scales")
        bits = -1 if self.kind == ROWS_F32 else self.kind
        for arr, name, width in ((a, "a", self.d_in), (bt, "bt", self.slices[i].d_out)):
            if not self.int8 and check_type(arr, name, bits) != self.kind:
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
        self._refs[i][slot] = (a, bt, scales)
        if scales is not None:
            self._scales[2 * i * self.n_slots + slot] = \
                <const float *>cnp.PyArray_DATA(<cnp.ndarray>scales[0])
            self._scales[(2 * i + 1) * self.n_slots + slot] = \
                <const float *>cnp.PyArray_DATA(<cnp.ndarray>scales[1])
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
        self._scales[2 * i * self.n_slots + slot] = NULL
        self._scales[(2 * i + 1) * self.n_slots + slot] = NULL
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


def _int8_scales(a, bt, scales, Py_ssize_t d_in, Py_ssize_t d_out):
    """Check int8 factors ``a`` ``(k, d_in)``, ``bt`` ``(k, d_out)`` and their scales; the scales."""
    for arr, name, width in ((a, "a", d_in), (bt, "bt", d_out)):
        if (not isinstance(arr, np.ndarray) or arr.dtype != np.int8 or arr.ndim != 2
                or not arr.flags.c_contiguous or arr.shape[1] != width):
            raise TypeError(f"{name} must be a C-contiguous 2-D int8 array (rank, {width}), got "
                            f"{type(arr).__name__} {getattr(arr, 'dtype', '')} "
                            f"{getattr(arr, 'shape', '')}")
    if not isinstance(scales, tuple) or len(scales) != 2:
        raise TypeError("int8 pairs take scales=(a_scale, b_scale)")
    for arr, name, n in ((scales[0], "a_scale", a.shape[0]), (scales[1], "b_scale", d_out)):
        if (not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.shape != (n,)
                or not arr.flags.c_contiguous or not arr.dtype.isnative):
            raise TypeError(f"{name} must be a C-contiguous float32 array of shape ({n},), got "
                            f"{type(arr).__name__} {getattr(arr, 'dtype', '')} "
                            f"{getattr(arr, 'shape', '')}")
        if not (np.isfinite(arr).all() and (arr >= 0).all()):
            raise ValueError(f"{name} must be finite and >= 0")
    return scales


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
    cdef int bits = half_bits(half)
    cdef Py_ssize_t d_in, d_out, ldx, ldy
    cdef int xk = rows_kind(x, "x", bits, False, groups.n_rows, &d_in, &ldx)
    cdef int yk = rows_kind(y, "y", bits, True, groups.n_rows, &d_out, &ldy)
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
    c.w8 = pairs.int8
    c.add = add
    c.scale = <float>float(scale)
    c.n_slices = pairs.n_slices
    for i in range(pairs.n_slices):
        c.slices[i] = pairs.slices[i]
        c.slices[i].t_off = pairs.slices[i].t_off * c.n_covered
    cdef const lh_team *tp = &team.t if team is not None else NULL
    cdef int own = 0
    pairs._busy += 1
    with nogil:
        c.T = lorahook_scratch_area(<size_t>(c.n_covered * pairs.t_floats), LH_SCRATCH_PRODUCTS,
                                    &own)
        if c.T != NULL:
            lh_pairs_run(&c, tp)
            if own:
                free(c.T)
    pairs._busy -= 1
    if c.T == NULL:
        raise MemoryError("lorahook could not allocate its scratch buffer")
    return 0
