"""Ray-actor backend of ``engines.bus.base.EventBus``: the embedded default under ``kvroute serve``.

One named actor (``BusHub``) holds a deployment's bounded logs by name (its KV-event log and its
load log), each an ``InProcessBus``. Engine replicas publish to it and router replicas read from it,
from any process in the Ray cluster. ``RayEventBus`` is the client of one log: it pickles as
the hub's and the log's names, so it can be passed to deployments as an argument. Two clients of
the same hub read together in one actor call (``read_pair``): a router's poll of both buses.

Publishing is fire-and-forget by default (one actor call, no round trip): ``publish`` returns -1
because the hub assigns the offset later (a ``sync=True`` client waits and returns it). Ray runs
one caller's calls to one actor in submission order, so a publisher's messages keep their order.
``flush`` waits until everything published so far is in the log. Two clients of the same hub
publish together in one call too (``publish_pair``: an engine's KV events and its load sample).

The hub also carries resync requests: a router that saw a gap calls ``request_resync(instance)``
and that instance's forwarder, polling ``take_resync``, publishes a ``Snapshot``.

Bounds: a log keeps at most ``maxlen`` entries and ``max_bytes`` bytes of payload
(``InProcessBus``'s bounds: the oldest go first; a reader whose cursor fell behind learns how
many it lost and resyncs, as with every ``EventBus``); a resync request nobody takes within
``RESYNC_TTL_S`` is forgotten (its instance died: an engine killed after a router asked; a
router that still needs one asks again every ``EngineWatcher.resync_interval_s``). Nothing else
in the hub grows with time or with instances.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray

from engines.bus.base import MAX_READ_ITEMS, BusRead, EventBus, InProcessBus

DEFAULT_NAMESPACE = "kvroute"
DEFAULT_MAX_BYTES = 256 * 2**20  # payload bytes per log
# A forwarder polls for its resync requests every second: one untaken for this long is an
# instance's that is gone (or a forwarder stuck as long); routers re-ask while they need one.
RESYNC_TTL_S = 60.0

_Read = tuple[list[bytes], int, int]

# NOTE: every publish and every poll is an actor call; with task events on, each would also be
# recorded in the GCS (memory and CPU for a task table nobody reads): they are off.
_quiet_events: Callable[[Any], Any] = ray.method(enable_task_events=False)
_M = TypeVar("_M", bound=Callable[..., Any])


def _quiet(method: _M) -> _M:
    """``ray.method(enable_task_events=False)`` typed as what it does: it marks ``method`` and
    returns it. (Ray types a decorated method as a remote-only one, but ``BusHub`` also calls
    its own methods in-process, and runs in-process in tests.)"""
    marked: _M = _quiet_events(method)
    return marked


@dataclass
class _Log:
    entries: InProcessBus
    # instance -> when a router last asked it to resync (the hub's clock)
    resync: dict[str, float] = field(default_factory=dict)


class BusHub:
    """The actor's state: bounded logs by name, each with its pending resync requests.

    ``clock`` (seconds) times resync requests; ``resync_ttl_s``: how long one waits to be
    taken before it is forgotten."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, resync_ttl_s: float = RESYNC_TTL_S
    ) -> None:
        if resync_ttl_s <= 0:
            raise ValueError(f"resync_ttl_s must be > 0, got {resync_ttl_s}")
        self._logs: dict[str, _Log] = {}
        self._clock, self._resync_ttl_s = clock, resync_ttl_s
        self._next_expiry = clock() + resync_ttl_s

    def _log(self, log: str) -> _Log:
        try:
            return self._logs[log]
        except KeyError:
            raise KeyError(f"bus hub: no log {log!r} (its creator opens it)") from None

    @_quiet
    def open(self, log: str, maxlen: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """Create ``log`` with ``maxlen`` entries and ``max_bytes`` payload bytes at most unless
        it exists (then it is kept as it is)."""
        if log not in self._logs:
            self._logs[log] = _Log(InProcessBus(maxlen, max_bytes))

    @_quiet
    def publish_many(self, log: str, payloads: list[bytes]) -> int:
        return self._log(log).entries.publish_many(payloads)

    @_quiet
    def publish_many_to(self, batches: list[tuple[str, list[bytes]]]) -> list[int]:
        """``publish_many`` of each ``(log, payloads)``, in one call."""
        return [self.publish_many(log, payloads) for log, payloads in batches]

    @_quiet
    def read(self, log: str, cursor: int, max_items: int) -> _Read:
        return tuple(self._log(log).entries.read(cursor, max_items))  # type: ignore[return-value]

    @_quiet
    def read_many(self, reads: list[tuple[str, int, int]]) -> list[_Read]:
        """``read`` of each ``(log, cursor, max_items)``, in one call."""
        return [self.read(*r) for r in reads]

    @_quiet
    def end(self, log: str) -> int:
        return self._log(log).entries.end()

    def _expire(self, now: float) -> None:
        """Forget the resync requests older than the TTL (a scan at most once per TTL: one
        lives at most twice the TTL)."""
        if now < self._next_expiry:
            return
        self._next_expiry = now + self._resync_ttl_s
        for lg in self._logs.values():
            old = [i for i, t in lg.resync.items() if now - t >= self._resync_ttl_s]
            for inst in old:
                del lg.resync[inst]

    @_quiet
    def request_resync(self, log: str, instance: str) -> None:
        now = self._clock()
        self._expire(now)
        self._log(log).resync[instance] = now

    @_quiet
    def take_resync(self, log: str, instance: str) -> bool:
        now = self._clock()
        self._expire(now)
        asked = self._log(log).resync.pop(instance, None)
        return asked is not None and now - asked < self._resync_ttl_s

    @_quiet
    def stats(self) -> dict[str, Any]:
        """What the hub holds (benchmarks, tests): per log its ``entries``, their payload
        ``bytes`` and its pending ``resync`` requests; this process's ``pid`` and Python's
        allocated blocks (``py_blocks``)."""
        logs = {
            name: {"entries": len(lg.entries), "bytes": lg.entries.bytes, "resync": len(lg.resync)}
            for name, lg in self._logs.items()
        }
        return {"pid": os.getpid(), "py_blocks": sys.getallocatedblocks(), "logs": logs}


_RemoteHub = ray.remote(num_cpus=0, max_restarts=0)(BusHub)


class RayEventBus(EventBus):
    """Client of the log ``name`` on the named hub actor ``hub`` (default: ``name``) in
    ``namespace``.

    ``create``: create the hub if it does not exist and open the log on it (``maxlen`` entries
    and ``max_bytes`` payload bytes apply to a new log). Ray ties a non-detached actor's life to
    its creator, so the composition root (the driver) creates the hub and replicas only connect
    (``create=False``, what an unpickled client does): a hub created by an engine replica would
    die with it. A non-detached hub also dies when its creator drops its last handle;
    ``detached`` hubs live until ``kill`` or the cluster's end.
    """

    def __init__(
        self,
        name: str = "kvroute-bus",
        *,
        hub: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        maxlen: int = 100_000,
        max_bytes: int = DEFAULT_MAX_BYTES,
        detached: bool = False,
        create: bool = True,
        sync: bool = False,
    ) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.name, self.namespace, self.maxlen, self.detached = name, namespace, maxlen, detached
        self.max_bytes = max_bytes
        self.hub = hub if hub is not None else name
        self.sync = sync
        # NOTE: Any: Ray types a created actor as "ActorHandle[BusHub] | type[BusHub]", whose
        # methods have no ``.remote``
        self._hub: Any
        if create:
            created: Any = _RemoteHub.options(
                name=self.hub,
                namespace=namespace,
                get_if_exists=True,
                lifetime="detached" if detached else None,
            ).remote()
            self._hub = created
            # NOTE: waited for: a replica connecting later must find the log
            ray.get(created.open.remote(name, maxlen, max_bytes))
        else:
            try:
                self._hub = ray.get_actor(self.hub, namespace=namespace)
            except ValueError:
                raise ValueError(
                    f"bus: no hub actor {self.hub!r} in namespace {namespace!r}; the driver "
                    "creates it (RayEventBus(..., create=True)) before starting replicas"
                ) from None
        self._last: Any = None  # the last fire-and-forget call, for flush()

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.name, self.hub, self.namespace, self.maxlen, self.detached, self.sync)
        return (_reconnect, (*args, self.max_bytes))

    def publish(self, payload: bytes) -> int:
        """Append; fire-and-forget returns -1 (the hub assigns the offset later, see ``flush``),
        a ``sync`` client waits for the offset (the full ``EventBus`` contract)."""
        return self.publish_many((payload,))

    def publish_sync(self, payload: bytes) -> int:
        return int(ray.get(self._hub.publish_many.remote(self.name, [payload])))

    def publish_many(self, payloads: Sequence[bytes]) -> int:
        """One actor call for all of ``payloads`` (fire-and-forget unless ``sync``)."""
        if not payloads:
            return -1
        ref = self._hub.publish_many.remote(self.name, list(payloads))
        if self.sync:
            return int(ray.get(ref))
        self._last = ref
        return -1

    def publish_pair(
        self, payloads: Sequence[bytes], other: EventBus, other_payloads: Sequence[bytes]
    ) -> tuple[int, int]:
        """One actor call when ``other`` is a log of the same hub, two otherwise."""
        if not (
            isinstance(other, RayEventBus)
            and (other.hub, other.namespace) == (self.hub, self.namespace)
        ):
            return super().publish_pair(payloads, other, other_payloads)
        pairs = ((self.name, payloads), (other.name, other_payloads))
        sent = [(log, list(p)) for log, p in pairs if p]
        if not sent:
            return -1, -1
        ref = self._hub.publish_many_to.remote(sent)
        if not (self.sync or other.sync):
            self._last = other._last = ref
            return -1, -1
        offsets = iter(ray.get(ref))
        mine = int(next(offsets)) if payloads else -1
        return mine, int(next(offsets)) if other_payloads else -1

    def flush(self, timeout_s: float | None = 10.0) -> None:
        """Wait until everything this client published is in the log."""
        if self._last is not None:
            ray.get(self._last, timeout=timeout_s)

    def read(self, cursor: int, max_items: int = MAX_READ_ITEMS) -> BusRead:
        return BusRead(*ray.get(self._hub.read.remote(self.name, cursor, max_items)))

    def read_pair(
        self, cursor: int, other: EventBus, other_cursor: int, max_items: int = MAX_READ_ITEMS
    ) -> tuple[BusRead, BusRead]:
        """One actor call when ``other`` is a log of the same hub, two reads otherwise."""
        if not (
            isinstance(other, RayEventBus)
            and (other.hub, other.namespace) == (self.hub, self.namespace)
        ):
            return super().read_pair(cursor, other, other_cursor, max_items)
        reads = [(self.name, cursor, max_items), (other.name, other_cursor, max_items)]
        mine, theirs = ray.get(self._hub.read_many.remote(reads))
        return BusRead(*mine), BusRead(*theirs)

    def end(self) -> int:
        return int(ray.get(self._hub.end.remote(self.name)))

    def request_resync(self, instance: str) -> None:
        self._hub.request_resync.remote(self.name, instance)

    def take_resync(self, instance: str) -> bool:
        return bool(ray.get(self._hub.take_resync.remote(self.name, instance)))

    def stats(self) -> dict[str, Any]:
        """The hub's ``BusHub.stats`` (every log on it, not only this client's)."""
        return dict(ray.get(self._hub.stats.remote()))

    def kill(self) -> None:
        """Destroy the hub, with every log on it (tests, teardown of a detached hub)."""
        ray.kill(self._hub)


def _reconnect(
    name: str,
    hub: str,
    namespace: str,
    maxlen: int,
    detached: bool,
    sync: bool,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> RayEventBus:
    return RayEventBus(
        name,
        hub=hub,
        namespace=namespace,
        maxlen=maxlen,
        max_bytes=max_bytes,
        detached=detached,
        create=False,
        sync=sync,
    )
