"""lorahook on Ray Serve: mixed-adapter batches, adapter-affine routing, one copy per node.

Needs Ray Serve (``pip install 'lorahook[ray]'``) for :func:`multiplexed`,
:func:`shared_resolver` and what they return: ray is imported when one of them
is first read (an ``ImportError`` that says what to install when it is
missing).  ``import lorahook`` never imports ray, nor does :func:`batch`,
which is plain asyncio.

- :func:`batch` gathers the pending requests of any adapters into one batch
  (Ray's own ``serve.batch`` splits a batch by multiplexed model id: one
  forward per adapter).  It is plain asyncio and works outside Ray too.
- :func:`multiplexed` routes an adapter's requests to the replicas that hold
  it, through Ray's ``serve.multiplexed``, while the replica's
  :class:`~lorahook.AdapterSet` bounds its memory in bytes.
- :func:`shared_resolver` loads each adapter once for the whole cluster, in
  one actor, and hands it to every replica through Ray's object store: the
  replicas of one node map one read-only copy.

A replica, in short::

    @serve.deployment(max_ongoing_requests=32)
    class Server:
        def __init__(self, resolver):
            self.adapters = lorahook.AdapterSet(capacity_bytes=64 << 20, resolver=resolver)
            self.load = lorahook.ray_serve.multiplexed(self.adapters, 8)

        async def __call__(self, item):
            name = await self.load(serve.get_multiplexed_model_id())  # None: the base model
            return await self.forward(name, item)

        @lorahook.ray_serve.batch(max_batch_size=16)
        async def forward(self, names, items):
            hook = self.adapters.bind(names)   # one batch, several adapters
            ...

    app = Server.bind(lorahook.ray_serve.shared_resolver("/models/adapters"))
"""
from ._batching import DONE, Joined, batch

__all__ = ["batch", "DONE", "Joined", "multiplexed", "shared_resolver", "SharedResolver", "AdapterLease"]

# the names of the Ray half (lorahook.ray_serve._replicas), imported when first read
_RAY_NAMES = frozenset(["multiplexed", "shared_resolver", "SharedResolver", "AdapterLease",
                        "NAMESPACE", "head_node_options"])


def __getattr__(name):
    if name not in _RAY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _replicas
    value = getattr(_replicas, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | _RAY_NAMES)
