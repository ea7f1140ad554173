"""The cluster KV pool in the cache map and the router (issue 58): the pool's announcements
mirror what it holds, kv_ttft's hint declines loads a slow link makes dearer than recompute,
and a load from the pool is asynchronous (the batch runs while it comes)."""

from __future__ import annotations

import pytest

from cachemap import POOL_INSTANCE, CacheMap, Match, Tier
from cachemap.events import InstanceEvents
from cachemap.ingest import CacheMapIngestor
from engines.pool.link import PoolLink
from engines.profile import LatencyProfile
from engines.sim.options import SimEngineOptions
from engines.sim.pool import SimPool
from engines.sim.virtual import VirtualInstance, trace_arrival
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from router.placement import InstanceView, PlacementRequest, profile_ttft
from router.scorers.kv_ttft import KvTtftScorer
from simulation.cluster import ClusterSimulator
from simulation.settings import EXACT, SimSettings

BS = 512


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")


def mirrored(pool: SimPool, until_s: float, cmap: CacheMap, seq: list[int]) -> None:
    """Apply the pool's announcements up to ``until_s`` to ``cmap``, as the KV bus does."""
    updates = pool.take_updates(until_s)
    if updates:
        seq[0] += 1
        CacheMapIngestor(cmap).apply(InstanceEvents(POOL_INSTANCE, seq[0], until_s, updates))


@pytest.mark.parametrize("stride", [1, 2])
def test_the_map_mirrors_the_pool_through_stores_and_evictions(stride):
    pool = SimPool(5, 1, announce=True, stride=stride)
    cmap, seq = CacheMap(stride=stride), [-1]
    chains = [[11, 12, 13, 14], [11, 12, 21, 22], [31, 32, 33, 34], [11, 12, 13, 14, 15, 16]]
    for t, chain in enumerate(chains):
        pool.put(chain, 0, len(chain), float(t))
        # the pool's truth, seen through the map at the map's stride, once the lag has passed
        mirrored(pool, float(t), cmap, seq)
        held = set(cmap.resident(POOL_INSTANCE, Tier.CPU))
        kept = {h for c in chains[: t + 1] for i, h in enumerate(c) if (i + 1) % stride == 0}
        assert held == kept & set(pool._ready)
    assert pool.evictions > 0
    # a prompt's match names the pool as a holder on the CPU tier: its leading run there
    pool.put([41, 42, 43, 44], 0, 4, 9.0)
    mirrored(pool, 9.0, cmap, seq)
    got = cmap.match([41, 42, 43, 44, 45]).get(POOL_INSTANCE)
    assert got is not None and got.gpu_blocks == 0
    assert got.total_blocks == pool.match([41, 42, 43, 44, 45], 0, 5, 9.0) // stride * stride == 4


def test_announcements_wait_for_their_time_and_keep_their_order():
    pool = SimPool(2, 1, announce=True)
    pool.put([1, 2], 0, 2, 1.0)
    pool.put([3], 0, 1, 2.0)  # evicts 1 (LRU)
    assert pool.take_updates(0.5) == []
    first = pool.take_updates(1.0)
    assert [type(u).__name__ for u in first] == ["Stored"] and first[0].hashes == [1, 2]
    later = pool.take_updates(5.0)
    assert [(type(u).__name__, u.hashes) for u in later] == [("Removed", [1]), ("Stored", [3])]
    quiet = SimPool(2, 1)  # not announcing: nothing kept
    quiet.put([1, 2], 0, 2, 1.0)
    assert quiet.take_updates(9.0) == []


def view(profile: LatencyProfile, iid: str, **load: int) -> InstanceView:
    return InstanceView(iid, BS, profile, kv_capacity_blocks=1000, **load)


def test_kv_ttft_hints_a_load_unless_the_link_is_slower_than_recompute(profile):
    req = PlacementRequest("r", 20 * BS + 7, list(range(1, 21)))
    match = {POOL_INSTANCE: Match(0, 20)}
    views = [view(profile, "a"), view(profile, "b")]
    for gbps, load in ((25.0, True), (1.25, False)):
        scorer = KvTtftScorer()
        scorer.attach_pool(PoolLink(gbps, 0.4))
        assert scorer.place(req, views, match).detail["pool_load"] is load
    # 20 blocks of 512 tokens of an 8B Llama: 1.3 GB; 53 ms at 25 GB/s, 1.1 s at 1.25 GB/s,
    # against ~0.4 s to compute them on an H100
    fast, slow = PoolLink(25.0, 0.4), PoolLink(1.25, 0.4)
    cold, _ = profile_ttft(req, views[0], None)
    for link, cached in ((fast, 20), (slow, 0)):
        est, got = profile_ttft(req, views[0], None, pool_blocks=20, link=link)
        assert got == cached and est <= cold
    # without a pool the placement carries no hint
    assert "pool_load" not in KvTtftScorer().place(req, views, match).detail


def test_price_pool_places_by_the_pools_residency(profile):
    """Off by default (docs/pool.md): the holder's queue decides; on, an idle engine that
    would load the prefix from the pool wins over a busy holder."""
    req = PlacementRequest("r", 20 * BS + 7, list(range(1, 21)))
    holder = view(profile, "holder", waiting=1, running=4, pending_prefill_tokens=5_000)
    idle = view(profile, "idle")
    match = {"holder": Match(20, 20), POOL_INSTANCE: Match(0, 20)}
    for price, want in ((False, "holder"), (True, "idle")):
        scorer = KvTtftScorer(price_pool=price, calibrate=False, externality=0.0)
        scorer.attach_pool(PoolLink())
        got = scorer.place(req, [holder, idle], match)
        assert got.instance_id == want
        assert got.cached_blocks == 20


def test_a_pool_load_is_asynchronous_the_batch_runs_meanwhile(profile):
    """A request loading from the pool waits aside; a request arriving with it that needs no
    load is admitted in the next step, not after the load."""
    opts = SimEngineOptions(block_size=BS)
    pool = SimPool(64, BS * profile.kv_bytes_per_token, link=PoolLink(0.5, 0.4))  # a slow link
    a = VirtualInstance("a", profile, options=opts, pool=pool)
    _, r0 = trace_arrival("r0", 0.0, 20 * BS + 7, 2, list(range(1, 21)), BS, BS)
    a.submit(r0, 0.0)
    a.run_until(100.0)
    b = VirtualInstance("b", profile, options=opts, pool=pool)
    _, loads = trace_arrival("r1", 100.0, 20 * BS + 7, 2, list(range(1, 21)), BS, BS)
    _, plain = trace_arrival("r2", 100.0, 300, 2, [900], BS, BS)
    b.submit(loads, 100.0)
    b.submit(plain, 100.0)
    b.run_until(200.0)
    load_s = pool.load_s(20)
    assert load_s > 2.0
    assert plain.first_token_s - 100.0 < 0.1  # not behind the load
    assert loads.cached_tokens == 20 * BS
    assert loads.first_token_s - 100.0 == pytest.approx(load_s, abs=0.1)
    # the router's hint can decline it: the same request recomputes
    c = VirtualInstance("c", profile, options=opts, pool=pool)
    _, declined = trace_arrival("r3", 100.0, 20 * BS + 7, 2, list(range(1, 21)), BS, BS)
    declined.pool_load = False
    c.submit(declined, 100.0)
    c.run_until(200.0)
    assert declined.cached_tokens == 0 and declined.first_token_s - 100.0 < load_s


def test_a_cluster_routes_with_the_pool_in_its_map(profile):
    """kv_ttft on a simulated cluster with a pool: once the event lag has passed, the map's
    pool tier equals the pool's truth, evictions included."""
    plan = build_schedule(generate("to-b", SynthParams(rate=30.0, duration_s=8.0, seed=1)))
    settings = SimSettings(3, perturbation=EXACT, pool_gib=0.5, event_lag_s=0.0)
    sim = ClusterSimulator(profile, "kv_ttft", settings, SYNTH_BLOCK_SIZE)
    try:
        run = sim.run(plan)
        pool = sim.pool
        assert pool is not None and pool.evictions > 0 and pool.loads > 0
        sim._publish_events(1e9)  # everything announced reaches the map
        held = set(sim.core.cache_map.resident(POOL_INSTANCE, Tier.CPU))
        assert held == set(pool._ready)
    finally:
        sim.close()
    assert all(r.ok for r in run.records)


def test_an_engine_lost_mid_run_takes_nothing_after_and_its_pool_blocks_stay(profile):
    plan = build_schedule(generate("to-b", SynthParams(rate=30.0, duration_s=8.0, seed=1)))
    settings = SimSettings(3, perturbation=EXACT, pool_gib=4.0, lose_engine_at_s=4.0)
    sim = ClusterSimulator(profile, "kv_ttft", settings, SYNTH_BLOCK_SIZE)
    try:
        run = sim.run(plan)
        assert sim.lost is not None and sim.pool is not None and len(sim.pool) > 0
    finally:
        sim.close()
    start = plan[0].offset_s
    late = [r for r in run.records if r.intended_s >= start + 4.0]
    assert late and all(r.ok and r.instance != sim.lost for r in late)
    assert any(r.instance == sim.lost for r in run.records)  # it served before
    with pytest.raises(ValueError, match="lose_engine_at_s"):
        SimSettings(1, lose_engine_at_s=1.0).validate()
