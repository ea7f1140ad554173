"""The capacity planner: its search finds the boundary the simulations show, the early exit
never changes a verdict, and ``kvroute plan`` answers bad input with the flag's name."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from deploy.cli import main
from engines.profile import LatencyProfile
from loadgen.records import RequestRecord
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from simulation.cluster import simulate
from simulation.options import parse_tiers
from simulation.planner import RATE_STEPS_PER_DOUBLING, Planner, find_boundary
from simulation.pricing import (
    NO_TIER,
    Candidate,
    PlanSetup,
    Slo,
    event_volume,
    judge,
    prefill_count,
)
from simulation.settings import SimSettings, SloBudget

PROFILE = "cpu-small-llama"


@pytest.fixture(scope="module")
def setup() -> PlanSetup:
    """An API workload that one or two small CPU engines cannot serve within 1.5 s and a
    few can: the planner has a boundary to find."""
    reqs = generate("to-b", SynthParams(seed=3, rate=20.0, duration_s=20.0))
    plan = build_schedule(reqs)
    return PlanSetup(plan, SYNTH_BLOCK_SIZE, LatencyProfile.load(PROFILE))


SLO = Slo(ttft_ms=1500, attainment=0.9)


def test_slo_validates_and_budgets() -> None:
    with pytest.raises(ValueError, match="--attainment"):
        Slo(1000, attainment=1.5)
    with pytest.raises(ValueError, match="--slo-tpot-ms"):
        Slo(1000, tpot_ms=-1)
    assert Slo(1000, attainment=0.99).percentile == "p99"
    assert Slo(1000, attainment=0.99).budget(1000).max_misses == 10
    assert Slo(1000, attainment=1.0).budget(1000).max_misses == 0


def test_judge_counts_refused_and_missing_requests_as_misses() -> None:
    def rec(i: int, ttft: float, done: float, out: int, status: int = 200) -> RequestRecord:
        r = RequestRecord(i, "all", None, 100, out, 0.0, sent_s=0.0, prompt_tokens=100)
        r.first_token_s, r.done_s, r.output_tokens, r.status = ttft, done, out, status
        r.cached_tokens = 50
        return r

    records = [
        rec(0, 0.5, 1.5, 11),  # ttft 500 ms, tpot 100 ms
        rec(1, 2.0, 2.1, 11),  # ttft misses
        rec(2, 0.1, 0.2, 11),  # both fine
    ]
    refused = RequestRecord(3, "all", None, 100, 10, 0.0, sent_s=0.0)
    refused.status, refused.error, refused.done_s = 429, "http_429", 0.0
    records.append(refused)
    met, ttft_met, tpot_met, n_refused, ttft_at, tpot_at, hit = judge(
        records, 5, Slo(1000, tpot_ms=50, attainment=0.5)
    )
    # request 4 has no record (a run stopped early): a miss on every count
    assert (met, ttft_met, tpot_met, n_refused) == (1, 2, 2, 1)
    # the p50 of 5: the 3rd smallest of (0.1, 0.5, 2.0, inf, inf) and of (10, 10, 100, inf, inf)
    assert ttft_at == pytest.approx(2000.0)
    assert tpot_at == pytest.approx(100.0)
    assert hit == pytest.approx(0.5)


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_boundary_search_finds_every_threshold_in_few_probes(jobs: int) -> None:
    lo, hi = 3, 70
    for threshold in range(lo, hi + 2):  # hi + 1: nothing passes
        for first in ([lo, hi], [threshold - 1, threshold], [lo + 5, lo + 6]):
            probed: list[int] = []
            asked: list[int] = []

            def fails(n: int, t: int = threshold, asked: list[int] = asked) -> bool:
                asked.append(n)
                return n < t

            got = find_boundary(lo, hi, first, fails, probed.extend, probes_per_round=jobs)
            assert sorted(asked) == sorted(probed)  # each probe judged once, after pricing
            assert got == (threshold if threshold <= hi else None), (threshold, first)
            assert all(lo <= n <= hi for n in probed)
            assert len(probed) == len(set(probed)), "a count was priced twice"
            assert len(probed) <= 2 * jobs * math.ceil(math.log2(hi - lo + 2)) + 2


def test_early_exit_never_changes_a_verdict(setup: PlanSetup) -> None:
    for n in (1, 3, 4, 6):
        cand = Candidate(n)
        quick, exact = setup.evaluate(cand, SLO, True), setup.evaluate(cand, SLO, False)
        assert quick.passes(SLO) == exact.passes(SLO), n
        assert not exact.aborted
        if quick.aborted:
            assert not quick.passes(SLO)
            assert quick.attainment >= exact.attainment  # an upper bound
            assert quick.stopped_after < quick.requests
            assert "more than the" in quick.why(SLO)
        else:
            assert quick.attainment == exact.attainment


def test_seeds_pool_one_run_per_perturbation_seed(setup: PlanSetup) -> None:
    from simulation.settings import Perturbation

    cand = Candidate(3)
    pooled = replace(setup, seeds=2).evaluate(cand, SLO, False)
    each = [
        replace(setup, settings=SimSettings(perturbation=Perturbation(seed=k))).evaluate(
            cand, SLO, False
        )
        for k in (0, 1)
    ]
    assert each[0].met != each[1].met or each[0].hit_rate != each[1].hit_rate  # seeds differ
    assert pooled.requests == 2 * len(setup.plan)
    assert pooled.met == each[0].met + each[1].met
    assert pooled.refused == each[0].refused + each[1].refused
    with pytest.raises(ValueError, match="--seeds"):
        replace(setup, seeds=0)


def test_simulator_stops_when_the_budget_runs_out(setup: PlanSetup) -> None:
    budget = SloBudget(ttft_s=0.2, tpot_s=None, max_misses=5)
    run = simulate(
        setup.plan,
        setup.trace_block_size,
        setup.truth,
        "kv_ttft",
        SimSettings(instances=1),
        budget=budget,
    )
    assert run.aborted and budget.exhausted  # first tokens come in batches: maybe past 6
    assert len(run.records) < len(setup.plan)


def test_size_answer_rests_on_both_sides(setup: PlanSetup) -> None:
    with Planner(setup, SLO, jobs=2, guide=0.0) as planner:
        result = planner.size(1, 8)
    best, below = result.best, result.cheaper_failing
    assert best is not None and below is not None
    assert best.passes(SLO) and not below.passes(SLO)
    assert below.candidate.instances == best.candidate.instances - 1
    # proved by whole-workload runs without the early exit as well
    n = best.candidate.instances
    assert setup.evaluate(Candidate(n), SLO, False).passes(SLO)
    assert not setup.evaluate(Candidate(n - 1), SLO, False).passes(SLO)
    assert len(result.outcomes) < 8  # a search, not a sweep
    # one process or two: the same simulations, the same answer
    with Planner(setup, SLO, jobs=1, guide=0.0) as serial:
        again = serial.size(1, 8)
    assert again.best is not None and again.best.candidate == best.candidate
    assert again.best.attainment == best.attainment


def test_size_with_tiers_picks_the_cheapest_tier_that_meets_it(setup: PlanSetup) -> None:
    tiers = parse_tiers("0,0.25,1", "wa")
    with Planner(setup, SLO, jobs=2, guide=0.0) as planner:
        result = planner.size(1, 8, tiers)
    best = result.best
    assert best is not None and best.passes(SLO)
    n = best.candidate.instances
    here = {o.candidate: o for o in result.outcomes if o.candidate.instances == n}
    assert len(here) == len(tiers)  # every tier priced at the answer
    for cand, out in here.items():
        if cand.cost < best.candidate.cost:
            assert not out.passes(SLO)
    # one fewer instance fails even with the largest tier, which the search priced
    below = planner.outcomes[Candidate(n - 1, 1.0, "wa")]
    assert not below.passes(SLO)
    assert result.cheaper_failing is not None and not result.cheaper_failing.passes(SLO)


def test_size_prices_prefill_decode_splits_at_every_count(setup: PlanSetup) -> None:
    """With splits, every probed count is priced colocated and split; the answer is the
    cheapest count some split meets, and a split candidate runs the simulator's PD mode."""
    with Planner(setup, SLO, jobs=2, guide=0.0) as planner:
        result = planner.size(1, 8, splits=(0.0, 0.5))
    best = result.best
    assert best is not None and best.passes(SLO)
    n = best.candidate.instances
    here = {o.candidate.prefill_instances for o in result.outcomes if o.candidate.instances == n}
    assert here == {0, prefill_count(n, 0.5)} and prefill_count(n, 0.5) >= 1
    # a count of one has no split; fewer instances fail whatever the split
    assert prefill_count(1, 0.5) == 0 and prefill_count(5, 0.9) == 4
    for o in result.outcomes:
        if o.candidate.instances < n:
            assert not o.passes(SLO)
    split = Candidate(4, prefill_instances=2)
    assert "2 prefill + 2 decode" in split.label and split.to_dict()["prefill_instances"] == 2
    assert setup.evaluate(split, SLO, False).requests == len(setup.plan)


def test_guided_search_gives_the_same_answer(setup: PlanSetup, monkeypatch) -> None:
    monkeypatch.setattr(Planner, "MIN_GUIDED", 100)
    seen: list[str] = []
    with Planner(setup, SLO, jobs=2, on_outcome=lambda f, _o: seen.append(f)) as guided:
        got = guided.size(1, 8)
    with Planner(setup, SLO, jobs=2, guide=0.0) as plain:
        want = plain.size(1, 8)
    assert "guide" in seen and "full" in seen
    assert got.best is not None and want.best is not None
    assert got.best.candidate == want.best.candidate


def test_max_rate_brackets_the_break_within_the_grid(setup: PlanSetup) -> None:
    with Planner(setup, SLO, jobs=2, guide=0.0) as planner:
        r = planner.max_rate(Candidate(2))
    assert r.max_pass is not None and r.min_fail is not None
    assert r.max_pass.passes(SLO) and not r.min_fail.passes(SLO)
    ratio = r.min_fail.candidate.rate_scale / r.max_pass.candidate.rate_scale
    assert ratio == pytest.approx(2 ** (1 / RATE_STEPS_PER_DOUBLING))


def test_cpu_tier_candidates_get_blocks_and_policy(setup: PlanSetup) -> None:
    assert parse_tiers("0,8", "wa,lru") == [(0.0, NO_TIER), (8.0, "wa"), (8.0, "lru")]
    with pytest.raises(ValueError, match="--policy"):
        parse_tiers("8", "nope")
    with pytest.raises(ValueError, match="--cpu-tier-gib"):
        parse_tiers("-1", "wa")
    per_block = setup.truth.kv_bytes_per_token * setup.block_size
    assert setup.cpu_blocks(1.0) == 2**30 // per_block
    # engines whose GPU holds a few prompts: what a CPU tier keeps shows as hits
    small = replace(setup, settings=SimSettings(engine={"num_gpu_blocks": 400}))
    bare = small.evaluate(Candidate(2), SLO, False)
    tiered = small.evaluate(Candidate(2, 1.0, "wa"), SLO, False)
    assert bare.hit_rate is not None and tiered.hit_rate is not None
    assert tiered.hit_rate > bare.hit_rate + 0.05, (bare.hit_rate, tiered.hit_rate)


def test_judge_meets_exactly_what_summarize_counts_as_goodput(setup: PlanSetup) -> None:
    from loadgen.metrics import summarize

    slo = Slo(ttft_ms=400, tpot_ms=30, attainment=0.5)
    run = simulate(
        setup.plan, setup.trace_block_size, setup.truth, "kv_ttft", SimSettings(instances=4)
    )
    met, *_, hit = judge(run.records, len(run.records), slo)
    s = summarize(
        run.records, duration_s=run.span_s, requested_span_s=1.0, slo_ttft_ms=400, slo_itl_ms=30
    )
    assert 0 < met < len(run.records)  # the SLO splits this run
    assert met == s["good_requests"]
    assert hit == s["server_hit_rate"]


def test_ceiling_counts_refused_prompts_and_slow_prefills(setup: PlanSetup) -> None:
    # a loose SLO: only prompts the engines refuse (at or over max_model_len) are lost, as the
    # simulation refuses them
    max_len = setup.truth.max_model_len
    refused = sum(p.req.input_length >= max_len for p in setup.plan)
    assert setup.ceiling(Slo(60_000)) == 1 - refused / len(setup.plan)
    out = setup.evaluate(Candidate(8), Slo(60_000, attainment=0.5), False)
    assert out.refused == refused and out.attainment == setup.ceiling(Slo(60_000))
    roomy = replace(setup, settings=SimSettings(engine={"max_model_len": 1 << 20}))
    assert roomy.ceiling(Slo(60_000)) == 1.0
    assert setup.ceiling(Slo(0.001)) == 0.0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--attainment", "1.5"], "--attainment"),
        (["--find-max-rate"], "--instances"),
        (["--instances", "3"], "--instances"),
        (["--policy", "bogus", "--cpu-tier-gib", "4"], "--policy"),
        (["--min-instances", "5", "--max-instances", "2"], "--min-instances"),
        (["--rate-scale", "2,x"], "--rate-scale"),
        (["--router", "kv_ttft,round_robin"], "--router"),
        (["--engine", "warp=9"], "--engine"),
        (["--prefill-fractions", "1"], "--prefill-fractions"),
        (["--prefill-fractions", "x"], "--prefill-fractions"),
    ],
)
def test_plan_cli_names_the_bad_flag(capsys, argv: list[str], flag: str) -> None:
    base = ["plan", "--workload", "to-b", "--duration", "5", "--slo-ttft-ms", "1000"]
    assert main([*base, *argv]) == 2
    assert flag in capsys.readouterr().err


def test_event_volume_counts_every_computed_block_stored_then_evicted(setup: PlanSetup) -> None:
    from cachemap.ingest import APPLY_BLOCKS_PER_S

    plan = setup.plan
    n = len(plan)
    new = sum(p.req.input_length * 0.75 + p.req.output_length for p in plan) / n
    ev = event_volume(plan, 10.0, 4, 0.25)
    assert ev.cluster_blocks_s == pytest.approx(2 * 10.0 * new / 16)
    assert ev.blocks_per_engine_s == pytest.approx(ev.cluster_blocks_s / 4)
    assert ev.router_cores == pytest.approx(ev.cluster_blocks_s / APPLY_BLOCKS_PER_S)
    # a thousand engines' worth: a coarser granularity keeps one router core within budget
    big = event_volume(plan, 10.0 * APPLY_BLOCKS_PER_S / ev.cluster_blocks_s, 1024, 0.25)
    assert big.router_cores == pytest.approx(1.0) and big.stride == 2


def test_plan_cli_json_and_report(capsys, tmp_path) -> None:
    argv = [
        "plan", "--workload", "to-b", "--rate", "20", "--duration", "20", "--seed", "3",
        "--profile", PROFILE, "--slo-ttft-ms", "1500", "--attainment", "0.9",
        "--max-instances", "12", "--json", "--no-progress", "--report", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    size = doc["sizes"][0]
    assert size["best"]["passes"] and size["best"]["margin_points"] >= 0
    assert not size["next_cheaper_failing"]["passes"] and size["next_cheaper_failing"]["why"]
    a = doc["meta"]["assumptions"]
    assert a["profile"] == PROFILE and a["router"] == "kv_ttft" and a["not_modelled"]
    ev = size["kv_events"]  # the event volume at the size it answers
    assert ev["block_size"] == 16 and ev["event_stride"] == 1
    assert ev["cluster_blocks_s"] == pytest.approx(
        ev["blocks_per_engine_s"] * size["best"]["instances"], rel=0.01
    )
    assert {p.name for p in tmp_path.iterdir()} == {"plan.json", "curve.csv", "attainment.png"}
    # an SLO nothing meets: exit 1, and the answer says so
    argv[argv.index("1500")] = "1"
    assert main(argv) == 1
    assert json.loads(capsys.readouterr().out)["sizes"][0]["best"] is None
