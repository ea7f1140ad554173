"""The cluster simulator: the production routing core placing requests on virtual engines, fed
through the real event ingestion and load tracking; and ``kvroute simulate``'s CLI."""

from __future__ import annotations

import json

import pytest

from deploy.cli import main as kvroute
from engines.profile import LatencyProfile
from loadgen.metrics import summarize
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from router.placement import create_scorer
from router.recorder import MemoryRecorder
from simulation.cluster import ClusterSimulator, simulate
from simulation.settings import EXACT, Perturbation, SimSettings


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("h100-llama3.1-8b")


def plan(kind: str = "to-b", rate: float = 30.0, duration: float = 20.0, seed: int = 0):
    return build_schedule(generate(kind, SynthParams(rate=rate, duration_s=duration, seed=seed)))


def run(profile, router, settings=None, workload=None, **kw):
    settings = settings or SimSettings(instances=4, perturbation=EXACT)
    return simulate(workload or plan(), SYNTH_BLOCK_SIZE, profile, router, settings, **kw)


def test_every_request_is_recorded_once_with_its_instance(profile):
    work = plan()
    sim = run(profile, "round_robin", workload=work)
    assert [r.index for r in sim.records] == [p.index for p in work]
    assert all(r.ok and r.instance is not None for r in sim.records)
    assert all(r.first_token_s >= r.intended_s and r.done_s >= r.first_token_s for r in sim.records)
    per = summarize(sim.records, duration_s=sim.span_s, requested_span_s=20.0)["per_instance"]
    assert per["instances"] == 4 and per["requests_max_over_mean"] < 1.01  # round robin


def test_replay_is_deterministic_and_the_seed_matters(profile):
    settings = SimSettings(instances=4, perturbation=Perturbation(jitter=0.2, seed=3))
    a = [r.ttft_s for r in run(profile, "kv_ttft", settings).records]
    assert a == [r.ttft_s for r in run(profile, "kv_ttft", settings).records]
    other = SimSettings(instances=4, perturbation=Perturbation(jitter=0.2, seed=4))
    assert a != [r.ttft_s for r in run(profile, "kv_ttft", other).records]


def test_the_map_is_fed_by_engine_events_and_prefix_routers_hit_more(profile):
    """to-b: programs share system prompts. The cache map (fed only by the engines' KV events
    through the bus) lets kv_ttft find them; round robin spreads every program everywhere."""
    work = plan(rate=40.0, duration=30.0)
    hits = {}
    for router in ("kv_ttft", "round_robin"):
        rec = MemoryRecorder()
        sim = run(profile, router, workload=work, recorder=rec)
        s = summarize(sim.records, duration_s=sim.span_s, requested_span_s=30.0)
        hits[router] = s["server_hit_rate"]
        # the router saw cached blocks only through events: some placements found a hit
        assert any(r["cached_blocks"] > 0 for r in rec.records)
    assert hits["kv_ttft"] > hits["round_robin"]


def test_router_prices_with_its_own_profile_and_calibrates(profile):
    """Engines three times slower than the profile: the router's profile stays the shipped one
    (never the truth object) and kv_ttft's calibration learns the slowdown. At a rate the two
    slow engines keep up with, so that queueing does not blur the fit (a queue's prompts are
    reported whole until their first token, what a slow engine computed of them included)."""
    slow = Perturbation(speed_sigma=0.0, jitter=0.0, stragglers=1.0, straggler_slowdown=3.0)
    sim = run(
        profile,
        "kv_ttft",
        SimSettings(instances=2, perturbation=slow),
        workload=plan(rate=3.0, duration=30.0),
    )
    assert sim.slowdowns == [3.0, 3.0]
    assert sim.calibration is not None and 2.5 < sim.calibration["a"] < 3.5


def test_lag_hides_fresh_events_from_placement(profile):
    """With a lag longer than the workload, the router never sees a cached block."""
    rec = MemoryRecorder()
    lagged = SimSettings(instances=2, perturbation=EXACT, event_lag_s=59.0, load_lag_s=0.0)
    run(profile, "kv_ttft", lagged, workload=plan(duration=10.0), recorder=rec)
    assert rec.records and all(r["cached_blocks"] == 0 for r in rec.records)


def test_admission_rejects_with_429_when_the_estimate_breaks_the_slo(profile):
    burst = plan(rate=400.0, duration=5.0)
    settings = SimSettings(instances=1, perturbation=EXACT, slo_ttft_s=0.05)
    sim = run(profile, "kv_ttft", settings, workload=burst)
    rejected = [r for r in sim.records if r.error == "http_429"]
    assert rejected and all(r.status == 429 and r.instance is None for r in rejected)
    assert any(r.ok for r in sim.records)


def test_every_registered_scorer_runs_in_the_simulator(profile):
    from router.placement import scorer_names

    work = plan(kind="mix", rate=20.0, duration=10.0)
    for name in scorer_names():
        sim = run(profile, name, workload=work)
        assert all(r.ok for r in sim.records), name


def test_bad_settings_name_the_option(profile):
    with pytest.raises(ValueError, match="--engine: unknown option 'gpu_blocks'"):
        run(profile, "kv_ttft", SimSettings(engine={"gpu_blocks": 3}))
    with pytest.raises(ValueError, match="--engine: queued_until_first_token must be true or"):
        SimSettings(engine={"queued_until_first_token": "yes"}).validate()
    with pytest.raises(ValueError, match="jitter"):
        Perturbation(jitter=-1)


def test_cli_prints_json_and_writes_a_report(tmp_path, capsys):
    rc = kvroute([
        "simulate", "--workload", "to-b", "--rate", "20", "--duration", "10", "--instances",
        "2", "--router", "kv_ttft,round_robin,kv_ttft@tie_s=0.01", "--slo-ttft-ms", "200",
        "--json", "--no-progress", "--report", str(tmp_path / "rep"),
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["routers"]) == {"kv_ttft", "round_robin", "kv_ttft@tie_s=0.01"}
    row = doc["routers"]["kv_ttft"]
    assert row["completed"] == row["requests"] > 0 and row["ttft_ms"]["p50"] > 0
    assert doc["meta"]["ideal_hit_rate_tokens"] > 0
    names = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"summary.json", "routers.csv", "ttft_cdf.png", "queue-kv_ttft.png"} <= names


def test_the_engines_kv_event_volume_is_counted_after_the_stride(capsys) -> None:
    """``kv_events``: what the engines put on the bus, measured; a stride of 4 carries about a
    quarter of the blocks (every fourth of each stored run) in as many messages."""
    got = {}
    for k in ("1", "4"):
        rc = kvroute([
            "simulate", "--workload", "to-b", "--rate", "20", "--duration", "10", "--instances",
            "2", "--router", "kv_ttft", "--event-stride", k, "--json", "--no-progress",
        ])  # fmt: skip
        assert rc == 0
        got[k] = json.loads(capsys.readouterr().out)["routers"]["kv_ttft"]["kv_events"]
    full, coarse = got["1"], got["4"]
    assert full["messages"] > 0 and full["blocks_per_engine_s"] > 0
    assert full["blocks"] / 5 < coarse["blocks"] < full["blocks"] / 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--router", "nope"], "--router nope: router: unknown scorer 'nope'"),
        (["--router", "kv_ttft@bogus=1"], "--router kv_ttft@bogus=1"),
        (["--engine", "max_num_seqs"], "--engine: expected KEY=VALUE"),
        (["--instances", "0"], "--instances must be > 0"),
        (["--jitter", "5"], "--jitter must be in [0, 2), got 5"),
        (["--lag-ms", "-1"], "--lag-ms must be in [0, 60000), got -1"),
        (["--profile", "no-such-profile"], "--profile: cannot load profile"),
        (["--admit"], "--admit needs --slo-ttft-ms"),
        (["--rate-scale", "2", "--time-scale", "2"], "--rate-scale, not both"),
        (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    ],
)
def test_cli_errors_name_the_flag(argv, message, capsys):
    rc = kvroute(["simulate", "--workload", "to-b", "--duration", "5", "--no-progress", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_jobs_run_routers_in_forked_processes_with_the_serial_output(tmp_path, capsys):
    """``--jobs 2`` simulates the routers two at a time in forked processes: the JSON (wall
    times aside), the router order and every report CSV are what ``--jobs 1`` writes."""
    docs, reports = [], []
    for jobs in ("1", "2"):
        rep = tmp_path / f"rep{jobs}"
        rc = kvroute([
            "simulate", "--workload", "to-b", "--rate", "30", "--duration", "10", "--instances",
            "3", "--router", "kv_ttft,round_robin,least_loaded", "--slo-ttft-ms", "300",
            "--json", "--no-progress", "--report", str(rep), "--jobs", jobs,
        ])  # fmt: skip
        assert rc == 0
        doc = json.loads(capsys.readouterr().out)
        for row in doc["routers"].values():
            assert row.pop("wall_s") > 0
            row.pop("sim_req_per_wall_s")
        docs.append(doc)
        reports.append({p.name: p.read_bytes() for p in rep.glob("*.csv")})
    assert list(docs[1]["routers"]) == ["kv_ttft", "round_robin", "least_loaded"]
    assert docs[0] == docs[1]
    assert len(reports[0]) == 7 and reports[0] == reports[1]


def test_run_each_raises_a_workers_error_as_the_call_would():
    from simulation.jobs import run_each

    def fail() -> int:
        raise ValueError("--router x: no such thing")

    assert run_each([lambda: 1, lambda: 2, lambda: 3], 2) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^--router x: no such thing$"):
        run_each([lambda: 1, fail, lambda: 3], 2)
    with pytest.raises(ValueError, match="--jobs must be >= 1"):
        run_each([lambda: 1], 0)


def test_cli_names_the_bad_trace_line(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": "x", "output_length": 5, "hash_ids": [1]}\n'
    )
    assert kvroute(["simulate", "--trace", str(bad), "--no-progress"]) == 2
    assert f"{bad}:2: field 'input_length'" in capsys.readouterr().err


def test_results_do_not_depend_on_the_process_hash_seed():
    """Two processes with different string-hash seeds (set and dict orders differ) simulate the
    same run to the same result: nothing breaks ties by iteration order of a set."""
    import os
    import subprocess
    import sys

    argv = [
        sys.executable, "-m", "deploy.cli", "simulate", "--workload", "to-b", "--rate", "60",
        "--duration", "20", "--instances", "8", "--router", "kv_ttft,least_loaded", "--json",
        "--no-progress",
    ]  # fmt: skip
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        for row in doc["routers"].values():
            row.pop("wall_s")
            row.pop("sim_req_per_wall_s")
        outs.append(doc)
    assert outs[0] == outs[1]


def test_requests_sharing_a_timestamp_are_seen_by_the_next_placement_at_any_lag(profile):
    """Traces stamp requests in whole milliseconds, so several arrive at one instant, and
    instants on the 100 ms sampling grid carry a sample stamped with them. The router must
    count each one it placed there: with no lag it once read a sample taken before them and,
    counting only assignments newer than the sample, piled the whole burst on one engine."""
    from loadgen.traces import TraceRequest
    from loadgen.workloads import Planned

    burst = [  # 4 distinct 2,000-token prompts at each of t = 1.0 s and 1.2 s
        Planned(
            i,
            1.0 + 0.2 * (i // 4),
            TraceRequest(0.0, 2000, 8, tuple(range(i * 200, i * 200 + 125))),
        )
        for i in range(8)
    ]
    for lag in (0.0, 0.001):
        settings = SimSettings(instances=4, perturbation=EXACT, event_lag_s=lag, load_lag_s=lag)
        sim = run(profile, "least_loaded", settings, workload=burst)
        for t in (1.0, 1.2):
            at_t = {r.instance for r in sim.records if r.intended_s == t}
            assert len(at_t) == 4, (lag, t, at_t)  # one per engine, as least_loaded should


def test_the_router_sees_the_prefill_step_an_engine_is_computing(profile):
    """A full step of prefill (8,192 tokens, ~0.29 s) starts at 1.0 s; an engine that reports
    what it has still to schedule (not kvroute's engines' count: ``queued_until_first_token``)
    has nothing left at its sample at 1.1 s, so it reports no queue. A prompt arriving at
    1.15 s still waits for that step, and the router's estimate says so (its own backlog)."""
    from loadgen.traces import TraceRequest
    from loadgen.workloads import Planned

    work = [
        Planned(0, 1.0, TraceRequest(0.0, 8192, 8, tuple(range(512)))),
        Planned(1, 1.15, TraceRequest(0.0, 1024, 8, tuple(range(1000, 1064)))),
    ]
    rec = MemoryRecorder()
    settings = SimSettings(
        instances=1, perturbation=EXACT, engine={"queued_until_first_token": False}
    )
    sim = run(profile, "kv_ttft", settings, workload=work, recorder=rec)
    second = next(e for e in rec.records if e["request"] == "1")
    late = next(r for r in sim.records if r.index == 1)
    waited = late.ttft_s
    alone = profile.ttft_s(1024)
    assert waited > alone + 0.1  # it did wait behind the step in flight
    # first scheduled when that step ended, its own prefill step after
    step_end = 1.0 + profile.ttft_s(8192) - profile.request_overhead_ms / 1e3
    assert late.scheduled_s == pytest.approx(step_end, abs=0.01)
    assert late.first_token_s - late.scheduled_s == pytest.approx(alone, abs=0.01)
    assert second["candidates"]["sim-0"]["pending_prefill_tokens"] > 0
    assert second["estimated_ttft_s"] == pytest.approx(waited, rel=0.15)


def test_prefill_decode_pools_split_long_prompts_and_hand_the_kv_over(profile):
    """1 prefill + 3 decode engines: long prompts are prefilled on the prefill engine and
    decoded elsewhere after the KV pull; short ones run whole on a decode engine; every request
    finishes once, the client's TTFT counting both legs and the hand-over."""
    work = plan(rate=20.0, duration=20.0)
    rec = MemoryRecorder()
    settings = SimSettings(instances=4, perturbation=EXACT, prefill_instances=1)
    cluster = ClusterSimulator(
        profile, create_scorer("kv_ttft"), settings, SYNTH_BLOCK_SIZE, recorder=rec
    )
    sim = cluster.run(work)
    assert [r.index for r in sim.records] == [p.index for p in work]
    assert all(r.ok and r.instance in ("sim-1", "sim-2", "sim-3") for r in sim.records)
    plans = [r["pd"] for r in rec.records]
    split = [p for p in plans if p["prefill"] is not None]
    whole = [p for p in plans if p["prefill"] is None]
    assert split and whole and all(p["prefill"] == "sim-0" for p in split)
    # split: over the local-prefill threshold, or sooner split by the estimate
    assert all(
        p["transfer_tokens"] > 1000 or p["estimated_ttft_s"] < p["colocated_ttft_s"] for p in split
    )
    # a decode leg arrives when its prefill finished, and its first token comes after the pull
    prefilled = {r.request_id: r.finish_s for r in cluster.instances[0].finished}
    assert len(prefilled) == len(split) and all(k.endswith("-prefill") for k in prefilled)
    decodes = [r for inst in cluster.instances[1:] for r in inst.finished if r.remote_prefill]
    assert len(decodes) == len(split)
    for r in decodes:
        assert r.arrival_s == prefilled[r.request_id + "-prefill"]
        assert r.remote_tokens > 0 and r.transfer_s > 0
        assert r.first_token_s >= r.arrival_s + r.transfer_s
    by_index = {r.index: r for r in sim.records}
    assert all(by_index[int(r.request_id)].ttft_s > r.transfer_s for r in decodes)
    # colocated on the same engines (4 colocated), the same requests all finish too
    colo = run(profile, "kv_ttft", SimSettings(instances=4, perturbation=EXACT), workload=work)
    assert all(r.ok for r in colo.records)


def test_pd_settings_are_checked(profile):
    with pytest.raises(ValueError, match="--prefill-instances"):
        run(profile, "kv_ttft", SimSettings(instances=2, prefill_instances=2))


@pytest.mark.parametrize("kind", ["agentic", "rag", "mix"])
def test_ideal_ttft_bounds_every_request_and_is_met_alone(profile, kind):
    """A request's ideal TTFT (alone on an idle engine, every earlier prefix cached) is at most
    what it measured under any router (engines exactly on the profile); a request alone on an
    idle cluster takes exactly its ideal."""
    from simulation.settings import ideal_ttfts

    work = plan(kind, rate=20.0, duration=8.0, seed=1)
    settings = SimSettings(instances=4, perturbation=EXACT)
    ideal = ideal_ttfts(work, SYNTH_BLOCK_SIZE, profile, settings)
    assert len(ideal) == len(work) and all(x > 0 for x in ideal)
    for router in ("round_robin", "kv_ttft", "session"):
        sim = run(profile, router, settings, workload=work)
        assert all(r.ok for r in sim.records)
        for r in sim.records:
            assert r.ttft_s >= ideal[r.index] - 1e-9, (router, r.index)
        alone = run(profile, router, settings, workload=work[:1]).records[0]
        assert alone.ttft_s == pytest.approx(ideal[0], abs=1e-9)
    # cached prefixes lower the ideal: a request re-sending an earlier one's blocks
    assert min(ideal[1:]) < ideal[0] or kind == "rag"


def test_cli_reports_excess_ttft_on_a_csv_trace(tmp_path, capsys):
    trace = tmp_path / "azure.csv"
    rows = [
        f"2023-11-16 18:15:{10 + i // 4:02d}.{i:07d},{300 + 40 * i},{20 + i}" for i in range(40)
    ]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    rc = kvroute([
        "simulate", "--trace", str(trace), "--instances", "2", "--router",
        "kv_ttft,round_robin", "--json", "--no-progress", "--speed-sigma", "0", "--jitter", "0",
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"]["source"].endswith("(azure)") and doc["meta"]["requests"] == 40
    ideal = doc["meta"]["ideal_ttft_ms"]
    assert 0 < ideal["p50"] <= ideal["p99"]
    for row in doc["routers"].values():
        ex = row["excess_ttft_ms"]
        assert set(ex) == {"mean", "p50", "p99"}
        assert 0 <= ex["p50"] <= ex["p99"] and ex["mean"] >= 0
        assert row["ttft_ms"]["p99"] >= ideal["p50"]
