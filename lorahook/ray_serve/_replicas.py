"""The Ray half of :mod:`lorahook.ray_serve`: adapter-affine routing and one copy per node.

It imports ray; :mod:`lorahook.ray_serve` imports it when one of its names is first read.
"""
try:
    import ray
    from ray import serve
except ImportError as exc:
    raise ImportError(
        "lorahook.ray_serve needs Ray Serve, which could not be imported "
        f"({exc}); install it with: pip install 'lorahook[ray]'"
    ) from exc

import asyncio
import collections
import functools
import os
import pickle
import threading
import warnings
import weakref

from .._values import describe, is_int
from ..adapter import LoraAdapter
from ..adapter_set import AdapterSet
from .._values import weight_dtype
from ..resolver import checked_capacity
from ..resolver import Load, check_name, check_resolver, identity as resolver_identity, resolve

__all__ = ["multiplexed", "shared_resolver", "SharedResolver", "AdapterLease"]

#: The Ray namespace of the actors :func:`shared_resolver` starts.
NAMESPACE = "lorahook"

# The resource only the head node of a Ray cluster has.
_HEAD = "node:__internal_head__"


def head_node_options():
    """Ray actor options that place an actor on the cluster's head node (none if it has no such node).

    What a cluster keeps in one actor survives the loss of any node but the
    head there; Ray's own cluster-wide actors (Serve's controller) live there too.
    """
    return {"resources": {_HEAD: 0.001}} if _HEAD in ray.cluster_resources() else {}


# --------------------------------------------------------------------------- multiplexed


class AdapterLease:
    """What Ray's per-replica LRU keeps for an adapter: its name, and nothing else.

    Ray's ``serve.multiplexed`` keeps the object its loader returns until it
    unloads the model by count.  The adapter itself lives in the replica's
    :class:`~lorahook.AdapterSet`, which bounds memory in bytes; Ray's list
    only decides which adapters this replica reports for routing.  So what
    Ray keeps is this plain object: no arrays, no ``__slots__`` and no
    ``__del__`` (Ray would call it on unload; unloading a lease frees
    nothing and must not).
    """

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"AdapterLease({self.name!r})"


def _check_max_models(value):
    if not is_int(value):
        raise TypeError(f"max_num_models_per_replica must be an int >= 1, found {describe(value)}")
    if value < 1:
        raise ValueError(
            f"max_num_models_per_replica must be an int >= 1 (Ray's -1, no limit, would report "
            f"every adapter this replica ever served for routing), found {value!r}")
    return int(value)


def multiplexed(adapters, max_num_models_per_replica):
    """An async loader for a replica's request handler: adapter-affine routing on Ray Serve.

    ``adapters`` is the replica's :class:`~lorahook.AdapterSet`, normally
    with a resolver (a directory, a callable, or :func:`shared_resolver`) and
    a ``capacity_bytes``.  Make the loader in the deployment's ``__init__``
    (it belongs to one replica and does not pickle) and call it per request::

        self.load = multiplexed(self.adapters, max_num_models_per_replica=8)
        ...
        name = await self.load(serve.get_multiplexed_model_id())

    ``await load(name)`` returns the adapter name, ready for :func:`batch`
    and :meth:`~lorahook.AdapterSet.bind`; ``load("")`` (Ray's "no model id")
    and ``load(None)`` return ``None``, the base model, without calling Ray.

    For a name, the loader first makes the adapter resident in ``adapters``,
    in a worker thread (reading files never blocks the replica's event loop),
    so an unknown or broken adapter raises there -- ``KeyError``,
    :class:`~lorahook.LoraFormatError`, :class:`~lorahook.LoraValidationError`,
    :class:`~lorahook.errors.LoraCapacityError` -- and Ray's list of this
    replica's models does not change.  Then it enters Ray's
    ``serve.multiplexed`` wrapper (``max_num_models_per_replica`` is its
    count), which records the name as loaded here, reports it to the routers
    and keeps an :class:`AdapterLease` for it.  Ray then routes the
    adapter's requests to the replicas that report it.

    Memory: the set's ``capacity_bytes`` is the one bound.  Ray unloading a
    lease by count only stops the replica reporting that name; the set
    evicts by bytes, and an evicted adapter is gone from the replica even if
    Ray still lists it (its next request loads it again).  Keep
    ``max_num_models_per_replica x bytes per adapter <= capacity_bytes``, or
    the set evicts adapters that Ray still routes here and reloads them (the
    set's ``stats()["loads"]`` shows it).

    The loader has two attributes for inspection: ``load.adapters`` (the
    set) and ``load.routed()`` (the names Ray's list holds now, sorted).

    Parameters
    ----------
    adapters : AdapterSet
        The replica's adapter set.
    max_num_models_per_replica : int
        Ray's ``serve.multiplexed`` count of models per replica, ``>= 1``.

    Returns
    -------
    coroutine function
        ``await load(name)``: the name, resident and reported to Ray's
        routers, or ``None`` for the base model.

    Raises
    ------
    TypeError, ValueError
        For an ``adapters`` that is not an :class:`~lorahook.AdapterSet` or
        a count that is not an int ``>= 1``.
    """
    if not isinstance(adapters, AdapterSet):
        raise TypeError(f"adapters must be a lorahook.AdapterSet, found {describe(adapters)}")
    max_models = _check_max_models(max_num_models_per_replica)
    leases = weakref.WeakValueDictionary()  # name -> the lease Ray's list holds

    # A new function for every loader: Ray keeps its per-replica LRU on the
    # function it decorates.  Its name must not be an attribute of str, or
    # Ray would take the model id for a ``self``.
    async def _lorahook_adapter_lease(name):
        lease = AdapterLease(name)
        leases[name] = lease
        return lease

    ray_load = serve.multiplexed(max_num_models_per_replica=max_models)(_lorahook_adapter_lease)

    async def load(model_id):
        if model_id is None or (isinstance(model_id, str) and not model_id):
            return None
        if not isinstance(model_id, str):
            raise TypeError(
                f"the multiplexed model id must be an adapter name (str), '' or None (the base "
                f"model), found {describe(model_id)}")
        if model_id not in adapters:
            # Raises for an unknown or broken adapter before Ray hears of it.
            await asyncio.to_thread(adapters.get, model_id)
        await ray_load(model_id)
        return model_id

    def routed():
        """The adapter names Ray's list of this replica's models holds now (sorted)."""
        return sorted(leases.keys())

    # Ray's marker that this replica multiplexes (Ray looks for it on the
    # deployment's attributes), without the wrapper's other attributes.
    functools.update_wrapper(load, ray_load, assigned=(), updated=("__dict__",))
    load.__dict__.pop("__wrapped__", None)
    load.__qualname__ = load.__name__ = "load"
    load.__doc__ = (f"Make an adapter resident in this replica's AdapterSet, then record it in "
                    f"Ray's multiplexed list (at most {max_models} names); returns the name, or "
                    f"None for the base model.")
    load.adapters = adapters
    load.max_num_models_per_replica = max_models
    load.routed = routed
    return load


# --------------------------------------------------------------------------- shared_resolver


def _portable_error(exc):
    """``exc`` if it pickles (it travels back to the caller), else a RuntimeError saying what it was."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")


class _ResolverActor:
    """The actor behind :func:`shared_resolver`: loads each name once, keeps it in the object store.

    Threaded (several ``resolve`` calls at once); a name's first callers
    share one load.  What it keeps is an object reference per name, so the
    adapter's one copy is the object store's; the actor's own copy is
    dropped right after ``ray.put``.
    """

    def __init__(self, resolver, dtype=None, capacity_bytes=None):
        self._resolver = resolver
        self._dtype = dtype  # a checked numpy dtype (ml_dtypes' bfloat16 unpickles with it)
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._held = collections.OrderedDict()  # name -> (ObjectRef, nbytes), least recent first
        self._evictions = 0
        self._loading = {}  # name -> Load
        self._loads = collections.Counter()
        self._failures = collections.Counter()

    def resolve(self, name):
        """``("ref", [ObjectRef])`` for ``name``, loading it first if needed; or ``("error", exc)``."""
        with self._lock:
            held = self._held.get(name)
            if held is not None:
                self._held.move_to_end(name)
                return ("ref", [held[0]])
            job = self._loading.get(name)
            mine = job is None
            if mine:
                job = self._loading[name] = Load()
        if mine:
            try:
                # the resolver rules of AdapterSet: safe names, directories, callables
                adapter = resolve(self._resolver, name)
                if self._dtype is not None:
                    adapter = adapter.astype(self._dtype)
                nbytes = adapter.nbytes
                job.value = ray.put(adapter)
                del adapter
                with self._lock:
                    self._hold(name, job.value, nbytes)
                    self._loads[name] += 1
            except Exception as exc:
                job.error = _portable_error(exc)
                with self._lock:
                    self._failures[name] += 1
            finally:
                with self._lock:
                    del self._loading[name]
                job.done.set()
        else:
            job.done.wait()
        if job.error is not None:
            return ("error", job.error)
        return ("ref", [job.value])

    def _hold(self, name, ref, nbytes):
        """Keep ``name``'s reference, then drop the least recently resolved past the capacity.

        One adapter larger than the capacity is handed out but not kept.
        Dropping a reference frees nothing a process still maps.
        """
        self._held[name] = (ref, nbytes)
        if self._capacity is None:
            return
        total = sum(n for _, n in self._held.values())
        while total > self._capacity and self._held:
            _, (_, freed) = self._held.popitem(last=False)
            total -= freed
            self._evictions += 1

    def resolver_identity(self):
        return tuple(resolver_identity(self._resolver)) + (_dtype_name(self._dtype),)

    def drop(self, name):
        with self._lock:
            if self._held.pop(name, None) is None:
                return False
        return True

    def stats(self):
        with self._lock:
            return {
                "loads_by_name": dict(self._loads),
                "failures_by_name": dict(self._failures),
                "resident": len(self._held),
                "names": sorted(self._held),
                "nbytes": int(sum(n for _, n in self._held.values())),
                "capacity_bytes": self._capacity,
                "evictions": self._evictions,
                "dtype": _dtype_name(self._dtype),
                "loading": len(self._loading),
                "pid": os.getpid(),
            }


def _dtype_name(dtype):
    return None if dtype is None else dtype.name


_RemoteResolverActor = ray.remote(_ResolverActor)

# Handles already found in this process, by (Ray job, actor name): one lookup
# per process and connection (a handle from an earlier ray.init is worthless).
_HANDLES = {}
_HANDLES_LOCK = threading.Lock()


class SharedResolver:
    """A resolver whose loads happen once per Ray cluster: see :func:`shared_resolver`.

    Call it as an :class:`~lorahook.AdapterSet` does, ``resolver(name) ->
    LoraAdapter``.  It pickles as its settings (the resolver and the actor's
    name), so it can be passed to a deployment's ``bind``.
    """

    #: Threads of the actor: concurrent loads of different names, and lookups of loaded ones.
    max_concurrency = 16

    def __init__(self, resolver, name="lorahook-adapters", dtype=None, capacity_bytes=None):
        self._resolver = check_resolver(resolver, optional=False)
        self._name = check_name(name, "name (the actor's name)")
        self._dtype = None if dtype is None else weight_dtype(dtype)
        self._capacity = checked_capacity(capacity_bytes)
        self._checked = False  # whether the running actor's resolver was compared with ours

    def __reduce__(self):
        return (SharedResolver, (self._resolver, self._name, self._dtype, self._capacity))

    @property
    def name(self):
        """The actor's name (in Ray namespace ``lorahook``)."""
        return self._name

    @property
    def resolver(self):
        """The resolver this object would start the actor with (a running actor keeps its own)."""
        return self._resolver

    @property
    def dtype(self):
        """The dtype adapters are held in (a numpy dtype), or ``None``: as read (float32)."""
        return self._dtype

    @property
    def capacity_bytes(self):
        """The most bytes the actor keeps, or ``None`` (every adapter it loaded)."""
        return self._capacity

    def __repr__(self):
        return (f"SharedResolver({self._resolver!r}, name={self._name!r}, dtype={self._dtype!r}, "
                f"capacity_bytes={self._capacity!r})")

    # --- the actor -----------------------------------------------------------

    def _key(self):
        if not ray.is_initialized():
            raise RuntimeError(
                f"shared_resolver {self._name!r} needs a running Ray: call ray.init() first, or "
                f"use it inside a Ray task, actor or Serve replica")
        return (ray.get_runtime_context().get_job_id(), self._name)

    def _actor(self):
        key = self._key()
        with _HANDLES_LOCK:
            handle = _HANDLES.get(key)
        if handle is not None:
            return handle
        # Joins the actor if it runs (and then uses its resolver), else starts it.
        handle = _RemoteResolverActor.options(
            name=self._name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            max_concurrency=self.max_concurrency, num_cpus=0, **head_node_options(),
        ).remote(self._resolver, self._dtype, self._capacity)
        with _HANDLES_LOCK:
            return _HANDLES.setdefault(key, handle)

    def _check_actor_resolver(self, handle):
        """Warn, once per object and process, when the running actor loads with another resolver."""
        if self._checked:
            return
        running = tuple(ray.get(handle.resolver_identity.remote()))
        self._checked = True
        mine = tuple(resolver_identity(self._resolver)) + (_dtype_name(self._dtype),)
        if running != mine:
            warnings.warn(
                f"shared_resolver {self._name!r} uses a running actor that loads with another "
                f"resolver or dtype ({running[0]} {running[1:]!r}, not {mine[0]} {mine[1:]!r}): names "
                f"resolve as the running actor does. close() it first, or give this resolver "
                f"another name, to load with it", RuntimeWarning, stacklevel=4)

    def _forget(self, handle):
        key = self._key()
        with _HANDLES_LOCK:
            if _HANDLES.get(key) is handle:
                del _HANDLES[key]

    def _call(self, method, *args):
        # A handle to an actor that has died fails once; the next try starts it again.
        for attempt in (0, 1):
            handle = self._actor()
            try:
                self._check_actor_resolver(handle)
                return ray.get(getattr(handle, method).remote(*args))
            except ray.exceptions.RayActorError:
                self._forget(handle)
                if attempt:
                    raise

    # --- the resolver --------------------------------------------------------

    def __call__(self, name):
        """The adapter under ``name``, loaded once for the cluster and mapped from the object store.

        Its arrays are read-only views of the object store's copy (no copy in
        this process).  Raises what the load raised: ``KeyError`` for an
        unknown name, :class:`~lorahook.LoraFormatError` for a broken one.
        """
        kind, value = self._call("resolve", check_name(name))
        if kind == "error":
            raise value
        adapter = ray.get(value[0])
        if not isinstance(adapter, LoraAdapter):  # pragma: no cover - the actor only puts adapters
            raise TypeError(f"shared_resolver {self._name!r} returned {describe(adapter)} for "
                            f"{name!r}; expected a LoraAdapter")
        return adapter

    def drop(self, name):
        """Release ``name`` from the actor (``KeyError`` if it holds none by that name).

        Processes that hold the adapter keep theirs (the object store keeps
        the copy while anyone maps it); the next first use loads it again --
        how a changed adapter directory is picked up.
        """
        if not self._call("drop", check_name(name)):
            raise KeyError(f"shared_resolver {self._name!r} holds no adapter named {name!r}")

    def stats(self):
        """The actor's counters: ``loads_by_name`` (name -> loads), ``resident``, ``nbytes``, ...

        Also ``failures_by_name``, ``names`` (held, sorted), ``loading``
        (loads in progress) and ``pid`` (the actor's process).
        """
        return self._call("stats")

    def close(self):
        """End the actor; what it held leaves the object store once no process maps it.

        A later call with this name starts a new actor.
        """
        key = self._key()
        with _HANDLES_LOCK:
            handle = _HANDLES.pop(key, None)
        if handle is None:
            try:
                handle = ray.get_actor(self._name, namespace=NAMESPACE)
            except ValueError:  # no such actor: nothing to end
                return
        ray.kill(handle, no_restart=True)


def shared_resolver(resolver, *, name="lorahook-adapters", dtype=None, capacity_bytes=None):
    """A resolver whose loads happen once per Ray cluster, shared through the object store.

    ``resolver`` is what :class:`~lorahook.AdapterSet` takes: a directory of
    PEFT adapters (name -> ``<dir>/<name>``) or a callable ``name ->
    LoraAdapter | path | None``.  The loads run in one detached, threaded
    actor named ``name`` in Ray namespace ``lorahook``, which loads each name
    at most once, concurrent first requests included, and keeps it in Ray's
    object store.  The actor runs on the cluster's head node, so it and the
    adapters it owns survive the loss of any other node.  Every process that resolves a name gets the adapter from
    there: on one node, all replicas map the same read-only copy (Ray moves
    it once to each other node, and spills it to disk under pressure).  The
    directory is read on the head node.

    Pass the result to each replica (``Deployment.bind(shared)``) and use it
    as the replica's set's resolver: ``AdapterSet(capacity_bytes=...,
    resolver=shared)``.  The first call starts the actor (again if it has
    died); later calls, from any process, join it and use its resolver.
    ``drop(name)`` releases one adapter from the actor (processes that hold
    it keep theirs), ``close()`` ends the actor, ``stats()`` returns at least
    ``loads_by_name`` (name -> count), ``resident``, ``nbytes``,
    ``capacity_bytes`` and ``evictions``.  A resolver that joins a running
    actor loading with another resolver (another directory, another callable)
    or in another dtype warns once, with a ``RuntimeWarning``: names resolve
    as the running actor does.

    Parameters
    ----------
    resolver : str, os.PathLike or callable
        A directory of PEFT adapters or a callable ``name -> LoraAdapter |
        path | None``, as :class:`~lorahook.AdapterSet` takes.
    name : str, default "lorahook-adapters"
        The actor's name in Ray namespace ``lorahook``.
    dtype : {None, "float32", "float16", "bfloat16", "int8"}, optional
        The dtype the actor holds adapters in (each one it loads is converted,
        :meth:`~lorahook.LoraAdapter.astype`): what the object store holds and
        the replicas map.  ``None``: as read (float32).  Give the
        replicas' sets the same ``dtype``, or each converts its own copy.
    capacity_bytes : int, optional
        The most bytes of adapters the actor keeps (``None``: every adapter
        it ever loaded).  Past it, the least recently resolved are dropped
        from the actor as :meth:`SharedResolver.drop` does: processes that
        hold one keep it, and its next first use loads it again.

    Returns
    -------
    SharedResolver
        A picklable resolver for the replicas' adapter sets.
    """
    return SharedResolver(resolver, name, dtype, capacity_bytes)


# Pickles, reprs and the documentation name these where users import them.
for _cls in (AdapterLease, SharedResolver):
    _cls.__module__ = "lorahook.ray_serve"
multiplexed.__module__ = shared_resolver.__module__ = "lorahook.ray_serve"
del _cls
