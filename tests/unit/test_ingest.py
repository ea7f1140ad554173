"""vLLM-format KV event bytes -> translator -> bus -> CacheMap, including the CPU placeholder form,
reference counting, malformed events, and sequence gaps on both hops."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachemap import CacheMap, Match, Tier, block_hashes, salt_hash
from cachemap.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cleared,
    InstanceEvents,
    InstanceGone,
    KVEventBatch,
    LastSeq,
    Removed,
    Stored,
    encode_message,
    encode_vllm_batch,
)
from cachemap.hashing import as_tier
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator
from engines.bus.base import BusConsumer, InProcessBus

BS = 4
MODEL = "tiny"


def stored(hashes, parent, tokens, medium="GPU", lora=None, extra=None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=lora,
        extra_keys=extra,
    )


def batch(*events) -> bytes:
    return encode_vllm_batch(KVEventBatch(ts=1.0, events=list(events)))


class Pipeline:
    """Translator (engine side) -> in-process bus -> ingestor (router side)."""

    def __init__(self, instance: str = "e0", chunk: int = 1) -> None:
        self.tr = EngineEventTranslator(instance, MODEL, BS, cpu_blocks_per_chunk=chunk)
        self.bus = InProcessBus()
        self.map = CacheMap()
        self.ing = CacheMapIngestor(self.map)
        self.consumer = BusConsumer(self.bus, self.ing)
        self.engine_seq = 0

    def feed(self, *events) -> None:
        msg = self.tr.feed(batch(*events), self.engine_seq, ts=0.0)
        self.engine_seq += 1
        if msg is not None:
            self.bus.publish(encode_message(msg))
        self.consumer.pump()


TOKENS = list(range(100, 112))  # three blocks of 4
OURS = block_hashes(TOKENS, BS, salt_hash(MODEL))


def test_gpu_store_maps_engine_hashes_to_our_chain() -> None:
    p = Pipeline()
    p.feed(stored([b"e1", b"e2"], None, TOKENS[:8]))
    p.feed(stored([b"e3"], b"e2", TOKENS[8:]))  # continuation: parent by engine hash
    assert p.map.match(OURS) == {"e0": Match(3, 3)}
    assert p.map.node(OURS[2]) == (OURS[1], 2)
    p.feed(BlockRemoved(block_hashes=[b"e3"], medium="GPU"))
    assert p.map.match(OURS) == {"e0": Match(2, 2)}


def test_int_engine_hashes_lora_and_cache_salt_change_the_chain() -> None:
    p = Pipeline()
    p.feed(stored([7, 8], None, TOKENS[:8], lora="ad1", extra=[("ad1", "salt9"), ("ad1",)]))
    salted = block_hashes(TOKENS[:8], BS, salt_hash(MODEL, "ad1", "salt9"))
    assert p.map.match(salted) == {"e0": Match(2, 2)}
    assert p.map.match(OURS) == {}


def test_repeated_announcements_are_reference_counted() -> None:
    p = Pipeline()
    p.feed(stored([b"a"], None, TOKENS[:4]))
    p.feed(stored([b"a"], None, TOKENS[:4]))  # a duplicate block with the same hash
    p.feed(BlockRemoved(block_hashes=[b"a"], medium="GPU"))
    assert p.map.match(OURS) == {"e0": Match(1, 1)}
    p.feed(BlockRemoved(block_hashes=[b"a"], medium="GPU"))
    assert p.map.match(OURS) == {}
    assert len(p.tr) == 0


def test_cpu_placeholder_expands_to_the_chunk() -> None:
    p = Pipeline(chunk=2)
    p.feed(stored([b"e1", b"e2", b"e3"], None, TOKENS))
    # Offloading connector: one CPU placeholder per chunk, naming the chunk's last engine hash.
    placeholder = BlockStored(
        block_hashes=[b"e2"],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    p.feed(placeholder)
    p.feed(BlockRemoved(block_hashes=[b"e1", b"e2", b"e3"], medium="GPU"))
    assert p.map.match(OURS) == {"e0": Match(0, 2)}
    p.feed(BlockRemoved(block_hashes=[b"e2"], medium="CPU"))  # the chunk goes as one
    assert p.map.match(OURS) == {}
    assert len(p.tr) == 0


def test_all_blocks_cleared_clears_every_tier() -> None:
    """kvroute's engines reset their CPU tier with the prefix cache, and vLLM publishes no CPU
    removals for it: AllBlocksCleared leaves the instance holding nothing, and forgets the
    engine hashes (a later CPU event for them is unknown)."""
    p = Pipeline()
    p.feed(stored([b"e1"], None, TOKENS[:4]), stored([b"e1"], None, TOKENS[:4], medium="CPU"))
    assert p.map.match(OURS) == {"e0": Match(1, 1)}
    p.feed(AllBlocksCleared())
    assert p.map.match(OURS) == {} and len(p.tr) == 0


def test_malformed_events_are_counted_and_skipped_not_fatal() -> None:
    p = Pipeline()
    good = msgspec.msgpack.encode(stored([b"e1"], None, TOKENS[:4]))
    bad_type = msgspec.msgpack.encode({"type": "NoSuchEvent"})
    bad_field = msgspec.msgpack.encode({"type": "BlockRemoved", "block_hashes": "x", "medium": 1})
    raw = msgspec.msgpack.encode(
        [1.0, [msgspec.Raw(bad_type), msgspec.Raw(good), msgspec.Raw(bad_field)]]
    )
    msg = p.tr.feed(raw, 0, ts=0.0)
    assert msg is not None and len(msg.updates) == 1
    assert p.tr.skipped["undecodable event"] == 2
    assert p.tr.feed(b"\xc1garbage", 1, ts=0.0) is None
    assert p.tr.skipped["undecodable batch"] == 1
    p.engine_seq = 2
    p.feed(stored([b"x"], b"unknown-parent", TOKENS[4:8]))  # parent never seen
    p.feed(stored([b"y"], None, TOKENS[:3]))  # token_ids shorter than a block
    p.feed(BlockRemoved(block_hashes=[b"never"], medium="GPU"))
    p.feed(stored([b"z"], None, TOKENS[:4], medium="STORAGE"))
    assert p.tr.skipped["unknown parent block"] == 1
    assert p.tr.skipped["token_ids length"] == 1
    assert p.tr.skipped["removal of unknown block"] == 1
    assert p.tr.skipped["unsupported medium 'STORAGE'"] == 1


def test_engine_side_gap_and_replay_are_detected() -> None:
    tr = EngineEventTranslator("e0", MODEL, BS)
    assert tr.feed(batch(stored([b"a"], None, TOKENS[:4])), 0, 0.0) is not None
    assert tr.feed(batch(stored([b"b"], b"a", TOKENS[4:8])), 3, 0.0) is not None
    assert tr.engine_gaps == 2
    assert tr.feed(batch(stored([b"c"], b"b", TOKENS[8:])), 2, 0.0) is None  # stale replay


def test_router_side_gap_is_reported_and_snapshot_resyncs() -> None:
    tr = EngineEventTranslator("e0", MODEL, BS)
    m1 = tr.feed(batch(stored([b"e1", b"e2"], None, TOKENS[:8])), 0, 0.0)
    m2 = tr.feed(batch(BlockRemoved(block_hashes=[b"e2"], medium="GPU")), 1, 0.0)
    m3 = tr.feed(batch(stored([b"e3"], b"e1", [9, 9, 9, 9], medium="CPU")), 2, 0.0)
    assert m1 and m2 and m3 and (m1.seq, m2.seq, m3.seq) == (0, 1, 2)
    cmap = CacheMap()
    ing = CacheMapIngestor(cmap)
    assert ing.apply(m1) is None
    gap = ing.apply(m3)  # m2 lost: the map now wrongly holds OURS[1]
    assert gap is not None and (gap.expected, gap.got) == (1, 2)
    assert ing.needs_resync == {"e0"}
    assert ing.apply(m1) is None and ing.duplicates == 1
    ing.apply(tr.snapshot())
    assert ing.needs_resync == set()
    assert cmap.match(OURS) == {"e0": Match(1, 1)}
    cpu_child = block_hashes([9, 9, 9, 9], BS, OURS[0])
    assert cmap.match([OURS[0], *cpu_child]) == {"e0": Match(1, 2)}
    cmap.check_integrity()


def test_a_mark_after_lost_trailing_batches_is_a_gap_and_a_repeated_one_is_not() -> None:
    tr = EngineEventTranslator("e0", MODEL, BS)
    m1 = tr.feed(batch(stored([b"e1", b"e2"], None, TOKENS[:8])), 0, 0.0)
    m2 = tr.feed(batch(BlockRemoved(block_hashes=[b"e2"], medium="GPU")), 1, 0.0)
    assert m1 and m2
    ing = CacheMapIngestor(CacheMap())
    assert ing.apply(LastSeq("e0", -1)) is None  # an instance with no batch yet
    assert ing.apply(m1) is None and ing.apply(LastSeq("e0", 0)) is None
    assert ing.apply(LastSeq("e0", 0)) is None and ing.gaps == 0  # repeated: still whole
    gap = ing.apply(LastSeq("e0", 1))  # m2 was lost and nothing followed it
    assert gap is not None and (gap.expected, gap.got) == (1, 2)
    assert ing.needs_resync == {"e0"} and ing.gaps == 1
    assert ing.apply(LastSeq("e1", 3)) is not None  # every batch of an instance never seen
    assert ing.needs_resync == {"e0", "e1"}
    ing.apply(tr.snapshot())
    assert ing.needs_resync == {"e1"} and ing.apply(LastSeq("e0", 1)) is None
    assert ing.map.match(OURS) == {"e0": Match(1, 1)}


def test_bus_trimming_reports_loss_and_instance_gone_drops() -> None:
    bus = InProcessBus(maxlen=2)
    cmap = CacheMap()
    ing = CacheMapIngestor(cmap)
    consumer = BusConsumer(bus, ing)
    for seq in range(3):
        bus.publish(encode_message(InstanceEvents("e0", seq, 0.0, [])))
    bus.publish(b"not msgpack")
    assert consumer.pump() == 2  # the oldest two were trimmed away
    assert ing.needs_resync == {"e0"} and consumer.malformed == 1
    cmap.store("e0", Tier.GPU, [1])
    bus.publish(encode_message(InstanceGone("e0")))
    consumer.pump()
    assert cmap.instances() == [] and ing.needs_resync == set()


def test_vllm_own_classes_encode_what_we_decode() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    events = [
        kv.BlockStored(
            block_hashes=[b"e1", b"e2"],
            parent_block_hash=None,
            token_ids=TOKENS[:8],
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        kv.BlockStored(
            block_hashes=[b"e2"],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=0,
        ),
        kv.BlockRemoved(block_hashes=[b"e1"], medium="GPU"),
    ]
    payload = msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=2.0, events=events))
    tr = EngineEventTranslator("e0", MODEL, BS)
    msg = tr.feed(payload, 0, ts=0.0)
    assert msg is not None and not tr.skipped
    cmap = CacheMap()
    CacheMapIngestor(cmap).apply(msg)
    # e1 left the GPU, so the GPU run is empty; e2 is on both tiers but its parent is gone.
    assert cmap.match(OURS) == {}
    assert cmap.holders(OURS[1]) == {"e0": frozenset({Tier.GPU, Tier.CPU})}


def test_trusted_hashes_map_hash_only_events_to_themselves() -> None:
    """Hash-only sim engines (trace ids as chained hashes): with ``trusted_hashes`` a
    BlockStored without token ids lands in the map under the engine's own hashes; without it,
    it is skipped (vLLM's hashes are opaque)."""
    ev, child = stored([11, 12], None, []), stored([13], 12, [])
    cmap = CacheMap()
    ingest = CacheMapIngestor(cmap)
    trusted = EngineEventTranslator("a", MODEL, BS, trusted_hashes=True)
    msg = trusted.feed(batch(ev, child), 0, 0.0)
    assert msg is not None and ingest.apply(msg) is None
    assert cmap.match([11, 12, 13, 99])["a"] == Match(3, 3)
    opaque = EngineEventTranslator("b", MODEL, BS)
    assert opaque.feed(batch(ev), 0, 0.0) is None and opaque.skipped["token_ids length"] == 1
    assert trusted.feed(batch(stored([b"x"], None, [])), 1, 0.0) is None
    assert trusted.skipped["trusted hash not a 64-bit int"] == 1


def test_adjacent_removals_become_one_update() -> None:
    tr = EngineEventTranslator("a", MODEL, BS, trusted_hashes=True)
    tr.feed(batch(stored([1, 2, 3], None, [])), 0, 0.0)
    gone = [BlockRemoved(block_hashes=[h], medium="GPU") for h in (3, 2, 1)]
    msg = tr.feed(batch(*gone), 1, 0.0)
    assert msg is not None and msg.updates == [Removed("GPU", [3, 2, 1])]


def test_removal_runs_split_by_tier_and_skip_unsupported_media_per_event() -> None:
    tr = EngineEventTranslator("a", MODEL, BS, trusted_hashes=True)
    tr.feed(batch(stored([1, 2, 3, 4], None, [])), 0, 0.0)
    tr.feed(batch(stored([1, 2], None, [], medium="CPU")), 1, 0.0)
    events = [
        BlockRemoved(block_hashes=[4], medium="GPU"),
        BlockRemoved(block_hashes=[3], medium=None),  # None is the GPU as well
        BlockRemoved(block_hashes=[9], medium="DISK"),  # skipped, does not end the run
        BlockRemoved(block_hashes=[2], medium="GPU"),
        BlockRemoved(block_hashes=[2], medium="CPU"),
        BlockRemoved(block_hashes=[1], medium="GPU"),
        stored([5], None, []),
        BlockRemoved(block_hashes=[5], medium="GPU"),
        BlockRemoved(block_hashes=[77], medium="GPU"),  # unknown: skipped
    ]
    msg = tr.feed(batch(*events), 2, 0.0)
    assert msg is not None and msg.updates == [
        Removed("GPU", [4, 3, 2]),
        Removed("CPU", [2]),
        Removed("GPU", [1]),
        Stored("GPU", [5], None, 0),
        Removed("GPU", [5]),
    ]
    assert tr.skipped["unsupported medium 'DISK'"] == 1
    assert tr.skipped["removal of unknown block"] == 1
    assert len(tr) == 1  # only block 1, still on the CPU tier


def test_a_batch_applies_in_order_with_its_store_runs_in_one_pass() -> None:
    """Consecutive stores on one tier reach the map together (``CacheMap.store_chains``); a
    removal, a clear or another tier ends the run, so the batch's order still decides."""
    updates = [
        Stored("GPU", [1, 2], None, 0),
        Stored("GPU", [3], 2, 2),
        Stored("CPU", [3], 2, 2),
        Stored("GPU", [4], 3, 3),
        Removed("GPU", [3, 4]),
        Stored("GPU", [4], 3, 3),
        Cleared(None),
        Stored("CPU", [9], None, 0),
        Stored("CPU", [10], 9, 1),
    ]
    cmap = CacheMap()
    seq = CacheMap()
    CacheMapIngestor(cmap).apply(InstanceEvents("e0", 0, 0.0, updates[:6]))
    for u in updates[:6]:
        if isinstance(u, Stored):
            seq.store("e0", as_tier(u.tier), u.hashes, u.parent, u.depth)
        else:
            seq.remove("e0", as_tier(u.tier), u.hashes)
    assert cmap.match([1, 2, 3, 4]) == seq.match([1, 2, 3, 4]) == {"e0": Match(2, 4)}
    assert cmap.holders(4) == {"e0": frozenset({Tier.GPU})} and cmap.node(4) == (3, 3)
    CacheMapIngestor(cmap).apply(InstanceEvents("e0", 0, 0.0, updates[6:]))
    assert cmap.match([1]) == {} and cmap.match([9, 10]) == {"e0": Match(0, 2)}
    cmap.check_integrity()


def _state(cmap: CacheMap) -> dict[tuple[str, str], set[int]]:
    return {
        (iid, t.value): set(cmap.resident(iid, t))
        for iid in ("e0", "e1")
        for t in (Tier.GPU, Tier.CPU)
    } | {("count", t.value): dict(cmap.counts(t)) for t in (Tier.GPU, Tier.CPU)}


_update = st.one_of(
    st.builds(
        lambda tier, start, n: (
            Stored(tier, list(range(start, start + n)), None, 0)
            if start == 1
            else Stored(tier, list(range(start, start + n)), start - 1, start - 1)
        ),
        st.sampled_from(["GPU", "CPU"]),
        st.integers(1, 8),
        st.integers(1, 4),
    ),
    st.builds(
        lambda tier, hs: Removed(tier, hs),
        st.sampled_from(["GPU", "CPU"]),
        st.lists(st.integers(1, 12), min_size=1, max_size=5),
    ),
    st.builds(Cleared, st.sampled_from(["GPU", "CPU", None])),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["e0", "e1"]), st.lists(_update, min_size=1, max_size=4)),
        min_size=1,
        max_size=8,
    )
)
def test_a_bus_read_applied_together_ends_as_its_batches_applied_one_by_one(batches) -> None:
    """``apply_all`` gathers an instance's consecutive batches (stores before removals, per
    tier) and must end where applying each batch alone does, also when a hash removed is
    stored again after, or a clear comes between."""
    seqs = {"e0": 0, "e1": 0}
    msgs = []
    for iid, updates in batches:
        msgs.append(InstanceEvents(iid, seqs[iid], 0.0, updates))
        seqs[iid] += 1
    together, alone = CacheMap(), CacheMap()
    assert CacheMapIngestor(together).apply_all(msgs) == []
    one = CacheMapIngestor(alone)
    for m in msgs:
        assert one.apply(m) is None
    assert _state(together) == _state(alone)
    together.check_integrity()


def test_translate_takes_the_events_feed_decodes() -> None:
    """A virtual engine's events go to ``translate`` without their bytes: the same message as
    ``feed`` of the encoded batch, the same sequence checks."""
    events = [
        stored([1, 2], None, TOKENS[:8]),
        stored([3], 2, TOKENS[8:]),
        BlockRemoved(block_hashes=[3], medium="GPU"),
    ]
    by_bytes = EngineEventTranslator("e0", MODEL, BS)
    by_events = EngineEventTranslator("e0", MODEL, BS)
    msg = by_bytes.feed(batch(*events), 0, 1.5)
    assert msg is not None and by_events.translate(events, 0, 1.5) == msg
    assert msg.updates == [
        Stored("GPU", OURS[:2], None, 0),
        Stored("GPU", OURS[2:], OURS[1], 2),
        Removed("GPU", [OURS[2]]),
    ]
    assert by_events.translate(events, 0, 2.0) is None  # a replayed batch
    assert by_events.translate([BlockRemoved(block_hashes=[1], medium="GPU")], 3, 2.0) is not None
    assert by_events.engine_gaps == 2
