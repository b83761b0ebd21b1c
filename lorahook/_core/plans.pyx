# cython: language_level=3
"""Layer kernels: the compiled views of adapter layers, and plans of them over a batch.

* :class:`LayerKernel` holds one validated layer's arrays as typed views (its
  ``kind``: a linear LoRA layer, DoRA included, an embedding LoRA layer, a
  module saved whole), made once;
* :class:`GroupPlan` holds the groups of one grouped projection (several
  layers, each on its own rows of one batch), checked and copied once;
* :c:func:`run_layer`, :meth:`GroupPlan.run` / ``run_ids`` and, from Python,
  :func:`apply_layer` (which checks the buffers first) fill
  :c:type:`~lorahook._core.gemm_rows.Segment` records and run them through the
  segment kernels of ``lorahook._core.segments``.

``B`` is kept in one layout only, ``B^T`` row-major (``(rank, d_out)``);
``LoraLayer.b`` is a read-only view of it.
"""
cimport cython
cimport numpy as cnp
from libc.limits cimport INT_MAX

from lorahook._core.checks cimport check_buffers
from lorahook._core.halfconv cimport LORAHOOK_HALF_BF16, LORAHOOK_HALF_F16
from lorahook._core.gemm_rows cimport PRE_AFFINE, PRE_NONE, PRE_REPLACE, WKIND_F32, WKIND_INT8, Segment
from lorahook._core.segments cimport run_embedding_segments, run_segments

import numpy as np

cnp.import_array()


#: What a LayerKernel computes (its ``kind``): a linear LoRA layer (DoRA
#: included), an embedding LoRA layer, a saved linear module, a saved embedding.
LORA, EMBEDDING, SAVED_LINEAR, SAVED_EMBEDDING = (
    KIND_LORA, KIND_EMBEDDING, KIND_SAVED_LINEAR, KIND_SAVED_EMBEDDING)

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
                  pre_mul=None, pre_add=None, bint needs_base=False, scales=None):
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
            self.wkind = WKIND_F32
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
            self.pre = PRE_REPLACE
            if pre_add is not None:
                self.pre_add = pre_add
                self.has_pre_add = True
                if self.pre_add.shape[0] != d_out:
                    raise ValueError(f"pre_add must have shape ({d_out},), got ({self.pre_add.shape[0]},)")
            return
        if (pre_mul is None) != (pre_add is None):
            raise ValueError("pre_mul and pre_add go together")
        if weights in ("float32", "float16", "bfloat16") and scales is not None:
            raise ValueError(f"{weights} weights take no scales")
        if weights == "float32":
            self.wkind = WKIND_F32
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
        elif weights == "int8":
            if scales is None:
                raise ValueError("int8 weights take scales=(a_scale, b_scale)")
            self.wkind = WKIND_INT8
            self.a8 = a
            self.bt8 = bt
            self.a_scale, self.b_scale = scales
            rank, d_in = self.a8.shape[0], self.a8.shape[1]
            bt_rank, d_out = self.bt8.shape[0], self.bt8.shape[1]
            if self.a_scale.shape[0] != rank or self.b_scale.shape[0] != d_out:
                raise ValueError(f"int8 scales must have shapes ({rank},) and ({d_out},), got "
                                 f"({self.a_scale.shape[0]},) and ({self.b_scale.shape[0]},)")
        else:
            raise ValueError(f"weights must be 'float32', 'float16', 'bfloat16' or 'int8', "
                             f"got {weights!r}")
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
        if self.has_bias and self.wkind < 0:  # float32 and int8 weights: a float32 bias
            self.bias = bias
            bias_len = self.bias.shape[0]
        elif self.has_bias:
            self.bias16 = bias
            bias_len = self.bias16.shape[0]
        if self.has_bias and bias_len != d_out:
            raise ValueError(f"bias must have shape ({d_out},), got ({bias_len},)")
        if pre_mul is not None:
            if self.wkind != WKIND_F32 or kind != KIND_LORA:
                raise ValueError("pre_mul / pre_add go with float32 linear LoRA kernels only")
            self.pre = PRE_AFFINE
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
        s.a8 = NULL
        s.b8 = NULL
        s.a_scale = NULL
        s.b_scale = NULL
        s.direct = self.kind == KIND_SAVED_LINEAR or self.kind == KIND_SAVED_EMBEDDING
        if s.direct:
            s.b = &self.bt[0, 0]
        elif self.rank > 0 and self.wkind == WKIND_F32:
            s.a = &self.a[0, 0]
            s.b = &self.bt[0, 0]
        elif self.rank > 0 and self.wkind == WKIND_INT8:
            s.a8 = &self.a8[0, 0]
            s.b8 = &self.bt8[0, 0]
            s.a_scale = &self.a_scale[0]
            s.b_scale = &self.b_scale[0]
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
        s.b_rows = False
        s.d_in = self.d_in
        s.pre_mul = &self.pre_mul[0] if self.pre == PRE_AFFINE else NULL
        s.pre_add = &self.pre_add[0] if self.has_pre_add else NULL



cdef int run_layer(LayerKernel layer, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n_rows,
                   int kind) except -1:
    """One layer on buffers already checked to hold ``n_rows`` rows of the layer's widths."""
    cdef Segment seg
    layer.fill(&seg)
    seg.n_rows = n_rows
    return run_segments(&seg, 1, x, y, layer.d_in, layer.d_out, kind)



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
            if rs_obj is not None and (layer.pre != PRE_NONE or layer.kind == KIND_SAVED_LINEAR
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
