"""Names to adapters: safe names, the resolver a store is given, and loading by name.

A *resolver* tells an :class:`~lorahook.AdapterSet` (or a
:func:`lorahook.ray_serve.shared_resolver`) how to find an adapter that is
not resident:

- ``None``: only adapters added by hand exist;
- a directory (``str`` or ``os.PathLike``): the name ``n`` is the PEFT
  directory ``<dir>/n``.  A name that is not one safe path component (a
  separator, ``.``, ``..``, a NUL, an absolute path) is a ``KeyError`` before
  any file is touched; a missing ``<dir>/n`` is a ``KeyError``; one that is
  not a PEFT directory a :class:`~lorahook.LoraFormatError`;
- a callable ``name -> LoraAdapter | path | None``: ``None`` means unknown
  (``KeyError``), a path is read as a PEFT directory, anything else is a
  ``TypeError``.

:func:`resolve` applies these rules and nothing else; validating against a
model and installing are the store's.  :class:`Load` is one resolver call for
one name, shared by every thread that asks for the name while it runs.
"""
import os
import threading
from collections import Counter

from ._core.sources import DISPATCH_KERNELS
from .adapter import LoraAdapter, kernel_dispatch
from ._values import describe, is_int
from .errors import LoraCapacityError, LoraFormatError

__all__ = ["check_name", "check_lookup_name", "check_adapter", "check_resolver", "resolve",
           "identity", "Load", "checked_capacity", "nbytes", "evict_to_fit"]


def check_name(name, what="adapter name"):
    """``name`` if it is a non-empty ``str`` (``TypeError`` / ``ValueError`` naming ``what``)."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__} ({name!r})")
    if not name:
        raise ValueError(f"{what} must be a non-empty str, got ''")
    return name


def check_lookup_name(name):
    """A name to look up: a ``str`` (``TypeError`` otherwise); ``""`` is simply unknown."""
    if not isinstance(name, str):
        raise TypeError(f"adapter name must be a str, got {type(name).__name__} ({name!r})")
    if not name:
        raise KeyError("no adapter named '': adapter names are non-empty")
    return name


def check_adapter(name, adapter):
    """``adapter`` if a store can batch it: a :class:`~lorahook.LoraAdapter` the core applies."""
    if not isinstance(adapter, LoraAdapter):
        raise TypeError(
            f"adapter {name!r} must be a lorahook.LoraAdapter, got {type(adapter).__name__}")
    if kernel_dispatch(adapter) != DISPATCH_KERNELS:
        raise TypeError(
            f"adapter {name!r} is a {type(adapter).__name__} with its own is_active or apply; an "
            f"AdapterSet batches adapters in the compiled core, which would not call them "
            f"(serve it alone with apply_lora_rows)")
    return adapter


def check_resolver(resolver, *, optional=True):
    """A resolver as :func:`resolve` takes it: a directory path (``str``) or a callable.

    ``None`` passes when ``optional`` (a store without a resolver), else it is
    a ``TypeError`` like any other wrong type.
    """
    if callable(resolver) or (resolver is None and optional):
        return resolver
    if isinstance(resolver, (str, os.PathLike)):
        path = os.fspath(resolver)
        if isinstance(path, bytes) or not path:
            raise TypeError(f"a resolver directory must be a non-empty str path, got {resolver!r}")
        return path
    raise TypeError(f"resolver must be {'None, ' if optional else ''}a directory of PEFT adapters "
                    f"(str or os.PathLike) or a callable name -> LoraAdapter | path | None, got "
                    f"{type(resolver).__name__}")


def safe_component(name):
    """Whether ``name`` is one path component that stays inside its directory."""
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    return (bool(name) and name not in (".", "..") and "\0" not in name
            and not any(sep in name for sep in seps) and not os.path.isabs(name)
            and os.path.basename(name) == name)


def load_directory(name, path):
    """A resolved name's PEFT directory, read with ``LoraAdapter.from_peft``."""
    if not os.path.isdir(path):
        raise LoraFormatError(f"adapter {name!r}: {os.fspath(path)} is not a PEFT adapter "
                              f"directory (expected a directory with adapter_config.json)")
    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        raise LoraFormatError(f"adapter {name!r}: {os.fspath(path)} is not a PEFT adapter "
                              f"directory: it has no adapter_config.json")
    return LoraAdapter.from_peft(path)


def resolve(resolver, name):
    """The adapter ``resolver`` gives for ``name``, by the rules above and nothing else.

    ``resolver`` is a checked directory path or callable (:func:`check_resolver`).
    ``KeyError`` for an unknown or unsafe name, ``LoraFormatError`` for a path that
    is not a PEFT directory, ``TypeError`` for a callable's wrong answer.
    """
    if callable(resolver):
        found = resolver(name)
        if found is None:
            raise KeyError(f"no adapter named {name!r}: the resolver does not know it")
        if isinstance(found, LoraAdapter):
            return check_adapter(name, found)
        if isinstance(found, (str, os.PathLike)):
            return load_directory(name, found)
        raise TypeError(f"the resolver returned {type(found).__name__} for {name!r}; "
                        f"expected a LoraAdapter, a path or None")
    if not safe_component(name):
        raise KeyError(f"no adapter named {name!r}: a resolver directory takes names that "
                       f"are one safe path component (no separators, not '.' or '..')")
    path = os.path.join(resolver, name)
    if not os.path.lexists(path):
        raise KeyError(f"no adapter named {name!r}: {path} does not exist")
    return load_directory(name, path)


def identity(resolver):
    """What tells two resolvers apart across processes: a directory's path, a callable's name."""
    if isinstance(resolver, str):
        return ("directory", os.path.normpath(resolver))
    target = resolver if hasattr(resolver, "__qualname__") else type(resolver)
    return ("callable", getattr(target, "__module__", None), getattr(target, "__qualname__", None))


class Load:
    """One resolver call for one name: its owner sets ``value`` or ``error``, waiters wait.

    ``abandoned`` when the owner was interrupted by a ``BaseException`` that is
    not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``): that stays
    in the owner's thread, and the waiters load the name again themselves.
    ``installed``: the value was installed once (one resolver call, one load).
    """

    __slots__ = ("done", "value", "error", "abandoned", "installed")

    def __init__(self):
        self.done = threading.Event()
        self.value = None       # what the load made (the store's entry, an object reference)
        self.error = None       # an Exception: every thread waiting on the load gets it
        self.abandoned = False
        self.installed = False


# ----------------------------------------------------------------------------
# capacity: what an adapter store evicts to stay within its bytes
# ----------------------------------------------------------------------------
def checked_capacity(capacity_bytes, what="capacity_bytes"):
    """``capacity_bytes`` as an ``int >= 0``, or ``None`` (no bound); ``TypeError`` / ``ValueError``."""
    if capacity_bytes is None:
        return None
    if not is_int(capacity_bytes):
        raise TypeError(f"{what} must be an int >= 0 or None, got {describe(capacity_bytes)}")
    if capacity_bytes < 0:
        raise ValueError(f"{what} must be >= 0 or None, got {capacity_bytes}")
    return int(capacity_bytes)


def nbytes(entries):
    """Bytes of the entries' arrays, an array shared between adapters counted once."""
    seen = {}
    for entry in entries:
        seen.update(entry.arrays)
    return int(sum(seen.values()))


def evict_to_fit(new, keep, pinned, lru, capacity):
    """Remove least recently used names from ``new`` until its arrays fit; return them, in order.

    ``new`` maps names to entries; ``keep`` (the adapters being installed or
    bound) and ``pinned`` names are never evicted; ``lru`` holds names, least
    recently used first.  ``LoraCapacityError`` (``new`` unchanged) when the
    kept adapters with the pinned ones cannot fit in ``capacity`` bytes.
    """
    need = nbytes(new[n] for n in keep if n in new)
    kept_pinned = sorted(n for n in pinned if n in new and n not in keep)
    # together: arrays the kept adapters share with pinned ones count once
    total = nbytes(new[n] for n in keep.union(kept_pinned) if n in new)
    if total > capacity:
        error = LoraCapacityError(
            f"adapters {sorted(keep)} need {need} bytes; with the pinned {kept_pinned} "
            f"they need {total} bytes and cannot fit in "
            f"capacity_bytes={capacity}; nothing was evicted")
        error.nbytes = need  # what the adapters need alone: more than the capacity
        raise error          # means they can never fit
    # bytes per array and how many resident adapters share it
    users = Counter(i for entry in new.values() for i in entry.arrays)
    sizes = {i: b for entry in new.values() for i, b in entry.arrays.items()}
    total = sum(sizes.values())
    evicted = []
    for name in list(lru):
        if total <= capacity:
            break
        if name in keep or name in pinned or name not in new:
            continue
        for i in new.pop(name).arrays:
            users[i] -= 1
            if not users[i]:
                total -= sizes[i]
        evicted.append(name)
    return evicted
