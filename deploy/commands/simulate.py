"""``kvroute simulate``: replay a trace or synthetic workload on a virtual cluster of sim engines,
placed by the production routing core, once per router; print the comparison table and write
``--json`` / ``--report`` outputs (see ``simulation.cluster`` for what is and is not modelled)."""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

from loadgen.args import add_workload_arguments, check_output_dir, check_positives, plan_workload
from simulation.measures import excess_ttfts, flapping, slo_attainment
from simulation.options import (
    add_engine_arguments,
    add_jobs_argument,
    add_output_arguments,
    add_truth_arguments,
    load_profile,
    parse_routers,
    perturbation_meta,
    sim_settings,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from router.settings import DEFAULTS
    from simulation.settings import DEFAULT_HANDOVER_HISTORY_S

    add_workload_arguments(p)
    c = p.add_argument_group("cluster")
    c.add_argument("--instances", type=int, default=16, help="engines [16]")
    c.add_argument(
        "--router",
        default="kv_ttft,round_robin",
        help="comma-separated scorers, each NAME or NAME@key=value+key=value [kv_ttft,round_robin]",
    )
    c.add_argument(
        "--tenants",
        type=int,
        default=0,
        metavar="K",
        help="K tenants, each session drawn into one by --seed, their blocks keyed apart as the "
        "ingress keys API keys' namespaces (simulation.tenants); 0 or 1: one shared cache [0]",
    )
    add_engine_arguments(c)
    d = p.add_argument_group("prefill/decode disaggregation")
    d.add_argument(
        "--prefill-instances",
        type=int,
        default=0,
        help="the first N engines are a prefill pool, the rest a decode pool [0: colocated]; "
        "KV pulls take --engine transfer_gbps / transfer_latency_ms",
    )
    d.add_argument(
        "--pd-max-local-prefill-tokens",
        type=int,
        default=DEFAULTS.pd_max_local_prefill_tokens,
        help="a request with at most this many uncached tokens may run whole on a decode "
        f"engine [{DEFAULTS.pd_max_local_prefill_tokens}]",
    )
    d.add_argument(
        "--pd-overload-factor",
        type=float,
        default=DEFAULTS.pd_overload_factor,
        help="run whole on a decode engine when the split is priced above this many times the "
        f"colocated TTFT estimate; 0: never [{DEFAULTS.pd_overload_factor:g}]",
    )
    a = p.add_argument_group("autoscaling (router.autoscale)")
    a.add_argument(
        "--autoscale",
        metavar="POLICY[@k=v,...]",
        help="run each router with this autoscaling policy in virtual time, from --instances "
        "(clamped to the bounds): static, ray_default, throughput, kvroute (model-predictive: "
        "simulates candidate pool sizes every decision; period_s=S for a known cycle) or "
        "kvroute_reactive, options as "
        "NAME@key=value+key=value (or ,); needs --slo-ttft-ms; reports attainment, GPU-hours "
        "and the replica count over time",
    )
    a.add_argument("--min-instances", type=int, default=1, help="autoscaling floor [1]")
    a.add_argument("--max-instances", type=int, default=64, help="autoscaling ceiling [64]")
    a.add_argument(
        "--autoscale-interval-s", type=float, default=10.0, help="seconds between decisions [10]"
    )
    a.add_argument(
        "--cold-start-s",
        type=float,
        default=None,
        help="seconds from a scale-up decision to the new engine's first step "
        "[45: vLLM, 8B model, one H100, weights local; router.autoscale.DEFAULT_COLD_START_S]",
    )
    a.add_argument(
        "--warm-prefixes",
        type=int,
        default=0,
        help="a new engine prefills this many of the recent requests' hottest prefixes at the "
        "end of its cold start, before it takes traffic (0: joins cold) [0]",
    )
    a.add_argument(
        "--handover-prefixes",
        type=int,
        default=0,
        help="a leaving engine's longest prompts of the last "
        f"{DEFAULT_HANDOVER_HISTORY_S:g} s, this many, that no survivor holds half of are "
        "prefilled where the router places them among the survivors (0: its cache leaves with "
        "it) [0]",
    )
    a.add_argument(
        "--attainment",
        type=float,
        default=0.99,
        help="the fraction of requests the policies aim to keep within the SLOs [0.99]",
    )
    add_truth_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft-ms", type=float, help="goodput SLO on TTFT")
    o.add_argument("--slo-tpot-ms", type=float, help="goodput SLO on time per output token")
    o.add_argument(
        "--admit",
        action="store_true",
        help="reject (429) requests whose best "
        "estimate breaks --slo-ttft-ms, as the router's admission does",
    )
    add_output_arguments(o, "results", "summary.json, CSV files and PNG plots")
    add_jobs_argument(o, "routers")


def autoscaler_factory(
    args: argparse.Namespace, belief: Any, settings: Any
) -> tuple[Any, dict[str, Any]] | None:
    """``--autoscale``'s flags checked (raises naming the flag): a function making a fresh
    ``router.autoscale.Autoscaler`` per run, and its description for the JSON; None without
    ``--autoscale``."""
    from router.autoscale import Autoscaler, Slo, create_policy

    spec = getattr(args, "autoscale", None)
    if spec is None:
        return None
    if args.slo_ttft_ms is None:
        raise ValueError("--autoscale needs --slo-ttft-ms")
    if settings.prefill_instances:
        raise ValueError("--autoscale: prefill/decode pools are not autoscaled yet")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    check_positives(args, "--autoscale-interval-s")
    if args.cold_start_s is not None:
        settings.cold_start_s = args.cold_start_s
    settings.warm_prefixes = args.warm_prefixes
    settings.handover_prefixes = args.handover_prefixes
    settings.validate()
    interval_ms = args.load_interval_ms
    if args.autoscale_interval_s * 1e3 < interval_ms:
        raise ValueError(
            f"--autoscale-interval-s must be >= --load-interval-ms ({interval_ms:g} ms): a "
            "decision sooner than the engines' next load sample sees nothing new, got "
            f"{args.autoscale_interval_s:g}"
        )
    slo = Slo(
        args.slo_ttft_ms / 1e3,
        args.slo_tpot_ms / 1e3 if args.slo_tpot_ms is not None else None,
        args.attainment,
    )
    for bound, floor_s in slo.floors_broken(belief):
        raise ValueError(
            f"--slo-{bound}-ms: no engine can meet it: the floor of profile {belief.name!r} is "
            f"{floor_s * 1e3:.3g} ms (a one-token prompt's TTFT, a lone decode step's TPOT, on "
            f"an idle engine), got {getattr(args, f'slo_{bound}_ms'):g}"
        )
    lo, hi = args.min_instances, args.max_instances

    def make() -> Any:
        policy = create_policy(spec, profile=belief, slo=slo, cold_start_s=settings.cold_start_s)
        return Autoscaler(policy, lo, hi, args.autoscale_interval_s)

    make()  # a bad policy or bound fails before the workload is read
    settings.instances = min(hi, max(lo, settings.instances))
    meta = {
        "policy": spec,
        "min_instances": lo,
        "max_instances": hi,
        "start_instances": settings.instances,
        "interval_s": args.autoscale_interval_s,
        "cold_start_s": settings.cold_start_s,
        "warm_prefixes": settings.warm_prefixes,
        "handover_prefixes": settings.handover_prefixes,
        "attainment_target": args.attainment,
    }
    return make, meta


def autoscale_row(sim: Any, args: argparse.Namespace, cold_start_s: float) -> dict[str, Any]:
    """An autoscaled run's figures: attainment, GPU-hours, how the target moved
    (``simulation.measures.flapping``), and the target over time."""
    slo_ttft_s = args.slo_ttft_ms / 1e3
    slo_tpot_s = args.slo_tpot_ms / 1e3 if args.slo_tpot_ms is not None else None
    return {
        "attainment": round(slo_attainment(sim.records, slo_ttft_s, slo_tpot_s), 5),
        "gpu_hours": round(sim.gpu_seconds / 3600, 5),
        "peak_instances": max((n for _, n, _ in sim.replicas), default=0),
        "flapping": flapping(sim.replicas, cold_start_s, sim.span_s),
        "replicas": [[round(t, 3), n, why] for t, n, why in sim.replicas],
    }


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from loadgen.metrics import summarize
    from loadgen.workloads import ideal_hit_rate
    from simulation.cluster import simulate
    from simulation.jobs import run_each
    from simulation.settings import ideal_ttfts
    from simulation.tenants import isolate

    _check(args)
    # before the workload is read: a bad flag fails fast
    settings = sim_settings(args, args.instances, args.slo_ttft_ms / 1e3 if args.admit else None)
    routers = parse_routers(args.router)
    truth = load_profile(args.profile, "--profile")
    belief = load_profile(args.router_profile, "--router-profile") if args.router_profile else None
    scaling = autoscaler_factory(args, belief or truth, settings)
    plan, block_size, source = plan_workload(args)
    if not plan:
        raise ValueError("the workload has no requests (check --duration / --max-requests)")
    plan = isolate(plan, args.tenants, args.seed)
    ideal = ideal_hit_rate((p.req for p in plan), block_size)
    ideal_s = ideal_ttfts(plan, block_size, truth, settings)
    span = plan[-1].offset_s if len(plan) > 1 else 0.0
    quiet = args.no_progress or not sys.stderr.isatty()
    # each router's requests placed so far: shared memory a forked worker writes into
    placed = multiprocessing.get_context("fork").Array("q", len(routers), lock=False)
    keep = bool(args.report)  # a worker sends its records and queue back only for the report
    parent = os.getpid()

    def one(k: int, name: str, options: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        def progress(done: int, _total: int) -> None:
            placed[k] = done
            if os.getpid() == parent:  # run here, not in a worker: nothing else refreshes
                refresh()

        sim = simulate(
            plan,
            block_size,
            truth,
            name,
            settings,
            scorer_options=options,
            router_profile=belief,
            progress=progress,
            autoscaler=scaling[0]() if scaling is not None else None,
        )
        s = summarize(
            sim.records,
            duration_s=sim.span_s,
            requested_span_s=span,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_itl_ms=args.slo_tpot_ms,
            ideal_hit_rate=ideal,
        )
        row = _row(s, sim, excess_ttft_ms(sim.records, ideal_s))
        if scaling is not None:
            row["autoscale"] = autoscale_row(sim, args, scaling[1]["cold_start_s"])
        return row, (sim if keep else None)

    # NOTE: no auto-refresh thread: the workers are forked while the bar is up
    with Progress(transient=True, disable=quiet, auto_refresh=False) as bar:
        tasks = [bar.add_task(f"simulate {label}", total=len(plan)) for label, _, _ in routers]

        def refresh() -> None:
            for task, done in zip(tasks, placed, strict=True):
                bar.update(task, completed=done)
            bar.refresh()

        out = run_each(
            [partial(one, k, name, options) for k, (_, name, options) in enumerate(routers)],
            args.jobs,
            poll=refresh,
        )
    results = {label: row for (label, _, _), (row, _) in zip(routers, out, strict=True)}
    runs = {label: sim for (label, _, _), (_, sim) in zip(routers, out, strict=True)}
    meta = {
        "source": source,
        "requests": len(plan),
        "instances": args.instances,
        "block_size": settings.block_size or block_size,
        **_assumptions(args, settings, truth, belief),
        "ideal_hit_rate_tokens": round(ideal[1], 4),
        "ideal_ttft_ms": _stats_ms(ideal_s),
        "not_modelled": "network/ingress time, admission's concurrency gate, engine failures",
    }
    if scaling is not None:
        meta["autoscale"] = scaling[1]
    doc = {"meta": meta, "routers": results}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_table(meta, results)
        if scaling is not None:
            _print_autoscale(scaling[1]["policy"], results)
    if args.report:
        written = write_report(Path(args.report), doc, runs)
        print(f"simulate: wrote {len(written)} files to {args.report}", file=sys.stderr)
    return 0


def _print_autoscale(policy: str, results: dict[str, Any]) -> None:
    for label, r in results.items():
        a = r["autoscale"]
        print(
            f"autoscale {policy} ({label}): attainment "
            f"{a['attainment']:.2%}, {a['gpu_hours']:.3f} GPU-hours, peak "
            f"{a['peak_instances']} instances, {len(a['replicas']) - 1} changes"
        )


def _check(args: argparse.Namespace) -> None:
    """The flags ``run`` cannot simulate with, refused before anything runs."""
    from simulation.jobs import check_jobs
    from simulation.tenants import check_tenants

    check_positives(args, "--slo-ttft-ms", "--slo-tpot-ms", "--instances")
    check_tenants(args.tenants)
    check_jobs(args.jobs)
    if args.admit and args.slo_ttft_ms is None:
        raise ValueError("--admit needs --slo-ttft-ms")
    if args.report:  # before the run: an unwritable --report fails fast
        check_output_dir(args.report, "--report")


def _assumptions(
    args: argparse.Namespace, settings: Any, truth: Any, belief: Any
) -> dict[str, Any]:
    """What the simulation took for granted: the engines, the router's profile, the SLO."""
    return {
        "profile": truth.name,
        "router_profile": belief.name if belief else truth.name,
        "perturbation": perturbation_meta(args),
        "lag_ms": args.lag_ms,
        "engine": settings.engine,
        "prefill_instances": settings.prefill_instances,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "admission": bool(args.admit),
        # absent without isolation: the output of a run without the flag
        **({"tenants": args.tenants} if args.tenants > 1 else {}),
        # absent without a pool, as above
        **({"pool": _pool_meta(settings)} if settings.pool_gib else {}),
    }


def _pool_meta(settings: Any) -> dict[str, Any]:
    return {
        "gib": settings.pool_gib,
        "gbps": settings.pool_gbps,
        "latency_ms": settings.pool_latency_ms,
        "policy": settings.pool_policy,
        "in_map": settings.pool_in_map,
    }


def _stats_ms(values_s: Any) -> dict[str, float | None]:
    """Mean, p50 and p99 in ms of seconds (NaNs left out; None for none)."""
    import numpy as np

    arr = np.asarray(values_s, dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    p50, p99 = np.percentile(arr, [50, 99])
    return {
        k: round(float(v) * 1e3, 4) for k, v in (("mean", arr.mean()), ("p50", p50), ("p99", p99))
    }


def excess_ttft_ms(records: Any, ideal_s: list[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of ``excess_ttfts`` in ms."""
    return _stats_ms(excess_ttfts(records, ideal_s))


def _row(s: dict[str, Any], sim: Any, excess: dict[str, float | None]) -> dict[str, Any]:
    return {
        "requests": s["requests"],
        "completed": s["completed"],
        "rejected": s["errors"].get("http_429", 0),
        "errors": s["errors"],
        "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p90", "p99")},
        "tpot_ms": {k: s["tpot_ms"][k] for k in ("p50", "p99")},
        "excess_ttft_ms": excess,
        "hit_rate": s["server_hit_rate"],
        "gpu_hit_rate": s["gpu_hit_rate"],
        "cpu_hit_rate": s["cpu_hit_rate"],
        "goodput_rps": s["goodput_rps"],
        "good_requests": s["good_requests"],
        "load_spread": {k: v for k, v in (s["per_instance"] or {}).items() if k != "requests"},
        "calibration": sim.calibration,
        # what the engines' KV events put on the bus (after --event-stride), per engine-second:
        # the measured side of kvroute plan's event-volume model
        "kv_events": {
            "messages": sim.kv_messages,
            "blocks": sim.kv_blocks,
            "blocks_per_engine_s": round(sim.kv_blocks / sim.gpu_seconds, 1)
            if sim.gpu_seconds > 0
            else None,
        },
        "wall_s": round(sim.wall_s, 3),
        "sim_req_per_wall_s": round(sim.requests_per_wall_s, 1),
    }


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}"


def _print_table(meta: dict[str, Any], results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    console.print(
        f"simulate: {meta['source']}, {meta['requests']:,} requests, {meta['instances']} x "
        f"{meta['profile']} (router prices with {meta['router_profile']}), block "
        f"{meta['block_size']}, ideal hit rate {meta['ideal_hit_rate_tokens']:.3f}"
    )
    table = Table()
    for col in (
        "router", "TTFT p50", "p90", "p99", "excess mean", "p99", "TPOT p50", "p99", "hit",
        "GPU", "CPU",
        "goodput/s", "rejected", "max/mean load", "wall s",
    ):  # fmt: skip
        table.add_column(col, justify="left" if col == "router" else "right")
    for label, r in results.items():
        table.add_row(
            label,
            _fmt(r["ttft_ms"]["p50"]),
            _fmt(r["ttft_ms"]["p90"]),
            _fmt(r["ttft_ms"]["p99"]),
            _fmt(r["excess_ttft_ms"]["mean"]),
            _fmt(r["excess_ttft_ms"]["p99"]),
            _fmt(r["tpot_ms"]["p50"], 2),
            _fmt(r["tpot_ms"]["p99"], 2),
            _fmt(r["hit_rate"], 3),
            _fmt(r["gpu_hit_rate"], 3),
            _fmt(r["cpu_hit_rate"], 3),
            _fmt(r["goodput_rps"], 2),
            _fmt(r["rejected"]),
            _fmt(r["load_spread"].get("requests_max_over_mean"), 2),
            _fmt(r["wall_s"], 2),
        )
    console.print(table)
    console.print(
        "times in ms; excess: TTFT over the request's ideal (alone on an idle engine, every "
        "earlier prefix cached); hit rates over prompt tokens; goodput under the given SLOs"
    )


def write_report(out: Path, doc: dict[str, Any], runs: dict[str, Any]) -> list[Path]:
    """summary.json, routers.csv, requests-<router>.csv, queue-<router>.csv, ttft_cdf.png and
    queue-<router>.png (per-instance waiting requests over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from loadgen.report import RECORD_FIELDS, record_row

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.json", out / "routers.csv"]
    written[0].write_text(json.dumps(doc, indent=1) + "\n")
    with written[1].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["router", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms",
                    "tpot_p99_ms", "hit_rate", "gpu_hit_rate", "cpu_hit_rate", "goodput_rps",
                    "rejected"])  # fmt: skip
        for label, r in doc["routers"].items():
            w.writerow([label, r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["ttft_ms"]["p99"],
                        r["tpot_ms"]["p50"], r["tpot_ms"]["p99"], r["hit_rate"],
                        r["gpu_hit_rate"], r["cpu_hit_rate"], r["goodput_rps"],
                        r["rejected"]])  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, sim in runs.items():
        safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in label)
        path = out / f"requests-{safe}.csv"
        with path.open("w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(RECORD_FIELDS))
            wr.writeheader()
            wr.writerows(record_row(r) for r in sim.records)
        qpath = out / f"queue-{safe}.csv"
        with qpath.open("w", newline="") as f:
            wq = csv.writer(f)
            wq.writerow(["t_s", "instance", "waiting", "running"])
            wq.writerows(sim.queue)
        written += [path, qpath]
        ttft = np.sort([r.ttft_s * 1e3 for r in sim.records if r.ok])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=label)
        qfig, qax = plt.subplots(figsize=(8, 4.5))
        by_inst: dict[str, tuple[list[float], list[int]]] = {}
        for t, inst, waiting, _running in sim.queue:
            xs, ys = by_inst.setdefault(inst, ([], []))
            xs.append(t)
            ys.append(waiting)
        for inst, (xs, ys) in sorted(by_inst.items()):
            qax.plot(xs, ys, lw=0.6, label=inst if len(by_inst) <= 16 else None)
        qax.set_xlabel("time (s)")
        qax.set_ylabel("waiting requests")
        qax.set_title(f"Per-instance queue, {label}")
        qax.grid(alpha=0.3)
        if len(by_inst) <= 16:
            qax.legend(fontsize=6, ncol=4)
        qfig.tight_layout()
        qpng = out / f"queue-{safe}.png"
        qfig.savefig(qpng, dpi=100)
        plt.close(qfig)
        written.append(qpng)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Time to first token, CDF per router")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    cdf = out / "ttft_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)
    written.append(cdf)
    return written
