"""``benchmarks/autoscale_suite.py``'s command line: a day too short to score and a bad CPU tier are
refused by name; the tier reaches the engines in the workload's blocks."""

from __future__ import annotations

import argparse

import pytest

from tests.support import load_benchmark


def test_a_day_no_longer_than_its_training_cycle_is_refused_naming_duration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    suite = load_benchmark("autoscale_suite")
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--workloads", "to-b", "--duration", "600"])
    assert exit_info.value.code == 2
    assert "--duration must be > 600" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--cpu-tier-gib", "-1"], "--cpu-tier-gib must be >= 0"),
        (["--cpu-tier-gib", "nan"], "--cpu-tier-gib must be >= 0"),
        (["--cpu-tier-gib", "160", "--cpu-policy", "nope"], "--cpu-policy: cpu_tier.policy"),
    ],
)
def test_a_bad_cpu_tier_is_refused_naming_its_flag(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = load_benchmark("autoscale_suite")
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--workloads", "to-b", *argv])
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err


def test_the_cpu_tier_reaches_the_engines_in_blocks_of_the_workload() -> None:
    """160 GiB (deploy/serve-gpu.yaml's tier) of Llama-3.1-8B's 128 KiB a token is 2,560 blocks of
    512 tokens (the Mooncake trace's) and 81,920 of 16 (the synthetic workloads')."""
    suite = load_benchmark("autoscale_suite")
    truth = suite.LatencyProfile.load("h100-llama3.1-8b")
    assert truth.kv_bytes_per_token == 128 * 1024
    tier = suite.CpuTierConfig(gib=160, policy="wa")
    args = argparse.Namespace(cpu_tier=tier, pool_gib=0.0)
    assert suite.engine_options(args, truth, 512) == {
        "cpu_capacity_blocks": 2560,
        "cpu_policy": "wa",
    }
    assert suite.engine_options(args, truth, 16)["cpu_capacity_blocks"] == 81_920
    none = argparse.Namespace(cpu_tier=None, pool_gib=0.0)
    assert suite.engine_options(none, truth, 512) == {}


def test_the_pool_reaches_the_cluster_beside_the_engines_options() -> None:
    suite = load_benchmark("autoscale_suite")
    truth = suite.LatencyProfile.load("h100-llama3.1-8b")
    pool = {"pool_gib": 2560.0, "pool_gbps": 25.0, "pool_latency_ms": 0.4}
    args = argparse.Namespace(cpu_tier=None, **pool, pool_policy="lru", pool_in_map=True)
    options = suite.engine_options(args, truth, 512)
    s = suite.sim_settings(4, 1, options, warm_prefixes=2)
    assert s.pool_gib == 2560.0 and s.pool_policy == "lru" and s.engine == {}
    assert s.instances == 4 and s.perturbation.seed == 1 and s.warm_prefixes == 2
    assert options["pool_gib"] == 2560.0  # the caller's options are left as they were


def test_a_two_level_schedule_holds_one_count_per_lull_and_one_per_burst() -> None:
    """Cycles of 600 s: the lull from each cycle's start, the burst from its last third, up to
    the day's end."""
    suite = load_benchmark("autoscale_suite")
    steps = suite.two_level_schedule(1300.0, 6, 16)
    assert steps == [(0.0, 6), (400.0, 16), (600.0, 6), (1000.0, 16), (1200.0, 6), (1600.0, 16)]
    policy = suite.SchedulePolicy(steps, lead_s=45.0)
    assert [policy.at(t) for t in (0.0, 399.0, 400.0, 599.0, 600.0, 1250.0)] == [6, 6, 16, 16, 6, 6]


def test_two_level_pairs_parse_and_bad_ones_are_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    suite = load_benchmark("autoscale_suite")
    assert suite.parse_pairs("9/14, 10/12") == [(9, 14), (10, 12)]
    for bad, says in (("3/2", "1 <= LULL <= BURST"), ("0/4", "1 <= LULL"), ("9-14", "LULL/BURST")):
        with pytest.raises(SystemExit):
            suite.main(["--workloads", "to-b", "--two-level-pairs", bad])
        assert "--two-level-pairs" in (err := capsys.readouterr().err) and says in err
