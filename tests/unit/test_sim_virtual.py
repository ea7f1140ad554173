"""Virtual-time sim instances and clusters: profile-exact timing, determinism, placements, KV event
bytes delivered to a callback, and trace hash expansion."""

from __future__ import annotations

import dataclasses
import random

import pytest

from cachemap import BlockHasher, CacheMap, Tier
from cachemap.events import decode_vllm_batch
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator
from engines.sim.profile import LatencyProfile
from engines.sim.request import make_request
from engines.sim.virtual import (
    VirtualCluster,
    VirtualInstance,
    expand_trace_hashes,
    least_loaded,
    prefix_affinity,
    round_robin,
    trace_arrival,
)
from policies.base import RequestInfo

BS = 16


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def test_single_request_ttft_and_finish_follow_the_profile(profile):
    inst = VirtualInstance("v0", profile)
    r = make_request("a", block_size=BS, max_tokens=5, prompt_token_ids=tokens(1, 20_000))
    inst.submit(r, 10.0)
    inst.drain()
    (rec,) = inst.finished
    assert rec.ttft_s == pytest.approx(profile.ttft_s(20_000))
    # Four decode steps after the first token, each attending to the growing context.
    decode = sum(profile.decode_step_s(1, 20_000 + k) for k in range(1, 5))
    assert rec.finish_s - rec.first_token_s == pytest.approx(decode)
    assert rec.output_tokens == 5 and rec.cached_tokens == 0


def test_request_overhead_delays_the_scheduler(profile):
    slow = dataclasses.replace(profile, request_overhead_ms=40.0)
    inst = VirtualInstance("v0", slow)
    for i in range(2):  # the second arrives while the first is still in its overhead
        r = make_request(f"r{i}", block_size=BS, max_tokens=1, prompt_token_ids=tokens(i, 3000))
        inst.submit(r, 1.0 + 0.01 * i)
    assert inst.outstanding() == 2 and inst.load().waiting == 2
    inst.drain()
    first, second = inst.finished
    assert first.ttft_s == pytest.approx(slow.ttft_s(3000))
    assert first.ttft_s == pytest.approx(profile.ttft_s(3000) + 0.040)
    # r1 reaches the scheduler at 1.05 s, while r0's prefill (1.04 s ..) runs: it queues.
    assert second.first_token_s == pytest.approx(first.first_token_s + profile.prefill_s(3000))


def test_second_identical_prompt_hits_all_but_the_last_block(profile):
    inst = VirtualInstance("v0", profile)
    prompt = tokens(2, 1000)
    for i, at in enumerate((0.0, 5.0)):
        inst.submit(make_request(f"r{i}", block_size=BS, max_tokens=3, prompt_token_ids=prompt), at)
        inst.run_until(at + 1.0)
    first, second = inst.finished
    assert first.cached_tokens == 0 and second.cached_tokens == (999 // BS) * BS
    assert second.ttft_s < first.ttft_s / 5


def _workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    systems = [tokens(100 + i, 300) for i in range(3)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        prompt = rng.choice(systems) + tokens(1000 + i, rng.randrange(50, 2000))
        r = make_request(
            f"r{i}", block_size=BS, max_tokens=rng.randrange(1, 300), prompt_token_ids=prompt
        )
        out.append((t, r))
    return out


@pytest.mark.parametrize("place", [least_loaded, prefix_affinity])
def test_replay_is_deterministic(profile, place):
    runs = [VirtualCluster.build(3, profile).replay(_workload(120), place) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 120
    assert len({rec.instance for rec in runs[0]}) == 3


def test_prefix_affinity_gets_more_hits_than_round_robin(profile):
    def cached(place):
        recs = VirtualCluster.build(4, profile).replay(_workload(200, seed=3), place)
        return sum(r.cached_tokens for r in recs)

    assert cached(prefix_affinity) > cached(round_robin())


def test_overload_queues_requests(profile):
    light = VirtualCluster.build(1, profile).replay(_workload(40), least_loaded)
    burst = [(0.0, r) for _, r in _workload(40)]
    heavy = VirtualCluster.build(1, profile).replay(burst, least_loaded)
    p50 = lambda recs: sorted(r.ttft_s for r in recs)[len(recs) // 2]  # noqa: E731
    assert p50(heavy) > 3 * p50(light)


def test_events_reach_a_cache_map_as_vllm_bytes(profile):
    cmap = CacheMap()
    ingest = CacheMapIngestor(cmap)
    translators = {}
    seqs: dict[str, list[int]] = {}

    def on_events(instance: str, seq: int, payload: bytes) -> None:
        decode_vllm_batch(payload)  # the envelope decodes as vLLM's
        seqs.setdefault(instance, []).append(seq)
        tr = translators.setdefault(instance, EngineEventTranslator(instance, "sim", BS))
        msg = tr.feed(payload, seq, 0.0)
        if msg is not None:
            ingest.apply(msg)

    cluster = VirtualCluster(
        [
            VirtualInstance(f"v{i}", profile, num_gpu_blocks=200, on_events=on_events)
            for i in range(2)
        ]
    )
    work = _workload(60, seed=5)
    cluster.replay(work, round_robin())
    hasher = BlockHasher("sim", BS)
    ours = {
        s: o for _, r in work for s, o in zip(r.block_hashes, hasher(r.token_ids), strict=False)
    }
    for inst in cluster.instances:
        assert seqs[inst.instance_id] == list(range(len(seqs[inst.instance_id])))
        assert {ours[h] for h in inst.blocks.gpu_hashes()} == set(
            cmap.resident(inst.instance_id, Tier.GPU)
        )
        assert translators[inst.instance_id].skipped.total() == 0


def test_expand_trace_hashes():
    assert expand_trace_hashes([7, 8, 9], 1100, 512, 512) == [7, 8]
    assert expand_trace_hashes([7, 8], 600, 512, 256) == [14, 15]
    with pytest.raises(ValueError):
        expand_trace_hashes([7], 512, 512, 300)


def test_trace_arrivals_replay_with_a_cpu_tier(profile):
    """Hash-only trace requests (no tokens): prefix hits come from the trace's ids, and a CPU
    tier with a category-aware policy takes what the small GPU cache evicts."""
    inst = VirtualInstance(
        "v0", profile, block_size=512, num_gpu_blocks=5, cpu_capacity_blocks=8, cpu_policy="wa"
    )
    lines = [  # (t, input_length, hash_ids): the third repeats the first's prefix
        (0.0, 1500, [1, 2, 3]),
        (100.0, 2000, [7, 8, 9, 10]),
        (200.0, 1600, [1, 2, 3, 4]),
    ]
    for i, (t, n, ids) in enumerate(lines):
        info = RequestInfo(category="text_1")
        at, req = trace_arrival(f"t{i}", t, n, 20, ids, 512, 512, info=info)
        inst.submit(req, at)
        inst.run_until(t + 50)
    cached = [(rec.cached_tokens, rec.cpu_cached_tokens) for rec in inst.finished]
    assert cached[:2] == [(0, 0), (0, 0)]
    assert cached[2] == (1024, 1024)  # blocks 1, 2 were evicted to and loaded from the CPU


def test_hash_only_requests_replay(profile):
    inst = VirtualInstance("v0", profile, block_size=512)
    for i, at in enumerate((0.0, 100.0)):
        r = make_request(
            f"t{i}", block_size=512, max_tokens=20, prompt_len=1500, prompt_block_hashes=[1, 2]
        )
        inst.submit(r, at)
        inst.run_until(at + 50)
    assert [rec.cached_tokens for rec in inst.finished] == [0, 1024]


@pytest.mark.parametrize("cap", [0, 2048])
def test_ttft_behind_a_queue_follows_the_scheduler(profile, cap):
    """``LatencyProfile.ttft_s`` with ``queued`` work against the sim's own scheduler: FCFS
    without a prefill cap, steps shared with the queue's capped chunks with one."""
    limited = profile.with_limits(long_prefill_token_threshold=cap)
    inst = VirtualInstance("v0", limited)
    queue = [(f"q{i}", tokens(10 + i, 8_000)) for i in range(2)]
    for rid, prompt in queue:
        inst.submit(make_request(rid, block_size=BS, max_tokens=1, prompt_token_ids=prompt), 0.0)
    new = make_request("new", block_size=BS, max_tokens=1, prompt_token_ids=tokens(9, 1500))
    inst.submit(new, 0.0)
    inst.drain()
    got = {r.request_id: r.ttft_s for r in inst.finished}["new"]
    want = limited.ttft_s(1500, queued=16_000, queued_requests=2)
    assert got == pytest.approx(want, rel=0.1)
    if cap:  # the cap lets it through long before the queue is done
        assert got < profile.ttft_s(1500, queued=16_000) / 3
