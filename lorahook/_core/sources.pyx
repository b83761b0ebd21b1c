# cython: language_level=3
"""Kernel sources: what a hook offers the compiled core.

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

from lorahook._core.checks cimport as_width
from lorahook._core.plans cimport KIND_EMBEDDING, KIND_SAVED_EMBEDDING, GroupPlan, LayerKernel
from lorahook._core.plans cimport private_vector, run_layer

import numpy as np

cnp.import_array()

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
