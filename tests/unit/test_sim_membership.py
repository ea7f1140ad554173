"""The cluster simulator's membership: engines join after their cold start with an empty cache
and reach the router core through the buses; leaving engines stop taking requests, drain, and
their blocks leave the map through InstanceGone; GPU-seconds count from the decision to the
release. Driven by ``router.autoscale.Autoscaler`` with a scripted policy."""

from __future__ import annotations

import math

import pytest

from cachemap.hashing import Tier
from engines.profile import LatencyProfile
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned, build_schedule
from router.autoscale import Autoscaler, Observation
from simulation.cluster import ClusterSimulator
from simulation.settings import EXACT, Perturbation, SimSettings


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")


class Script:
    """Targets by time: the last ``(from_s, n)`` at or before the decision's ``now``."""

    name = "script"

    def __init__(self, steps: list[tuple[float, int]]) -> None:
        self.steps = steps
        self.seen: list[Observation] = []

    def desired(self, obs: Observation, lo: int, hi: int) -> tuple[float, str]:
        self.seen.append(obs)
        n = obs.replicas
        for at, k in self.steps:
            if obs.now >= at:
                n = k
        return n, f"scripted {n}"


def work(duration: float = 60.0, rate: float = 20.0, seed: int = 0):
    return build_schedule(generate("to-b", SynthParams(rate=rate, duration_s=duration, seed=seed)))


def req(k, ids):
    """Request ``k`` of a plan, arriving at ``k`` s, carrying the trace block ids ``ids``."""
    return Planned(k, float(k), TraceRequest(float(k), 16 * len(ids), 8, tuple(ids)))


def replay(
    profile, instances, steps, *, cold=20.0, interval=5.0, seed=0, plan=None, warm=0, handover=0,
    cached=False,
):  # fmt: skip
    settings = SimSettings(
        instances=instances,
        perturbation=EXACT,
        cold_start_s=cold,
        warm_prefixes=warm,
        handover_prefixes=handover,
        what_if_cached=cached,
    )
    settings.perturbation = Perturbation(speed_sigma=0.1, jitter=0.05, seed=seed)
    sim = ClusterSimulator(profile, "kv_ttft", settings, SYNTH_BLOCK_SIZE)
    script = Script(steps)
    run = sim.run(plan or work(), autoscaler=Autoscaler(script, 1, 8, interval))
    return sim, run, script


def test_a_new_engine_takes_traffic_only_after_its_cold_start(profile):
    sim, run, script = replay(profile, 1, [(5.0, 3)])
    assert run.replicas[0] == (0.0, 1, "initial")
    assert run.replicas[1][:2] == (5.0, 3) and "scripted 3" in run.replicas[1][2]
    assert all(r.ok for r in run.records)
    by = {}
    for r in run.records:
        by.setdefault(r.instance, []).append(r.intended_s)
    assert set(by) == {"sim-0", "sim-1", "sim-2"}
    for iid in ("sim-1", "sim-2"):  # decided at 5 s, routable 20 s later
        assert min(by[iid]) >= 25.0
        assert len(by[iid]) > 50
    # the starting engine's requests before 25 s all went to sim-0
    assert all(r.instance == "sim-0" for r in run.records if r.intended_s < 25.0)
    # the joiners started empty: their first request hit nothing on the engine
    first = {iid: min((r for r in run.records if r.instance == iid), key=lambda r: r.index)
             for iid in ("sim-1", "sim-2")}  # fmt: skip
    assert all(r.cached_tokens == 0 for r in first.values())
    # their KV events reached the router's map through the bus, and their load samples
    assert all(sim.core.cache_map.count(iid, Tier.GPU) > 0 for iid in ("sim-1", "sim-2"))
    assert {"sim-0", "sim-1", "sim-2"} <= set(sim.core.watcher.loads)
    # the policy saw the joiners as replicas at once, as ready only after the cold start
    at = {o.now: o for o in script.seen}
    assert (at[10.0].replicas, at[10.0].ready) == (3, 1)
    assert (at[30.0].replicas, at[30.0].ready) == (3, 3)
    # billed from the decision: sim-0 from the first arrival, the joiners from 5 s
    end = max(r.done_s for r in run.records)
    start = run.records[0].intended_s
    assert run.gpu_seconds == pytest.approx((end - start) + 2 * (end - 5.0))


def test_a_leaving_engine_drains_and_its_blocks_leave_the_map(profile):
    sim, run, _ = replay(profile, 3, [(10.0, 1)])
    assert all(r.ok for r in run.records)  # nothing lost: the leavers finished their requests
    kept = {r.instance for r in run.records if r.intended_s > 10.0}
    assert len(kept) == 1
    (stay,) = kept
    gone = {"sim-0", "sim-1", "sim-2"} - kept
    cmap = sim.core.cache_map
    assert cmap.count(stay, Tier.GPU) > 0
    assert all(cmap.count(iid, Tier.GPU) == 0 and iid not in cmap.instances() for iid in gone)
    assert set(sim.core.members()) == {stay}
    # each leaver is billed to its last finish, at or after the decision
    end = max(r.done_s for r in run.records)
    start = run.records[0].intended_s
    last = {iid: max(r.done_s for r in run.records if r.instance == iid) for iid in gone}
    expect = (end - start) + sum(max(10.0, t) - start for t in last.values())
    assert run.gpu_seconds == pytest.approx(expect)
    assert run.gpu_seconds < 3 * (end - start) * 0.6


def test_scale_down_cancels_starting_engines_first(profile):
    _, run, _ = replay(profile, 1, [(5.0, 3), (10.0, 1)], cold=30.0)
    assert [n for _, n, _ in run.replicas] == [1, 3, 1]
    assert {r.instance for r in run.records} == {"sim-0"}  # the joiners never served
    end = max(r.done_s for r in run.records)
    start = run.records[0].intended_s
    assert run.gpu_seconds == pytest.approx((end - start) + 2 * 5.0)  # billed 5 s to 10 s


def test_membership_replay_is_deterministic_per_seed(profile):
    steps = [(5.0, 3), (40.0, 2)]
    a = replay(profile, 1, steps, seed=1)[1]
    b = replay(profile, 1, steps, seed=1)[1]
    c = replay(profile, 1, steps, seed=2)[1]
    key = lambda run: [(r.instance, r.first_token_s, r.done_s) for r in run.records]  # noqa: E731
    assert key(a) == key(b) and a.gpu_seconds == b.gpu_seconds and a.replicas == b.replicas
    assert key(a) != key(c)


def test_a_fixed_cluster_bills_every_engine_for_the_whole_run(profile):
    settings = SimSettings(instances=3, perturbation=EXACT)
    run = ClusterSimulator(profile, "kv_ttft", settings, SYNTH_BLOCK_SIZE).run(work(20.0))
    end = max(r.done_s for r in run.records)
    assert run.gpu_seconds == pytest.approx(3 * (end - run.records[0].intended_s))
    assert run.replicas == []


def test_cold_start_and_pd_autoscaling_are_checked(profile):
    with pytest.raises(ValueError, match="--cold-start-s"):
        SimSettings(cold_start_s=-1).validate()
    settings = SimSettings(instances=2, prefill_instances=1, perturbation=EXACT)
    sim = ClusterSimulator(profile, "kv_ttft", settings, SYNTH_BLOCK_SIZE)
    with pytest.raises(ValueError, match="prefill/decode"):
        sim.run(work(5.0), autoscaler=Autoscaler(Script([]), 1, 4))
    assert math.isfinite(SimSettings().cold_start_s)


def test_the_policy_is_handed_a_what_if_of_the_recent_requests(profile):
    """Every decision carries a ``WhatIfSimulator`` built from the requests the router placed
    in the last ``what_if_history_s``; more engines attain at least as much under a burst, a
    pool of 64 is simulated as a slice of ``max_engines``, and re-used requests get fresh
    blocks. The run reports its billing and each decision's CPU cost."""
    from router.autoscale import Slo
    from simulation.whatif import WhatIfSimulator

    _, run, script = replay(profile, 2, [], plan=work(30.0))
    late = [o for o in script.seen if o.now >= 25.0]
    assert late and all(isinstance(o.what_if, WhatIfSimulator) for o in late)
    w = late[0].what_if
    assert all(late[0].now - 120.0 <= p.offset_s < late[0].now for p in w.recent)
    slo = Slo(0.5, 0.05, 0.99)
    rate = 3 * len(w.recent) / 25.0  # three times what the window saw
    one, four = w(1, rate, 10.0, slo), w(4, rate, 10.0, slo)
    assert one < four and four > 0.9 and w.calls == 2
    m, plan = w.plan(64, 100.0, 20.0)
    assert m == w.max_engines == 8 and len(plan) >= 8 / 64 * 100 * 20
    m, plan = w.plan(64, 400.0, 20.0)  # 8 engines' share would be 1000 arrivals: thinner
    assert m == 3 and len(plan) <= w.max_requests + w.waiting
    # one engine's share alone would bring more: a shorter run, down to min_horizon_s
    assert w.span(64, 100.0, 60.0) == 60.0 and w.span(1, 10.0, 30.0) == 30.0
    assert w.span(1, 15.0, 60.0) == pytest.approx(w.max_requests / 15.0)
    assert w.span(1, 100.0, 60.0) == w.min_horizon_s
    m, plan = w.plan(1, 15.0, 60.0)
    assert m == 1 and len(plan) <= w.max_requests + w.waiting
    laps = [p.req.hash_ids for p in plan]
    assert len(set(laps)) == len(laps) or len(plan) <= len(w.recent)
    assert len(run.decision_cpu_s) == len(script.seen)
    assert sum(b - a for a, b in run.billed) == pytest.approx(run.gpu_seconds)
    assert run.gpu_seconds_in(10.0, 20.0) == pytest.approx(2 * 10.0)


def test_a_what_if_can_start_holding_what_its_requests_found_cached(profile):
    """With ``what_if_cached`` the cluster tells each what-if the tokens every placed request
    found cached; the what-if's run then begins with a one-token request per such prefix
    (longest first, none a prefix of another), and its sample arrives ``lead`` seconds later,
    in order and counted as before."""
    from router.autoscale import Slo

    _, _, script = replay(profile, 2, [], plan=work(30.0), cached=True)
    w = next(o for o in script.seen if o.now >= 25.0).what_if
    assert w.cached and any(v > 0 for v in w.cached.values())  # to-b shares system prompts
    assert set(w.cached) == {p.index for p in w.recent}  # its own copy, of its sample's requests
    rate = 3 * len(w.recent) / 25.0
    m, plan, held = w._slice(4, rate, 10.0)
    assert held and all(h == r.hash_ids[: len(h)] for r, h in held)
    out, lead, n = w._warmed(plan, held, m)
    warm, late = out[:n], out[n:]
    taken = [p.req.hash_ids for p in warm]
    assert [len(h) for h in taken] == sorted((len(h) for h in taken), reverse=True)
    assert not any(a != b and b[: len(a)] == a for a in taken for b in taken)
    assert all(any(t[: len(h)] == h for t in taken) for _, h in held)
    assert all(p.offset_s == 0.0 and p.req.output_length == 1 for p in warm)
    assert all(p.req.input_length == len(p.req.hash_ids) * SYNTH_BLOCK_SIZE for p in warm)
    assert lead > 1.0 and [p.index for p in out] == list(range(len(out)))
    assert [(p.offset_s, p.req) for p in late] == [(p.offset_s + lead, p.req) for p in plan]
    assert 0.0 <= w(4, rate, 10.0, Slo(0.5, 0.05, 0.99)) <= 1.0
    _, _, plain = replay(profile, 2, [], plan=work(30.0))
    assert next(o for o in plain.seen if o.now >= 25.0).what_if.cached is None


def test_a_what_if_counts_the_backlog_in_its_request_cap(profile):
    """The queue's share is part of the ``max_requests`` a slice may bring: a long queue thins
    the slice, so a decision behind a backlog costs what one without does."""
    _, _, script = replay(profile, 2, [], plan=work(30.0))
    w = next(o for o in script.seen if o.now >= 25.0).what_if
    w.waiting, w.ready = 300, 4
    m, plan = w.plan(64, 100.0, 20.0)  # 8 engines: 250 arrivals and 600 of the queue
    assert m == 3 and len(plan) == 94 + 225 <= w.max_requests


def test_a_what_if_asked_for_a_goal_stops_once_the_goal_is_out_of_reach(profile):
    """With ``goal`` the what-if ends a run as soon as the requests it counts have missed too
    often: an overloaded pool answers just under the goal (the misses so far, not the whole
    run's far lower fraction), and a pool that passes answers exactly what the whole run
    does."""
    from router.autoscale import Slo

    _, _, script = replay(profile, 2, [], plan=work(30.0))
    w = next(o for o in script.seen if o.now >= 25.0).what_if
    slo, goal = Slo(0.5, 0.05, 0.99), 0.99
    rate = 3 * len(w.recent) / 25.0
    whole_one, whole_four = w(1, rate, 10.0, slo), w(4, rate, 10.0, slo)
    one, four = w(1, rate, 10.0, slo, goal), w(4, rate, 10.0, slo, goal)
    assert whole_one < 0.9 < one < goal  # ended at the first misses past the allowance
    assert whole_four >= goal and four == whole_four


def test_a_shortened_what_if_fails_a_rate_over_one_engines_capacity(profile):
    """A run shortened to its span hides an engine a little over its capacity (its batch and
    queue build slowly): the same 20 s of traffic that passes as a 20 s horizon fails as a
    60 s one shortened to 20 s, as the whole 60 s run does, while a rate within capacity
    passes both ways."""
    from router.autoscale import Slo

    _, _, script = replay(profile, 2, [], plan=work(30.0))
    w = next(o for o in script.seen if o.now >= 25.0).what_if
    slo = Slo(2.0, 0.05, 0.99)
    w.max_requests = 200  # one engine's 60 s at 18-21 req/s: shortened to 20 s
    assert w.span(1, 21.0, 60.0) == w.span(1, 21.0, 20.0) == 20.0
    assert w(1, 21.0, 20.0, slo) >= 0.99  # 20 s alone: no sign of the overload
    assert w(1, 21.0, 60.0, slo) < 0.5  # the span of a 60 s horizon: over capacity
    assert w(1, 18.0, 60.0, slo) == 1.0  # within capacity: passes shortened
    w.max_requests = 10**6
    assert w(1, 21.0, 60.0, slo) < 0.9  # the whole 60 s run fails too


def test_a_fixed_run_without_what_if_matches_one_with(profile):
    """The what-if is built from the replay's state but never changes it: a policy that
    ignores it sees the same run with it switched off."""
    a = replay(profile, 1, [(5.0, 3)], plan=work(20.0))[1]
    settings = SimSettings(instances=1, cold_start_s=20.0, what_if=False)
    settings.perturbation = Perturbation(speed_sigma=0.1, jitter=0.05, seed=0)
    sim = ClusterSimulator(profile, "kv_ttft", settings, SYNTH_BLOCK_SIZE)
    b = sim.run(work(20.0), autoscaler=Autoscaler(Script([(5.0, 3)]), 1, 8, 5.0))
    key = lambda run: [(r.instance, r.first_token_s, r.done_s) for r in run.records]  # noqa: E731
    assert key(a) == key(b) and a.gpu_seconds == b.gpu_seconds


def test_hot_prefixes_rank_the_shared_prefixes_by_the_prefill_they_save():
    from simulation.warming import hot_prefixes

    recent = [
        req(0, [1, 2, 3, 4, 50]), req(1, [1, 2, 3, 4, 51]), req(2, [1, 2, 3, 4, 52]),
        req(3, [7, 8, 60]), req(4, [7, 8, 61]), req(5, [9, 70]),
    ]  # fmt: skip
    got = [prefix for _, prefix in hot_prefixes(recent, 5)]
    assert got == [(1, 2, 3, 4), (7, 8)]  # 3 x 4 blocks, then 2 x 2; a lone prompt: none
    assert [p for _, p in hot_prefixes(recent, 1)] == [(1, 2, 3, 4)]


def test_a_warmed_engine_holds_the_hot_prefixes_before_it_serves(profile):
    """With warming a joiner prefills the recent requests' hot prefixes at the end of its
    cold start, becomes routable only when that is done, and its first request already
    hits; the warming prefills are no client's requests."""
    plan = work(32.0)
    _, cold_run, _ = replay(profile, 1, [(5.0, 2)], plan=plan)
    _, run, _ = replay(profile, 1, [(5.0, 2)], plan=plan, warm=4)
    ((t_cold, iid, w_cold),) = cold_run.joins
    ((t_warm, iid2, w_warm),) = run.joins
    assert iid == iid2 == "sim-1" and not w_cold and w_warm
    assert t_cold == pytest.approx(25.0) and t_warm > t_cold  # prefill time, after the start
    assert len(run.records) == len(plan) and all(r.ok for r in run.records)
    first = min((r for r in run.records if r.instance == "sim-1"), key=lambda r: r.index)
    cold_first = min((r for r in cold_run.records if r.instance == "sim-1"), key=lambda r: r.index)
    assert first.cached_tokens > 0 and cold_first.cached_tokens == 0
    assert first.intended_s >= t_warm
    with pytest.raises(ValueError, match="--warm-prefixes"):
        SimSettings(warm_prefixes=-1).validate()


def test_longest_prompts_are_taken_none_a_prefix_of_another():
    from simulation.warming import longest_prompts

    served = [
        req(0, [1, 2]), req(1, [1, 2, 3, 4]),  # one conversation: its later turn carries both
        req(2, [5, 6, 7]), req(3, [8]), req(4, [1, 2, 9]),
    ]  # fmt: skip
    got = [prefix for _, prefix in longest_prompts(served, 5)]
    assert got == [(1, 2, 3, 4), (1, 2, 9), (5, 6, 7), (8,)]
    assert [p for _, p in longest_prompts(served, 2)] == [(1, 2, 3, 4), (1, 2, 9)]


def test_a_leaving_engine_hands_its_longest_prompts_to_a_survivor(profile):
    """With hand-over, an engine scaled down has its longest recent prompts prefilled on the
    survivors (where the router places them) before its blocks leave the map; without it,
    nothing is; either way every client request is served and the hand-over is no client's."""
    plan = work(40.0)
    sims = {}
    for k in (0, 3):
        sims[k], run, _ = replay(profile, 2, [(20.0, 1)], plan=plan, handover=k)
        assert len(run.records) == len(plan) and all(r.ok for r in run.records)

    def handed(sim):
        return [
            r for inst in sim.instances for r in inst.finished if r.request_id.startswith("warm-h")
        ]

    assert handed(sims[0]) == []
    sim = sims[3]
    got = handed(sim)
    assert 1 <= len(got) <= 3
    (left,) = [i for i in range(len(sim.instances)) if not sim._publishing[i]]
    survivor = sim.instances[1 - left].instance_id
    assert all(r.request_id.startswith(f"warm-h{left}-") for r in got)
    assert all(r in sim.by_id[survivor].finished for r in got)
    # the survivor holds the handed prompts in the router's map
    held = sim.core.cache_map.match(got[0].block_hashes)
    assert held[survivor].total_blocks >= len(got[0].block_hashes) - 1
    with pytest.raises(ValueError, match="--handover-prefixes"):
        SimSettings(handover_prefixes=-1).validate()


def test_a_replay_inside_a_replay_keeps_the_outer_collector_settings():
    """A what-if's replay runs inside the autoscaled one: it leaves the collector as the
    outer replay set it (frozen heap, rare young collections), and the outer one restores the
    process's settings at its end."""
    import gc

    from simulation.cluster import _replay_collector

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with _replay_collector():
        outer, outer_frozen = gc.get_threshold(), gc.get_freeze_count()
        assert outer[0] > before[0] and outer_frozen >= frozen
        with _replay_collector():
            assert gc.get_threshold() == outer and gc.get_freeze_count() == outer_frozen
        assert gc.get_threshold() == outer
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
