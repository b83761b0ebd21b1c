"""Many adapters over one base model: :class:`AdapterSet`, a store in bounded memory.

A CPU inference server keeps its adapters in an :class:`AdapterSet`, one per
customer or task, and for every batch calls :meth:`AdapterSet.bind` with the
adapter name (or ``None``) of each row.  The result is a
:class:`~lorahook.LoraHook` for exactly that batch, passed to
:func:`lorahook.apply_lora_rows` after each projection like any other hook
(:mod:`lorahook.bound`).  Names it does not hold are found through its resolver
(:mod:`lorahook.resolver`).

Snapshots and threads
---------------------
The installed adapters are held in an immutable mapping that :meth:`add`,
:meth:`replace` and :meth:`remove` swap, under a lock, for a new one.
:meth:`bind` reads the mapping once, so a bound batch sees one consistent
version of every adapter for its whole life: an adapter replaced or removed
after ``bind`` never changes, or tears, a batch in flight.  Adapters are
immutable, so a bound batch can be applied from several threads at once.
"""
import threading
import time
from collections import OrderedDict
from types import MappingProxyType

from .threads import look_ahead
from ._values import weight_dtype
from .resolver import checked_capacity, evict_to_fit, nbytes
from .adapter import base_lookup, store_entry
from .bound import bound_batch, bound_sequences, checked_names, group_units, refuse_unknown
from .bound import unit_factors
from .errors import LoraCapacityError
from .resolver import Load, check_adapter, check_lookup_name, check_name, check_resolver, resolve

__all__ = ["AdapterSet"]

_EMPTY = MappingProxyType({})


def _check_model(model):
    if model is None:
        return None
    from .models import ModelGeometry
    if not isinstance(model, ModelGeometry):
        raise TypeError(
            f"model must be a lorahook.ModelGeometry (Qwen35Config, BertConfig, LlamaConfig, ...) "
            f"or None, got {type(model).__name__}")
    return model


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

    Parameters
    ----------
    model : ModelGeometry, optional
        The base model every adapter is checked against before it is
        installed (``None``: not checked).
    capacity_bytes : int, optional
        The most the resident adapters may hold (``None``: no bound).
    resolver : str, os.PathLike or callable, optional
        How a name that is not resident is loaded on first use.
    base_weights : mapping or callable, optional
        The base weights DoRA layers need, as :meth:`set_base_weights` takes.
    dtype : {None, "float32", "float16", "bfloat16", "int8"}, optional
        The dtype adapters are held in: each one added or loaded is converted
        (:meth:`~lorahook.LoraAdapter.astype`, which keeps one already in it),
        and capacity counts its bytes in it (int8: a quarter, plus a scale per
        rank and output).  ``None``: as given (float32 from a directory).

    Examples
    --------
    >>> import numpy as np, lorahook
    >>> model = lorahook.LlamaConfig(hidden_size=8, num_hidden_layers=1,
    ...                              num_attention_heads=2, intermediate_size=16)
    >>> def adapter(value):
    ...     layer = lorahook.LoraLayer(np.full((2, 8), value), np.ones((8, 2)))
    ...     return lorahook.LoraAdapter({(0, "q_proj"): layer})
    >>> adapters = lorahook.AdapterSet(model=model)
    >>> adapters.add("support", adapter(0.5))
    >>> adapters.add("legal", adapter(-1.0))
    >>> hook = adapters.bind(["support", None, "legal"])   # one adapter (or none) per row
    >>> x = np.ones((3, 8), np.float32)
    >>> y = np.zeros((3, 8), np.float32)
    >>> lorahook.apply_lora_rows(hook, 0, "q_proj", x, y)
    >>> y[:, 0].tolist()
    [8.0, 0.0, -16.0]
    """

    __slots__ = ("_model", "_lock", "_installed", "_capacity", "_resolver", "_lru",
                 "_pinned", "_loading", "_stats", "_base_weights", "_dtype")

    def __init__(self, model=None, *, capacity_bytes=None, resolver=None, base_weights=None,
                 dtype=None):
        look_ahead()  # the one-time BLAS look, at start-up (lorahook.threads)
        self._model = _check_model(model)
        self._capacity = checked_capacity(capacity_bytes)
        self._resolver = check_resolver(resolver)
        self._dtype = None if dtype is None else weight_dtype(dtype)
        if base_weights is not None:
            base_lookup(base_weights)
        self._base_weights = base_weights
        self._lock = threading.Lock()
        # name -> StoreEntry (lorahook.adapter); never mutated, only replaced as a whole.
        self._installed = _EMPTY
        # resident names, least recently used first (values unused)
        self._lru = OrderedDict()
        self._pinned = set()
        self._loading = {}  # name -> Load in progress (or done, until installed)
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
    def dtype(self):
        """The dtype adapters are held in (a numpy dtype), or ``None``: as given."""
        return self._dtype

    @property
    def nbytes(self):
        """Bytes of the resident adapters' arrays, each array counted once (an ``int``)."""
        return nbytes(self._installed.values())

    def _prepare(self, name, adapter):
        check_name(name)
        check_adapter(name, adapter)
        return self._checked(adapter)

    def _checked(self, adapter):
        """Validate an adapter about to be installed and give its DoRA layers their base."""
        if self._dtype is not None:
            adapter = adapter.astype(self._dtype)
        if self._model is not None:
            adapter.validate_against(self._model)
        base = self._base_weights
        if base is not None and adapter.needs_base:
            adapter = adapter.with_base(base)
        return store_entry(adapter)

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
            base_lookup(weights)  # refuse a wrong type before anything changes
        self._base_weights = weights
        if weights is None:
            return
        for name, entry in list(self._installed.items()):
            if entry.adapter.needs_base:
                based = store_entry(entry.adapter.with_base(weights))
                with self._lock:
                    if self._installed.get(name) is entry:
                        self._commit({name: based}, protect=(name,))

    # --- the resident set (callers hold the lock) -----------------------------

    def _commit(self, changes, protect=()):
        """Install / remove ``changes`` (name -> StoreEntry or None), evicting to fit.

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
            evicted = evict_to_fit(new, keep, self._pinned, self._lru, self._capacity)
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
                refuse_unknown(what, set(missing), snap)
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
        """``({name: Load}, names this thread loads)`` for the names not resident now."""
        jobs, mine = {}, set()
        with self._lock:
            for name in missing:
                if name in self._installed:
                    continue
                job = self._loading.get(name)
                if job is None:
                    job = self._loading[name] = Load()
                    mine.add(name)
                jobs[name] = job
        return jobs, mine

    def _run_load(self, name, job):
        """Resolve and validate ``name`` for ``job`` (this thread owns it); errors go in the job."""
        start = time.perf_counter()
        try:
            adapter = resolve(self._resolver, name)
            job.value = self._checked(adapter)
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
                    changes[name] = job.value
                elif job is not None:
                    extra[name] = job.value
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

        The adapter is validated against the model (if any) first; least
        recently used adapters are evicted to fit the capacity.  A name the
        resolver knows but that is not resident is installed as given.

        Parameters
        ----------
        name : str
            A non-empty name.
        adapter : LoraAdapter
            The adapter.
        pin : bool, default False
            Pin it: never evicted until :meth:`unpin`.

        Raises
        ------
        ValueError
            If ``name`` is resident (use :meth:`replace`).
        LoraValidationError
            If the adapter does not fit the model; nothing changed.
        LoraCapacityError
            If it cannot fit the capacity; nothing changed, nothing evicted.
        """
        check_name(name)
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
        check_lookup_name(name)
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
        check_lookup_name(name)
        with self._lock:
            if name not in self._installed:
                raise KeyError(f"no adapter named {name!r} is installed")
            self._commit({name: None})

    def pin(self, name):
        """Keep ``name`` resident: never evicted until :meth:`unpin` or :meth:`remove`.

        Loads it first when it is not resident and the resolver knows it.
        """
        check_lookup_name(name)
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
        check_lookup_name(name)
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
        check_lookup_name(name)
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
            out.update(resident=len(installed), nbytes=nbytes(installed.values()),
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

        Parameters
        ----------
        row_adapters : sequence of str or None
            Per row, the name of an installed adapter (or one the resolver
            loads) or ``None`` (no adapter).
        scales : None, float, sequence of float or mapping of str to float
            Multiplies the adapters' own scales: ``None``, ``1`` for every
            row; one finite real, the same factor for every row; one finite
            real per row; or ``name -> factor`` for that adapter's rows
            (names must be installed; adapters not named get ``1``).

        Returns
        -------
        BoundBatch
            A hook for :func:`~lorahook.apply_lora_rows` on exactly
            ``len(row_adapters)`` rows (another row count is a
            ``ValueError``), a snapshot of the adapters installed now.  Rows
            with ``None`` or an effective scale of zero are never written.

        Raises
        ------
        KeyError
            Naming the unknown adapter names.
        ValueError
            For a wrong number of scales or a non-finite scale (also when a
            factor times a layer's scale overflows float32).
        TypeError
            For entries that are neither ``str`` nor ``None``, and scales
            that are not real numbers.

        Notes
        -----
        Binding is cheap (rows are grouped by adapter once; each
        projection's plan is made on its first call), so a server may bind
        once per step of a packed, continuous batch.
        """
        names, parts = self._bind_parts(row_adapters, scales, "row_adapters", "row")
        return bound_batch(names, parts)

    def bind_sequences(self, seq_adapters, scales=None):
        """A hook for every call of a generation loop over ``len(seq_adapters)`` sequences.

        Parameters
        ----------
        seq_adapters : sequence of str or None
            Per sequence, an installed adapter name or ``None``.
        scales : None, float, sequence of float or mapping of str to float
            As in :meth:`bind`, per sequence.

        Returns
        -------
        BoundSequences
            The hook for the prefill and every decode step.

        Notes
        -----
        The hook
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
        return bound_sequences(names, parts)

    def _bind_parts(self, unit_names, scales, what, unit):
        """Check a bind's names and scales; group the units by adapter.

        Returns the names as a tuple and the core's parts: per adapter used
        with a non-zero scale, ``(name, adapter, {kernel scale: (scale,
        unit indices or None, unit scales or None)})``.
        """
        names = checked_names(unit_names, what)
        used = tuple(dict.fromkeys(n for n in names if n is not None))
        # the scales are checked before anything is loaded: a refused bind changes nothing
        factors = unit_factors(scales, names, set(used).union(self._installed), what, unit)
        # one snapshot holding every name (loaded on first use when a resolver knows it)
        installed = self._resident(used, what)
        return names, group_units(names, factors, installed, unit)
