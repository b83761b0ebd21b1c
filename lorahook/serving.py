"""Serving many adapters over one base model: :class:`AdapterSet` and bound batches.

A CPU inference server keeps its adapters in an :class:`AdapterSet`, one per
customer or task, and for every batch calls :meth:`AdapterSet.bind` with the
adapter name (or ``None``) of each row.  The result is a
:class:`~lorahook.LoraHook` for exactly that batch, passed to
:func:`lorahook.apply_lora_rows` after each projection like any other hook.

How a bound batch is computed
-----------------------------
At bind time the rows are grouped by adapter: for every adapter the batch
uses, the ascending ``int32`` indices of its rows and their scales are
computed once.  A projection call then does a handful of dictionary lookups
and one call into the compiled core, which -- with the GIL released -- runs
one matrix-matrix product pair per adapter (or the per-row loop for groups
smaller than :func:`lorahook._rows.get_gemm_crossover`, the same crossover a
single adapter uses), gathers rows that are not contiguous in the batch and
scatter-adds the deltas back.  Rows without an adapter, or whose effective
scale is zero, are never written: their output stays bit-identical.

Different kernel paths round differently in the last bits, so a row's result
can depend on the batch it was computed in (how many other rows share its
adapter, and where they are).

Snapshots and threads
---------------------
The installed adapters are held in an immutable mapping that :meth:`add`,
:meth:`replace` and :meth:`remove` swap, under a lock, for a new one.
:meth:`bind` reads the mapping once, so a bound batch sees one consistent
version of every adapter for its whole life: an adapter replaced or removed
after ``bind`` never changes, or tears, a batch in flight.  Adapters are
immutable, so a bound batch can be applied from several threads at once.
"""
import math
import numbers
import threading
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from . import _rows
from .adapter import LoraAdapter
from .hook import LoraHook

__all__ = ["AdapterSet", "BoundBatch"]

_EMPTY = MappingProxyType({})


def _check_name(name):
    if not isinstance(name, str):
        raise TypeError(f"adapter name must be a str, got {type(name).__name__} ({name!r})")
    if not name:
        raise ValueError("adapter name must be a non-empty str, got ''")
    return name


def _check_adapter(name, adapter):
    if not isinstance(adapter, LoraAdapter):
        raise TypeError(
            f"adapter {name!r} must be a lorahook.LoraAdapter, got {type(adapter).__name__}")
    return adapter


def _check_model(model):
    if model is None:
        return None
    from .models import ModelGeometry
    if not isinstance(model, ModelGeometry):
        raise TypeError(
            f"model must be a lorahook.ModelGeometry (Qwen35Config, BertConfig, LlamaConfig, ...) "
            f"or None, got {type(model).__name__}")
    return model


def _finite(value, what):
    """``value`` as a finite float; ``TypeError`` / ``ValueError`` naming ``what``."""
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value}")
    return value


class _Installed:
    """An installed adapter with what binding needs, computed once at install."""

    __slots__ = ("adapter", "layer_scales")

    def __init__(self, adapter):
        self.adapter = adapter
        # The distinct scales of the layers that apply something: a batch's
        # per-row scales are multiplied by each of them once, at bind time.
        self.layer_scales = tuple(sorted(
            {layer.scale for layer in adapter.layers.values() if layer.rank > 0}))


class AdapterSet:
    """A thread-safe set of named adapters over one base model.

    ``model`` (a :class:`~lorahook.Qwen35Config`, a :class:`~lorahook.BertConfig`
    or ``None``): when given, every adapter is checked with
    ``adapter.validate_against(model)`` before it is installed, and a misfit
    raises :class:`~lorahook.LoraValidationError` with nothing changed.

    Names are non-empty ``str``; adapters are :class:`~lorahook.LoraAdapter`
    instances (``TypeError`` otherwise).  :meth:`bind` makes the hook for one
    batch.  All methods may be called from any thread at any time.
    """

    __slots__ = ("_model", "_lock", "_installed")

    def __init__(self, model=None):
        self._model = _check_model(model)
        self._lock = threading.Lock()
        # name -> _Installed; never mutated, only replaced as a whole.
        self._installed = _EMPTY

    @property
    def model(self):
        """The model adapters are validated against, or ``None``."""
        return self._model

    def _prepare(self, name, adapter):
        _check_name(name)
        _check_adapter(name, adapter)
        if self._model is not None:
            adapter.validate_against(self._model)
        return _Installed(adapter)

    def _swap(self, name, entry):
        # caller holds the lock; entry None removes
        new = dict(self._installed)
        if entry is None:
            del new[name]
        else:
            new[name] = entry
        self._installed = MappingProxyType(new)

    def add(self, name, adapter):
        """Install ``adapter`` under a new ``name``.

        ``ValueError`` if ``name`` is already installed; the adapter is
        validated against the model (if any) first.
        """
        _check_name(name)
        if name in self._installed:
            raise ValueError(f"adapter {name!r} is already installed (use replace to swap it)")
        entry = self._prepare(name, adapter)
        with self._lock:
            if name in self._installed:
                raise ValueError(f"adapter {name!r} is already installed (use replace to swap it)")
            self._swap(name, entry)

    def replace(self, name, adapter):
        """Atomically swap the adapter installed under ``name`` for ``adapter``.

        ``KeyError`` if ``name`` is not installed.  The new adapter is
        validated first; when validation fails the old adapter stays
        installed and the error propagates.  Batches bound before the swap
        keep the old adapter; batches bound after it get the new one.
        """
        _check_name(name)
        if name not in self._installed:
            raise KeyError(f"no adapter named {name!r} is installed (use add to install one)")
        entry = self._prepare(name, adapter)
        with self._lock:
            if name not in self._installed:
                raise KeyError(f"no adapter named {name!r} is installed (use add to install one)")
            self._swap(name, entry)

    def remove(self, name):
        """Uninstall the adapter named ``name`` (``KeyError`` if there is none).

        Batches already bound keep using it.
        """
        _check_name(name)
        with self._lock:
            if name not in self._installed:
                raise KeyError(f"no adapter named {name!r} is installed")
            self._swap(name, None)

    def names(self):
        """The installed names, sorted (a new list)."""
        return sorted(self._installed)

    def get(self, name):
        """The adapter installed under ``name`` (``KeyError`` if there is none)."""
        try:
            return self._installed[name].adapter
        except KeyError:
            raise KeyError(f"no adapter named {name!r} is installed") from None

    def __contains__(self, name):
        return name in self._installed

    def __len__(self):
        return len(self._installed)

    def __repr__(self):
        return f"AdapterSet({self.names()!r})"

    def bind(self, row_adapters, scales=None):
        """A hook for one batch of ``len(row_adapters)`` rows.

        ``row_adapters`` gives, per row, the name of an installed adapter or
        ``None`` (no adapter).  ``scales`` multiplies the adapters' own scales:

        * ``None``: ``1`` for every row;
        * one finite real number: the same factor for every row;
        * a sequence (or 1-D array) of one finite real per row;
        * a mapping ``name -> finite real``: the factor for that adapter's
          rows (names must be installed; adapters not named get ``1``).

        Raises ``KeyError`` naming the unknown adapter names, ``ValueError``
        for a wrong number of scales or a non-finite scale (also when a
        factor times a layer's scale overflows float32), ``TypeError`` for
        entries that are neither ``str`` nor ``None`` and for scales that are
        not real numbers.  Rows with ``None`` or an effective scale of zero
        are never written.

        The hook is a snapshot of the adapters installed now.  Passing it
        to :func:`~lorahook.apply_lora_rows` with a different row count
        raises ``ValueError``.
        """
        installed = self._installed  # one read: the snapshot
        if isinstance(row_adapters, (str, bytes)) or not hasattr(row_adapters, "__len__"):
            raise TypeError(
                f"row_adapters must be a sequence of adapter names or None, "
                f"got {type(row_adapters).__name__}")
        row_names = tuple(row_adapters)
        n = len(row_names)
        unknown = set()
        for i, name in enumerate(row_names):
            if name is None:
                continue
            if not isinstance(name, str):
                raise TypeError(
                    f"row_adapters[{i}] must be an adapter name (str) or None, "
                    f"got {type(name).__name__} ({name!r})")
            if name not in installed:
                unknown.add(name)
        _refuse_unknown("row_adapters", unknown, installed)
        factors = _row_factors(scales, row_names, installed)

        # Group the rows by adapter, rows with a zero factor left out.
        grouped = {}
        for i, name in enumerate(row_names):
            if name is not None and factors[i] != 0.0:
                grouped.setdefault(name, []).append(i)
        plans = {}
        all_factors = np.asarray(factors, dtype=np.float64)
        for name, rows in grouped.items():
            entry = installed[name]
            rows = np.asarray(rows, dtype=np.int64)
            f = all_factors[rows]
            per_scale = {}
            for s in entry.layer_scales:
                group = _group_for_scale(name, s, rows, f, n)
                if group is not None:
                    per_scale[s] = group
            plans[name] = (entry.adapter, per_scale)
        return BoundBatch._make(row_names, plans, n)


def _refuse_unknown(what, unknown, installed):
    if unknown:
        raise KeyError(
            f"{what} names adapters that are not installed: {sorted(unknown)} "
            f"(installed: {sorted(installed)})")


def _row_factors(scales, row_names, installed):
    """One float per row from the ``scales`` argument of :meth:`AdapterSet.bind`."""
    n = len(row_names)
    if scales is None:
        return [1.0] * n
    if isinstance(scales, Mapping):
        per_name = {}
        unknown = []
        for key, value in scales.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"scales mapping keys must be adapter names (str), got "
                    f"{type(key).__name__} ({key!r})")
            if key not in installed:
                unknown.append(key)
                continue
            per_name[key] = _finite(value, f"scales[{key!r}]")
        _refuse_unknown("scales", unknown, installed)
        return [1.0 if name is None else per_name.get(name, 1.0) for name in row_names]
    if isinstance(scales, (numbers.Real, np.generic)) or (
            isinstance(scales, np.ndarray) and scales.ndim == 0):
        value = _finite(scales, "scales")
        return [value] * n
    if isinstance(scales, (str, bytes)) or not hasattr(scales, "__len__"):
        raise TypeError(
            f"scales must be None, a real number, a sequence of one per row or a "
            f"mapping name -> real, got {type(scales).__name__}")
    if isinstance(scales, np.ndarray) and scales.ndim != 1:
        raise ValueError(f"scales must be 1-D with one value per row, got shape {scales.shape}")
    values = scales.tolist() if isinstance(scales, np.ndarray) else list(scales)
    if len(values) != n:
        raise ValueError(
            f"scales must have one value per row: expected {n} (len(row_adapters)), "
            f"got {len(values)}")
    return [_finite(v, f"scales[{i}]") for i, v in enumerate(values)]


def _group_for_scale(name, layer_scale, rows, factors, n_rows):
    """The ``(scale, rows, row_scales)`` of one adapter's rows for layers of one scale.

    ``None`` when no row has a non-zero effective scale.  The effective
    scales are rounded to float32 (what the kernel uses) before the zero
    test, so a row is never touched by a scale that rounds to zero.
    """
    with np.errstate(over="ignore", under="ignore"):
        eff = (factors * layer_scale).astype(np.float32)
    if not np.isfinite(eff).all():
        raise ValueError(
            f"the effective scale of adapter {name!r} (row scale x layer scale "
            f"{layer_scale:g}) overflows float32 for some rows")
    keep = eff != 0
    if not keep.any():
        return None
    if not keep.all():
        rows, eff = rows[keep], eff[keep]
    if len(rows) == n_rows:
        rows_arr = None  # every row, in order
    else:
        rows_arr = np.ascontiguousarray(rows, dtype=np.int32)
        rows_arr.flags.writeable = False
    if (eff == eff[0]).all():
        return (float(eff[0]), rows_arr, None)
    eff = np.ascontiguousarray(eff)
    eff.flags.writeable = False
    return (1.0, rows_arr, eff)


class BoundBatch(LoraHook):
    """The hook :meth:`AdapterSet.bind` returns: one batch, one snapshot of adapters.

    Pass it to :func:`~lorahook.apply_lora_rows` after each projection of
    the batch it was bound for; a call with another row count raises
    ``ValueError``.  For a projection, every row bound to an adapter that
    covers it gets ``effective_scale * B @ (A @ x)`` (+ the scaled bias)
    added, where ``effective_scale`` is the layer's scale times the row's
    factor; rows bound to the same adapter are computed together.  Other rows
    are never written.  Immutable, and safe to apply from several threads.

    It has no meaning for a lone row: :meth:`apply` raises ``TypeError``.
    """

    __slots__ = ("_bound_rows", "_row_adapters", "_plans", "_cache", "_group_plans")

    def __init__(self, *args, **kwargs):
        raise TypeError("BoundBatch is made by AdapterSet.bind, not constructed directly")

    @classmethod
    def _make(cls, row_names, plans, n):
        self = object.__new__(cls)
        object.__setattr__(self, "_bound_rows", n)
        object.__setattr__(self, "_row_adapters", row_names)
        # name -> (adapter, {layer scale: (scale, rows, row_scales)})
        object.__setattr__(self, "_plans", plans)
        # (layer_idx, module) -> tuple of (name, layer, group); filled on first use
        object.__setattr__(self, "_cache", {})
        # (layer_idx, module) -> the compiled GroupPlan of those groups; made
        # on the first call whose widths fit, so later calls only run kernels
        object.__setattr__(self, "_group_plans", {})
        return self

    def __setattr__(self, name, value):
        raise AttributeError("BoundBatch is immutable")

    def __reduce__(self):
        raise TypeError("a BoundBatch belongs to one batch in one process and does not pickle; "
                        "pickle the adapters and bind again")

    # --- introspection ------------------------------------------------------

    @property
    def n_rows(self):
        """The row count this batch was bound for."""
        return self._bound_rows

    @property
    def row_adapters(self):
        """Per row, the adapter name or ``None`` (a tuple)."""
        return self._row_adapters

    @property
    def adapters(self):
        """Read-only mapping name -> the adapter this batch applies (rows with non-zero scale)."""
        return MappingProxyType({name: plan[0] for name, plan in self._plans.items()})

    def __repr__(self):
        return f"BoundBatch({self._bound_rows} rows, adapters {sorted(self._plans)!r})"

    # --- the hook contract -------------------------------------------------

    def _covering(self, layer_idx, module):
        key = (layer_idx, module)
        found = self._cache.get(key)
        if found is None:
            items = []
            for name, (adapter, per_scale) in self._plans.items():
                layer = adapter.layers.get(key)
                if layer is None or layer.rank == 0:
                    continue
                group = per_scale.get(layer.scale)
                if group is not None:
                    items.append((name, layer, group))
            found = tuple(items)
            # Concurrent fills compute the same value; the last one wins.
            self._cache[key] = found
        return found

    def is_active(self, layer_idx, module):
        """True when some row's adapter covers the projection with a non-zero scale."""
        return bool(self._covering(layer_idx, module))

    def _apply_rows(self, layer_idx, module, input, output, input_row_width,
                    output_row_width, n_rows):
        key = (layer_idx, module)
        plan = self._group_plans.get(key)
        if plan is None or plan.d_in != input_row_width or plan.d_out != output_row_width:
            covering = self._covering(layer_idx, module)
            for name, layer, _ in covering:
                if layer.d_in != input_row_width or layer.d_out != output_row_width:
                    raise ValueError(
                        f"adapter {name!r} layer ({layer_idx}, {module!r}) has (d_in, d_out) = "
                        f"({layer.d_in}, {layer.d_out}) but the call's row widths are "
                        f"(input_row_width, output_row_width) = "
                        f"({input_row_width}, {output_row_width})")
            if not covering:
                return
            plan = _rows.GroupPlan([(layer._kernel,) + group for _, layer, group in covering],
                                   n_rows, input_row_width, output_row_width)
            # Concurrent first calls build equal plans; the last one wins.
            self._group_plans[key] = plan
        plan.apply(input, output)

    def apply(self, layer_idx, module, x, output):
        """Not supported: a bound batch is applied to whole batches only."""
        raise TypeError(
            "a bound AdapterSet batch has no meaning for a lone row: call "
            "lorahook.apply_lora_rows(hook, layer_idx, module, input, output, "
            "input_row_width, output_row_width) with the whole batch it was bound for")

    # --- geometry -----------------------------------------------------------

    def validate_against(self, config):
        """Check every adapter this batch applies against ``config``."""
        for name in sorted(self._plans):
            self._plans[name][0].validate_against(config)
        return None

    def validate_against_bert(self, num_hidden_layers, hidden_size, intermediate_size):
        """The same check for a BERT encoder of these dimensions."""
        for name in sorted(self._plans):
            self._plans[name][0].validate_against_bert(
                num_hidden_layers, hidden_size, intermediate_size)
        return None
