"""The sim engines' cluster KV pool (``engines.sim.pool``, issue 58): engines store the prompt
blocks they compute, and load from it the leading blocks their own tiers miss, the load
delaying the request's first step; capacity evicts; off, nothing changes."""

from __future__ import annotations

import pytest

from deploy.cli import main as kvroute
from engines.pool.link import PoolLink
from engines.profile import LatencyProfile
from engines.sim.options import SimEngineOptions
from engines.sim.pool import SimPool
from engines.sim.virtual import VirtualInstance, trace_arrival
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from simulation.cluster import simulate
from simulation.settings import EXACT, SimSettings

BS = 512
OPTIONS = SimEngineOptions(block_size=BS)


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")


def pool_for(profile: LatencyProfile, capacity_blocks: int = 64) -> SimPool:
    return SimPool(capacity_blocks, BS * profile.kv_bytes_per_token, link=PoolLink(25.0, 0.4))


def serve(inst: VirtualInstance, rid: str, t: float, n: int, ids: list[int]):
    _, req = trace_arrival(rid, t, n, 4, ids, BS, BS)
    inst.submit(req, t)
    inst.run_until(t + 50)
    return inst.finished[-1]


def test_a_block_computed_on_one_engine_is_loaded_by_another(profile):
    pool = pool_for(profile)
    a = VirtualInstance("a", profile, options=OPTIONS, pool=pool)
    b = VirtualInstance("b", profile, options=OPTIONS, pool=pool)
    first = serve(a, "r0", 0.0, 1600, [1, 2, 3])
    assert first.cached_tokens == 0
    # A stored its three full prompt blocks, readable from the end of the step computing them
    assert {1, 2, 3} <= set(pool._ready) and len(pool) == 3
    assert pool.match([1, 2, 3], 0, 3, first.first_token_s) == 3
    assert pool.match([1, 2, 3], 0, 3, first.first_token_s - 1e-3) == 0
    got = serve(b, "r1", 100.0, 2100, [1, 2, 3, 4])
    assert got.cached_tokens == 3 * BS and got.cpu_cached_tokens == 0
    assert pool.loads == 1 and pool.loaded_blocks == 3
    # the control: the same prefix hit on the GPU of an engine without a pool, no load
    c = VirtualInstance("c", profile, options=OPTIONS)
    serve(c, "r0", 0.0, 1600, [1, 2, 3])
    local = serve(c, "r1", 100.0, 2100, [1, 2, 3, 4])
    assert local.cached_tokens == got.cached_tokens
    load_s = 0.4e-3 + 3 * BS * profile.kv_bytes_per_token / 25e9
    assert pool.load_s(3) == pytest.approx(load_s)
    assert got.ttft_s == pytest.approx(local.ttft_s + load_s)
    # B computed block 4 and stored it; decode blocks are not stored (save_decode_cache off)
    assert 4 in pool and len(pool) == 4


def test_the_own_tiers_come_first_and_only_leading_blocks_load(profile):
    pool = pool_for(profile)
    a = VirtualInstance("a", profile, options=OPTIONS, pool=pool)
    serve(a, "r0", 0.0, 2100, [1, 2, 3, 4])
    got = serve(a, "r1", 100.0, 2100, [1, 2, 3, 4])  # its own GPU holds them: no pool load
    assert got.cached_tokens == 4 * BS and pool.loads == 0
    b = VirtualInstance("b", profile, options=OPTIONS, pool=pool)
    # block 9 is not in the pool: the chain breaks there, nothing after it loads
    got = serve(b, "r2", 100.0, 2600, [1, 9, 3, 4, 5])
    assert got.cached_tokens == BS and pool.loaded_blocks == 1


def test_capacity_evicts_the_least_recently_used(profile):
    pool = SimPool(3, 1)
    pool.put([1, 2, 3], 0, 3, 0.0)
    pool.load([1], 1.0)  # reused: now the most recent
    pool.put([1, 2, 3, 4, 5], 3, 5, 2.0)
    assert sorted(pool._ready) == [1, 4, 5] and pool.evictions == 2
    pool.put([1, 2], 1, 2, 3.0)  # a put of a missing block evicts the oldest, now block 1
    assert sorted(pool._ready) == [2, 4, 5] and pool.evictions == 3
    # an engine whose prompt's first block was evicted loads nothing
    small = pool_for(profile, capacity_blocks=2)
    a = VirtualInstance("a", profile, options=OPTIONS, pool=small)
    b = VirtualInstance("b", profile, options=OPTIONS, pool=small)
    serve(a, "r0", 0.0, 1600, [1, 2, 3])
    assert sorted(small._ready) == [2, 3]
    assert serve(b, "r1", 100.0, 2100, [1, 2, 3, 4]).cached_tokens == 0
    assert small.loads == 0


def test_a_put_keeps_the_first_value_and_its_earliest_time():
    pool = SimPool(4, 1)
    pool.put([1, 2], 0, 2, 5.0)
    pool.put([1, 2], 0, 2, 3.0)  # a lagging engine stored it earlier in virtual time
    pool.put([1, 2], 0, 2, 9.0)
    assert pool.stored_blocks == 2 and pool.match([1, 2], 0, 2, 3.0) == 2


def _plan():
    return build_schedule(generate("to-b", SynthParams(rate=30.0, duration_s=20.0, seed=0)))


def _rows(sim):
    return [(r.index, r.instance, r.first_token_s, r.cached_tokens) for r in sim.records]


def test_the_pool_off_changes_nothing_and_on_it_adds_hits(profile):
    plan = _plan()
    base = simulate(
        plan, SYNTH_BLOCK_SIZE, profile, "round_robin", SimSettings(4, perturbation=EXACT)
    )
    off = SimSettings(4, perturbation=EXACT, pool_gib=0.0, pool_gbps=1.0, pool_latency_ms=50.0)
    assert _rows(simulate(plan, SYNTH_BLOCK_SIZE, profile, "round_robin", off)) == _rows(base)
    on = SimSettings(4, perturbation=EXACT, pool_gib=64.0)
    pooled = simulate(plan, SYNTH_BLOCK_SIZE, profile, "round_robin", on)
    assert len(pooled.records) == len(base.records)
    hits = sum(r.cached_tokens or 0 for r in pooled.records)
    assert hits > sum(r.cached_tokens or 0 for r in base.records)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pool-gib", "-1"], "--pool-gib must be a number >= 0 (0: no pool), got -1"),
        (["--pool-gib", "nan"], "--pool-gib must be a number >= 0"),
        (["--pool-gbps", "0"], "--pool-gbps must be a positive number, got 0"),
        (["--pool-latency-ms", "-2"], "--pool-latency-ms must be a number >= 0, got -2"),
        (["--pool-policy", "nope"], "--pool-policy: policy: unknown name 'nope'"),
        (["--pool-policy", "belady"], "--pool-policy: 'belady' needs the future"),
    ],
)
def test_bad_pool_flags_are_named(argv, message, capsys):
    rc = kvroute(["simulate", "--workload", "to-b", "--duration", "5", "--no-progress", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_the_cli_reports_the_pool_only_when_on(capsys):
    import json

    argv = ["simulate", "--workload", "to-b", "--rate", "20", "--duration", "5"]
    argv += ["--instances", "2", "--router", "round_robin", "--json", "--no-progress"]
    assert kvroute(argv) == 0
    assert "pool" not in json.loads(capsys.readouterr().out)["meta"]
    assert kvroute([*argv, "--pool-gib", "8", "--pool-gbps", "10"]) == 0
    meta = json.loads(capsys.readouterr().out)["meta"]
    assert meta["pool"] == {
        "gib": 8.0,
        "gbps": 10.0,
        "latency_ms": 0.4,
        "policy": "lru",
        "in_map": True,
    }
