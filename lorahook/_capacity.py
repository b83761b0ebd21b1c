"""What an adapter store evicts to stay within its byte capacity.

Pure functions over store entries (anything with ``arrays``, ``id -> nbytes``
of every array an adapter keeps): an array shared by several adapters counts
once, and evicting an adapter frees only the arrays no other resident adapter
keeps.
"""
from collections import Counter

from ._values import describe, is_int
from .errors import LoraCapacityError

__all__ = ["checked_capacity", "nbytes", "evict_to_fit"]


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
