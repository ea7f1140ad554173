"""Ray-actor backend of ``cachemap.bus.EventBus``: the embedded default under ``kvroute serve``.

One named actor (``BusHub``) holds the bounded log: an ``InProcessBus`` wrapped in a few lines.
Engine replicas publish to it and router replicas read from it, from any process in the Ray
cluster. ``RayEventBus`` is the client: it pickles as the hub's name, so it can be passed to
deployments as an argument.

Publishing is fire-and-forget by default (one actor call, no round trip): ``publish`` returns -1
because the hub assigns the offset later (a ``sync=True`` client waits and returns it). Ray runs
one caller's calls to one actor in submission order, so a publisher's messages keep their order.
``flush`` waits until everything published so far is in the log.

The hub also carries resync requests: a router that saw a gap calls ``request_resync(instance)``
and that instance's forwarder, polling ``take_resync``, publishes a ``Snapshot``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from cachemap.bus import BusRead, EventBus, InProcessBus

DEFAULT_NAMESPACE = "kvroute"


# NOTE: every publish and every poll is an actor call; with task events on, each would also be
# recorded in the GCS (memory and CPU for a task table nobody reads): they are off.
_quiet = ray.method(enable_task_events=False)


class BusHub:
    """The actor's state: a bounded log plus pending resync requests."""

    def __init__(self, maxlen: int) -> None:
        self._bus = InProcessBus(maxlen)
        self._resync: set[str] = set()

    @_quiet
    def publish_many(self, payloads: list[bytes]) -> int:
        return self._bus.publish_many(payloads)

    @_quiet
    def read(self, cursor: int, max_items: int) -> tuple[list[bytes], int, int]:
        return tuple(self._bus.read(cursor, max_items))  # type: ignore[return-value]

    @_quiet
    def end(self) -> int:
        return self._bus.end()

    @_quiet
    def request_resync(self, instance: str) -> None:
        self._resync.add(instance)

    @_quiet
    def take_resync(self, instance: str) -> bool:
        if instance in self._resync:
            self._resync.discard(instance)
            return True
        return False


_RemoteHub = ray.remote(num_cpus=0, max_restarts=0)(BusHub)


class RayEventBus(EventBus):
    """Client of the named hub actor ``name`` in ``namespace``.

    ``create``: create the hub if it does not exist (``maxlen`` applies then). Ray ties a
    non-detached actor's life to its creator, so the composition root (the driver) creates the
    hub and replicas only connect (``create=False``, what an unpickled client does): a hub created
    by an engine replica would die with it. A non-detached hub also dies when its creator drops
    its last handle; ``detached`` hubs live until ``kill`` or the cluster's end.
    """

    def __init__(
        self,
        name: str = "kvroute-bus",
        *,
        namespace: str = DEFAULT_NAMESPACE,
        maxlen: int = 100_000,
        detached: bool = False,
        create: bool = True,
        sync: bool = False,
    ) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.name, self.namespace, self.maxlen, self.detached = name, namespace, maxlen, detached
        self.sync = sync
        if create:
            self._hub: Any = _RemoteHub.options(
                name=name,
                namespace=namespace,
                get_if_exists=True,
                lifetime="detached" if detached else None,
            ).remote(maxlen)
        else:
            try:
                self._hub = ray.get_actor(name, namespace=namespace)
            except ValueError:
                raise ValueError(
                    f"bus: no hub actor {name!r} in namespace {namespace!r}; the driver creates "
                    "it (RayEventBus(..., create=True)) before starting replicas"
                ) from None
        self._last: Any = None  # the last fire-and-forget call, for flush()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reconnect, (self.name, self.namespace, self.maxlen, self.detached, self.sync))

    def publish(self, payload: bytes) -> int:
        """Append; fire-and-forget returns -1 (the hub assigns the offset later, see ``flush``),
        a ``sync`` client waits for the offset (the full ``EventBus`` contract)."""
        return self.publish_many((payload,))

    def publish_sync(self, payload: bytes) -> int:
        return int(ray.get(self._hub.publish_many.remote([payload])))

    def publish_many(self, payloads: Sequence[bytes]) -> int:
        """One actor call for all of ``payloads`` (fire-and-forget unless ``sync``)."""
        if not payloads:
            return -1
        ref = self._hub.publish_many.remote(list(payloads))
        if self.sync:
            return int(ray.get(ref))
        self._last = ref
        return -1

    def flush(self, timeout_s: float | None = 10.0) -> None:
        """Wait until everything this client published is in the log."""
        if self._last is not None:
            ray.get(self._last, timeout=timeout_s)

    def read(self, cursor: int, max_items: int = 4096) -> BusRead:
        return BusRead(*ray.get(self._hub.read.remote(cursor, max_items)))

    def end(self) -> int:
        return int(ray.get(self._hub.end.remote()))

    def request_resync(self, instance: str) -> None:
        self._hub.request_resync.remote(instance)

    def take_resync(self, instance: str) -> bool:
        return bool(ray.get(self._hub.take_resync.remote(instance)))

    def kill(self) -> None:
        """Destroy the hub (tests, teardown of a detached hub)."""
        ray.kill(self._hub)


def _reconnect(name: str, namespace: str, maxlen: int, detached: bool, sync: bool) -> RayEventBus:
    return RayEventBus(
        name, namespace=namespace, maxlen=maxlen, detached=detached, create=False, sync=sync
    )
