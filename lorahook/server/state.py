"""What one ``lorahook serve`` application keeps cluster-wide: its runtime adapters and its drain.

One detached actor per application (named after it, in Ray namespace
``lorahook``), started by the first replica that needs it and joined by the
others, by a redeployment of the application, and by the ``lorahook serve``
process that drains and stops it.  It runs on the cluster's head node, so
that it survives the loss of any other node (a replica on a lost node is
replaced; the adapters loaded at run time and the drain are not lost with it).
"""
import asyncio
import time

import ray

from ..ray_serve import NAMESPACE, head_node_options

__all__ = ["ServerState", "state_of", "state_name"]


def state_name(app_name):
    return f"lorahook-serve-state-{app_name}"


class ServerState:
    """Runtime adapters (name -> (path, version)) and the drain, shared by every replica.

    An unloaded name keeps its entry with path ``None``: it is a 404 from then
    on, even where an adapters-directory adapter has that name.  The drain:
    :meth:`drain` starts it (once); every replica waits for it in
    :meth:`draining` and then reports its requests in flight with
    :meth:`report` until it has none; :meth:`busy` is what the stopping process
    waits on.  A replica silent for :attr:`SILENT_S` seconds of the drain (its
    node was lost) is not waited for.
    """

    #: Seconds after which a replica that has not reported during the drain is taken for gone
    #: (a live one reports every tenth of a second while it has requests in flight).
    SILENT_S = 2.0

    def __init__(self):
        self._entries = {}
        self._version = 0
        self._drain_at = None       # time.monotonic() at which the drain started
        self._drain_end = None      # and at which it ends
        self._drain_started = asyncio.Event()
        self._replicas = {}         # replica id -> requests in flight (None: not reported yet)
        self._heard = {}            # replica id -> time.monotonic() of its last report

    # --- runtime adapters ------------------------------------------------

    async def put(self, name, path):
        self._version += 1
        self._entries[name] = (path, self._version)

    async def remove(self, name):
        entry = self._entries.get(name)
        if entry is None or entry[0] is None:
            return False
        self._version += 1
        self._entries[name] = (None, self._version)
        return True

    async def entries(self):
        return dict(self._entries)

    # --- the drain -------------------------------------------------------

    async def join(self, replica):
        """A replica is running (it will report when the drain starts)."""
        self._replicas.setdefault(replica, None)

    async def leave(self, replica):
        """A replica has stopped (or been replaced)."""
        self._replicas.pop(replica, None)
        self._heard.pop(replica, None)

    async def drain(self, seconds):
        """Start the drain: replicas refuse new requests, and end the rest after ``seconds``."""
        if self._drain_end is None:
            self._drain_at = time.monotonic()
            self._drain_end = self._drain_at + seconds
            self._drain_started.set()

    async def draining(self):
        """Returns the seconds left of the drain once it has started (a replica's long poll)."""
        await self._drain_started.wait()
        return max(0.0, self._drain_end - time.monotonic())

    async def report(self, replica, in_flight):
        self._replicas[replica] = in_flight
        self._heard[replica] = time.monotonic()

    async def busy(self):
        """Replicas of the drain that still have requests in flight, or have not said yet."""
        if self._drain_end is None:
            return sorted(self._replicas)
        now = time.monotonic()
        early = now - self._drain_at < self.SILENT_S
        return sorted(r for r, n in self._replicas.items() if (n is None or n > 0) and (
            early or now - self._heard.get(r, -float("inf")) < self.SILENT_S))


_RemoteState = ray.remote(ServerState)


def state_of(app_name):
    """The application's state actor: joined if it runs, else started on the head node."""
    return _RemoteState.options(
        name=state_name(app_name), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True, num_cpus=0, max_concurrency=1000, **head_node_options(),
    ).remote()
