"""Router replicas in the cluster simulator (issue 59): ``SimSettings.router_replicas`` cores on
the same buses, arrivals spread over them in turn."""

from __future__ import annotations

import pytest

from engines.profile import LatencyProfile
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from simulation.cluster import ClusterSimulator
from simulation.settings import EXACT, SimSettings


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")


def test_router_replicas_each_place_their_share_and_hear_of_their_own(profile):
    """Arrivals go to the replicas in turn; each replica's ledger hears the first token and the
    finish of the requests it placed (it ends empty), and one replica is the plain cluster."""
    plan = build_schedule(generate("to-b", SynthParams(rate=30.0, duration_s=6.0, seed=2)))
    runs = {}
    for replicas in (1, 3):
        sim = ClusterSimulator(
            profile,
            "kv_ttft",
            SimSettings(4, perturbation=EXACT, router_replicas=replicas),
            SYNTH_BLOCK_SIZE,
        )
        try:
            runs[replicas] = sim.run(plan)
            assert len(sim.cores) == replicas
            assert all(core.load.in_flight() == 0 for core in sim.cores)
            # each replica's scorer learned from the first tokens of the requests it placed
            learned = [core.scorer.calibration.samples for core in sim.cores]
            assert sum(learned) == len(plan) and min(learned) >= len(plan) // replicas - 1
        finally:
            sim.close()
        assert all(r.ok for r in runs[replicas].records)
    with pytest.raises(ValueError, match="--router-replicas"):
        SimSettings(2, router_replicas=0).validate()
