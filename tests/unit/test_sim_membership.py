"""The cluster simulator's membership: engines join after their cold start with an empty cache
and reach the router core through the buses; leaving engines stop taking requests, drain, and
their blocks leave the map through InstanceGone; GPU-seconds count from the decision to the
release. Driven by ``router.autoscale.Autoscaler`` with a scripted policy."""

from __future__ import annotations

import math

import pytest

from cachemap.hashing import Tier
from engines.sim.profile import LatencyProfile
from loadgen.simulator import EXACT, ClusterSimulator, Perturbation, SimSettings
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from router.autoscale import Autoscaler, Observation


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


def replay(profile, instances, steps, *, cold=20.0, interval=5.0, seed=0, plan=None):
    settings = SimSettings(instances=instances, perturbation=EXACT, cold_start_s=cold)
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
