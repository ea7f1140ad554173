"""Redis Streams backend of ``engines.bus.base.EventBus``: for production, many router replicas.

One stream per bus. Offsets are dense integers, so every entry gets the explicit stream id
``0-<offset + 1>``, assigned with a counter in the same Lua call as the XADD (atomic: concurrent
publishers never reorder ids). ``MAXLEN ~`` bounds the stream; a consumer that falls behind the
trimmed head sees ``lost > 0`` and resyncs, exactly as with the in-process bus.

A Redis that restarts without its data starts the log again at offset 0. Every log carries an
epoch (a random token its first publisher sets); a reader that sees the epoch change starts
again from the new log's head and reports everything before its cursor lost, so routers ask
every engine for a snapshot instead of waiting, blind, for the new log to pass their cursor.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from engines.bus.base import MAX_READ_ITEMS, BusRead, EventBus

log = logging.getLogger(__name__)

# KEYS[1] stream, KEYS[2] counter, KEYS[3] epoch; ARGV[1] payload, ARGV[2] maxlen, ARGV[3] a
# candidate epoch (the first publisher to a fresh log sets it). Returns the new offset.
_PUBLISH = """
redis.call('SETNX', KEYS[3], ARGV[3])
local n = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '0-' .. n, 'd', ARGV[1])
return n - 1
"""

_PUBLISH_SHA = hashlib.sha1(_PUBLISH.encode()).hexdigest()


class RedisStreamBus(EventBus):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        stream: str = "kvroute:kv-events",
        maxlen: int = 100_000,
        client: Any = None,
        **auth: Any,
    ) -> None:
        """``auth``: the client's credentials and TLS options (``BusConfig.redis_auth``:
        ``username``, ``password``, ``ssl``, ``ssl_ca_certs``)."""
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.url, self.stream, self.maxlen = url, stream, maxlen
        self._counter = f"{stream}:next"
        self._epoch_key = f"{stream}:epoch"
        self._epoch: bytes | None = None  # the log's epoch this reader last saw
        self._redis = client if client is not None else redis_client(url, **auth)

    def publish(self, payload: bytes) -> int:
        return self.publish_many((payload,))

    def publish_many(self, payloads: Sequence[bytes]) -> int:
        """One round trip for all of ``payloads`` (a pipeline of the same atomic script, called
        by its SHA: redis-py's script objects would ask ``SCRIPT EXISTS`` first, every call)."""
        return _publish_all(self._redis, [(self, payloads)])[0]

    def publish_pair(
        self, payloads: Sequence[bytes], other: EventBus, other_payloads: Sequence[bytes]
    ) -> tuple[int, int]:
        """One round trip when ``other`` is a stream on the same client, two otherwise."""
        if not (isinstance(other, RedisStreamBus) and other._redis is self._redis):
            return super().publish_pair(payloads, other, other_payloads)
        mine, theirs = _publish_all(self._redis, [(self, payloads), (other, other_payloads)])
        return mine, theirs

    def read(self, cursor: int, max_items: int = MAX_READ_ITEMS) -> BusRead:
        pipe = self._redis.pipeline(transaction=True)
        self._queue_read(pipe, cursor, max_items)
        return self._read_from(pipe.execute(), cursor, max_items)

    def read_pair(
        self, cursor: int, other: EventBus, other_cursor: int, max_items: int = MAX_READ_ITEMS
    ) -> tuple[BusRead, BusRead]:
        """One round trip when ``other`` is a stream on the same client, two reads otherwise."""
        if not (isinstance(other, RedisStreamBus) and other._redis is self._redis):
            return super().read_pair(cursor, other, other_cursor, max_items)
        pipe = self._redis.pipeline(transaction=True)
        self._queue_read(pipe, cursor, max_items)
        other._queue_read(pipe, other_cursor, max_items)
        replies = pipe.execute()
        return (
            self._read_from(replies[:3], cursor, max_items),
            other._read_from(replies[3:], other_cursor, max_items),
        )

    def _queue_read(self, pipe: Any, cursor: int, max_items: int) -> None:
        # NOTE: in one MULTI/EXEC: the counter read with the entries, so an entry published
        # in between cannot be taken for one trimmed (and skipped, reported lost)
        pipe.xrange(self.stream, min=f"0-{cursor + 1}", count=max_items)
        pipe.get(self._epoch_key)
        pipe.get(self._counter)

    def _read_from(self, replies: list[Any], cursor: int, max_items: int) -> BusRead:
        """The ``BusRead`` of ``_queue_read``'s three replies."""
        entries, epoch, counter = replies
        if epoch is not None and epoch != self._epoch:
            reset = self._epoch is not None
            self._epoch = epoch
            if reset:  # a new log: read it from its head; all we had not read is lost
                log.warning("stream %s: the log was reset (Redis restarted?)", self.stream)
                got = self.read(0, max_items)
                return BusRead(got.items, got.cursor, got.lost + max(cursor, 1))
        if not entries:
            end = int(counter) if counter is not None else 0
            # Everything from cursor to end was trimmed (or nothing new was published).
            return BusRead([], max(cursor, end), max(0, end - cursor))
        first = _offset(entries[0][0])
        items = [fields[b"d"] for _, fields in entries]
        return BusRead(items, _offset(entries[-1][0]) + 1, max(0, first - cursor))

    def end(self) -> int:
        v = self._redis.get(self._counter)
        return int(v) if v is not None else 0

    def request_resync(self, instance: str) -> None:
        """Ask ``instance``'s forwarder to publish a full ``Snapshot`` (a router saw a gap)."""
        self._redis.sadd(f"{self.stream}:resync", instance)

    def take_resync(self, instance: str) -> bool:
        """Whether a resync of ``instance`` was requested (and clear the request)."""
        return bool(self._redis.srem(f"{self.stream}:resync", instance))

    def close(self) -> None:
        self._redis.close()


def redis_client(url: str, *, ssl: bool = False, **options: Any) -> Any:
    """A ``redis.Redis`` for ``url`` with ``options`` (``BusConfig.redis_auth``): ``ssl`` (TLS
    on a ``redis://`` URL, as a ``rediss://`` one asks) opens it as the ``rediss://`` URL, since
    redis-py's ``from_url`` takes TLS from the scheme only (an ``ssl`` keyword fails there)."""
    import redis

    if ssl and url.startswith("redis://"):
        url = "rediss://" + url.removeprefix("redis://")
    return redis.Redis.from_url(url, **options)


def _offset(stream_id: bytes | str) -> int:
    raw = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    return int(raw.split("-", 1)[1]) - 1


def _publish_all(client: Any, parts: list[tuple[RedisStreamBus, Sequence[bytes]]]) -> list[int]:
    """Append each part's payloads to its stream, in order, in one pipeline of the publish
    script; returns each part's last offset (-1 for a part with none)."""
    from redis.exceptions import NoScriptError

    replies = _run_publish(client, parts)
    # A server without the script (a restart, SCRIPT FLUSH) ran none of those messages: load
    # it and publish them again, in order.
    again = [
        (bus, [p for p, r in zip(payloads, got, strict=True) if isinstance(r, NoScriptError)])
        for (bus, payloads), got in zip(parts, replies, strict=True)
    ]
    if any(payloads for _, payloads in again):
        client.script_load(_PUBLISH)
        retried = _run_publish(client, again)
        replies = [
            [r for r in got if not isinstance(r, NoScriptError)] + more
            for got, more in zip(replies, retried, strict=True)
        ]
    for reply in (r for got in replies for r in got):
        if isinstance(reply, Exception):
            raise reply
    return [int(got[-1]) if got else -1 for got in replies]


def _run_publish(
    client: Any, parts: Sequence[tuple[RedisStreamBus, Sequence[bytes]]]
) -> list[list[Any]]:
    """The script's replies for each part's payloads, errors included (one pipeline)."""
    pipe = client.pipeline(transaction=False)
    for bus, payloads in parts:
        keys = (bus.stream, bus._counter, bus._epoch_key)
        for payload in payloads:
            # NOTE: a fresh epoch candidate per message: a publisher that outlives a Redis
            # restart must not give the new log the old epoch, or readers would never see it
            pipe.evalsha(_PUBLISH_SHA, 3, *keys, payload, bus.maxlen, uuid.uuid4().hex)
    flat = list(pipe.execute(raise_on_error=False)) if any(p for _, p in parts) else []
    out, i = [], 0
    for _, payloads in parts:
        out.append(flat[i : i + len(payloads)])
        i += len(payloads)
    return out
