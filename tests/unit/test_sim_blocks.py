"""The sim's paged KV block manager: vLLM's prefix-hit rule, LRU over free blocks with tail-first
freeing, uncached blocks reused first, no de-duplication, the CPU tier with a policy, and KV
events that rebuild the engine's residency in a CacheMap."""

from __future__ import annotations

import random

import pytest

from cachemap import BlockHasher, CacheMap, Tier
from cachemap.events import BlockRemoved, BlockStored, KVEventBatch, encode_vllm_batch
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator
from engines.sim.blocks import KVBlockManager
from engines.sim.request import SimRequest, make_request
from policies.base import RequestInfo

BS = 4
MML = 10_000


def req(rid: str, tokens: list[int], model: str = "sim") -> SimRequest:
    return make_request(rid, block_size=BS, max_tokens=8, prompt_token_ids=tokens, model=model)


def admit(bm: KVBlockManager, r: SimRequest) -> int:
    """Look up and allocate the whole prompt (one chunk); returns the hit in tokens."""
    hit, n_cpu = bm.lookup(r)
    computed = (len(hit) + n_cpu) * BS
    assert bm.allocate_new(r, r.num_tokens - computed, hit, n_cpu, MML)
    r.num_computed = r.num_tokens
    return computed


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_prefix_hit_never_covers_the_last_prompt_token():
    bm = KVBlockManager(64, BS)
    a = req("a", toks(100, 16))  # exactly 4 blocks
    assert admit(bm, a) == 0
    bm.free(a)
    # The same 16-token prompt: at most 15 tokens may hit, so the last block is recomputed.
    assert admit(bm, req("b", toks(100, 16))) == 12
    # One token more: all four blocks hit.
    assert admit(bm, req("c", toks(100, 17))) == 16
    # A prompt sharing 2.5 blocks hits the 2 full ones.
    assert admit(bm, req("d", [*toks(100, 10), 7, 7, 7, 7])) == 8


def test_lru_order_and_tail_first_freeing():
    bm = KVBlockManager(9, BS)  # 8 usable blocks
    a, b = req("a", toks(100, 12)), req("b", toks(200, 12))  # 3 full blocks each
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    ha, hb = a.block_hashes, b.block_hashes
    # Never-used blocks first, then a's blocks tail first, then b's tail first.
    assert bm.free_queue_hashes() == [None, None, ha[2], ha[1], ha[0], hb[2], hb[1], hb[0]]
    c = req("c", toks(300, 16))  # 4 new blocks: evicts a's tail and middle block
    admit(bm, c)
    assert bm.gpu_hashes() >= {ha[0], *hb} and not {ha[1], ha[2]} & bm.gpu_hashes()
    assert admit(bm, req("a2", toks(100, 13))) == 4  # only a's head survives


def test_hit_on_a_free_block_refreshes_it():
    bm = KVBlockManager(7, BS)  # 6 usable
    a, b = req("a", toks(100, 8)), req("b", toks(200, 8))
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    a2 = req("a2", toks(100, 9))
    assert admit(bm, a2) == 8  # takes a's blocks out of the free queue
    bm.free(a2)  # ... and puts them back behind b's
    hb, ha = b.block_hashes, a.block_hashes
    assert bm.free_queue_hashes()[-4:] == [hb[1], hb[0], ha[1], ha[0]]


def test_partial_blocks_are_reused_before_cached_ones():
    bm = KVBlockManager(5, BS)
    a = req("a", toks(100, 6))  # 1 full block + a partial one
    admit(bm, a)
    bm.free(a)
    q = bm.free_queue_hashes()
    assert q[0] is None and q[-1] == a.block_hashes[0]


def test_a_pool_makes_its_blocks_on_first_use_in_the_queue_order():
    """Blocks never used exist only once taken, from the middle of the free queue: behind
    the uncached blocks freed, ahead of the cached ones."""
    bm = KVBlockManager(100_000, BS)
    assert len(bm.blocks) == 1 and bm.num_free == 99_999 and bm.gpu_usage() == 0.0
    a = req("a", toks(100, 6))  # 1 full block + a partial one
    admit(bm, a)
    partial = a.blocks[1].block_id
    assert len(bm.blocks) == 3 and bm.num_free == 99_997
    bm.free(a)
    q = bm.free_queue_hashes()
    assert len(q) == 99_999 and q[0] is None and q[-1] == a.block_hashes[0]
    b = req("b", toks(500, 3))  # one partial block: a's, from the front
    admit(bm, b)
    assert [x.block_id for x in b.blocks] == [partial] and len(bm.blocks) == 3
    c = req("c", toks(900, 8))  # two blocks never used before
    admit(bm, c)
    assert [x.block_id for x in c.blocks] == [3, 4] and bm.num_free == 99_996


def test_equal_blocks_computed_twice_are_both_cached():
    # Two requests looked up before either stored: both miss, both store (as vLLM does).
    bm2 = KVBlockManager(16, BS, enable_events=True)
    c, d = req("c", toks(100, 9)), req("d", toks(100, 9))
    hc, hd = bm2.lookup(c), bm2.lookup(d)
    assert bm2.allocate_new(c, 9, *hc, MML) and bm2.allocate_new(d, 9, *hd, MML)
    stored = [e for e in bm2.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [c.block_hashes, d.block_hashes]
    bm2.free(c)
    bm2.free(d)
    big = req("big", toks(500, 4 * 15))  # needs all 15 blocks: evicts both copies
    admit(bm2, big)
    events = bm2.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(c.block_hashes * 2)


def test_admission_needs_room_for_the_whole_prompt():
    bm = KVBlockManager(5, BS)  # 4 usable
    a = req("a", toks(100, 8))
    admit(bm, a)
    big = req("big", toks(200, 12))  # 3 blocks, 2 free
    hit, n_cpu = bm.lookup(big)
    assert not bm.allocate_new(big, 4, hit, n_cpu, MML)  # even a 1-block chunk is refused
    assert bm.num_free == 2 and not big.blocks


def test_cpu_tier_takes_gpu_evictions_and_serves_hits():
    bm = KVBlockManager(5, BS, cpu_capacity_blocks=3, cpu_policy="lru", enable_events=True)
    a = req("a", toks(100, 13))  # 3 full blocks + 1 token
    admit(bm, a)
    bm.free(a)
    admit(bm, req("b", toks(200, 16)))  # evicts all of a's blocks to the CPU tier
    assert bm.cpu_hashes() == set(a.block_hashes) and not bm.gpu_hashes() & set(a.block_hashes)
    events = bm.take_events()
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [e.block_hashes[0] for e in cpu_stored] == [
        a.block_hashes[2],
        a.block_hashes[1],
        a.block_hashes[0],
    ]
    assert cpu_stored[0].token_ids == toks(108, 4)
    assert cpu_stored[0].parent_block_hash == a.block_hashes[1]


def test_cpu_hit_loads_blocks_and_lru_policy_orders_cpu_evictions():
    bm = KVBlockManager(5, BS, cpu_capacity_blocks=4, cpu_policy="lru")
    a = req("a", toks(100, 13))
    admit(bm, a)
    bm.free(a)
    b = req("b", toks(200, 16))
    admit(bm, b)  # a -> CPU
    bm.free(b)
    a2 = req("a2", toks(100, 13))
    hit, n_cpu = bm.lookup(a2)
    assert (len(hit), n_cpu) == (0, 3)
    assert admit(bm, a2) == 12  # loaded from CPU: counts as cached
    assert set(a.block_hashes) <= bm.gpu_hashes()
    # b's blocks were evicted to CPU while a2 loaded (CPU holds 4): the LRU victims are a's
    # blocks touched least recently, never the ones being loaded.
    assert len(bm.cpu_hashes()) == 4 and bm.cpu.evictions > 0


def test_cpu_tier_uses_the_named_policy():
    """The CPU tier's victim comes from the policy. x2 loads x0, x1 from the CPU tier and
    reports that reuse when it ends; later offloads evict: LRU the least recently used block
    (y0, so x0 and x1 stay), FIFO the first inserted (x1)."""
    kept = {}
    for name in ("lru", "fifo"):
        bm = KVBlockManager(4, BS, cpu_capacity_blocks=3, cpu_policy=name)  # 3 usable GPU blocks
        x = req("x", toks(100, 9))
        for r in (x, req("y", toks(200, 9)), req("x2", toks(100, 9)), req("v", toks(300, 9))):
            bm.begin_request(r)
            admit(bm, r)
            bm.free(r)
            bm.end_request(r)  # x2 reports its reuse of x0, x1 here
        admit(bm, req("u", toks(400, 5)))
        kept[name] = bm.cpu_hashes()
        assert bm.cpu.policy.name == name
    x0, x1 = x.block_hashes
    assert {x0, x1} <= kept["lru"]
    assert x0 in kept["fifo"] and x1 not in kept["fifo"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_events_rebuild_the_residency_in_a_cache_map(seed):
    rng = random.Random(seed)
    bm = KVBlockManager(24, BS, cpu_capacity_blocks=10, enable_events=True)
    translator = EngineEventTranslator("sim-0", "sim", BS)
    cmap = CacheMap()
    ingest = CacheMapIngestor(cmap)
    hasher = BlockHasher("sim", BS)
    ours: dict[int, int] = {}
    prefixes = [[rng.randrange(1000, 1100) for _ in range(rng.randrange(0, 13))] for _ in range(3)]
    live: list[SimRequest] = []
    for i in range(150):
        if live and rng.random() < 0.45:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            salt = rng.choice([None, None, "tenant-b"])  # travels in extra_keys of block 0
            tokens = rng.choice(prefixes) + [rng.randrange(1000, 1100) for _ in range(9)]
            r = make_request(
                f"r{i}", block_size=BS, max_tokens=8, prompt_token_ids=tokens, cache_salt=salt
            )
            ours.update(zip(r.block_hashes, hasher(tokens, cache_salt=salt), strict=True))
            hit, n_cpu = bm.lookup(r)
            n = r.num_tokens - (len(hit) + n_cpu) * BS
            if bm.allocate_new(r, n, hit, n_cpu, MML):
                live.append(r)
        msg = translator.feed(
            encode_vllm_batch(KVEventBatch(ts=float(i), events=bm.take_events())), i, float(i)
        )
        if msg is not None:
            ingest.apply(msg)
        assert {ours[h] for h in bm.gpu_hashes()} == set(cmap.resident("sim-0", Tier.GPU))
        assert {ours[h] for h in bm.cpu_hashes()} == set(cmap.resident("sim-0", Tier.CPU))
    assert translator.skipped.total() == 0


def _online_policies() -> list[str]:
    from policies.base import OfflinePolicy
    from policies.registry import get_policy_class, policy_names

    return [n for n in policy_names() if not issubclass(get_policy_class(n), OfflinePolicy)]


@pytest.mark.parametrize("policy", _online_policies())
def test_cpu_tier_runs_every_online_policy(policy):
    """Any registered policy orders the CPU tier; capacity holds and the policy tracks exactly
    the resident blocks."""
    rng = random.Random(0)
    bm = KVBlockManager(12, BS, cpu_capacity_blocks=6, cpu_policy=policy)
    prefixes = [toks(100 * (i + 1), 4 * rng.randrange(1, 4)) for i in range(4)]
    loaded = 0
    for i in range(120):
        r = req(f"r{i}", rng.choice(prefixes) + toks(5000 + 10 * i, rng.randrange(1, 6)))
        bm.begin_request(r)
        hit, n_cpu = bm.lookup(r)
        n = r.num_tokens - (len(hit) + n_cpu) * BS
        assert bm.allocate_new(r, n, hit, n_cpu, MML)
        loaded += n_cpu
        bm.free(r)
        bm.end_request(r)
        assert len(bm.cpu_hashes()) <= 6 and len(bm.cpu.policy) == len(bm.cpu_hashes())
    assert loaded > 0


def _run(bm: KVBlockManager, r: SimRequest) -> int:
    bm.begin_request(r)
    hit = admit(bm, r)
    bm.free(r)
    bm.end_request(r)
    return hit


@pytest.mark.parametrize("policy", ["lru", "wa"])
def test_a_pinned_prefix_survives_a_flood_in_the_cpu_tier_and_unpins(policy):
    """An operator's pin (RequestInfo.pin) keeps a prefix's blocks in the CPU tier through a
    flood of other prompts that evicts the same-sized unpinned control; unpinning makes them
    victims again. The GPU tier has no pins (vLLM's has none either)."""
    bm = KVBlockManager(6, BS, cpu_capacity_blocks=8, cpu_policy=policy, enable_events=True)
    pinned, control = toks(100, 16), toks(500, 16)  # 4 blocks each
    pin = req("pin", pinned)
    pin.info = RequestInfo(category="sys_1", pin=True)
    _run(bm, pin)
    _run(bm, req("control", control))
    for i in range(40):
        _run(bm, req(f"flood{i}", toks(1_000 + 100 * i, 17)))
    assert set(pin.block_hashes) <= bm.cpu_hashes()
    assert not set(req("c", control).block_hashes) & bm.cpu_hashes()
    assert _run(bm, req("again", [*pinned, 7])) == 16  # the next request is a full hit

    unpin = req("unpin", [*pinned, 7])
    unpin.info = RequestInfo(pin=False)
    _run(bm, unpin)
    for i in range(40):
        _run(bm, req(f"flood2-{i}", toks(9_000 + 100 * i, 17)))
    assert not set(pin.block_hashes) & bm.cpu_hashes()


def test_pins_never_overfill_the_tier():
    """With every resident block pinned, an offload is refused rather than evicting a pin."""
    bm = KVBlockManager(6, BS, cpu_capacity_blocks=2, cpu_policy="lru")
    pin = req("pin", toks(100, 16))
    pin.info = RequestInfo(pin=True)
    _run(bm, pin)
    for i in range(10):
        _run(bm, req(f"f{i}", toks(1_000 + 100 * i, 17)))
    assert len(bm.cpu_hashes()) == 2 and bm.cpu_hashes() <= set(pin.block_hashes)


def test_clear_cache_empties_both_tiers_and_says_so_in_events():
    """The sim's reset_prefix_cache: refused while a request holds blocks, then both tiers
    empty, and the events it publishes empty the engine's residency in a CacheMap too."""
    bm = KVBlockManager(6, BS, cpu_capacity_blocks=4, enable_events=True)
    cmap = CacheMap()
    ingest = CacheMapIngestor(cmap)
    translator = EngineEventTranslator("sim-0", "sim", BS)
    seq = iter(range(100))

    def publish() -> None:
        batch = encode_vllm_batch(KVEventBatch(ts=0.0, events=bm.take_events()))
        msg = translator.feed(batch, next(seq), 0.0)
        if msg is not None:
            ingest.apply(msg)

    _run(bm, req("a", toks(100, 16)))
    _run(bm, req("b", toks(200, 17)))  # a -> CPU
    publish()
    assert cmap.resident("sim-0", Tier.GPU) and cmap.resident("sim-0", Tier.CPU)
    held = req("held", toks(300, 5))
    admit(bm, held)
    assert not bm.clear_cache()  # a request holds blocks: refused, nothing changed
    bm.free(held)
    assert bm.gpu_hashes() and bm.cpu_hashes()
    assert bm.clear_cache()
    assert not bm.gpu_hashes() and not bm.cpu_hashes()
    publish()
    assert not cmap.resident("sim-0", Tier.GPU) and not cmap.resident("sim-0", Tier.CPU)
    assert _run(bm, req("a2", toks(100, 16))) == 0  # a miss now


def test_an_offloaded_block_carries_the_request_that_held_it() -> None:
    """The CPU tier stores a GPU-evicted block on behalf of the request that last held it, not of
    whichever request's allocation evicted it (LPC's odds are per request)."""
    bm = KVBlockManager(5, BS, cpu_capacity_blocks=8, cpu_policy="lpc")
    a = req("a", toks(100, 13))
    a.info = RequestInfo(category="text_1", continuation=0.9)
    _run(bm, a)
    b = req("b", toks(200, 16))
    b.info = RequestInfo(category="api_1", continuation=0.0)
    bm.begin_request(b)  # b is the latest to arrive when a's blocks leave the GPU
    seen: list[float | None] = []
    policy = bm.cpu.policy  # type: ignore[union-attr]
    original = policy.resume_request

    def spy(info: RequestInfo, now_s: float) -> None:
        seen.append(info.continuation)
        original(info, now_s)

    policy.resume_request = spy  # type: ignore[method-assign]
    admit(bm, b)
    assert set(a.block_hashes) <= bm.cpu_hashes()
    assert seen and set(seen) == {0.9}  # every offload on a's behalf
