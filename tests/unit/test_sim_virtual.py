"""Virtual-time sim instances: profile-exact timing, KV event bytes delivered to a callback, first
tokens and finishes announced, the truth's slowdown and jitter, and trace hash expansion. (Clusters
with the routing core in the loop: ``test_simulator.py``.)"""

from __future__ import annotations

import dataclasses
import random

import pytest

from cachemap import BlockHasher, CacheMap, Tier
from cachemap.events import KVEventBatch, decode_vllm_batch, encode_vllm_batch
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator
from engines.profile import LatencyProfile
from engines.sim.options import SimEngineOptions
from engines.sim.request import make_request
from engines.sim.virtual import VirtualInstance, expand_trace_hashes, trace_arrival
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
    assert rec.num_output == 5 and rec.cached_tokens == 0


def test_request_overhead_delays_the_scheduler(profile):
    slow = dataclasses.replace(profile, request_overhead_ms=40.0)
    inst = VirtualInstance("v0", slow)
    for i in range(2):  # the second arrives while the first is still in its overhead
        r = make_request(f"r{i}", block_size=BS, max_tokens=1, prompt_token_ids=tokens(i, 3000))
        inst.submit(r, 1.0 + 0.01 * i)
    assert inst.load().waiting == 2
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


def test_overload_queues_requests(profile):
    def p50(arrivals) -> float:
        inst = VirtualInstance("v0", profile)
        for t, r in arrivals:
            inst.run_until(t)
            inst.submit(r, t)
        inst.drain()
        return sorted(r.ttft_s for r in inst.finished)[len(inst.finished) // 2]

    light = p50(_workload(40))
    assert p50([(0.0, r) for _, r in _workload(40)]) > 3 * light


def test_progress_is_announced_in_time_order(profile):
    seen: list[tuple[float, str, bool]] = []
    inst = VirtualInstance(
        "v0", profile, on_progress=lambda t, r, done: seen.append((t, r.request_id, done))
    )
    work = _workload(30, seed=2)
    for t, r in work:
        inst.run_until(t)
        inst.submit(r, t)
    inst.drain()
    assert [x[0] for x in seen] == sorted(x[0] for x in seen)
    firsts = {rid: t for t, rid, done in seen if not done}
    ends = {rid: t for t, rid, done in seen if done}
    assert set(firsts) == set(ends) == {r.request_id for _, r in work}
    for r in inst.finished:
        assert firsts[r.request_id] == r.first_token_s and ends[r.request_id] == r.finish_s


def test_slowdown_and_jitter_perturb_the_truth(profile):
    def ttfts(**kw) -> list[float]:
        inst = VirtualInstance("v0", profile, **kw)
        for i in range(20):
            r = make_request(
                f"r{i}", block_size=BS, max_tokens=40, prompt_token_ids=tokens(i, 4000)
            )
            inst.submit(r, 10.0 * i)
            inst.run_until(10.0 * i + 5)
        inst.drain()
        return [r.ttft_s for r in inst.finished]

    base = ttfts()
    assert ttfts(slowdown=2.0) == pytest.approx([2 * t for t in base])
    noisy = ttfts(jitter=0.3, seed=1)
    assert noisy == ttfts(jitter=0.3, seed=1)  # seeded
    ratios = [a / b for a, b in zip(noisy, base, strict=True)]
    assert min(ratios) < 0.95 and max(ratios) > 1.05
    assert 0.8 < sum(ratios) / len(ratios) < 1.2  # mean-one noise
    with pytest.raises(ValueError, match="slowdown"):
        VirtualInstance("v0", profile, slowdown=0.0)


def test_events_reach_a_cache_map_as_vllm_bytes(profile):
    cmap = CacheMap()
    ingest = CacheMapIngestor(cmap)
    translators = {}
    seqs: dict[str, list[int]] = {}

    def on_events(instance: str, seq: int, events: list) -> None:
        # the step's events, encoded as vLLM's publisher sends them
        payload = encode_vllm_batch(KVEventBatch(ts=0.0, events=events))
        decode_vllm_batch(payload)  # the envelope decodes as vLLM's
        seqs.setdefault(instance, []).append(seq)
        tr = translators.setdefault(instance, EngineEventTranslator(instance, "sim", BS))
        msg = tr.feed(payload, seq, 0.0)
        if msg is not None:
            ingest.apply(msg)

    instances = [
        VirtualInstance(
            f"v{i}", profile, on_events=on_events, options=SimEngineOptions(num_gpu_blocks=200)
        )
        for i in range(2)
    ]
    work = _workload(60, seed=5)
    for i, (t, r) in enumerate(work):
        for inst in instances:
            inst.run_until(t)
        instances[i % 2].submit(r, t)
    for inst in instances:
        inst.drain()
    hasher = BlockHasher("sim", BS)
    ours = {
        s: o for _, r in work for s, o in zip(r.block_hashes, hasher(r.token_ids), strict=False)
    }
    for inst in instances:
        assert seqs[inst.instance_id] == list(range(len(seqs[inst.instance_id])))
        assert {ours[h] for h in inst.blocks.gpu_hashes()} == set(
            cmap.resident(inst.instance_id, Tier.GPU)
        )
        assert translators[inst.instance_id].skipped.total() == 0


def test_expand_trace_hashes():
    assert expand_trace_hashes([7, 8, 9], 1100, 512, 512) == [7, 8]
    assert expand_trace_hashes([7, 8], 600, 512, 256) == [14, 15]
    # coarser engine blocks (loadgen's 16-token synthetic ids on 32-token engines): each takes
    # the id of the last trace block it covers; a partial engine block is not hashed
    assert expand_trace_hashes([7, 8, 9, 10, 11], 80, 16, 32) == [8, 10]
    with pytest.raises(ValueError, match="must divide, equal or be a multiple"):
        expand_trace_hashes([7], 512, 512, 300)


def test_trace_arrivals_replay_with_a_cpu_tier(profile):
    """Hash-only trace requests (no tokens): prefix hits come from the trace's ids, and a CPU
    tier with a category-aware policy takes what the small GPU cache evicts."""
    inst = VirtualInstance(
        "v0",
        profile,
        options=SimEngineOptions(
            block_size=512, num_gpu_blocks=5, cpu_capacity_blocks=8, cpu_policy="wa"
        ),
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
    inst = VirtualInstance("v0", profile, options=SimEngineOptions(block_size=512))
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
