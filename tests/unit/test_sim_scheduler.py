"""The sim scheduler: token budget, chunked prefill, continuous batching, preemption, step timing,
and the closed-form decode skip that virtual time relies on."""

from __future__ import annotations

import random

import pytest

from engines.profile import LatencyProfile
from engines.sim.blocks import KVBlockManager
from engines.sim.request import SimRequest, Status, make_request
from engines.sim.scheduler import Scheduler, SchedulerConfig
from policies.base import RequestInfo
from policies.registry import create_policy

BS = 4


def profile(**kw) -> LatencyProfile:
    values = dict(
        name="test",
        model="m",
        hardware="h",
        block_size=BS,
        kv_capacity_tokens=4096,
        kv_bytes_per_token=1000,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=2048,
        base_ms=5.0,
        prefill_token_ms=0.1,
        prefill_attn_ms=0.001,
        decode_seq_ms=0.5,
        decode_ctx_ms=0.01,
        cpu_load_gbps=1.0,
    )
    values.update(kw)
    return LatencyProfile(**values)


def make(n_blocks: int = 200, budget: int = 64, seqs: int = 8, cpu: int = 0, **kw) -> Scheduler:
    p = profile(max_num_batched_tokens=budget, max_num_seqs=seqs, **kw)
    bm = KVBlockManager(n_blocks, BS, cpu_capacity_blocks=cpu)
    return Scheduler(bm, p, SchedulerConfig.from_profile(p))


def req(rid: str, n: int, start: int = 100, out: int = 4) -> SimRequest:
    return make_request(
        rid, block_size=BS, max_tokens=out, prompt_token_ids=list(range(start, start + n))
    )


def run(s: Scheduler, t: float = 0.0, max_steps: int = 10_000) -> float:
    for _ in range(max_steps):
        if s.idle:
            return t
        step = s.schedule(t)
        t += step.duration_s
        s.complete(step, t)
    raise AssertionError("did not finish")


def test_token_budget_and_chunked_prefill():
    s = make(budget=64)
    a, b = req("a", 100), req("b", 40, start=500)
    s.add(a)
    s.add(b)
    step = s.schedule(0.0)
    assert [(r.request_id, n) for r, n, _ in step.scheduled] == [("a", 64)]  # b waits
    s.complete(step, 0.05)
    step = s.schedule(0.05)
    assert [(r.request_id, n) for r, n, _ in step.scheduled] == [("a", 36), ("b", 28)]
    s.complete(step, 0.1)
    assert a.num_output == 1 and b.num_output == 0  # a's prompt is done: first token
    step = s.schedule(0.1)
    assert [(r.request_id, n) for r, n, _ in step.scheduled] == [("a", 1), ("b", 12)]


def test_long_prefill_threshold_makes_room_for_a_short_prompt():
    def first_tokens(threshold: int) -> tuple[float, float]:
        p = profile(max_num_batched_tokens=64)
        cfg = SchedulerConfig.from_profile(p, long_prefill_token_threshold=threshold)
        s = Scheduler(KVBlockManager(200, BS), p, cfg)
        long, short = req("long", 400), req("short", 8, start=900)
        s.add(long)
        step = s.schedule(0.0)
        assert step.scheduled[0][1] == 64  # alone: the cap does not apply
        t = step.duration_s
        s.complete(step, t)
        s.add(short)
        step = s.schedule(t)
        want = [("long", 16), ("short", 8)] if threshold else [("long", 64)]
        assert [(r.request_id, n) for r, n, _ in step.scheduled] == want
        t += step.duration_s
        s.complete(step, t)
        run(s, t)
        return long.first_token_s, short.first_token_s

    long_capped, short_capped = first_tokens(16)
    long_plain, short_plain = first_tokens(0)
    assert short_capped < short_plain  # no longer waits for the whole long prefill
    assert long_capped > long_plain  # which pays for it


def test_first_token_only_after_the_last_chunk():
    s = make(budget=32)
    a = req("a", 100, out=3)
    s.add(a)
    chunks = []
    t = 0.0
    while a.first_token_s < 0:
        step = s.schedule(t)
        chunks.append(step.scheduled[0][1])
        t += step.duration_s
        s.complete(step, t)
    assert chunks == [32, 32, 32, 4]
    run(s, t)
    assert a.status == Status.FINISHED and a.num_output == 3 and a.finish_reason == "length"


def test_continuous_batching_admits_while_others_decode():
    s = make(budget=64)
    a = req("a", 20, out=10)
    s.add(a)
    t = 0.0
    for _ in range(3):
        step = s.schedule(t)
        t += step.duration_s
        s.complete(step, t)
    b = req("b", 30, start=700, out=2)
    s.add(b)
    step = s.schedule(t)
    assert [(r.request_id, n) for r, n, _ in step.scheduled] == [("a", 1), ("b", 30)]
    t += step.duration_s
    s.complete(step, t)
    run(s, t)
    assert b.finish_s < a.finish_s


def test_max_num_seqs_caps_the_batch():
    s = make(budget=512, seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 8, start=100 * (i + 1)))
    step = s.schedule(0.0)
    assert len(step.scheduled) == 2 and len(s.waiting) == 1


def test_prefix_hit_at_admission_and_cached_tokens():
    s = make()
    a = req("a", 33)
    s.add(a)
    run(s)
    b = req("b", 33)  # same prompt: 8 full blocks, the last prompt token is recomputed
    s.add(b)
    step = s.schedule(10.0)
    assert step.scheduled == [(b, 1, 32)] and b.cached_tokens == 32


def test_preemption_frees_the_last_running_request():
    s = make(n_blocks=8, budget=64)  # 7 usable blocks
    a, b = req("a", 12, out=12), req("b", 12, start=500, out=12)
    s.add(a)
    s.add(b)
    t = run_steps(s, 0.0, 5)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    t = run(s, t)
    assert a.status == b.status == Status.FINISHED
    assert a.scheduled_s == b.scheduled_s == 0.0  # when first scheduled, not re-admitted
    assert a.num_output == b.num_output == 12 and s.num_preemptions >= 1


def run_steps(s: Scheduler, t: float, n: int) -> float:
    for _ in range(n):
        step = s.schedule(t)
        t += step.duration_s
        s.complete(step, t)
    return t


PASSES = [
    {},
    {"base_ms": 0.0, "prefill_pass_ms": 3.0, "decode_pass_ms": 2.0},
    {"base_ms": 0.0, "prefill_pass_ms": 3.0, "prefill_sq_ms": 0.01, "decode_pass_ms": 2.0},
]


@pytest.mark.parametrize("passes", PASSES)
def test_step_duration_follows_the_profile(passes):
    """A step costs ``base_ms``, plus ``prefill_pass_ms`` and ``prefill_sq_ms`` per squared new
    token if it prefills and ``decode_pass_ms`` if it decodes (a mixed step: both)."""
    s = make(budget=64, **passes)
    p = s.profile
    a = req("a", 40, out=5)
    s.add(a)
    step = s.schedule(0.0)
    assert step.duration_s == pytest.approx(p.prefill_s(40, 0))
    s.complete(step, step.duration_s)
    b = req("b", 10, start=900)
    s.add(b)
    step = s.schedule(1.0)  # a decodes (context 41), b prefills 10 tokens
    want_ms = p.base_ms + p.prefill_pass_ms + p.prefill_sq_ms * 100 + p.chunk_ms(10, 0)
    want_ms += p.decode_pass_ms + p.decode_seq_ms + p.decode_ctx_ms * 41
    assert step.duration_s == pytest.approx(want_ms / 1e3)
    s.complete(step, 1.0 + step.duration_s)
    step = s.schedule(2.0)  # both decode
    assert step.duration_s == pytest.approx(p.decode_step_s(2, 42 + 11))


def test_a_pass_squares_the_new_tokens_of_all_its_chunks():
    """``prefill_sq_ms`` squares a pass's new tokens together (Dynamo's mocker: ``a T^2``), not
    chunk by chunk: two prompts prefilled in one pass cost more than each alone."""
    s = make(budget=64, base_ms=0.0, prefill_pass_ms=3.0, prefill_sq_ms=0.01)
    p = s.profile
    s.add(req("a", 20, out=1))
    s.add(req("b", 30, start=900, out=1))
    step = s.schedule(0.0)
    assert sorted(n for _, n, _ in step.scheduled) == [20, 30]
    want_ms = 3.0 + 0.01 * 50**2 + p.chunk_ms(20, 0) + p.chunk_ms(30, 0)
    assert step.duration_s == pytest.approx(want_ms / 1e3)  # 12 ms over squares chunk by chunk


def test_cpu_hits_charge_the_load_time():
    p = profile(max_num_batched_tokens=64)
    bm = KVBlockManager(6, BS, cpu_capacity_blocks=8)
    s = Scheduler(bm, p, SchedulerConfig.from_profile(p))
    a = req("a", 13, out=1)
    s.add(a)
    run(s)
    s.add(req("b", 16, start=500, out=1))  # pushes a's blocks to the CPU tier
    run(s)
    a2 = req("a2", 13, out=1)
    s.add(a2)
    step = s.schedule(5.0)
    cpu = a2.cpu_cached_tokens
    assert a2.cached_tokens == 12 and cpu > 0 and step.load_tokens == cpu
    assert step.duration_s == pytest.approx(p.prefill_s(1, 12) + p.load_s(cpu))


def test_admission_counters_count_each_request_once():
    """Prompt, cached and CPU-cached tokens summed at first admission; a preempted request
    re-admitted is not counted again."""
    s = make(n_blocks=8, budget=64)  # the preemption case above
    a, b = req("a", 12, out=12), req("b", 12, start=500, out=12)
    s.add(a)
    s.add(b)
    run(s)
    assert b.num_preemptions >= 1
    assert (s.requests_admitted, s.prompt_tokens_admitted) == (2, 24)
    assert s.cached_tokens_admitted == s.cpu_cached_tokens_admitted == 0

    p = profile(max_num_batched_tokens=64)  # the CPU-tier case above
    s = Scheduler(KVBlockManager(6, BS, cpu_capacity_blocks=8), p, SchedulerConfig.from_profile(p))
    reqs = [req("a", 13, out=1), req("b", 16, start=500, out=1), req("a2", 13, out=1)]
    for r in reqs:
        s.add(r)
        run(s)
    assert s.requests_admitted == 3 and s.prompt_tokens_admitted == 13 + 16 + 13
    assert s.cached_tokens_admitted == sum(r.cached_tokens for r in reqs) == 12
    assert s.cpu_cached_tokens_admitted == reqs[2].cpu_cached_tokens > 0


def test_cpu_policy_hears_each_request_begin_once():
    """A queue head blocked for KV blocks is retried every step; the policy hears it begin once."""
    p = profile(max_num_batched_tokens=64)
    policy = create_policy("lru", 8)
    begun: list[str] = []
    inner = policy.begin_request
    policy.begin_request = lambda info, now: (begun.append(info.category), inner(info, now))
    s = Scheduler(
        KVBlockManager(10, BS, cpu_capacity_blocks=8, cpu_policy=policy),
        p,
        SchedulerConfig.from_profile(p),
    )
    for i, rid in enumerate(("a", "b")):  # 6 blocks each, 9 usable: b waits for a to finish
        r = req(rid, 20, start=100 * (i + 1), out=4)
        r.info = RequestInfo(category=rid)
        s.add(r)
    run(s)
    assert begun == ["a", "b"]


def test_abort_frees_blocks():
    s = make()
    a = req("a", 30, out=50)
    s.add(a)
    run_steps(s, 0.0, 3)
    free_before = s.blocks.num_free
    assert s.abort(a) and a.finish_reason == "abort" and s.idle
    assert s.blocks.num_free > free_before
    assert not s.abort(a)


def test_rejects_requests_that_cannot_fit():
    s = make(n_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(req("a", 30))


def _simulate(seed: int, fast: bool, cpu: int, **kw: float) -> tuple[list[tuple], int]:
    """Every request's outcome, and how many steps ``decode_run`` skipped."""
    rng = random.Random(seed)
    s = make(n_blocks=60, budget=48, seqs=6, cpu=cpu, **kw)
    arrivals = sorted(
        (rng.uniform(0, 2.0), f"r{i}", rng.randrange(5, 60), rng.randrange(1, 40), rng.randrange(3))
        for i in range(25)
    )
    reqs = []
    t, k, skipped = 0.0, 0, 0
    while k < len(arrivals) or not s.idle:
        while k < len(arrivals) and arrivals[k][0] <= t:
            at, rid, n, out, pre = arrivals[k]
            r = req(rid, n, start=1000 * pre, out=out)
            r.arrival_s = at
            s.add(r)
            reqs.append(r)
            k += 1
        if s.idle:
            t = arrivals[k][0]
            continue
        limit = arrivals[k][0] if k < len(arrivals) else float("inf")
        step = s.schedule(t)
        t += step.duration_s
        s.complete(step, t)
        if fast and t < limit:
            n_skip, dur = s.decode_run(t, limit)
            t += dur
            skipped += n_skip
    outcomes = [
        (
            r.request_id,
            r.cached_tokens,
            r.cpu_cached_tokens,
            r.num_output,
            r.num_preemptions,
            round(r.first_token_s, 9),
            round(r.finish_s, 9),
            tuple(r.token_ids),
        )
        for r in reqs
    ]
    return outcomes, skipped


@pytest.mark.parametrize("passes", PASSES)
@pytest.mark.parametrize("cpu", [0, 30])
@pytest.mark.parametrize("seed", range(5))
def test_decode_run_is_equivalent_to_stepping(seed, cpu, passes):
    fast, skipped = _simulate(seed, True, cpu, **passes)
    slow, _ = _simulate(seed, False, cpu, **passes)
    assert skipped > 0  # decode_run did skip steps, or the comparison proves nothing
    assert fast == slow
    if cpu:
        assert any(r[2] for r in slow)  # the CPU tier served hits


def _queued(s: Scheduler, now_s: float) -> int:
    """What ``s``'s load report says is queued at ``now_s``."""
    return s.load_snapshot("e", now_s, 0, now_s).queued_prefill_tokens


def test_the_queued_prefill_report_counts_a_prompt_until_its_first_token_unless_asked() -> None:
    """What is still to schedule (if asked) against kvroute's vLLM engine's count (the
    default): a prompt beyond its cached prefix until its first token is out, computed chunks
    included. A 200-token prompt in 64-token steps: 64, 64, 64 and 8; the virtual engine
    completes a step as it schedules it, with its end in the future."""
    p = profile()
    config = SchedulerConfig.from_profile(p, queued_until_first_token=False)
    asked = Scheduler(KVBlockManager(200, BS), p, config)
    for s, in_flight, last_in_flight in ((asked, 136, 0), (make(), 200, 200)):
        a, b = req("a", 200), req("b", 40, start=900)
        s.add(a)
        t, ends = 0.0, []
        for _ in range(4):
            step = s.schedule(t)
            t += step.duration_s
            s.complete(step, t)
            ends.append(t)
            if len(ends) == 1:
                assert _queued(s, ends[0] / 2) == in_flight
                s.add(b)  # waiting: counted beyond its cached prefix either way
                assert _queued(s, ends[0] / 2) == in_flight + 40
        # b was admitted in the last step beside a's 8 tokens; both answered at its end
        assert a.first_token_s == b.first_token_s == ends[-1]
        assert _queued(s, (ends[-2] + ends[-1]) / 2) == last_in_flight + (0 if s is asked else 40)
        assert _queued(s, ends[-1]) == 0
