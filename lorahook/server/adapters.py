"""A replica's adapters: which key a request's model names, runtime adapters, and leases.

A runtime adapter is installed as ``name/vN``, one key per version; no
request may name a key with a ``/``: a request keeps the version it was
given for all its steps, even when a reload or an unload comes while it
decodes, and nothing else reaches an old version.  Runtime adapters live in
the application's :mod:`~lorahook.server.state` actor; each replica follows
it before it resolves a name.

A *lease* holds a request's adapter resident and pinned until the request
ends, so that no other request's load can evict it from under a running row.
An adapter that cannot be resident beside the leased ones waits for a lease
to end; one larger than the capacity is a 503 at once.
"""
import asyncio
import collections
import os

from ..adapter import LoraAdapter
from ..adapter_set import AdapterSet
from ..errors import LoraCapacityError, LoraFormatError, LoraValidationError
from ..ray_serve import multiplexed, shared_resolver
from .deadline import until
from .openai import RequestError

__all__ = ["ReplicaAdapters", "read_runtime_adapter", "not_found"]


def not_found(model):
    return RequestError(404, f"The model '{model[:256]}' does not exist", "model",
                        code="model_not_found")


def read_runtime_adapter(path):
    """A runtime adapter's directory read; what is wrong is named, the files are never quoted."""
    if not os.path.isdir(path):
        raise RequestError(400, "'lora_path' is not a directory", "lora_path")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise RequestError(400, "'lora_path' is not a PEFT adapter directory (it has no "
                                "adapter_config.json)", "lora_path")
    try:
        return LoraAdapter.from_peft(path)
    except LoraValidationError:
        raise RequestError(400, "'lora_path' does not fit this model", "lora_path") from None
    except LoraFormatError:
        raise RequestError(400, "'lora_path' is not a LoRA adapter lorahook can serve: its files "
                                "are malformed, or it uses a method lorahook does not "
                                "support", "lora_path") from None
    except (OSError, ValueError, UnicodeError, MemoryError):
        raise RequestError(400, "'lora_path' could not be read as a PEFT adapter",
                           "lora_path") from None


class ReplicaAdapters:
    """The adapters of one replica: an :class:`~lorahook.AdapterSet` and what leads to it.

    ``geometry`` is the model's; ``state`` the application's state actor
    (needed with runtime adapters).  Adapters of the adapters directory are
    loaded once per cluster through :func:`~lorahook.ray_serve.shared_resolver`.
    """

    def __init__(self, settings, geometry, state):
        self.settings = settings
        self.state = state
        if settings.adapter_dtype == "bfloat16":
            import ml_dtypes  # noqa: F401  (lorahook names bfloat16 through it)
        self.shared = (shared_resolver(settings.adapters_dir, name=settings.resolver_name,
                                       dtype=settings.adapter_dtype,
                                       capacity_bytes=settings.resolver_capacity_bytes)
                       if settings.adapters_dir else None)
        self.runtime = {}    # name -> (path or None, version) of adapters loaded at run time
        self.paths = {}      # "name/vN" -> path of the runtime versions in use here
        self.set = AdapterSet(geometry, capacity_bytes=settings.capacity_bytes,
                              resolver=self._resolve, dtype=settings.adapter_dtype)
        self.load = multiplexed(self.set, settings.max_models_per_replica)
        self.leases = collections.Counter()  # adapter key -> requests holding it resident
        self.room = asyncio.Event()          # set (and replaced) when a lease ends

    def _resolve(self, key):
        """The AdapterSet's resolver (runs in worker threads)."""
        path = self.paths.get(key)
        if path is not None:
            return LoraAdapter.from_peft(path)
        return self.shared(key) if self.shared is not None and "/" not in key else None

    # --- runtime adapters ----------------------------------------------

    async def sync(self):
        """Follow the application's runtime adapters (nothing to do without them)."""
        if self.settings.runtime_root is None:
            return
        entries = await self.state.entries.remote()
        if entries == self.runtime:
            return
        self.runtime = entries
        for key in set(self.paths) - self._current_keys():
            if not self.leases[key]:  # a leased one goes when its last request ends
                self._forget(key)

    def _current_keys(self):
        return {f"{name}/v{version}" for name, (path, version) in self.runtime.items()
                if path is not None}

    def _forget(self, key):
        self.paths.pop(key, None)
        try:
            self.set.remove(key)
        except KeyError:
            pass  # not resident here

    async def put(self, name, path):
        await self.state.put.remote(name, path)

    async def remove(self, name):
        """Whether a runtime adapter named ``name`` was served (and is now unloaded)."""
        return await self.state.remove.remote(name)

    def listed(self):
        """The adapters' names, as ``/v1/models`` lists them (reads the adapters directory)."""
        names = {n for n, (path, _) in self.runtime.items() if path is not None}
        adapters_dir = self.settings.adapters_dir
        if adapters_dir and os.path.isdir(adapters_dir):
            names.update(n for n in os.listdir(adapters_dir)
                         if n not in self.runtime
                         and os.path.isfile(os.path.join(adapters_dir, n, "adapter_config.json")))
        return sorted(names)

    def served(self, name):
        """Whether ``name`` is served now (a runtime adapter, or one of the adapters directory)."""
        entry = self.runtime.get(name)
        if entry is not None:
            return entry[0] is not None
        adapters_dir = self.settings.adapters_dir
        return bool(adapters_dir) and os.path.isfile(
            os.path.join(adapters_dir, name, "adapter_config.json"))

    # --- leases --------------------------------------------------------

    async def _key(self, model):
        """The adapter key for a request's ``model``; 404 for a name nothing serves."""
        await self.sync()
        entry = self.runtime.get(model)
        if entry is not None and entry[0] is not None:
            key = f"{model}/v{entry[1]}"
            self.paths[key] = entry[0]
            return key
        if entry is not None or self.shared is None or "/" in model or "\\" in model:
            raise not_found(model)
        return model

    async def acquire(self, model, deadline):
        """Make ``model``'s adapter resident and pinned for a request; its key (``None``: base).

        The caller gives the key back with :meth:`release` when the request ends.
        """
        if model == self.settings.base_id:
            return None
        key = await self._key(model)
        self.leases[key] += 1
        try:
            while True:
                try:
                    # pinned as it is loaded (no other load can evict it in between),
                    # then recorded in Ray's list of this replica's adapters
                    await asyncio.to_thread(self.set.pin, key)
                    await self.load(key)
                    return key
                except LoraCapacityError as exc:
                    alone = exc.nbytes
                    if (alone is not None and alone > self.settings.capacity_bytes) or not any(
                            n for k, n in self.leases.items() if k != key):
                        raise RequestError(503, f"adapter '{model}' cannot be made resident: "
                                                f"{exc}", "model") from None
                    room = self.room  # wait for a running request's adapter to leave
                    await until(room.wait(), deadline)
        except BaseException as exc:
            self.release(key)
            if isinstance(exc, KeyError):
                raise not_found(model) from None
            if isinstance(exc, LoraValidationError):
                raise RequestError(400, f"adapter '{model}' does not fit this model",
                                   "model") from None
            if isinstance(exc, ValueError):  # LoraFormatError
                raise RequestError(400, f"adapter '{model}' cannot be served: "
                                        f"{type(exc).__name__}", "model") from None
            raise

    def release(self, key):
        self.leases[key] -= 1
        if self.leases[key] > 0:
            return
        del self.leases[key]
        try:
            self.set.unpin(key)
        except KeyError:
            pass
        if "/" in key and key not in self._current_keys():
            self._forget(key)  # replaced or unloaded while it ran
        self.room.set()
        self.room = asyncio.Event()
