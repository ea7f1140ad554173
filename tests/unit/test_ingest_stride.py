"""A coarser router granularity: the translator keeps every k-th block, the map matches in whole
runs of k engine blocks, and nothing else changes."""

from __future__ import annotations

import itertools
import random

import pytest

from cachemap import CacheMap, Tier, block_hashes, salt_hash
from cachemap.events import (
    BlockRemoved,
    BlockStored,
    EngineHash,
    KVEventBatch,
    encode_vllm_batch,
)
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator

BS = 4
MODEL = "tiny"


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str) -> BlockStored:
    return BlockStored(list[EngineHash](hashes), parent, tokens, BS, None, medium, None)


class Engine:
    """One engine's block pool as vLLM reports it: a block's hash is its prefix's (the same
    prefix is the same block), only blocks not yet cached on a tier are announced (in pieces,
    a parent chain across events), and eviction takes a leaf (a prefix's last blocks go before
    its first: what stays on a tier is closed under prefixes). Every batch goes to a translator
    of each stride."""

    def __init__(self, strides: tuple[int, ...]) -> None:
        self.maps = {k: CacheMap(stride=k) for k in strides}
        self.tr = {k: EngineEventTranslator("e0", MODEL, BS, stride=k) for k in strides}
        self.ing = {k: CacheMapIngestor(m) for k, m in self.maps.items()}
        self.seq = 0
        self.ids: dict[tuple[int, ...], int] = {}  # a prefix -> its last block's engine hash
        self.parent: dict[int, int | None] = {}
        self.held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}

    def feed(self, *events: object) -> None:
        payload = encode_vllm_batch(KVEventBatch(ts=0.0, events=list(events)))  # type: ignore[arg-type]
        for k, tr in self.tr.items():
            msg = tr.feed(payload, self.seq, 0.0)
            if msg is not None:
                self.ing[k].apply(msg)
        self.seq += 1

    def store(self, tokens: list[int], medium: str, rng: random.Random) -> None:
        hashes: list[int] = []
        for i in range(len(tokens) // BS):
            h = self.ids.setdefault(tuple(tokens[: (i + 1) * BS]), len(self.ids) + 1)
            self.parent[h] = hashes[-1] if hashes else None
            hashes.append(h)
        held = self.held[medium]
        first = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        n = len(hashes)
        cuts = sorted({first, n, *rng.sample(range(first, n), min(2, n - first))})
        for a, b in itertools.pairwise(cuts):
            parent = hashes[a - 1] if a else None
            self.feed(stored(hashes[a:b], parent, tokens[a * BS : b * BS], medium))
        held.update(hashes)

    def evict(self, medium: str, rng: random.Random, n: int) -> None:
        held = self.held[medium]
        for _ in range(n):
            inner = {self.parent[h] for h in held}
            leaves = sorted(held - inner)
            if not leaves:
                return
            h = rng.choice(leaves)
            held.discard(h)
            self.feed(BlockRemoved([h], medium))


@pytest.mark.parametrize("seed", range(4))
def test_a_strided_map_matches_whole_runs_of_the_full_one(seed: int) -> None:
    rng = random.Random(seed)
    eng = Engine((1, 2, 4))
    salt = salt_hash(MODEL)
    systems = [[rng.randrange(1000) for _ in range(BS * rng.randint(1, 9))] for _ in range(3)]
    prompts = []
    for _ in range(40):
        tokens = rng.choice(systems) + [rng.randrange(1000) for _ in range(BS * rng.randint(0, 12))]
        prompts.append(tokens)
        eng.store(tokens, "GPU" if rng.random() < 0.7 else "CPU", rng)
        if rng.random() < 0.4:
            eng.evict(rng.choice(("GPU", "CPU")), rng, rng.randint(1, 12))
    for tokens in prompts:
        fine = block_hashes(tokens, BS, salt)
        full = eng.maps[1].match(fine).get("e0")
        for k in (2, 4):
            got = eng.maps[k].match(fine).get("e0")
            if full is None:
                assert got is None
                continue
            g, a = full.gpu_blocks // k * k, full.total_blocks // k * k
            assert ((got.gpu_blocks, got.total_blocks) if got else (0, 0)) == (g, a), (k, full)
    for k in (2, 4):  # a resync from the translator's snapshot gives the same map
        snap = eng.tr[k].snapshot()
        fresh = CacheMap(stride=k)
        CacheMapIngestor(fresh).apply(snap)
        for tier in Tier:
            assert sorted(fresh.resident("e0", tier)) == sorted(eng.maps[k].resident("e0", tier))
        assert fresh.count("e0", Tier.GPU) == eng.maps[k].count("e0", Tier.GPU)
        # fewer entries (about k times fewer: one per kept block of each branch)
        assert eng.maps[k].stats().residency < eng.maps[1].stats().residency
        eng.maps[k].check_integrity()


def test_the_kept_chain_links_kept_blocks() -> None:
    tokens = list(range(BS * 9))
    tr = EngineEventTranslator("e0", MODEL, BS, stride=4)
    hashes = list(range(1, 10))
    payload = encode_vllm_batch(
        KVEventBatch(ts=0.0, events=[stored(hashes[:6], None, tokens[: 6 * BS], "GPU")])
    )
    first = tr.feed(payload, 0, 0.0)
    payload = encode_vllm_batch(
        KVEventBatch(ts=0.0, events=[stored(hashes[6:], 6, tokens[6 * BS :], "GPU")])
    )
    second = tr.feed(payload, 1, 0.0)
    ours = block_hashes(tokens, BS, salt_hash(MODEL))
    assert first is not None and second is not None
    assert first.updates[0].hashes == [ours[3]] and first.updates[0].parent is None  # type: ignore[union-attr]
    assert second.updates[0].hashes == [ours[7]]  # type: ignore[union-attr]
    assert second.updates[0].parent == ours[3] and second.updates[0].depth == 1  # type: ignore[union-attr]
    removed = tr.feed(encode_vllm_batch(KVEventBatch(0.0, [BlockRemoved([9, 8], "GPU")])), 2, 0.0)
    assert removed is not None and removed.updates[0].hashes == [ours[7]]  # type: ignore[union-attr]
    assert tr.feed(encode_vllm_batch(KVEventBatch(0.0, [BlockRemoved([7], "GPU")])), 3, 0.0) is None
    with pytest.raises(ValueError, match="stride"):
        EngineEventTranslator("e0", MODEL, BS, stride=0)
