"""lorahook on Ray Serve: batches that mix adapters across one replica's requests.

Needs Ray Serve (``pip install 'lorahook[ray]'``); this is the one lorahook
module that imports ray, and ``import lorahook`` never imports it.

- :func:`batch` gathers the pending requests of any adapters into one batch
  (Ray's own ``serve.batch`` splits a batch by multiplexed model id: one
  forward per adapter).  It is plain asyncio and works outside Ray too.
"""
try:
    import ray.serve  # noqa: F401  (the extra's dependency, checked at import)
except ImportError as exc:
    raise ImportError(
        "lorahook.ray_serve needs Ray Serve, which could not be imported "
        f"({exc}); install it with: pip install 'lorahook[ray]'"
    ) from exc

from ._batching import batch

__all__ = ["batch"]

# Still to come here (SPEC section 12): ``multiplexed`` (adapter-affine routing
# through Ray's serve.multiplexed, bounded by an AdapterSet's byte capacity)
# and ``shared_resolver`` (one load of each adapter per cluster, shared through
# the object store).  They are not defined yet.
