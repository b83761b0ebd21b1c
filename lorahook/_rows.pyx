# cython: language_level=3
"""The interface between hooks and the compiled core: ``apply_lora_rows``.

The core knows kernels and buffers, never adapters, file formats or names.
Its public entry point is :func:`apply_lora_rows` (re-exported by
:mod:`lorahook`); the modules behind it are ``_checks`` (the call checks),
``_kernels`` (layers and the GIL-free BLAS kernels), ``_halfconv`` (float16
and bfloat16 conversions), and, beside the core, ``_load`` (reading tensors
from files for the loaders) and ``_testing`` (entry points for tests and
benchmarks only).

What the core runs
------------------
A hook reaches the kernels through a :class:`KernelSource`, of one of two
kinds:

* a :class:`KernelTable`: ``(layer_idx, module) -> LayerKernel``, each kernel
  applied to every row of any batch (what :class:`lorahook.LoraAdapter` is);
* :class:`UnitGroups`: the rows of a call are ``units`` equal blocks (a block
  is one row of a bound batch, or all the rows of one sequence), and for each
  part -- a kernel table with, per layer scale, the blocks it applies to and
  their scales -- the core runs that table's kernel on those blocks' rows
  (what :meth:`lorahook.AdapterSet.bind` and ``bind_sequences`` return).

Both answer the same three questions -- how many rows per unit a call has,
whether the layers covering a projection fit the call's widths, and run --
and :func:`apply_lora_rows` asks nothing else of them.  A kernel table's
``dispatch`` says how far the core trusts it: :data:`DISPATCH_KERNELS` (the
kernels answer ``is_active`` and do the work), :data:`DISPATCH_ASK_HOOK` (the
hook's own ``is_active`` first) or :data:`DISPATCH_PER_ROW` (the hook's own
``apply``, once per row).  Any other :class:`lorahook.LoraHook`, registered
virtual subclasses included, gets the per-row path: ``is_active`` (taken as
``True`` when missing), then one ``apply`` per row.
"""
cimport cython
cimport numpy as cnp
from cpython.type cimport PyType_IsSubtype

from lorahook._checks cimport ROWS_BF16, ROWS_F16, ROWS_F32, as_int, as_width, check_call
from lorahook._checks cimport check_layout, check_type, row_count
from lorahook._kernels cimport KIND_EMBEDDING, KIND_SAVED_EMBEDDING, GroupPlan, LayerKernel
from lorahook._kernels cimport private_vector, run_layer

import numpy as np

from lorahook._checks import check_rows

cnp.import_array()

cdef extern from *:
    """
    #ifndef LORAHOOK_DEBUG_BUILD
    #define LORAHOOK_DEBUG_BUILD 0
    #endif
    """
    int LORAHOOK_DEBUG_BUILD

#: True when the extension was built with bounds checking (LORAHOOK_CYTHON_DEBUG=1).
DEBUG_BUILD = bool(LORAHOOK_DEBUG_BUILD)

# How apply_lora_rows treats a kernel table (KernelSource._dispatch).
cdef enum:
    _KERNELS = 0
    _ASK_HOOK = 1
    _PER_ROW = 2

#: The kernels answer ``is_active`` and do the work.
DISPATCH_KERNELS = _KERNELS
#: The hook's own ``is_active`` is asked first, then the kernels run.
DISPATCH_ASK_HOOK = _ASK_HOOK
#: The hook's own ``apply`` runs once per row (the generic path).
DISPATCH_PER_ROW = _PER_ROW

# Row-per-unit counts whose plans a unit-group source keeps (a generation
# loop needs two: the prefill length and 1 for decode steps).
cdef enum:
    _MAX_PLAN_LENGTHS = 4

# Set by lorahook.hook at import: the abstract base every hook derives from
# or is registered with.
cdef object _hook_base = None


def _set_hook_base(cls):
    global _hook_base
    _hook_base = cls


cdef inline bint _is_embedding(LayerKernel kernel):
    return kernel.kind == KIND_EMBEDDING or kernel.kind == KIND_SAVED_EMBEDDING


cdef int _check_kernel(LayerKernel kernel, tuple key, str label, Py_ssize_t d_in,
                       Py_ssize_t d_out, bint embedding=False) except -1:
    """A layer covering ``key`` fits the call: its kind, its widths, its base weight.

    For an embedding call ``d_in`` is ignored (the ids are checked against
    the layer's ``num_embeddings`` by the caller).
    """
    who = f"adapter {label!r} layer" if label else "adapter layer"
    if _is_embedding(kernel) != embedding:
        raise ValueError(
            f"{who} ({key[0]}, {key[1]!r}) is an "
            f"{'embedding' if _is_embedding(kernel) else 'linear'} layer: use "
            f"{'apply_lora_embedding' if _is_embedding(kernel) else 'apply_lora_rows'} for it")
    if kernel.needs_base:
        raise ValueError(
            f"{who} ({key[0]}, {key[1]!r}) is a DoRA layer without its base weight: give it "
            f"with adapter.with_base(weights), AdapterSet(..., base_weights=...) or "
            f"lorahook.torch.attach")
    if embedding:
        if kernel.d_out != d_out:
            raise ValueError(
                f"{who} ({key[0]}, {key[1]!r}) has embedding_dim {kernel.d_out} but the call's "
                f"output_row_width is {d_out}")
        return 0
    if kernel.d_in != d_in or kernel.d_out != d_out:
        raise ValueError(
            f"{who} ({key[0]}, {key[1]!r}) has (d_in, d_out) = ({kernel.d_in}, {kernel.d_out}) "
            f"but the call's row widths are (input_row_width, output_row_width) = "
            f"({d_in}, {d_out})")
    return 0


@cython.auto_pickle(False)
cdef class KernelSource:
    """The compiled side of a hook: which layer kernels run on which rows.

    Not made directly: see :class:`KernelTable` and :class:`UnitGroups`.  A
    source is filled once, when its hook is built, and never changes
    afterwards, so it may be used from several threads.
    """

    cdef int _fill_once(self) except -1:
        if self._filled:
            raise TypeError(f"{type(self).__name__} is immutable: its kernels are set once, "
                            f"when it is made")
        self._filled = True
        return 0

    cdef Py_ssize_t _rows_per_unit(self, Py_ssize_t n) except -1:
        """Check a call's row count; the rows per unit (0 when the source has no units)."""
        return 0

    cdef int _check_widths(self, tuple key, Py_ssize_t d_in, Py_ssize_t d_out) except -1:
        """``ValueError`` when a layer covering ``key`` does not fit the call's widths."""
        return 0

    cdef int _run(self, tuple key, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n,
                  Py_ssize_t per_unit, Py_ssize_t d_in, Py_ssize_t d_out, int kind) except -1:
        """Check the covering layers' widths, then add their deltas to the checked buffers."""
        return 0

    cdef int _run_ids(self, tuple key, cnp.ndarray ids, cnp.ndarray y, Py_ssize_t n,
                      Py_ssize_t per_unit, Py_ssize_t d_out, int kind) except -1:
        """The same for an embedding: ``ids`` is a private int64 copy, not yet range-checked."""
        return 0


@cython.auto_pickle(False)
cdef class KernelTable(KernelSource):
    """A kernel table: ``(layer_idx, module) -> LayerKernel``, applied to every row."""

    def _set_table(self, table, int dispatch):
        """Fill the table: ``table`` maps keys to LayerKernels (rank > 0).

        ``dispatch`` is one of the ``DISPATCH_*`` values.  The table is copied
        (the caller's dict may change afterwards); a table is filled once.
        """
        table = dict(table)
        for key, kernel in table.items():
            if type(kernel) is not LayerKernel or (<LayerKernel>kernel).rank == 0:
                raise TypeError(f"kernel for {key!r} must be a LayerKernel of rank > 0")
        if dispatch not in (_KERNELS, _ASK_HOOK, _PER_ROW):
            raise ValueError(f"dispatch must be DISPATCH_KERNELS, DISPATCH_ASK_HOOK or "
                             f"DISPATCH_PER_ROW ({_KERNELS}, {_ASK_HOOK}, {_PER_ROW}), "
                             f"got {dispatch}")
        self._fill_once()
        self._table = table
        self._dispatch = dispatch

    def is_active(self, layer_idx, module):
        """True when a kernel covers ``(layer_idx, module)``."""
        return self._table is not None and (layer_idx, module) in self._table

    cdef int _check_widths(self, tuple key, Py_ssize_t d_in, Py_ssize_t d_out) except -1:
        found = self._table.get(key) if self._table is not None else None
        if found is not None:
            _check_kernel(<LayerKernel>found, key, "", d_in, d_out)
        return 0

    cdef int _run(self, tuple key, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n,
                  Py_ssize_t per_unit, Py_ssize_t d_in, Py_ssize_t d_out, int kind) except -1:
        found = self._table.get(key) if self._table is not None else None
        if found is None:
            return 0
        _check_kernel(<LayerKernel>found, key, "", d_in, d_out)
        if n:
            run_layer(<LayerKernel>found, x, y, n, kind)
        return 0

    cdef int _run_ids(self, tuple key, cnp.ndarray ids, cnp.ndarray y, Py_ssize_t n,
                      Py_ssize_t per_unit, Py_ssize_t d_out, int kind) except -1:
        found = self._table.get(key) if self._table is not None else None
        if found is None:
            return 0
        kernel = <LayerKernel>found
        _check_kernel(kernel, key, "", 0, d_out, True)
        _check_ids(ids, kernel.d_in, key)
        if n:
            plan = GroupPlan([(kernel, kernel.scale, None, None)], n, kernel.d_in, d_out, True)
            (<GroupPlan>plan).run_ids(ids, y, kind)
        return 0


cdef object _expand_units(object idx, Py_ssize_t per_unit):
    """Row indices of the blocks ``idx`` (``None``: every row), ``per_unit`` rows each."""
    if idx is None:
        return None
    if per_unit == 1:
        return idx
    return (np.asarray(idx, dtype=np.int64)[:, None] * per_unit
            + np.arange(per_unit, dtype=np.int64)).astype(np.int32).ravel()


@cython.auto_pickle(False)
cdef class UnitGroups(KernelSource):
    """Unit groups: kernel tables each applied to some blocks of a call's rows."""

    def _set_units(self, parts, Py_ssize_t units, bint exact):
        """Fill the groups over ``units`` blocks of rows.

        ``parts`` is a sequence of ``(label, table, by_scale)``: ``table`` a
        :class:`KernelTable`, ``by_scale`` maps a kernel's ``scale`` (as a
        Python float) to ``(scale, unit_indices, unit_scales)`` -- strictly
        ascending int32 block indices in ``[0, units)`` (``None``: every
        block) and one float32 scale each (``None``: ``scale`` for all).
        Blocks no part names are never written.  With ``exact`` a call has
        exactly ``units`` rows, otherwise any multiple of ``units``.
        """
        if units < 0:
            raise ValueError(f"units must be >= 0, got {units}")
        checked = []
        for label, table, by_scale in parts:
            if not isinstance(table, KernelTable):
                raise TypeError(f"part {label!r}: the source must be a KernelTable, "
                                f"got {type(table).__name__}")
            groups = {}
            for s, (scale, idx, scales) in dict(by_scale).items():
                idx = private_vector(idx, cnp.NPY_INT32, np.int32, f"part {label!r}",
                                     "unit indices", "int32")
                scales = private_vector(scales, cnp.NPY_FLOAT32, np.float32, f"part {label!r}",
                                        "unit scales", "float32")
                m = units if idx is None else len(idx)
                if idx is not None and m and (idx[0] < 0 or idx[m - 1] >= units
                                              or (m > 1 and not (np.diff(idx) > 0).all())):
                    raise ValueError(f"part {label!r}: unit indices must be strictly "
                                     f"ascending in [0, {units})")
                if scales is not None and len(scales) != m:
                    raise ValueError(f"part {label!r}: {len(scales)} unit scales for {m} units")
                groups[float(s)] = (float(scale), idx, scales)
            checked.append((str(label), table, groups))
        self._fill_once()
        self._parts = tuple(checked)
        self._units = units
        self._exact = exact
        self._dispatch = _KERNELS
        self._resolved = {}
        self._plans = {}

    def is_active(self, layer_idx, module):
        """True when some part's kernel covers ``(layer_idx, module)`` for some unit."""
        return self._parts is not None and bool(self._groups((layer_idx, module)))

    cdef Py_ssize_t _rows_per_unit(self, Py_ssize_t n) except -1:
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
        if self._parts is None:
            return ()
        found = self._resolved.get(key)
        if found is None:
            items = []
            for label, table, by_scale in self._parts:
                kernel = (<KernelTable>table)._table.get(key)
                if kernel is None:
                    continue
                group = (<dict>by_scale).get(<double>(<LayerKernel>kernel).scale)
                if group is not None:
                    items.append((label, kernel) + group)
            found = tuple(items)
            # Concurrent fills compute the same value; the last one wins.
            self._resolved[key] = found
        return <tuple>found

    cdef int _check_widths(self, tuple key, Py_ssize_t d_in, Py_ssize_t d_out) except -1:
        for label, kernel, _, _, _ in self._groups(key):
            _check_kernel(<LayerKernel>kernel, key, label, d_in, d_out)
        return 0

    cdef int _run(self, tuple key, cnp.ndarray x, cnp.ndarray y, Py_ssize_t n,
                  Py_ssize_t per_unit, Py_ssize_t d_in, Py_ssize_t d_out, int kind) except -1:
        """Run the plan of a checked call (widths are checked even for zero rows).

        Plans are kept per rows-per-unit count, at most ``_MAX_PLAN_LENGTHS``
        counts (the oldest is dropped).
        """
        cdef GroupPlan plan
        per = self._plans.get(per_unit)
        if per is not None:
            found = (<dict>per).get(key)
            if found is not None:
                plan = <GroupPlan>found
                if plan.d_in == d_in and plan.d_out == d_out:
                    return plan.run(x, y, kind)
        groups = self._groups(key)
        if not groups:
            return 0
        self._check_widths(key, d_in, d_out)
        if n == 0:
            return 0
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
        return plan.run(x, y, kind)

    cdef int _run_ids(self, tuple key, cnp.ndarray ids, cnp.ndarray y, Py_ssize_t n,
                      Py_ssize_t per_unit, Py_ssize_t d_out, int kind) except -1:
        """An embedding call: checked and planned on every call (once per forward)."""
        groups = self._groups(key)
        if not groups:
            return 0
        cdef Py_ssize_t num_emb = -1
        for label, kernel, _, _, _ in groups:
            _check_kernel(<LayerKernel>kernel, key, label, 0, d_out, True)
            if num_emb < 0 or (<LayerKernel>kernel).d_in < num_emb:
                num_emb = (<LayerKernel>kernel).d_in
        _check_ids(ids, num_emb, key)
        if n == 0:
            return 0
        plan = GroupPlan([(kernel, scale, _expand_units(idx, per_unit),
                           None if scales is None else np.repeat(scales, per_unit))
                          for _, kernel, scale, idx, scales in groups], n, num_emb, d_out, True)
        return (<GroupPlan>plan).run_ids(ids, y, kind)


cdef inline tuple _checked_key(object layer_idx, object module):
    """``(layer_idx, module)`` as the key of a table: an int >= 0 or ``None``, and a str."""
    if type(layer_idx) is int and layer_idx >= 0 and type(module) is str:  # the common case
        return (layer_idx, module)
    if layer_idx is not None and type(layer_idx) is not int:
        layer_idx = as_int(layer_idx, "layer_idx (an int, or None for a model-level module)")
    if layer_idx is not None and layer_idx < 0:
        raise ValueError(f"layer_idx must be >= 0 (or None for a model-level module), "
                         f"got {layer_idx}")
    if type(module) is not str:
        if not isinstance(module, str):
            raise TypeError(f"module must be a str, got {type(module).__name__}")
        module = str(module)  # a str subclass (numpy.str_) as the str it holds
    return (layer_idx, module)


cdef int _check_ids(cnp.ndarray ids, Py_ssize_t num_emb, tuple key) except -1:
    """``ValueError`` unless every id is in ``[0, num_emb)`` (``ids``: a private int64 copy)."""
    if cnp.PyArray_SIZE(ids) == 0:
        return 0
    lo = int((<object>ids).min())
    hi = int((<object>ids).max())
    if lo < 0 or hi >= num_emb:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"ids must be in [0, {num_emb}) (num_embeddings of the layer ({key[0]}, {key[1]!r})), "
            f"got {bad}")
    return 0


cdef object _private_ids(object ids, Py_ssize_t n):
    """A private int64 copy of a 1-D int32 / int64 ``ids`` array of ``n`` values."""
    if not cnp.PyArray_Check(ids):
        raise TypeError(f"ids must be a 1-D numpy.ndarray of int32 or int64, got "
                        f"{type(ids).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>ids
    cdef int t = cnp.PyArray_TYPE(a)
    if (t != cnp.NPY_INT32 and t != cnp.NPY_INT64) or not cnp.PyArray_ISNOTSWAPPED(a):
        raise TypeError(f"ids must have dtype int32 or int64 in native byte order, got "
                        f"{a.dtype.str} ({a.dtype})")
    if cnp.PyArray_NDIM(a) != 1:
        raise ValueError(f"ids must be 1-D, got {cnp.PyArray_NDIM(a)}-D with shape "
                         f"{(<object>a).shape}")
    if cnp.PyArray_DIM(a, 0) != n:
        raise ValueError(f"ids must hold one id per output row: expected {n}, got "
                         f"{cnp.PyArray_DIM(a, 0)}")
    return np.array(a, dtype=np.int64, order="C", copy=True)


def apply_lora_embedding(hook, layer_idx, module, ids, output, output_row_width=None):
    """Add ``hook``'s embedding LoRA delta to every row of ``output`` in place.

    The row of token id ``i`` gets ``scale * B @ A[:, i]`` added (PEFT's
    ``lora_embedding_A`` ``(r, num_embeddings)`` and ``lora_embedding_B``
    ``(embedding_dim, r)``), or, for an adapter that saved the embedding
    whole (``modules_to_save``), becomes that module's row ``i``.

    Parameters
    ----------
    hook : LoraAdapter or a bound AdapterSet batch or sequence selection
        What to apply (rows may mix adapters); runs in the compiled core with
        the GIL released.
    layer_idx : int
        The layer of the embedding (``0`` for a model's input embedding).
    module : str
        The embedding's name (``"embed_tokens"``, ...).
    ids : ndarray
        One token id per row of ``output``: 1-D, int32 or int64.
    output : ndarray
        The embedded rows: C-contiguous, float32, float16 or bfloat16, 1-D
        with ``output_row_width`` or 2-D ``(rows, embedding_dim)``; updated
        in place.
    output_row_width : int, optional
        The embedding dimension; needed for a 1-D ``output``.

    Returns
    -------
    None

    Raises
    ------
    TypeError
        For a hook that is not an adapter or a bound batch, and for the
        arrays' types and dtypes.
    ValueError
        For shapes, row counts, a bound hook's row count, a covering layer
        that is not an embedding of the output's width, or an id outside
        ``[0, num_embeddings)``.  Nothing is written when a check fails.
    """
    return _apply_ids(hook, layer_idx, module, ids, output, output_row_width, -1)


def _apply_lora_embedding_bits(hook, layer_idx, module, ids, output, output_row_width,
                               bfloat16):
    """``apply_lora_embedding`` for a uint16 ``output`` of float16 (or bfloat16) bits."""
    return _apply_ids(hook, layer_idx, module, ids, output, output_row_width,
                      ROWS_BF16 if bfloat16 else ROWS_F16)


cdef object _apply_ids(hook, layer_idx, module, ids, output, output_row_width, int bits):
    if not isinstance(hook, KernelSource) or (<KernelSource>hook)._dispatch == _PER_ROW:
        raise TypeError(
            f"apply_lora_embedding takes a lorahook.LoraAdapter or a bound AdapterSet hook "
            f"(the compiled core), got {type(hook).__name__}")
    cdef KernelSource src = <KernelSource>hook
    cdef int kind = check_type(output, "output", bits)
    cdef cnp.ndarray y = <cnp.ndarray>output
    check_layout(y, "output", True)
    if output_row_width is None:
        if cnp.PyArray_NDIM(y) != 2:
            raise TypeError(f"output_row_width is required for a 1-D output (it is taken from "
                            f"shape[1] of a 2-D array only), got shape {(<object>y).shape}")
        output_row_width = cnp.PyArray_DIM(y, 1)
    cdef Py_ssize_t d_out = as_width(output_row_width, "output_row_width")
    cdef Py_ssize_t n = row_count(y, d_out, "output", "output_row_width")
    private = _private_ids(ids, n)
    cdef Py_ssize_t per_unit = src._rows_per_unit(n)
    cdef tuple key = _checked_key(layer_idx, module)
    if src._dispatch == _ASK_HOOK and not hook.is_active(*key):
        return
    src._run_ids(key, <cnp.ndarray>private, y, n, per_unit, d_out, kind)


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


def apply_lora_rows(hook, layer_idx, module, input, output, input_row_width=None,
                    output_row_width=None):
    """Add ``hook``'s LoRA delta to every row of ``output`` in place.

    The server computes ``output = input @ W.T`` for a batch of token rows,
    then calls this: every row gets ``scale * B @ (A @ x)`` of the adapter
    (or adapters) ``hook`` holds for projection ``(layer_idx, module)``.

    Parameters
    ----------
    hook : LoraHook, LoraAdapter or a bound AdapterSet batch
        What to apply.  A :class:`~lorahook.LoraAdapter` or a batch bound by
        :meth:`~lorahook.AdapterSet.bind` runs in the compiled core with the
        GIL released, on the calling thread; any other hook gets one
        :meth:`~lorahook.LoraHook.apply` call per row, in row order (float32
        rows only).
    layer_idx : int
        The layer the projection belongs to.
    module : str
        The projection's name (``"q_proj"``, ``"down_proj"``, ...).
    input : ndarray
        The rows given to the base projection: C-contiguous, flattened 1-D
        (``len == rows * input_row_width``) or 2-D ``(rows, d_in)``; float32,
        float16 or bfloat16 (an ``ml_dtypes.bfloat16`` array: lorahook
        recognises the dtype once the caller has imported ml_dtypes, and
        never imports it itself).
    output : ndarray
        The projection's result, the same layout and dtype as ``input``,
        writable, not overlapping ``input``; updated in place.
    input_row_width, output_row_width : int, optional
        ``d_in`` and ``d_out``.  Needed for 1-D buffers; for 2-D arrays they
        default to ``shape[1]``, and given ones are checked against it.

    Returns
    -------
    None

    Raises
    ------
    TypeError
        For the hook's type, the arrays' types and dtypes, non-integer
        widths, a 1-D buffer without its width, or half-precision rows for a
        generic Python hook.
    ValueError
        For ndim, contiguity, writability, widths, row counts, overlapping
        buffers, a bound hook's row count, or adapter layers whose
        ``(d_in, d_out)`` differ from the call's (checked for zero-row calls
        too).  Nothing is written when a check fails.

    Notes
    -----
    Every check runs before anything is written.  Then
    ``hook.is_active(layer_idx, module)`` is asked once (a registered
    virtual subclass without ``is_active`` counts as active); an inactive
    hook returns at once.  Half-precision rows are widened to float32, the
    delta is added to the widened output, and the sum is rounded once to
    the output dtype (to nearest even).  Results equal a float64 reference
    to float32 accuracy.

    Examples
    --------
    >>> import numpy as np, lorahook
    >>> rng = np.random.default_rng(0)
    >>> layer = lorahook.LoraLayer(rng.standard_normal((4, 16)), rng.standard_normal((8, 4)),
    ...                            scale=0.5)
    >>> adapter = lorahook.LoraAdapter({(0, "q_proj"): layer})
    >>> x = rng.standard_normal((3, 16)).astype(np.float32)
    >>> y = np.zeros((3, 8), np.float32)
    >>> lorahook.apply_lora_rows(adapter, 0, "q_proj", x, y)
    >>> bool(np.allclose(y, 0.5 * x @ layer.a.T @ layer.b.T, rtol=1e-5, atol=1e-5))
    True
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
    cdef int dispatch = _PER_ROW
    # Subtype tests on the MRO first (isinstance through ABCMeta costs ~0.4
    # us of a ~1 us inactive call); registered virtual subclasses last.
    if PyType_IsSubtype(t, KernelSource):
        src = <KernelSource>hook
        dispatch = src._dispatch
    elif _hook_base is None or not (PyType_IsSubtype(t, <type>_hook_base)
                                    or isinstance(hook, _hook_base)):
        raise TypeError(f"hook must be a lorahook.LoraHook, got {type(hook).__name__}")
    cdef Py_ssize_t widths[2]
    cdef int kind = ROWS_F32
    cdef Py_ssize_t n = check_call(input, output, input_row_width, output_row_width, widths,
                                   &kind, bits,
                                   type(hook).__name__ if dispatch == _PER_ROW else None)
    cdef Py_ssize_t per_unit = 0
    if src is not None:
        per_unit = src._rows_per_unit(n)
    cdef tuple key = _checked_key(layer_idx, module)
    if dispatch != _KERNELS:
        is_active = getattr(hook, "is_active", None)
        if is_active is not None and not is_active(*key):
            return
    if dispatch == _PER_ROW:
        if src is not None:
            src._check_widths(key, widths[0], widths[1])
        if n:
            _apply_each_row(hook, key[0], key[1], <cnp.ndarray>input, <cnp.ndarray>output,
                            widths[0], widths[1], n)
        return
    src._run(key, <cnp.ndarray>input, <cnp.ndarray>output, n, per_unit, widths[0], widths[1],
             kind)
