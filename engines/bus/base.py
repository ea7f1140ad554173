"""The event bus: an append-only, bounded log of encoded ``BusMessage`` payloads.

Every backend has the same shape (Redis Streams semantics): ``publish`` appends and returns the
entry's offset; consumers keep their own cursor and ``read`` from it. The log keeps at most
``maxlen`` entries; a consumer whose cursor fell behind the trimmed head learns how many entries
it lost, and must resync (``CacheMapIngestor.lost``). Backends: in-process (here), a Ray actor
hub (``engines.bus.ray_bus``) and Redis Streams (``engines.bus.redis_bus``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from cachemap.events import InstanceEvents, decode_message
from cachemap.ingest import CacheMapIngestor

# entries one read returns at most: a read that returns this many leaves more behind
MAX_READ_ITEMS = 4096


class BusRead(NamedTuple):
    items: list[bytes]
    cursor: int  # pass back on the next read
    lost: int  # entries trimmed before this consumer read them


class EventBus(ABC):
    """Append-only bounded log. Offsets start at 0 and increase by one per entry."""

    @abstractmethod
    def publish(self, payload: bytes) -> int:
        """Append ``payload``; returns its offset, or -1 from a fire-and-forget backend that
        does not know it yet (``RayEventBus`` unless ``sync``)."""

    def publish_many(self, payloads: Sequence[bytes]) -> int:
        """Append ``payloads`` in order (one call to the backend where it can: a forwarder
        coalescing a busy engine's batches); returns the last one's offset, as ``publish``
        (-1 for none)."""
        offset = -1
        for payload in payloads:
            offset = self.publish(payload)
        return offset

    def publish_pair(
        self, payloads: Sequence[bytes], other: EventBus, other_payloads: Sequence[bytes]
    ) -> tuple[int, int]:
        """``self.publish_many(payloads)`` and ``other.publish_many(other_payloads)``: one call
        where the backend can (two logs of one Ray hub, two streams on one Redis client). A
        forwarder sends a busy engine's KV events and its load sample together."""
        return self.publish_many(payloads), other.publish_many(other_payloads)

    @abstractmethod
    def read(self, cursor: int, max_items: int = MAX_READ_ITEMS) -> BusRead:
        """Entries from offset ``cursor`` on, at most ``max_items``."""

    @abstractmethod
    def end(self) -> int:
        """The offset the next published entry will get (a new consumer's cursor to tail)."""

    def read_pair(
        self, cursor: int, other: EventBus, other_cursor: int, max_items: int = MAX_READ_ITEMS
    ) -> tuple[BusRead, BusRead]:
        """``self.read(cursor)`` and ``other.read(other_cursor)``: one round trip where the
        backend can (two logs of one Ray hub, two streams on one Redis client). A router reads
        its KV-event and load buses together on every poll."""
        return self.read(cursor, max_items), other.read(other_cursor, max_items)


class InProcessBus(EventBus):
    """Thread-safe in-memory log, for tests and single-process deployments (and the Ray hub's
    logs). It keeps the newest ``maxlen`` entries and, with ``max_bytes``, drops the oldest
    while their payloads hold more than that (the newest entry always stays); a reader whose
    cursor fell behind learns how many it lost."""

    def __init__(self, maxlen: int = 100_000, max_bytes: int | None = None) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.maxlen, self.max_bytes = maxlen, max_bytes
        # NOTE: without a byte bound the deque drops the oldest itself; with one, ``_trim`` does
        # (so that the byte count follows every entry that leaves)
        self._log: deque[bytes] = deque(maxlen=maxlen if max_bytes is None else None)
        self._end = 0
        self.bytes = 0  # payload bytes held (counted with ``max_bytes`` only)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._log)

    def _trim(self) -> None:
        log, max_bytes = self._log, self.max_bytes
        assert max_bytes is not None
        while len(log) > self.maxlen or (self.bytes > max_bytes and len(log) > 1):
            self.bytes -= len(log.popleft())

    def publish(self, payload: bytes) -> int:
        with self._lock:
            self._log.append(payload)
            self._end += 1
            if self.max_bytes is not None:
                self.bytes += len(payload)
                self._trim()
            return self._end - 1

    def publish_many(self, payloads: Sequence[bytes]) -> int:
        if not payloads:
            return -1
        with self._lock:
            self._log.extend(payloads)
            self._end += len(payloads)
            if self.max_bytes is not None:
                self.bytes += sum(map(len, payloads))
                self._trim()
            return self._end - 1

    def read(self, cursor: int, max_items: int = MAX_READ_ITEMS) -> BusRead:
        with self._lock:
            head = self._end - len(self._log)
            lost = max(0, head - cursor)
            start = max(cursor, head)
            stop = min(self._end, start + max_items)
            items = [self._log[i - head] for i in range(start, stop)]
            return BusRead(items, stop, lost)

    def end(self) -> int:
        with self._lock:
            return self._end


class BusConsumer:
    """Pumps a bus into a ``CacheMapIngestor``; counts and skips undecodable payloads."""

    def __init__(self, bus: EventBus, ingestor: CacheMapIngestor, from_start: bool = True) -> None:
        self.bus = bus
        self.ingestor = ingestor
        self.cursor = 0 if from_start else bus.end()
        self.malformed = 0
        # the last read's: the oldest event batch's stamp (None: it held none), and whether
        # it was a full read (more was waiting behind it)
        self.oldest_ts: float | None = None
        self.full = False

    def pump(self, max_items: int = MAX_READ_ITEMS) -> int:
        """Apply what is available (up to ``max_items``); returns how many entries were read."""
        return self.apply(self.bus.read(self.cursor, max_items))

    def apply(self, got: BusRead) -> int:
        """Apply a ``read`` made from ``self.cursor`` (lets callers do the I/O outside a lock)."""
        self.cursor = got.cursor
        if got.lost:
            self.ingestor.lost()
        oldest = None
        msgs = []
        for payload in got.items:
            try:
                msg = decode_message(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.malformed += 1
                continue
            if isinstance(msg, InstanceEvents) and (oldest is None or msg.ts < oldest):
                oldest = msg.ts
            msgs.append(msg)
        self.ingestor.apply_all(msgs)
        self.oldest_ts, self.full = oldest, len(got.items) >= MAX_READ_ITEMS
        return len(got.items)
