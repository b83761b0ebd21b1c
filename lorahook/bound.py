"""The hooks a store binds: :class:`BoundBatch`, :class:`BoundSequences`, and their grouping.

:meth:`AdapterSet.bind <lorahook.AdapterSet.bind>` and ``bind_sequences`` turn
one adapter name (or ``None``) per row or per sequence, and the bind's
``scales``, into one of these hooks.

How a bound batch is computed
-----------------------------
At bind time the rows are grouped by adapter: for every adapter the batch
uses, the ascending ``int32`` indices of its rows and their scales are
computed once.  A projection call then does a handful of dictionary lookups
and one call into the compiled core, which -- with the GIL released -- runs
one matrix-matrix product pair per adapter (or the per-row loop for groups
smaller than :func:`lorahook._core.segments.get_gemm_crossover`, the same crossover a
single adapter uses), gathers rows that are not contiguous in the batch and
scatter-adds the deltas back.  Rows without an adapter, or whose effective
scale is zero, are never written: their output stays bit-identical.

Different kernel paths round differently in the last bits, so a row's result
can depend on the batch it was computed in (how many other rows share its
adapter, and where they are).
"""
import numbers
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from ._core.sources import UnitGroups
from ._values import finite_real
from .hook import LoraHook

__all__ = ["BoundBatch", "BoundSequences", "unit_factors", "group_units"]


def refuse_unknown(what, unknown, installed):
    """``KeyError`` naming the ``unknown`` names (none: nothing happens)."""
    if unknown:
        raise KeyError(
            f"{what} names adapters that are not installed: {sorted(unknown)} "
            f"(installed: {sorted(installed)})")


def unit_factors(scales, row_names, known, what="row_adapters", unit="row"):
    """One float per row (or sequence) from the ``scales`` argument of a bind.

    ``known``: the names a scales mapping may name (the bind's own and the
    resident ones).
    """
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
            if key not in known:
                unknown.append(key)
                continue
            per_name[key] = finite_real(value, f"scales[{key!r}]")
        refuse_unknown("scales", unknown, known)
        return [1.0 if name is None else per_name.get(name, 1.0) for name in row_names]
    if isinstance(scales, (numbers.Real, np.generic)) or (
            isinstance(scales, np.ndarray) and scales.ndim == 0):
        value = finite_real(scales, "scales")
        return [value] * n
    if isinstance(scales, (str, bytes)) or not hasattr(scales, "__len__"):
        raise TypeError(
            f"scales must be None, a real number, a sequence of one per {unit} or a "
            f"mapping name -> real, got {type(scales).__name__}")
    if isinstance(scales, np.ndarray) and scales.ndim != 1:
        raise ValueError(f"scales must be 1-D with one value per {unit}, got shape {scales.shape}")
    values = scales.tolist() if isinstance(scales, np.ndarray) else list(scales)
    if len(values) != n:
        raise ValueError(
            f"scales must have one value per {unit}: expected {n} (len({what})), "
            f"got {len(values)}")
    return [finite_real(v, f"scales[{i}]") for i, v in enumerate(values)]


def _group_for_scale(name, layer_scale, idx, factors, n_units):
    """The ``(scale, unit indices, unit scales)`` of one adapter's units for kernels of one scale.

    ``None`` when no unit has a non-zero effective scale.  The effective
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
        idx, eff = idx[keep], eff[keep]
    idx_arr = None if len(idx) == n_units else idx.astype(np.int32)  # None: every unit
    if (eff == eff[0]).all():
        return (float(eff[0]), idx_arr, None)
    return (1.0, idx_arr, eff)




def group_units(names, factors, installed, unit):
    """The core's parts of a bind: per adapter used with a non-zero factor,
    ``(name, adapter, {kernel scale: (scale, unit indices or None, unit scales or None)})``.

    ``names``: per unit, an adapter name or ``None``; ``factors``: per unit,
    the bind's factor (:func:`unit_factors`); ``installed``: a snapshot
    ``name -> entry`` of the store holding every name used (an entry has
    ``adapter``, ``layer_scales`` and ``exact``).
    """
    n = len(names)
    # Group the units by adapter, units with a zero factor left out.
    grouped = {}
    for i, name in enumerate(names):
        if name is not None and factors[i] != 0.0:
            grouped.setdefault(name, []).append(i)
    parts = []
    all_factors = np.asarray(factors, dtype=np.float64)
    for name, idx in grouped.items():
        entry = installed[name]
        idx = np.asarray(idx, dtype=np.int64)
        f = all_factors[idx]
        if entry.exact and not (f == 1.0).all():
            raise ValueError(
                f"adapter {name!r} has DoRA layers or saved modules (modules_to_save), which "
                f"are not linear in the scale: its {unit}s take scale 0 or 1, got "
                f"{sorted(set(f[f != 1.0].tolist()))[:3]}")
        per_scale = {}
        for s in entry.layer_scales:
            group = _group_for_scale(name, s, idx, f, n)
            if group is not None:
                per_scale[s] = group
        parts.append((name, entry.adapter, per_scale))
    return parts


class _Bound(UnitGroups, LoraHook):
    """What the hooks of :meth:`AdapterSet.bind` and ``bind_sequences`` share.

    A snapshot of adapters grouped by unit (a row, or a sequence), immutable
    and safe to apply from several threads.  For a projection, every row of a
    unit bound to an adapter that covers it gets
    ``effective_scale * B @ (A @ x)`` (+ the scaled bias) added, where
    ``effective_scale`` is the layer's scale times the unit's factor; rows
    bound to the same adapter are computed together.  Other rows are never
    written.  It has no meaning for a lone row: :meth:`apply` raises
    ``TypeError``.
    """

    __slots__ = ("_names", "_adapters")
    _exact_rows = True

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is made by AdapterSet.bind or bind_sequences, "
                        f"not constructed directly")

    @classmethod
    def _make(cls, names, parts):
        self = UnitGroups.__new__(cls)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_adapters",
                           MappingProxyType({name: adapter for name, adapter, _ in parts}))
        self._set_units(parts, len(names), cls._exact_rows)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self):
        raise TypeError(f"a {type(self).__name__} belongs to one process and does not pickle; "
                        f"pickle the adapters and bind again")

    @property
    def adapters(self):
        """Read-only mapping name -> the adapter this hook applies (units with non-zero scale)."""
        return self._adapters

    # --- the hook contract -------------------------------------------------
    # is_active comes from the core: true when some unit's adapter covers the
    # projection with a non-zero scale.

    def apply(self, layer_idx, module, x, output):
        """Not supported: a bound hook is applied to whole batches only."""
        raise TypeError(
            "a bound AdapterSet hook has no meaning for a lone row: call "
            "lorahook.apply_lora_rows(hook, layer_idx, module, input, output, "
            "input_row_width, output_row_width) with the whole batch")

    # --- geometry -----------------------------------------------------------

    def validate_against(self, config):
        """Check every adapter this hook applies against ``config``."""
        for name in sorted(self._adapters):
            self._adapters[name].validate_against(config)
        return None

    def validate_against_bert(self, num_hidden_layers, hidden_size, intermediate_size):
        """The same check for a BERT encoder of these dimensions."""
        for name in sorted(self._adapters):
            self._adapters[name].validate_against_bert(
                num_hidden_layers, hidden_size, intermediate_size)
        return None


class BoundBatch(_Bound):
    """The hook :meth:`AdapterSet.bind` returns: one batch, one snapshot of adapters.

    Pass it to :func:`~lorahook.apply_lora_rows` after each projection of
    the batch it was bound for; a call with another row count raises
    ``ValueError``.  See :class:`_Bound` for what it adds.
    """

    __slots__ = ()
    _exact_rows = True

    @property
    def n_rows(self):
        """The row count this batch was bound for."""
        return len(self._names)

    @property
    def row_adapters(self):
        """Per row, the adapter name or ``None`` (a tuple)."""
        return self._names

    def __repr__(self):
        return f"BoundBatch({len(self._names)} rows, adapters {sorted(self._adapters)!r})"


class BoundSequences(_Bound):
    """The hook :meth:`AdapterSet.bind_sequences` returns: S sequences, any rows per sequence.

    Serves every call whose row count is a multiple of the sequence count,
    rows sequence-major (row ``r`` of ``n`` belongs to sequence
    ``r // (n // S)``); otherwise as :class:`BoundBatch`.
    """

    __slots__ = ()
    _exact_rows = False

    @property
    def n_rows(self):
        """``None``: any multiple of :attr:`n_sequences` rows."""
        return None

    @property
    def n_sequences(self):
        """The number of sequences ``S``."""
        return len(self._names)

    @property
    def seq_adapters(self):
        """Per sequence, the adapter name or ``None`` (a tuple)."""
        return self._names

    def __repr__(self):
        return (f"BoundSequences({len(self._names)} sequences, "
                f"adapters {sorted(self._adapters)!r})")


def checked_names(unit_names, what):
    """``unit_names`` as a tuple: a sequence of adapter names (``str``) or ``None``, per unit."""
    if isinstance(unit_names, (str, bytes)) or not hasattr(unit_names, "__len__"):
        raise TypeError(
            f"{what} must be a sequence of adapter names or None, "
            f"got {type(unit_names).__name__}")
    names = tuple(unit_names)
    for i, name in enumerate(names):
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"{what}[{i}] must be an adapter name (str) or None, "
                f"got {type(name).__name__} ({name!r})")
    return names


def bound_batch(names, parts):
    """The :class:`BoundBatch` of ``AdapterSet.bind``: one entry of ``names`` per row."""
    return BoundBatch._make(names, parts)


def bound_sequences(names, parts):
    """The :class:`BoundSequences` of ``AdapterSet.bind_sequences``: one entry per sequence."""
    return BoundSequences._make(names, parts)
