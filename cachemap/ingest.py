"""From vLLM KV events to cache-map updates, in two halves joined by the event bus.

``EngineEventTranslator`` runs next to one engine (in its replica's forwarder): it decodes vLLM
batches, maps the engine's opaque block hashes to our chained hashes (from ``token_ids`` and the
parent), reference-counts repeated announcements, places CPU-tier events (one per offloaded
chunk, self-describing or a placeholder naming only the chunk's last engine hash) on every block
the chunk covers through its per-instance table, watches vLLM's sequence numbers for drops, and
stamps its own per-instance sequence on what it emits. It can dump everything it
knows as a ``Snapshot`` for resync.

``CacheMapIngestor`` runs in every router replica: it applies stamped messages to its
``CacheMap`` and checks each instance's sequence; a gap is reported (and the instance listed in
``needs_resync``) so the caller can fetch a snapshot, instead of silently diverging.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from cachemap.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BusMessage,
    Cleared,
    EngineHash,
    InstanceEvents,
    InstanceGone,
    LastSeq,
    Removed,
    Snapshot,
    SnapshotBlock,
    Stored,
    Update,
    VllmEvent,
    decode_vllm_batch,
)
from cachemap.hashing import BlockHasher, Tier, as_tier, block_hashes
from cachemap.map import CacheMap

log = logging.getLogger(__name__)

# Engine blocks (stored or removed) whose KV events one router core decodes and applies per
# second at event_stride 1: ``benchmarks/cachemap_bench.py``'s ``router_ingest`` measured 4.3M
# (10M resident blocks over 1,024 instances) to 4.9M (1M) on this project's 2-core reference
# machine; rounded down. What ``kvroute plan``'s event-volume model divides by.
APPLY_BLOCKS_PER_S = 4_000_000


class _Tier(NamedTuple):
    """A tier as the translator uses it, resolved once (this runs per event)."""

    tier: Tier
    slot: int  # its count's index in ``_Block`` (``refs``, ``add``)
    value: str  # ``tier.value``, the name on the bus


_TIERS: dict[str, _Tier] = {
    t.value: _Tier(t, i, t.value) for i, t in enumerate((Tier.GPU, Tier.CPU))
}


class _Block:
    """What the translator knows about one engine block (one per resident block: keep small)."""

    __slots__ = ("cpu", "depth", "gpu", "ours", "parent")

    def __init__(self, ours: int, parent: EngineHash | None, depth: int, slot: int) -> None:
        self.ours = ours
        self.parent = parent  # the engine hash of the parent block
        self.depth = depth
        # announcements per tier (``_Tier.slot`` 0 and 1): one on ``slot`` so far
        self.gpu = 1 if slot == 0 else 0
        self.cpu = 1 - self.gpu

    def refs(self, slot: int) -> int:
        return self.gpu if slot == 0 else self.cpu

    def add(self, slot: int, n: int) -> int:
        """``n`` more announcements on tier ``slot``; returns its count after."""
        if slot == 0:
            self.gpu += n
            return self.gpu
        self.cpu += n
        return self.cpu


class EngineEventTranslator:
    """Per-instance translation of vLLM events into stamped ``InstanceEvents``.

    CPU-tier events (medium ``CPU``) from vLLM's offloading connector come in two forms, one per
    offloaded chunk: self-describing (every GPU block hash of the chunk, its tokens and parent;
    ``BlockRemoved`` names every hash) or a placeholder (only the chunk's last engine hash, no
    tokens, ``block_size`` 0; ``BlockRemoved`` names that hash). Either way each block of the chunk
    gets one CPU announcement, so blocks shared by two chunks stay on the CPU tier until both
    are gone. A chunk whose blocks the translator already knows keeps their known mapping (vLLM
    leaves ``extra_keys``, hence a ``cache_salt``, out of CPU events).

    ``cpu_blocks_per_chunk``: GPU blocks per CPU-tier chunk (offloaded block size / engine block
    size), what a placeholder covers.

    ``trusted_hashes``: the engine's block hashes already are chained prefix ids in our hash
    space, so a ``BlockStored`` without ``token_ids`` maps each engine hash to itself. That is
    the case for hash-only traces (Mooncake/Bailian ``hash_ids``, which identify a whole prefix)
    replayed on sim engines; never for vLLM, whose hashes are opaque and process-local.

    ``stride``: emit every ``stride``-th block of a prompt only (block index ``i`` with
    ``(i + 1) % stride == 0``, each the child of the kept block ``stride`` before it, at depth
    ``(i + 1) // stride - 1``), for a ``CacheMap`` of the same ``stride``: the bus and every
    router replica carry ``stride`` times fewer blocks, and a match rounds down to whole runs
    of ``stride`` blocks. The translator itself still follows every block.
    """

    def __init__(
        self,
        instance: str,
        model: str,
        block_size: int,
        cpu_blocks_per_chunk: int = 1,
        *,
        trusted_hashes: bool = False,
        stride: int = 1,
    ) -> None:
        if cpu_blocks_per_chunk < 1:
            raise ValueError(f"cpu_blocks_per_chunk must be >= 1, got {cpu_blocks_per_chunk}")
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        self.stride = stride
        self.instance = instance
        self.block_size = block_size
        self.cpu_blocks_per_chunk = cpu_blocks_per_chunk
        self.trusted_hashes = trusted_hashes
        self._hasher = BlockHasher(model, block_size)
        self._table: dict[EngineHash, _Block] = {}
        self._chunks: dict[EngineHash, list[EngineHash]] = {}  # placeholder chunk -> members
        self.seq = -1  # last stamped sequence number
        self.last_engine_seq: int | None = None
        self.engine_gaps = 0  # vLLM batches lost between the publisher and us
        self.skipped: Counter[str] = Counter()  # malformed or untranslatable events, by reason

    def __len__(self) -> int:
        return len(self._table)

    def _skip(self, reason: str, detail: object = "") -> None:
        if not self.skipped[reason]:
            log.warning("instance %s: skipping KV event (%s) %s", self.instance, reason, detail)
        self.skipped[reason] += 1

    def feed(self, payload: bytes, engine_seq: int | None, ts: float) -> InstanceEvents | None:
        """Translate one vLLM ZMQ payload; returns the stamped message, or None if it yields no
        update. ``engine_seq`` is vLLM's frame sequence number (None when unknown)."""
        if not self._check_seq(engine_seq):
            return None  # a replayed batch we already have
        try:
            _, events = decode_vllm_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._skip("undecodable batch", e)
            return None
        return self._translate(events, ts)

    def translate(
        self,
        events: Sequence[VllmEvent | msgspec.DecodeError],
        engine_seq: int | None,
        ts: float,
    ) -> InstanceEvents | None:
        """``feed`` of a batch already decoded: vLLM's event objects, in order (an event that
        did not decode as its ``DecodeError``), as the cluster simulator's virtual engines hand
        them over without the bytes."""
        if not self._check_seq(engine_seq):
            return None  # a replayed batch we already have
        return self._translate(events, ts)

    def _translate(
        self, events: Sequence[VllmEvent | msgspec.DecodeError], ts: float
    ) -> InstanceEvents | None:
        updates: list[Update] = []
        # NOTE: vLLM (and the sim) emit one BlockRemoved per evicted block: a run of them on
        # one tier is gathered and translated at its end, in one pass, into one update.
        removed: list[EngineHash] = []
        removed_medium: str | None = None  # the run's, valid while it is not empty
        removed_tier = _TIERS[Tier.GPU.value]
        for ev in events:
            if isinstance(ev, BlockRemoved):
                if not removed or ev.medium != removed_medium:
                    tier = self._tier(ev.medium)
                    if tier is None:
                        continue
                    if removed and tier is not removed_tier:
                        self._removed(removed_tier, removed, updates)
                        removed = []
                    removed_medium, removed_tier = ev.medium, tier
                removed.extend(ev.block_hashes)
                continue
            if removed:
                self._removed(removed_tier, removed, updates)
                removed = []
            if isinstance(ev, BlockStored):
                self._stored(ev, updates)
            elif isinstance(ev, AllBlocksCleared):
                self._cleared(updates)
            elif isinstance(ev, msgspec.DecodeError):
                self._skip("undecodable event", ev)
        if removed:
            self._removed(removed_tier, removed, updates)
        if not updates:
            return None
        self.seq += 1
        return InstanceEvents(self.instance, self.seq, ts, updates)

    def _check_seq(self, engine_seq: int | None) -> bool:
        """Count the vLLM batches lost before ``engine_seq``; False for one already had."""
        if engine_seq is not None:
            if self.last_engine_seq is not None and engine_seq > self.last_engine_seq + 1:
                self.engine_gaps += engine_seq - self.last_engine_seq - 1
                log.warning(
                    "instance %s: lost vLLM KV batches %d..%d",
                    self.instance,
                    self.last_engine_seq + 1,
                    engine_seq - 1,
                )
            if self.last_engine_seq is not None and engine_seq <= self.last_engine_seq:
                return False
            self.last_engine_seq = engine_seq
        return True

    def _tier(self, medium: str | None) -> _Tier | None:
        tier = _TIERS.get(medium or Tier.GPU.value)
        if tier is None:
            self._skip(f"unsupported medium {medium!r}")
        return tier

    def _stored(self, ev: BlockStored, out: list[Update]) -> None:
        tier = self._tier(ev.medium)
        if tier is None or not ev.block_hashes:
            return
        if not ev.token_ids and ev.block_size == 0:
            self._placeholder(ev.block_hashes, tier, out)
            return
        if tier.tier is Tier.CPU and all(eh in self._table for eh in ev.block_hashes):
            self._announce(ev.block_hashes, tier, out)  # a chunk of blocks the GPU announced
            return
        n = len(ev.block_hashes)
        if ev.block_size != self.block_size:
            self._skip("block size mismatch", f"{ev.block_size} != {self.block_size}")
            return
        trusted = self.trusted_hashes and not ev.token_ids
        if not trusted and len(ev.token_ids) != n * self.block_size:
            self._skip("token_ids length", f"{len(ev.token_ids)} for {n} blocks")
            return
        root: int
        if ev.parent_block_hash is None:
            parent_ours: int | None = None
            root = self._hasher.salt(ev.lora_name, _cache_salt(ev))
            depth = 0
        else:
            pb = self._table.get(ev.parent_block_hash)
            if pb is None:
                self._skip("unknown parent block", ev.parent_block_hash)
                return
            parent_ours = root = pb.ours
            depth = pb.depth + 1
        ours: Sequence[int]
        if trusted:
            ours = [h for h in ev.block_hashes if isinstance(h, int) and 0 <= h < 1 << 64]
            if len(ours) != n:
                self._skip("trusted hash not a 64-bit int", ev.block_hashes[:4])
                return
        else:
            try:
                ours = block_hashes(ev.token_ids, self.block_size, root)
            except ValueError as e:
                self._skip("bad token_ids", e)
                return
        ti = tier.slot
        table = self._table
        get = table.get
        prev = ev.parent_block_hash
        d = depth
        for eh, oh in zip(ev.block_hashes, ours, strict=True):
            b = get(eh)
            if b is None:
                table[eh] = _Block(oh, prev, d, ti)
            else:
                b.add(ti, 1)
            prev = eh
            d += 1
        self._emit(tier.value, ours, depth, ev.parent_block_hash, parent_ours, out)

    def _emit(
        self,
        tier: str,
        ours: Sequence[int],
        depth: int,
        parent: EngineHash | None,
        parent_ours: int | None,
        out: list[Update],
    ) -> None:
        """A stored chain ``ours`` from block index ``depth`` on, after the engine block
        ``parent`` (ours: ``parent_ours``), as the update of its blocks the map keeps."""
        k = self.stride
        if k == 1:
            out.append(Stored(tier, list(ours), parent_ours, depth))
            return
        first = -(depth + 1) % k  # the first position with (depth + position + 1) % k == 0
        if first >= len(ours):
            return
        back = first - k  # the kept block before it, relative to ours[0]
        kept_parent: int | None
        if back >= 0:
            kept_parent = ours[back]
        elif depth + back < 0:
            kept_parent = None
        else:
            kept_parent = self._ancestor(parent, -back - 1)
        out.append(Stored(tier, list(ours[first::k]), kept_parent, (depth + first + 1) // k - 1))

    def _ancestor(self, eh: EngineHash | None, steps: int) -> int | None:
        """Our hash of the block ``steps`` parents above engine block ``eh`` (None: unknown)."""
        b = self._table.get(eh) if eh is not None else None
        for _ in range(steps):
            if b is None or b.parent is None:
                return None
            b = self._table.get(b.parent)
        return b.ours if b is not None else None

    def _chain(self, last: EngineHash) -> list[EngineHash]:
        """The placeholder chunk ending at ``last``, oldest first, as far as the table knows."""
        members = [last]
        b = self._table.get(last)
        while b is not None and b.parent is not None and len(members) < self.cpu_blocks_per_chunk:
            members.append(b.parent)
            b = self._table.get(b.parent)
        members.reverse()
        return members

    def _placeholder(self, hashes: list[EngineHash], tier: _Tier, out: list[Update]) -> None:
        for last in hashes:
            if last not in self._table:
                self._skip("placeholder for unknown block", last)
                continue
            members = [m for m in self._chain(last) if m in self._table]
            self._chunks[last] = members
            self._announce(members, tier, out)

    def _announce(self, members: Sequence[EngineHash], tier: _Tier, out: list[Update]) -> None:
        """One more announcement on ``tier`` of known blocks ``members`` (a chain, oldest
        first)."""
        ti = tier.slot
        table = self._table
        first = table[members[0]]
        parent = table.get(first.parent) if first.parent is not None else None
        for m in members:
            table[m].add(ti, 1)
        ours = [table[m].ours for m in members]
        parent_ours = parent.ours if parent is not None else None
        self._emit(tier.value, ours, first.depth, first.parent, parent_ours, out)

    def _removed(self, tier: _Tier, hashes: list[EngineHash], out: list[Update]) -> None:
        """Removals of ``hashes`` (from one or more BlockRemoved events) on ``tier``."""
        ti = tier.slot
        chunks = self._chunks if tier.tier is Tier.CPU else None
        gone: list[int] = []
        for eh in hashes:
            members = chunks.pop(eh, None) if chunks is not None else None
            for m in members or (eh,):
                self._remove_one(m, ti, gone)
        if gone:  # adjacent removals on one tier become one update: one call to the map
            last = out[-1] if out else None
            if isinstance(last, Removed) and last.tier == tier.value:
                last.hashes.extend(gone)
            else:
                out.append(Removed(tier.value, gone))

    def _remove_one(self, eh: EngineHash, ti: int, gone: list[int]) -> None:
        """One announcement fewer of engine block ``eh`` on tier slot ``ti``; our hash goes to
        ``gone`` when the tier holds it no more (and the map keeps it)."""
        b = self._table.get(eh)
        if b is None or b.refs(ti) == 0:
            self._skip("removal of unknown block", eh)
            return
        if b.add(ti, -1) == 0:
            k = self.stride
            if k == 1 or b.depth % k == k - 1:  # a block the map keeps
                gone.append(b.ours)
            if b.gpu == 0 and b.cpu == 0:
                del self._table[eh]

    def _cleared(self, out: list[Update]) -> None:
        # NOTE: vLLM emits AllBlocksCleared from the GPU block pool (reset_prefix_cache), and
        # nothing for its connector's CPU tier, which kvroute's engines reset with it
        # (``Engine.clear_cache``): the instance holds nothing on any tier afterwards.
        self._table.clear()
        self._chunks.clear()
        out.append(Cleared(None))

    def snapshot(self) -> Snapshot:
        """Everything this instance holds, as of ``self.seq`` (for a router's resync)."""
        table, k = self._table, self.stride
        blocks = []
        for b in table.values():
            if b.depth % k != k - 1:
                continue  # not a block the map keeps
            parent = self._ancestor(b.parent, k - 1) if b.depth >= k else None
            tiers = [t.value for t in _TIERS.values() if b.refs(t.slot)]
            blocks.append(SnapshotBlock(b.ours, parent, (b.depth + 1) // k - 1, tiers))
        return Snapshot(self.instance, self.seq, blocks)


def _cache_salt(ev: BlockStored) -> str | None:
    """vLLM puts the cache_salt in the first block's extra keys, after the LoRA name."""
    if not ev.extra_keys or not ev.extra_keys[0]:
        return None
    keys = list(ev.extra_keys[0])
    if ev.lora_name is not None and keys and keys[0] == ev.lora_name:
        keys = keys[1:]
    salts = [k for k in keys if isinstance(k, str)]
    return salts[-1] if salts else None


@dataclass(frozen=True, slots=True)
class Gap:
    instance: str
    expected: int
    got: int


class _Gathered:
    """One instance's updates gathered from consecutive event batches for ``CacheMapIngestor``:
    per tier the stored chains and the removed hashes (each once, in order: a second removal
    of a hash the map no longer holds there changes nothing)."""

    __slots__ = ("instance", "removed", "stored")

    def __init__(self) -> None:
        self.instance = ""
        self.stored: dict[str, list[tuple[Sequence[int], int | None, int]]] = {}
        self.removed: dict[str, dict[int, None]] = {}

    def add_stored(self, u: Stored) -> bool:
        """Gather ``u``; False (nothing gathered) when it stores a hash gathered as removed,
        which must reach the map after that removal."""
        gone = self.removed.get(u.tier)
        if gone and not gone.keys().isdisjoint(u.hashes):
            return False
        self.stored.setdefault(u.tier, []).append((u.hashes, u.parent, u.depth))
        return True

    def add_removed(self, u: Removed) -> None:
        self.removed.setdefault(u.tier, {}).update(dict.fromkeys(u.hashes))

    def tiers(self) -> list[str]:
        """The tiers gathered: independent in the map, in a fixed order (the map's slot
        numbering the same from run to run)."""
        return list(dict.fromkeys([*self.stored, *self.removed]))

    def clear(self) -> None:
        self.stored.clear()
        self.removed.clear()


class CacheMapIngestor:
    """Applies bus messages to one ``CacheMap``, checking every instance's sequence."""

    def __init__(self, cache_map: CacheMap) -> None:
        self.map = cache_map
        self._next: dict[str, int] = {}
        self.needs_resync: set[str] = set()
        self.duplicates = 0
        self.gaps = 0

    def apply(self, msg: BusMessage) -> Gap | None:
        gaps = self.apply_all((msg,))
        return gaps[0] if gaps else None

    def apply_all(self, msgs: Sequence[BusMessage]) -> list[Gap]:
        """``apply`` of each of ``msgs`` in turn (a bus read): the same map and counts at the
        end, and the gaps found, in order. An instance's consecutive event batches (a busy
        engine's steps since the last read) go to the map together: per tier its stored chains
        in one pass (``CacheMap.store_chains``), then its removed hashes in one. That order
        ends where the batches' own order does unless a hash removed is stored again after;
        such a store first applies what was gathered before it (``_Gathered``)."""
        gaps: list[Gap] = []
        got = _Gathered()
        for msg in msgs:
            if not isinstance(msg, InstanceEvents):
                self._flush(got)
                gap = self._apply_other(msg)
                if gap is not None:
                    gaps.append(gap)
                continue
            expected = self._next.get(msg.instance, 0)
            if msg.seq < expected:
                self.duplicates += 1
                continue
            if msg.instance != got.instance:
                self._flush(got)
                got.instance = msg.instance
            # Apply anyway (best effort) and ask for a snapshot, which replaces it all.
            if msg.seq > expected:
                gaps.append(self._gap(msg.instance, expected, msg.seq))
            self._next[msg.instance] = msg.seq + 1
            for u in msg.updates:
                if isinstance(u, Stored):
                    if not got.add_stored(u):
                        self._flush(got)
                        got.add_stored(u)
                elif isinstance(u, Removed):
                    got.add_removed(u)
                else:
                    self._flush(got)
                    self.map.clear(msg.instance, as_tier(u.tier) if u.tier is not None else None)
        self._flush(got)
        return gaps

    def _flush(self, got: _Gathered) -> None:
        """Apply what ``got`` gathered (stores before removals, per tier), and empty it."""
        if not got.stored and not got.removed:
            return
        for tier in got.tiers():
            chains = got.stored.get(tier)
            if chains:
                self.map.store_chains(got.instance, as_tier(tier), chains)
            removed = got.removed.get(tier)
            if removed:
                self.map.remove(got.instance, as_tier(tier), removed)
        got.clear()

    def _apply_other(self, msg: InstanceGone | Snapshot | LastSeq) -> Gap | None:
        """A message other than an event batch."""
        if isinstance(msg, InstanceGone):
            self.map.drop_instance(msg.instance)
            self._next.pop(msg.instance, None)
            self.needs_resync.discard(msg.instance)
            return None
        if isinstance(msg, Snapshot):
            self._apply_snapshot(msg)
            return None
        expected = self._next.get(msg.instance, 0)
        if msg.seq < expected:
            return None  # we have every batch up to it
        # the batches expected..seq were lost and nothing came after them
        return self._gap(msg.instance, expected, msg.seq + 1)

    def _gap(self, instance: str, expected: int, got: int) -> Gap:
        self.gaps += 1
        self.needs_resync.add(instance)
        return Gap(instance, expected, got)

    def _apply_snapshot(self, snap: Snapshot) -> None:
        if snap.seq < self._next.get(snap.instance, 0) - 1:
            self.duplicates += 1  # older than what we have already applied
            return
        self.map.clear(snap.instance)
        by_tier: dict[str, list[tuple[Sequence[int], int | None, int]]] = {}
        for b in snap.blocks:
            for t in b.tiers:
                by_tier.setdefault(t, []).append(((b.hash,), b.parent, b.depth))
        for t, chains in by_tier.items():
            self.map.store_chains(snap.instance, as_tier(t), chains)
        self._next[snap.instance] = snap.seq + 1
        self.needs_resync.discard(snap.instance)

    def lost(self) -> None:
        """The bus dropped messages we never saw: every known instance needs a resync."""
        self.needs_resync.update(self._next)
        self.gaps += 1
