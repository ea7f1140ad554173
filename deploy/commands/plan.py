"""``kvroute plan``: how many engines, with how much CPU KV tier and which eviction policy, a
workload needs to meet its SLO; or (``--find-max-rate``) the rate at which a given configuration
stops meeting it. Each configuration priced is a cluster simulation through the production
router core (``simulation.planner``); the output states what the answer assumes."""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from loadgen.args import add_workload_arguments, check_output_dir, check_positives, plan_workload
from simulation.options import (
    add_engine_arguments,
    add_jobs_argument,
    add_output_arguments,
    add_truth_arguments,
    load_profile,
    parse_floats,
    parse_routers,
    parse_tiers,
    perturbation_meta,
    sim_settings,
)

NOT_MODELLED = (
    "network and ingress time; admission's concurrency gate; engine failures and restarts; "
    "request cancellation. Caches start cold."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Exit status: 0 when a configuration meets the SLO (or, with --find-max-rate, when the "
        "configuration meets it at some rate searched), 1 when none does, 2 on bad input."
    )
    add_workload_arguments(p, rate_scale_list=True)
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft-ms", type=float, required=True, help="time to first token SLO")
    s.add_argument("--slo-tpot-ms", type=float, help="time per output token SLO (mean per request)")
    s.add_argument(
        "--attainment",
        type=float,
        default=0.99,
        help="fraction of all requests that must meet every SLO [0.99]",
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--router", default="kv_ttft", help="scorer, NAME or NAME@key=value [kv_ttft]")
    add_engine_arguments(c)
    c.add_argument("--min-instances", type=int, default=1, help="smallest count searched [1]")
    c.add_argument("--max-instances", type=int, default=64, help="largest count searched [64]")
    c.add_argument(
        "--cpu-tier-gib",
        default="0",
        metavar="GIB[,GIB...]",
        help="CPU KV tier sizes per engine to try, cheapest first (0: none) [0]",
    )
    c.add_argument(
        "--policy",
        default="wa",
        metavar="NAME[,NAME...]",
        help="CPU-tier eviction policies to try with each non-zero size [wa]",
    )
    c.add_argument(
        "--prefill-fractions",
        default="0",
        metavar="F[,F...]",
        help="prefill/decode splits to try at every count: the fraction of the engines in a "
        "prefill pool (rounded, one engine per pool at least), the rest decode; 0: colocated. "
        "E.g. 0,0.25,0.375 [0]",
    )
    r = p.add_argument_group("break rate")
    r.add_argument(
        "--find-max-rate",
        action="store_true",
        help="instead of sizing: the highest rate at which --instances engines (one CPU tier "
        "size and policy) meet the SLO",
    )
    r.add_argument("--instances", type=int, help="with --find-max-rate: the engines")
    add_truth_arguments(p)
    o = p.add_argument_group("search and output")
    add_jobs_argument(o)
    o.add_argument(
        "--no-guide",
        action="store_true",
        help="search on the whole workload from the start (by default a search on its first "
        "quarter guesses where the boundary is; the answer always rests on whole-workload runs)",
    )
    o.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="simulate each configuration with this many perturbation seeds (--seed, --seed+1, "
        "...) and judge their requests pooled: steadier verdicts near the boundary, K times "
        "the time [1]",
    )
    o.add_argument(
        "--exhaustive",
        action="store_true",
        help="simulate failing configurations to the end (exact attainment figures; slower)",
    )
    o.add_argument(
        "--curve",
        type=int,
        default=0,
        metavar="N",
        help="also price N instance counts spread over [--min-instances, --max-instances] for "
        "the attainment curve [0]",
    )
    add_output_arguments(o, "result", "plan.json, curve.csv and attainment.png")


def _fractions(raw: str) -> list[float]:
    return parse_floats(raw, "--prefill-fractions", lambda f: 0 <= f < 1, "in [0, 1)")


def _scales(args: argparse.Namespace) -> list[float]:
    """``--rate-scale``'s list (cleared from ``args`` so the schedule is built at scale 1)."""
    raw, args.rate_scale = args.rate_scale, None
    if raw is None:
        return [1.0]
    if args.time_scale is not None:
        raise ValueError("give --time-scale or --rate-scale, not both")
    return parse_floats(raw, "--rate-scale", lambda x: x > 0 and math.isfinite(x), "> 0")


def run(args: argparse.Namespace) -> int:
    from simulation.pricing import PlanSetup, Slo, event_volume, rescaled

    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.attainment)
    scales = _scales(args)
    tiers = parse_tiers(args.cpu_tier_gib, args.policy)
    splits = _fractions(args.prefill_fractions)
    _check(args, len(scales), len(tiers), len(splits))
    (label, router, options), *rest = parse_routers(args.router)
    if rest:
        raise ValueError("--router: plan with one router (compare routers with kvroute simulate)")
    settings = sim_settings(args, args.instances or args.min_instances)
    truth = load_profile(args.profile, "--profile")
    belief = load_profile(args.router_profile, "--router-profile") if args.router_profile else None
    t0 = time.perf_counter()
    plan, block_size, source = plan_workload(args)
    if not plan:
        raise ValueError("the workload has no requests (check --duration / --max-requests)")
    if args.find_max_rate:  # the start of the rate search is the workload at its given scale
        plan = rescaled(plan, scales[0])
        scales = [1.0]
    setup = PlanSetup(plan, block_size, truth, router, options, settings, belief, args.seeds)
    ceiling = setup.ceiling(slo)
    rate, sizes, sims = _search(args, setup, slo, tiers, scales, splits)
    elapsed = time.perf_counter() - t0
    meta = {
        "source": source,
        "requests": len(plan),
        "rate_rps": setup.rate,
        "slo": {
            "ttft_ms": slo.ttft_ms,
            "tpot_ms": slo.tpot_ms,
            "attainment": slo.attainment,
            "percentile": slo.percentile,
        },
        "ceiling": round(ceiling, 5),
        "assumptions": _assumptions(args, setup, label, belief),
        "search": {
            "simulations": sims["full"],
            "guide_simulations": sims["guide"],
            "jobs": args.jobs,
            "early_exit": not args.exhaustive,
            "wall_s": round(elapsed, 2),
        },
    }
    doc: dict[str, Any]
    if args.find_max_rate:
        doc = {"meta": meta, "max_rate": _rate_doc(rate, setup, slo)}
        ok = rate.max_pass is not None
    else:
        doc = {"meta": meta, "sizes": [_size_doc(r, setup, slo) for r in sizes]}
        for d in doc["sizes"]:
            b = d["best"]
            if b is not None:
                ev = event_volume(plan, d["rate_rps"], b["instances"], b["hit_rate"])
                d["kv_events"] = ev.to_dict()
        ok = all(r.best is not None for r in sizes)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print(doc, slo)
    if args.report:
        written = write_report(Path(args.report), doc)
        print(f"plan: wrote {len(written)} files to {args.report}", file=sys.stderr)
    return 0 if ok else 1


def _search(
    args: argparse.Namespace,
    setup: Any,
    slo: Any,
    tiers: list[tuple[float, str]],
    scales: list[float],
    splits: list[float],
) -> tuple[Any, list[Any], dict[str, int]]:
    """The planner's search, with a progress line: (the max-rate answer, or None; the size
    answers per rate scale; the simulations run, full and guide)."""
    from simulation.planner import Planner
    from simulation.pricing import Candidate, prefill_count

    quiet = args.no_progress or not sys.stderr.isatty()
    sims = {"full": 0, "guide": 0}
    rate: Any = None

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
        transient=True, disable=quiet,
    ) as bar:  # fmt: skip
        task = bar.add_task("plan: simulating", total=None)

        def seen(fidelity: str, out: Any) -> None:
            sims[fidelity] += 1
            verdict = "meets" if out.passes(slo) else "fails"
            bar.update(
                task,
                description=f"plan: {sims['full'] + sims['guide']} simulations; last "
                f"{out.candidate.label} x{out.candidate.rate_scale:g} ({fidelity}) {verdict}",
            )

        planner = Planner(
            setup,
            slo,
            jobs=args.jobs,
            early_exit=not args.exhaustive,
            guide=0.0 if args.no_guide else 0.25,
            on_outcome=seen,
        )
        with planner:
            if args.find_max_rate:
                assert args.instances is not None  # checked above: it needs --instances
                tier_gib, policy = tiers[0]
                rate = planner.max_rate(
                    Candidate(
                        args.instances,
                        tier_gib,
                        policy,
                        prefill_instances=prefill_count(args.instances, splits[0]),
                    )
                )
                sizes = []
            else:
                sizes = [
                    planner.size(
                        args.min_instances, args.max_instances, tiers, scale, args.curve, splits
                    )
                    for scale in scales
                ]
    return rate, sizes, sims


def _check(args: argparse.Namespace, scales: int, tiers: int, splits: int) -> None:
    """The flags ``run`` cannot plan with, refused before anything runs (``scales``, ``tiers``,
    ``splits``: how many rate scales, CPU tiers and prefill fractions were given)."""
    check_positives(args, "--min-instances", "--max-instances", "--instances", "--jobs", "--seeds")
    if args.curve < 0:
        raise ValueError(f"--curve must be >= 0, got {args.curve}")
    if args.find_max_rate:
        if args.instances is None:
            raise ValueError("--find-max-rate needs --instances N")
        if tiers != 1:
            raise ValueError("--find-max-rate takes one --cpu-tier-gib size and one --policy")
        if scales != 1:
            raise ValueError("--find-max-rate takes at most one --rate-scale (its starting rate)")
        if splits != 1:
            raise ValueError("--find-max-rate takes one --prefill-fractions value")
    elif args.instances is not None:
        raise ValueError("--instances is for --find-max-rate; size with --min/--max-instances")
    if args.min_instances > args.max_instances:
        raise ValueError(
            f"--min-instances ({args.min_instances}) is above --max-instances "
            f"({args.max_instances})"
        )
    if args.report:  # before the run: an unwritable --report fails fast
        check_output_dir(args.report, "--report")


def _assumptions(args: argparse.Namespace, setup: Any, label: str, belief: Any) -> dict[str, Any]:
    """What the plan took for granted: the engines, the router, the perturbation."""
    truth, settings = setup.truth, setup.settings
    return {
        "profile": truth.name,
        "router": label,
        "router_profile": belief.name if belief else truth.name,
        "block_size": setup.block_size,
        "gpu_kv_blocks_per_engine": settings.gpu_blocks(truth, setup.block_size),
        "kv_bytes_per_token": truth.kv_bytes_per_token,
        "engine": settings.engine,
        "perturbation": perturbation_meta(args),
        "lag_ms": args.lag_ms,
        "seeds": args.seeds,
        "not_modelled": NOT_MODELLED,
    }


def _size_doc(r: Any, setup: Any, slo: Any) -> dict[str, Any]:
    best: dict[str, Any] | None = None
    if r.best is not None:
        best = r.best.to_dict(slo)
        best["margin_points"] = round((r.best.attainment - slo.attainment) * 100, 2)
    return {
        "rate_scale": r.rate_scale,
        "rate_rps": setup.rate * r.rate_scale,
        "best": best,
        "next_cheaper_failing": r.cheaper_failing.to_dict(slo) if r.cheaper_failing else None,
        "curve": [o.to_dict(slo) for o in r.outcomes],
    }


def _rate_doc(r: Any, setup: Any, slo: Any) -> dict[str, Any]:
    def one(o: Any) -> dict[str, Any] | None:
        if o is None:
            return None
        return {**o.to_dict(slo), "rate_rps": setup.rate * o.candidate.rate_scale}

    return {
        "candidate": r.candidate.to_dict(),
        "max_passing": one(r.max_pass),
        "min_failing": one(r.min_fail),
        "curve": [one(o) for o in r.outcomes],
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _ms(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _print(doc: dict[str, Any], slo: Any) -> None:
    from rich.console import Console

    meta, a = doc["meta"], doc["meta"]["assumptions"]
    con = Console(width=100, highlight=False)
    tpot = f" and TPOT <= {slo.tpot_ms:g} ms" if slo.tpot_ms is not None else ""
    con.print(
        f"plan: {meta['source']}, {meta['requests']:,} requests at {meta['rate_rps']:.2f} req/s"
    )
    con.print(
        f"SLO: TTFT <= {slo.ttft_ms:g} ms{tpot} for {slo.attainment:.1%} of requests "
        f"({slo.percentile}); ceiling {meta['ceiling']:.1%} (every request alone on an idle "
        "engine with every earlier prefix cached)"
    )
    if "max_rate" in doc:
        rows, first_col = _print_max_rate(con, doc["max_rate"], slo), "req/s"
    else:
        rows, first_col = _print_sizes(con, doc["sizes"], slo, a["seeds"]), "instances"
    con.print(_table(rows, first_col, slo))
    con.print(
        f"assumptions: engines {a['profile']} (router prices with {a['router_profile']}), "
        f"router {a['router']}, block {a['block_size']}, {a['gpu_kv_blocks_per_engine']:,} GPU "
        f"KV blocks per engine, per-engine speed sigma {a['perturbation']['speed_sigma']:g}, "
        f"step jitter {a['perturbation']['jitter']:g}, stragglers "
        f"{a['perturbation']['stragglers']:g}, KV event and load lag {a['lag_ms']:g} ms, "
        + (
            "one perturbation seed per configuration (--seeds K pools K)"
            if a["seeds"] == 1
            else f"{a['seeds']} perturbation seeds per configuration, pooled"
        )
        + f". Not modelled: {a['not_modelled']}"
    )
    sr = meta["search"]
    con.print(
        f"searched in {sr['wall_s']:.1f} s: {sr['simulations']} whole-workload simulations"
        + (
            f" and {sr['guide_simulations']} on its first quarter"
            if sr["guide_simulations"]
            else ""
        )
        + f", {sr['jobs']} at a time; times in ms; '<' marks a run stopped once it had missed"
        " more requests than the target allows"
    )


def _print_max_rate(con: Any, m: dict[str, Any], slo: Any) -> list[dict[str, Any]]:
    """``--find-max-rate``'s answer in words; its curve's rows for the table."""
    what = _label(m["candidate"])
    hi, lo = m["max_passing"], m["min_failing"]
    if hi is None:
        con.print(f"[bold]{what} fail the SLO at every rate searched[/bold] (down to 1/64 x)")
    else:
        con.print(
            f"[bold]{what} meet the SLO up to {hi['rate_rps']:.2f} req/s "
            f"(x{hi['rate_scale']:.3g} this workload's rate)[/bold]: attainment "
            f"{hi['attainment']:.1%}, TTFT {slo.percentile} {_ms(hi['ttft_ms_at_percentile'])}"
            f" ms, hit rate {_pct(hi['hit_rate'])}"
        )
    if lo is not None:
        con.print(f"  at {lo['rate_rps']:.2f} req/s they fail: {lo['why']}")
    else:
        con.print("  they meet it at the highest rate searched (64 x)")
    return [o for o in m["curve"] if o is not None]


def _print_sizes(
    con: Any, sizes: list[dict[str, Any]], slo: Any, seeds: int
) -> list[dict[str, Any]]:
    """The sizing answers in words, a paragraph per rate scale; their curves' rows."""
    from simulation.pricing import ROUTER_CORE_BUDGET

    rows: list[dict[str, Any]] = []
    for s in sizes:
        head = f"at x{s['rate_scale']:g} ({s['rate_rps']:.2f} req/s): "
        b = s["best"]
        if b is None:
            con.print(f"[bold]{head}no configuration up to the maximum meets the SLO[/bold]")
        else:
            con.print(
                f"[bold]{head}{_label(b)}[/bold] meet it: attainment {b['attainment']:.1%} "
                f"(margin {b['margin_points']:+.1f} points; TTFT {slo.percentile} "
                f"{_ms(b['ttft_ms_at_percentile'])} ms"
                + (
                    f", TPOT {slo.percentile} {_ms(b['tpot_ms_at_percentile'], 1)} ms"
                    if slo.tpot_ms is not None
                    else ""
                )
                + f"), hit rate {_pct(b['hit_rate'])}"
            )
        ev = s.get("kv_events")
        if ev is not None:
            con.print(
                f"  KV events at {ev['block_size']}-token blocks: "
                f"{ev['blocks_per_engine_s']:,} blocks/s per engine, "
                f"{ev['cluster_blocks_s'] / 1e6:.2f}M/s in all: "
                f"{ev['router_cores']:.0%} of one router core"
                + (
                    f" (over {ROUTER_CORE_BUDGET:.0%}: set engines.event_stride "
                    f"{ev['event_stride']})"
                    if ev["event_stride"] > 1
                    else ""
                )
            )
        f = s["next_cheaper_failing"]
        if f is not None:
            con.print(f"  next cheaper, {_label(f)}, fails: {f['why']}")
        if b is not None and b["margin_points"] < 1 and seeds == 1:
            con.print(
                "  [bold]the margin is within one perturbation seed's noise: confirm with "
                "--seeds 3[/bold]"
            )
        rows += [{**o, "rate_rps": s["rate_rps"]} for o in s["curve"]]
    return rows


def _table(rows: list[dict[str, Any]], first_col: str, slo: Any) -> Any:
    """The priced configurations, a row each."""
    from rich.table import Table

    table = Table(title="priced configurations (whole workload)")
    cols = [first_col, "CPU tier", "attainment", f"TTFT {slo.percentile}"]
    cols += [f"TPOT {slo.percentile}"] if slo.tpot_ms is not None else []
    cols += ["hit rate", "verdict"]
    if any(o.get("prefill_instances") for o in rows):
        cols.insert(cols.index("CPU tier"), "prefill+decode")
    if len({o["rate_scale"] for o in rows}) > 1 and first_col == "instances":
        cols.insert(0, "req/s")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("verdict", "CPU tier") else "left")
    for o in rows:
        # a run stopped early is known only to fall short of the target
        att = (
            f"<{slo.attainment:.1%}" if o["attainment_is_upper_bound"] else f"{o['attainment']:.1%}"
        )
        cells = {
            "req/s": f"{o['rate_rps']:.2f}",
            "instances": str(o["instances"]),
            "prefill+decode": (
                f"{o['prefill_instances']}+{o['instances'] - o['prefill_instances']}"
                if o.get("prefill_instances")
                else "colocated"
            ),
            "CPU tier": f"{o['cpu_tier_gib']:g} GiB {o['policy']}" if o["cpu_tier_gib"] else "-",
            "attainment": att,
            f"TTFT {slo.percentile}": _ms(o["ttft_ms_at_percentile"]),
            f"TPOT {slo.percentile}": _ms(o["tpot_ms_at_percentile"], 1),
            "hit rate": _pct(o["hit_rate"]),
            "verdict": "meets" if o["passes"] else "fails",
        }
        table.add_row(*(cells[c] for c in cols))
    return table


def _label(c: dict[str, Any]) -> str:
    tier = f" with a {c['cpu_tier_gib']:g} GiB {c['policy']} CPU tier" if c["cpu_tier_gib"] else ""
    p = c.get("prefill_instances") or 0
    split = f" ({p} prefill + {c['instances'] - p} decode)" if p else ""
    return f"{c['instances']} instances{split}{tier}"


def write_report(out: Path, doc: dict[str, Any]) -> list[Path]:
    """plan.json, curve.csv and attainment.png (attainment and hit rate against instances, or
    against the request rate with --find-max-rate; the target as a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "plan.json", out / "curve.csv", out / "attainment.png"]
    written[0].write_text(json.dumps(doc, indent=1) + "\n")
    rate = "max_rate" in doc
    if rate:
        rows = [o for o in doc["max_rate"]["curve"] if o is not None]
    else:
        rows = [{**o, "rate_rps": s["rate_rps"]} for s in doc["sizes"] for o in s["curve"]]
    fields = ["rate_rps", "instances", "prefill_instances", "cpu_tier_gib", "policy",
              "rate_scale", "attainment",
              "attainment_is_upper_bound", "passes", "ttft_ms_at_percentile",
              "tpot_ms_at_percentile", "hit_rate", "refused", "why", "wall_s"]  # fmt: skip
    with written[1].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    hx = ax.twinx()
    series: dict[str, list[dict[str, Any]]] = {}
    for o in rows:
        key = (
            (f"{o['cpu_tier_gib']:g} GiB {o['policy']}" if o["cpu_tier_gib"] else "no CPU tier")
            + (f", {o['prefill_instances']} prefill" if o.get("prefill_instances") else "")
            + ("" if rate else f", {o['rate_rps']:.1f} req/s")
        )
        series.setdefault(key, []).append(o)
    xkey = "rate_rps" if rate else "instances"
    for key, pts in series.items():
        pts.sort(key=lambda o: o[xkey])
        xs = [o[xkey] for o in pts]
        line = ax.plot(xs, [o["attainment"] for o in pts], label=key)[0]
        full = [o for o in pts if not o["attainment_is_upper_bound"]]
        cut = [o for o in pts if o["attainment_is_upper_bound"]]
        ax.plot(
            [o[xkey] for o in full], [o["attainment"] for o in full], "o", color=line.get_color()
        )
        ax.plot([o[xkey] for o in cut], [o["attainment"] for o in cut], "v", color=line.get_color())
        hx.plot(xs, [o["hit_rate"] or math.nan for o in pts], ls=":", color=line.get_color())
    slo = doc["meta"]["slo"]
    ax.axhline(slo["attainment"], color="grey", ls="--", lw=1, label="target")
    ax.set_xlabel("request rate (req/s)" if rate else "instances")
    ax.set_ylabel("SLO attainment (solid; v: stopped early, at most)")
    hx.set_ylabel("hit rate (dotted)")
    ax.set_ylim(0, 1.02)
    hx.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right" if rate else "lower left")
    ax.set_title(f"SLO attainment: TTFT <= {slo['ttft_ms']:g} ms, {slo['percentile']}")
    fig.tight_layout()
    fig.savefig(written[2], dpi=100)
    plt.close(fig)
    return written
