"""KV events on the wire: vLLM 0.32's schema as published on ZMQ, and kvroute's bus messages.

vLLM side (``vllm/distributed/kv_events.py``): a ``KVEventBatch`` is an array-like msgpack
``[ts, events, data_parallel_rank?]``; each event is a map tagged ``{"type": "BlockStored", ...}``.
Block hashes are opaque engine hashes (``bytes`` or ``int``). The ZMQ frames are
``(topic, seq as 8 big-endian bytes, payload)``.

kvroute side: engine hashes are translated to our chained hashes (``cachemap.hashing``) before
they leave the engine replica, so the bus carries only ``InstanceEvents`` (a stamped,
per-instance sequence of ``Stored``/``Removed``/``Cleared`` updates), ``Snapshot`` (a full
residency dump for resync) and ``InstanceGone``.
"""

from __future__ import annotations

from typing import Any

import msgspec

EngineHash = bytes | int

# -- vLLM 0.32 KV events (field order and options as vLLM declares them) -------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's KV cache events (tagged by class name under ``type``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[EngineHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[VllmEvent]


class _LenientBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are decoded one by one, so one bad event does not sink the rest."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_strict_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_batch_decoder = msgspec.msgpack.Decoder(_LenientBatch)
_event_decoder = msgspec.msgpack.Decoder(VllmEvent)
_vllm_encoder = msgspec.msgpack.Encoder()


def encode_vllm_batch(batch: KVEventBatch) -> bytes:
    """Bytes exactly as vLLM's ZMQ publisher sends them (for the sim engine and tests)."""
    return _vllm_encoder.encode(batch)


def decode_vllm_batch(payload: bytes) -> tuple[float, list[VllmEvent | msgspec.DecodeError]]:
    """Decode a vLLM batch; an event that does not decode comes back as its DecodeError.

    Raises ``msgspec.DecodeError`` only if the batch envelope itself is unreadable.
    """
    try:  # fast path: a well-formed batch decodes in one call
        strict = _strict_decoder.decode(payload)
        return strict.ts, list(strict.events)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    batch = _batch_decoder.decode(payload)
    out: list[VllmEvent | msgspec.DecodeError] = []
    for raw in batch.events:
        try:
            out.append(_event_decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            out.append(msgspec.DecodeError(str(e)))
    return batch.ts, out


# -- kvroute bus messages ------------------------------------------------------------------------


class Stored(msgspec.Struct, array_like=True, gc=False, tag="s"):
    """``hashes`` is a chain: ``hashes[0]`` is the child of ``parent`` (None: a prompt's first
    block) at block index ``depth``; each later hash is the child of the one before it."""

    tier: str
    hashes: list[int]
    parent: int | None
    depth: int


class Removed(msgspec.Struct, array_like=True, gc=False, tag="r"):
    tier: str
    hashes: list[int]


class Cleared(msgspec.Struct, array_like=True, gc=False, tag="c"):
    tier: str | None  # None: every tier


Update = Stored | Removed | Cleared


class InstanceEvents(msgspec.Struct, array_like=True, gc=False, tag="ev"):
    """One stamped batch from one engine instance; ``seq`` increases by exactly 1 per batch."""

    instance: str
    seq: int
    ts: float
    updates: list[Update]


class SnapshotBlock(msgspec.Struct, array_like=True, gc=False):
    hash: int
    parent: int | None
    depth: int
    tiers: list[str]


class Snapshot(msgspec.Struct, array_like=True, gc=False, tag="snap"):
    """Everything ``instance`` holds, consistent with its batches up to and including ``seq``
    (-1: none yet). Replaces the instance's residency wherever it is applied."""

    instance: str
    seq: int
    blocks: list[SnapshotBlock]


class InstanceGone(msgspec.Struct, array_like=True, gc=False, tag="gone"):
    """The instance crashed or was scaled down: drop all of its residency."""

    instance: str


class LastSeq(msgspec.Struct, array_like=True, gc=False, tag="last"):
    """``instance``'s last stamped batch is ``seq`` (-1: none yet). Its forwarder sends one after
    each quiet spell that follows a batch: a consumer that lost the trailing batches of a burst
    sees the gap here, where it would otherwise see it only at the instance's next batch. It
    stamps nothing itself, so it can be repeated."""

    instance: str
    seq: int


BusMessage = InstanceEvents | Snapshot | InstanceGone | LastSeq

_bus_encoder = msgspec.msgpack.Encoder()
# NOTE: typed here: msgspec's stubs type a decoder of a union as Decoder[Any] before 0.23
_bus_decoder: msgspec.msgpack.Decoder[BusMessage] = msgspec.msgpack.Decoder(BusMessage)


def encode_message(msg: BusMessage) -> bytes:
    return _bus_encoder.encode(msg)


def decode_message(payload: bytes) -> BusMessage:
    """Raises ``msgspec.DecodeError``/``ValidationError`` on a malformed payload."""
    return _bus_decoder.decode(payload)
