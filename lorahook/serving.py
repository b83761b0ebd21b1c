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
smaller than :func:`lorahook._kernels.get_gemm_crossover`, the same crossover a
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
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from . import _rows, threads
from .adapter import LoraAdapter, _base_lookup
from .errors import LoraCapacityError, LoraFormatError
from .hook import LoraHook

__all__ = ["AdapterSet", "BoundBatch", "BoundSequences"]

_EMPTY = MappingProxyType({})


def _check_name(name, what="adapter name"):
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__} ({name!r})")
    if not name:
        raise ValueError(f"{what} must be a non-empty str, got ''")
    return name


def _check_lookup_name(name):
    """A name to look up: a ``str`` (``TypeError`` otherwise); ``""`` is simply unknown."""
    if not isinstance(name, str):
        raise TypeError(f"adapter name must be a str, got {type(name).__name__} ({name!r})")
    if not name:
        raise KeyError("no adapter named '': adapter names are non-empty")
    return name


def _check_adapter(name, adapter):
    if not isinstance(adapter, LoraAdapter):
        raise TypeError(
            f"adapter {name!r} must be a lorahook.LoraAdapter, got {type(adapter).__name__}")
    if adapter._core_dispatch != _rows.DISPATCH_KERNELS:
        raise TypeError(
            f"adapter {name!r} is a {type(adapter).__name__} with its own is_active or apply; an "
            f"AdapterSet batches adapters in the compiled core, which would not call them "
            f"(serve it alone with apply_lora_rows)")
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


def _check_resolver(resolver):
    if resolver is None or callable(resolver):
        return resolver
    if isinstance(resolver, (str, os.PathLike)):
        path = os.fspath(resolver)
        if isinstance(path, bytes) or not path:
            raise TypeError(f"a resolver directory must be a non-empty str path, got {resolver!r}")
        return path
    raise TypeError(f"resolver must be None, a directory (str or os.PathLike) or a callable "
                    f"name -> LoraAdapter | path | None, got {type(resolver).__name__}")


def _safe_component(name):
    """Whether ``name`` is one path component that stays inside its directory."""
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    return (bool(name) and name not in (".", "..") and "\0" not in name
            and not any(sep in name for sep in seps) and not os.path.isabs(name)
            and os.path.basename(name) == name)


def _load_directory(name, path):
    """A resolved name's PEFT directory, read with ``LoraAdapter.from_peft``."""
    if not os.path.isdir(path):
        raise LoraFormatError(f"adapter {name!r}: {os.fspath(path)} is not a PEFT adapter "
                              f"directory (expected a directory with adapter_config.json)")
    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        raise LoraFormatError(f"adapter {name!r}: {os.fspath(path)} is not a PEFT adapter "
                              f"directory: it has no adapter_config.json")
    return LoraAdapter.from_peft(path)


def resolve(resolver, name):
    """The adapter a resolver (SPEC section 9) gives for ``name``, validated by nothing else.

    ``resolver`` is a checked directory path or callable (``_check_resolver``).
    ``KeyError`` for an unknown or unsafe name, ``LoraFormatError`` for a path that
    is not a PEFT directory, ``TypeError`` for a callable's wrong answer.
    """
    if callable(resolver):
        found = resolver(name)
        if found is None:
            raise KeyError(f"no adapter named {name!r}: the resolver does not know it")
        if isinstance(found, LoraAdapter):
            return _check_adapter(name, found)
        if isinstance(found, (str, os.PathLike)):
            return _load_directory(name, found)
        raise TypeError(f"the resolver returned {type(found).__name__} for {name!r}; "
                        f"expected a LoraAdapter, a path or None")
    if not _safe_component(name):
        raise KeyError(f"no adapter named {name!r}: a resolver directory takes names that "
                       f"are one safe path component (no separators, not '.' or '..')")
    path = os.path.join(resolver, name)
    if not os.path.lexists(path):
        raise KeyError(f"no adapter named {name!r}: {path} does not exist")
    return _load_directory(name, path)


def _nbytes(entries):
    """Bytes of the installed entries' arrays, an array shared between adapters counted once."""
    seen = {}
    for entry in entries:
        seen.update(entry.arrays)
    return int(sum(seen.values()))


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

    __slots__ = ("adapter", "layer_scales", "arrays", "exact")

    def __init__(self, adapter):
        self.adapter = adapter
        # id -> nbytes of every array the adapter keeps, for the set's byte count
        self.arrays = {id(arr): arr.nbytes for arr in adapter._all_arrays()}
        # The distinct scales of the kernels that apply something (float32
        # values, as the core keys them): a batch's per-row scales are
        # multiplied by each of them once, at bind time.
        scales = {layer._kernel.scale for layer in adapter.layers.values() if layer.rank > 0}
        scales.update(module._kernel.scale for module in adapter.saved_modules.values())
        self.layer_scales = tuple(sorted(scales))
        # DoRA layers and saved modules are not linear in the scale: rows take 0 or 1
        self.exact = adapter._row_exact


class _Load:
    """One resolver call for one name: its owner sets the entry or the error, waiters wait.

    ``abandoned`` when the owner was interrupted by a ``BaseException`` that is
    not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``): that stays
    in the owner's thread, and the waiters load the name again themselves.
    """

    __slots__ = ("done", "entry", "error", "abandoned", "installed")

    def __init__(self):
        self.done = threading.Event()
        self.entry = None       # the _Installed made from the loaded adapter
        self.error = None       # an Exception: every thread waiting on the load gets it
        self.abandoned = False
        self.installed = False  # installed once at most: one resolver call, one load


class AdapterSet:
    """A thread-safe set of named adapters over one base model, in bounded memory.

    ``model`` (any :class:`~lorahook.ModelGeometry`, e.g. a
    :class:`~lorahook.Qwen35Config` or a :class:`~lorahook.BertConfig`, or
    ``None``): when given, every adapter is checked with
    ``adapter.validate_against(model)`` before it is installed, and a misfit
    raises :class:`~lorahook.LoraValidationError` with nothing changed.

    ``capacity_bytes`` (an int ``>= 0`` or ``None``): the resident adapters'
    :attr:`~lorahook.LoraAdapter.nbytes`, arrays shared between adapters
    counted once, never exceed it.  Before an install that would, the least
    recently used adapters that are not pinned are evicted (removed from the
    set; batches already bound keep theirs).  An adapter that cannot fit
    (larger than the capacity, or than what the pinned ones leave) raises
    :class:`~lorahook.LoraCapacityError`, a ``MemoryError``, and evicts
    nothing.

    ``resolver`` loads adapters by name on first use (:meth:`bind`,
    :meth:`bind_sequences`, :meth:`get`, :meth:`pin`): ``None`` (only what
    was added), a directory (``str`` / ``os.PathLike``: name -> the PEFT
    directory ``<dir>/<name>``; a name that is not one safe path component is
    a ``KeyError`` before any file is touched, a missing ``<dir>/<name>`` a
    ``KeyError``, one that is not a PEFT directory a
    :class:`~lorahook.LoraFormatError`), or a callable ``name -> LoraAdapter |
    path | None`` (``None``: unknown, ``KeyError``; anything else a
    ``TypeError``).  A load that fails raises its error, changes nothing, and
    reaches every thread waiting on it; the next use tries again.  The other
    names of that call that did load are installed (each resolver call is
    one load), unless the call was a bind that could not fit.
    Concurrent first uses of one name load it once, and no lock is held
    while a file is read or an adapter validated: a slow load never blocks
    binds that need only resident adapters.

    Names are non-empty ``str``; adapters are :class:`~lorahook.LoraAdapter`
    instances (``TypeError`` otherwise).  ``names()``, ``in`` and ``len``
    speak of resident adapters.  All methods may be called from any thread
    at any time.
    """

    __slots__ = ("_model", "_lock", "_installed", "_capacity", "_resolver", "_lru",
                 "_pinned", "_loading", "_stats", "_base_weights")

    def __init__(self, model=None, *, capacity_bytes=None, resolver=None, base_weights=None):
        threads._look_ahead()  # the one-time BLAS look, at start-up (lorahook.threads)
        self._model = _check_model(model)
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, numbers.Integral):
                raise TypeError(f"capacity_bytes must be an int >= 0 or None, got "
                                f"{type(capacity_bytes).__name__} ({capacity_bytes!r})")
            if capacity_bytes < 0:
                raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
            capacity_bytes = int(capacity_bytes)
        self._capacity = capacity_bytes
        self._resolver = _check_resolver(resolver)
        if base_weights is not None:
            _base_lookup(base_weights)
        self._base_weights = base_weights
        self._lock = threading.Lock()
        # name -> _Installed; never mutated, only replaced as a whole.
        self._installed = _EMPTY
        # resident names, least recently used first (values unused)
        self._lru = OrderedDict()
        self._pinned = set()
        self._loading = {}  # name -> _Load in progress (or done, until installed)
        self._stats = {"hits": 0, "loads": 0, "evictions": 0, "load_seconds": 0.0}

    @property
    def model(self):
        """The model adapters are validated against, or ``None``."""
        return self._model

    @property
    def capacity_bytes(self):
        """The byte capacity, or ``None`` (unbounded)."""
        return self._capacity

    @property
    def nbytes(self):
        """Bytes of the resident adapters' arrays, each array counted once (an ``int``)."""
        return _nbytes(self._installed.values())

    def _prepare(self, name, adapter):
        _check_name(name)
        _check_adapter(name, adapter)
        return self._checked(adapter)

    def _checked(self, adapter):
        """Validate an adapter about to be installed and give its DoRA layers their base."""
        if self._model is not None:
            adapter.validate_against(self._model)
        base = self._base_weights
        if base is not None and adapter.needs_base:
            adapter = adapter.with_base(base)
        return _Installed(adapter)

    @property
    def base_weights(self):
        """The base weights DoRA layers get when installed (``None``: none given)."""
        return self._base_weights

    def set_base_weights(self, weights):
        """Give DoRA layers their base weights: those installed from now on, and resident
        ones that have none yet (each replaced atomically by the adapter with its base).

        ``weights`` is what :meth:`LoraAdapter.with_base` takes, or ``None``.  A
        resident adapter whose base cannot be computed keeps its place and the
        error propagates (its DoRA rows keep refusing).
        """
        if weights is not None:
            _base_lookup(weights)  # refuse a wrong type before anything changes
        self._base_weights = weights
        if weights is None:
            return
        for name, entry in list(self._installed.items()):
            if entry.adapter.needs_base:
                based = _Installed(entry.adapter.with_base(weights))
                with self._lock:
                    if self._installed.get(name) is entry:
                        self._commit({name: based}, protect=(name,))

    # --- the resident set (callers hold the lock) -----------------------------

    def _commit(self, changes, protect=()):
        """Install / remove ``changes`` (name -> _Installed or None), evicting to fit.

        Checks the capacity first and changes nothing when it cannot be met;
        ``protect`` names are never evicted (a bind's own adapters).
        """
        new = dict(self._installed)
        for name, entry in changes.items():
            if entry is None:
                new.pop(name, None)
            else:
                new[name] = entry
        evicted = []
        if self._capacity is not None:
            keep = set(protect) | set(n for n, e in changes.items() if e is not None)
            need = _nbytes(new[n] for n in keep if n in new)
            pinned = sorted(n for n in self._pinned if n in new and n not in keep)
            # together: arrays the kept adapters share with pinned ones count once
            total = _nbytes(new[n] for n in keep.union(pinned) if n in new)
            if total > self._capacity:
                raise LoraCapacityError(
                    f"adapters {sorted(keep)} need {need} bytes; with the pinned {pinned} "
                    f"they need {total} bytes and cannot fit in "
                    f"capacity_bytes={self._capacity}; nothing was evicted")
            # bytes per array and how many resident adapters share it: an
            # eviction frees only the arrays no other adapter keeps
            users = Counter(i for entry in new.values() for i in entry.arrays)
            sizes = {i: b for entry in new.values() for i, b in entry.arrays.items()}
            total = sum(sizes.values())
            for name in list(self._lru):
                if total <= self._capacity:
                    break
                if name in keep or name in self._pinned or name not in new:
                    continue
                for i in new.pop(name).arrays:
                    users[i] -= 1
                    if not users[i]:
                        total -= sizes[i]
                evicted.append(name)
        self._installed = MappingProxyType(new)
        for name in evicted:
            self._lru.pop(name, None)
        for name, entry in changes.items():
            if entry is None:
                self._lru.pop(name, None)
                self._pinned.discard(name)
            else:
                self._lru[name] = None
                self._lru.move_to_end(name)
        self._stats["evictions"] += len(evicted)

    def _touch(self, names):
        # caller holds the lock
        for name in names:
            if name in self._lru:
                self._lru.move_to_end(name)

    # --- loading on first use -------------------------------------------------

    def _resident(self, names, what="name"):
        """A snapshot holding every name of ``names`` (loaded if needed), marked as used.

        Missing names are claimed first -- a load per name not already being
        loaded by another thread -- then this thread runs its own loads, then
        waits on the others'.  Each load's result is installed once (one
        resolver call, one load in :meth:`stats`).  A name that was resident
        when this call looked, or whose load was installed by another thread,
        and that has left the set since (evicted, removed) is not put back:
        only this call's snapshot holds it, as a batch bound earlier keeps
        its adapters.
        """
        while True:
            snap = self._installed
            missing = [n for n in names if n not in snap]
            if not missing:
                if names:
                    with self._lock:
                        self._touch(names)
                        self._stats["hits"] += len(names)
                return snap
            if self._resolver is None:
                _refuse_unknown(what, set(missing), snap)
            jobs, mine = self._claim(missing)
            keep = False  # this thread's finished loads stay claimed, to be installed
            try:
                for name in sorted(mine):
                    self._run_load(name, jobs[name])
                for job in jobs.values():
                    job.done.wait()
                if any(job.abandoned for job in jobs.values()):
                    keep = True
                    continue  # an owner was interrupted: load those names again
                for name in sorted(jobs):
                    if jobs[name].error is not None:
                        raise jobs[name].error
                try:
                    found = self._install(names, snap, jobs)
                finally:
                    # installed, or (LoraCapacityError) not: a bind that cannot fit
                    # changes nothing, and its loads stay claimed for their next use
                    keep = True
            finally:
                self._release(jobs, mine, keep)
            if found is not None:
                return found

    def _claim(self, missing):
        """``({name: _Load}, names this thread loads)`` for the names not resident now."""
        jobs, mine = {}, set()
        with self._lock:
            for name in missing:
                if name in self._installed:
                    continue
                job = self._loading.get(name)
                if job is None:
                    job = self._loading[name] = _Load()
                    mine.add(name)
                jobs[name] = job
        return jobs, mine

    def _run_load(self, name, job):
        """Resolve and validate ``name`` for ``job`` (this thread owns it); errors go in the job."""
        start = time.perf_counter()
        try:
            adapter = resolve(self._resolver, name)
            job.entry = self._checked(adapter)
        except Exception as exc:
            job.error = exc
        except BaseException:
            job.abandoned = True
            raise
        finally:
            with self._lock:
                if job.error is not None or job.abandoned:
                    if self._loading.get(name) is job:
                        del self._loading[name]  # the next use tries again
                self._stats["load_seconds"] += time.perf_counter() - start
            job.done.set()

    def _release(self, jobs, mine, keep):
        """Give up the loads this thread owns and did not finish (it was interrupted).

        Unless ``keep`` (installed, looked up again, or part of a bind that
        could not fit), the loads it did finish are installed now, though
        another load of the call failed or was interrupted after them: one
        resolver call, one load, and nothing left claimed.  One that cannot
        fit now stays claimed for its next use.
        """
        for name in mine:
            job = jobs[name]
            if not job.done.is_set():
                job.abandoned = True
                with self._lock:
                    if self._loading.get(name) is job:
                        del self._loading[name]
                job.done.set()
            elif not keep and job.error is None and not job.abandoned:
                try:
                    self._install((name,), self._installed, {name: job})
                except LoraCapacityError:
                    pass

    def _install(self, names, snap, jobs):
        """Install the finished loads of ``names``; the snapshot, or ``None`` to look again."""
        with self._lock:
            changes, extra = {}, {}
            for name in names:
                if name in self._installed:
                    continue
                job = jobs.get(name)
                if job is not None and not job.installed:
                    changes[name] = job.entry
                elif job is not None:
                    extra[name] = job.entry
                elif name in snap:
                    extra[name] = snap[name]
                else:
                    return None  # installed at claim time and gone since: look again
            self._commit(changes, protect=names)
            for name in changes:
                jobs[name].installed = True
                if self._loading.get(name) is jobs[name]:
                    del self._loading[name]
            self._stats["loads"] += len(changes)
            self._stats["hits"] += len(names) - len(changes)
            self._touch(names)
            if extra:
                return MappingProxyType({**self._installed, **extra})
            return self._installed

    # --- changing the set ------------------------------------------------------

    def add(self, name, adapter, pin=False):
        """Install ``adapter`` under ``name``, which must not be resident.

        ``ValueError`` if ``name`` is resident (a name the resolver knows but
        that is not resident is installed as given).  The adapter is
        validated against the model (if any) first; least recently used
        adapters are evicted to fit the capacity (``LoraCapacityError`` if it
        cannot fit, nothing changed).  ``pin=True`` pins it.
        """
        _check_name(name)
        if name in self._installed:
            raise ValueError(f"adapter {name!r} is already installed (use replace to swap it)")
        entry = self._prepare(name, adapter)
        with self._lock:
            if name in self._installed:
                raise ValueError(f"adapter {name!r} is already installed (use replace to swap it)")
            if pin:
                self._pinned.add(name)
            try:
                self._commit({name: entry})
            except BaseException:
                self._pinned.discard(name)
                raise

    def replace(self, name, adapter):
        """Atomically swap the adapter resident under ``name`` for ``adapter``.

        ``KeyError`` if ``name`` is not resident.  The new adapter is
        validated first; when validation (or the capacity) fails the old
        adapter stays installed and the error propagates.  Batches bound
        before the swap keep the old adapter; batches bound after it get the
        new one.  A pinned name stays pinned.
        """
        _check_lookup_name(name)
        if name not in self._installed:
            raise KeyError(f"no adapter named {name!r} is installed (use add to install one)")
        entry = self._prepare(name, adapter)
        with self._lock:
            if name not in self._installed:
                raise KeyError(f"no adapter named {name!r} is installed (use add to install one)")
            self._commit({name: entry})

    def remove(self, name):
        """Unload the adapter resident under ``name`` (``KeyError`` if there is none).

        A name the resolver knows is loaded again on its next use.  Batches
        already bound keep using the adapter.  Removing unpins.
        """
        _check_lookup_name(name)
        with self._lock:
            if name not in self._installed:
                raise KeyError(f"no adapter named {name!r} is installed")
            self._commit({name: None})

    def pin(self, name):
        """Keep ``name`` resident: never evicted until :meth:`unpin` or :meth:`remove`.

        Loads it first when it is not resident and the resolver knows it.
        """
        _check_lookup_name(name)
        while True:
            self._resident((name,))
            with self._lock:
                if name not in self._installed:
                    continue  # evicted between the load and the pin: load again
                # resident adapters fit the capacity, so pinned ones do too
                self._pinned.add(name)
                return

    def unpin(self, name):
        """Let ``name`` be evicted again (``KeyError`` if it is not resident)."""
        _check_lookup_name(name)
        with self._lock:
            if name not in self._installed:
                raise KeyError(f"no adapter named {name!r} is installed")
            self._pinned.discard(name)

    # --- reading ------------------------------------------------------------

    def names(self):
        """The resident names, sorted (a new list)."""
        return sorted(self._installed)

    def pinned(self):
        """The pinned names, sorted (a new list)."""
        with self._lock:
            return sorted(self._pinned)

    def get(self, name):
        """The adapter under ``name``, loaded on first use (``KeyError`` if unknown)."""
        _check_lookup_name(name)
        return self._resident((name,))[name].adapter

    def stats(self):
        """Counters, as a new dict.

        ``resident`` (a count), ``nbytes``, ``capacity_bytes``, ``pinned``,
        ``hits`` (uses of a resident adapter), ``loads`` (adapters loaded and
        installed; failed loads do not count), ``evictions``,
        ``load_seconds`` (time spent resolving and validating), ``loading``
        (loads in progress).
        """
        with self._lock:
            installed = self._installed
            out = dict(self._stats)
            out.update(resident=len(installed), nbytes=_nbytes(installed.values()),
                       capacity_bytes=self._capacity, pinned=len(self._pinned),
                       loading=len(self._loading))
        return out

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
        raises ``ValueError``.  Binding is cheap (rows are grouped by
        adapter once; each projection's plan is made on its first call), so a
        server may bind once per step of a packed, continuous batch.
        """
        names, parts = self._bind_parts(row_adapters, scales, "row_adapters", "row")
        return BoundBatch._make(names, parts)

    def bind_sequences(self, seq_adapters, scales=None):
        """A hook for every call of a generation loop over ``len(seq_adapters)`` sequences.

        ``seq_adapters`` gives, per sequence, an installed adapter name or
        ``None``; ``scales`` is as in :meth:`bind`, per sequence.  The hook
        serves any call whose row count ``n`` is a multiple of
        ``S = len(seq_adapters)``, rows laid out sequence-major: row ``r``
        belongs to sequence ``r // (n // S)``.  So one hook serves the
        prefill (``S * L`` rows) and every decode step (``S`` rows).  A row
        count that is not a multiple of ``S`` raises ``ValueError`` naming
        both numbers, as a call check (before ``is_active``, nothing
        written).  Snapshot, ``None`` and zero-scale semantics as
        :meth:`bind`; the plan of each projection is made once per rows-per-
        sequence count and kept (the last few counts).
        """
        names, parts = self._bind_parts(seq_adapters, scales, "seq_adapters", "sequence")
        return BoundSequences._make(names, parts)

    def _bind_parts(self, unit_names, scales, what, unit):
        """Check a bind's names and scales; group the units by adapter.

        Returns the names as a tuple and the core's parts: per adapter used
        with a non-zero scale, ``(name, adapter, {kernel scale: (scale,
        unit indices or None, unit scales or None)})``.
        """
        if isinstance(unit_names, (str, bytes)) or not hasattr(unit_names, "__len__"):
            raise TypeError(
                f"{what} must be a sequence of adapter names or None, "
                f"got {type(unit_names).__name__}")
        names = tuple(unit_names)
        n = len(names)
        for i, name in enumerate(names):
            if name is None:
                continue
            if not isinstance(name, str):
                raise TypeError(
                    f"{what}[{i}] must be an adapter name (str) or None, "
                    f"got {type(name).__name__} ({name!r})")
        used = tuple(dict.fromkeys(n for n in names if n is not None))
        # the scales are checked before anything is loaded: a refused bind changes nothing
        factors = _row_factors(scales, names, set(used).union(self._installed), what, unit)
        # one snapshot holding every name (loaded on first use when a resolver knows it)
        installed = self._resident(used, what)

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
        return names, parts


def _refuse_unknown(what, unknown, installed):
    if unknown:
        raise KeyError(
            f"{what} names adapters that are not installed: {sorted(unknown)} "
            f"(installed: {sorted(installed)})")


def _row_factors(scales, row_names, known, what="row_adapters", unit="row"):
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
            per_name[key] = _finite(value, f"scales[{key!r}]")
        _refuse_unknown("scales", unknown, known)
        return [1.0 if name is None else per_name.get(name, 1.0) for name in row_names]
    if isinstance(scales, (numbers.Real, np.generic)) or (
            isinstance(scales, np.ndarray) and scales.ndim == 0):
        value = _finite(scales, "scales")
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
    return [_finite(v, f"scales[{i}]") for i, v in enumerate(values)]


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


class _Bound(_rows.UnitGroups, LoraHook):
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
        self = _rows.UnitGroups.__new__(cls)
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
