"""NVIDIA Dynamo's own KV router + mocker engines replaying the Mooncake trace (or a synthetic
workload) offline: an external peer for kvroute's cluster simulator. Prints JSON.

    .venv/bin/python benchmarks/dynamo_replay.py [--instances 16] [--routers kv_router,round_robin]
        [--seeds 3] [--rate-scale 1] [--num-gpu-blocks 859] [--slo-ttft-ms 1000]
        [--slo-tpot-ms 50] [--trace PATH | --workload mix [--workload-requests 4000]
        [--workload-rate 100] [--workload-seed 0]] [--setup] [--kvroute kv_ttft,round_robin]
        [--prefill-load-scale 1] [--overlap-score-credit 1] [--router-temperature 0]

``--workload KIND`` replays one of loadgen's synthetic workloads instead of a trace: generated
once, written for Dynamo as a Mooncake-layout trace of 16-token blocks (its replay's
``trace_block_size``; the mocker's engines then use 16-token blocks, as many as hold the same
KV tokens), and simulated from the same requests on kvroute's side.

Dynamo runs in its own virtual environment, ``.venv-dynamo`` (git-ignored), never in kvroute's:
this script, run with kvroute's python, re-invokes itself there (``--inner``) once per replay,
one replay at a time. The environment is created on first use, or again with ``--setup``:
``pip download --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1``, those wheels installed
``--no-deps`` (the package's own dependency list pulls ``aisimulate``, which the offline replay
does not need), then the few runtime dependencies by name.

Each replay is ``dynamo.replay.run_trace_replay`` over the trace with ``num_workers`` aggregated
vLLM-style mocker engines (block size = the trace's 512 tokens, ``num_gpu_blocks`` per worker)
behind Dynamo's router: ``kv_router`` (cost = prefill_load_scale x uncached prompt blocks +
active blocks, lowest wins, ties broken at random) or ``round_robin``. The mocker's default
timing model (aisimulate-core 0.13.0 "polynomial"), checked against a probe replay in every run:

    prefill pass ms = 4.209989e-7 T^2 + 0.01518344 T + 16.50142   (T: new tokens in the pass)
    decode pass ms  = max(1, -25.74 p^2 + 54.01 p + 5.74)          (p: sum of the decoding
                      requests' sequence lengths / (num_gpu_blocks x block_size), at most 1)

and a pass that both prefills and decodes takes the sum of the two. ``--rate-scale X`` divides
every arrival time by X (the replay's own ``arrival_speedup_ratio``). Dynamo's random tie-breaks
are not seedable: ``--seeds N`` runs every router N times and reports each run and the medians.

Per run: TTFT p50/p90/p99, TPOT (a request's mean inter-token gap) p50/p99, goodput (requests
meeting both SLOs per second of the trace's arrival span), the engines' prefix hit rate (prompt
tokens they reused / prompt tokens) and what the router saw (its chosen worker's overlap),
``no_wait_p50_ms`` / ``no_wait_p99_ms`` (the TTFT percentiles had no request waited for
another: each request's prefill at the cache hit it got, alone on a worker, from the formula
above), the wall time of the replay call, and Dynamo's own goodput count and hit ratio as a
cross-check. Dynamo's logs go to stderr (``DYN_LOG``, default ``warn``).

engines/profiles/dynamo-mocker-h100.json is this engine in kvroute's profile form. With it,
``--kvroute ROUTERS`` (default ``kv_ttft,round_robin``; empty: none) replays the same trace on
kvroute's cluster simulator lined up with the mocker: the same workers, block size, KV blocks,
batch limits and rate scale, that profile as the engines' truth (no perturbation) and as the
router's prices, KV events and load samples lagged by ``--kv-event-lag-ms`` (default 0, as the
replay). Its runs are reported under ``kvroute`` with the same metrics, computed the same way,
and ``comparison`` sets each kvroute router beside each Dynamo router (medians): kvroute's
router on kvroute's sim, Dynamo's router on Dynamo's mocker, each simulator's round_robin the
common baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dynamo_mocker import DECODE_POLY, PREFILL_POLY, decode_ms, prefill_ms, run_metrics

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
)
VENV = REPO / ".venv-dynamo"
VENV_PYTHON = VENV / "bin" / "python"
DYNAMO_VERSION = "1.6.1"
DYNAMO_WHEELS = (f"ai-dynamo=={DYNAMO_VERSION}", f"ai-dynamo-runtime=={DYNAMO_VERSION}")
DYNAMO_DEPS = (
    "aiohttp",
    "certifi",
    "kubernetes==32.0.1",
    "msgspec",
    "prometheus-client",
    "pyzmq",
    "redis",
    "tqdm",
    "transformers",
    "typing-extensions",
    "zstandard",
    "pydantic<=2.13.5",
    "uvloop",
)
ROUTERS = ("kv_router", "round_robin")
KVROUTE_PROFILE = "dynamo-mocker-h100"
TRACE_BLOCK = 512
# H100 80GB + Llama-3.1-8B's KV capacity, from kvroute's profile (read as JSON: this file also
# runs inside Dynamo's venv, where kvroute is not installed): 859 blocks = 439,808 tokens
DEFAULT_GPU_BLOCKS = (
    json.loads((REPO / "engines" / "profiles" / "h100-llama3.1-8b.json").read_text())[
        "kv_capacity_tokens"
    ]
    // TRACE_BLOCK
)
ENGINE_KEYS = (
    "backend",
    "num_gpu_blocks",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "preemption_mode",
    "speedup_ratio",
    "timing_model",
)


def log(msg: str) -> None:
    print(f"[dynamo_replay] {msg}", file=sys.stderr, flush=True)


# -- inside .venv-dynamo ---------------------------------------------------------------------


def engine_args(spec: dict[str, Any]) -> dict[str, Any]:
    engine = {
        "block_size": spec.get("block_size", TRACE_BLOCK),
        "num_gpu_blocks": spec["num_gpu_blocks"],
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "timing_model": {"type": "polynomial"},
    }
    return {"engine": engine}


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Replay three requests on one idle worker and compare with the formulas: a cold
    4,096-token prefill, then the same prompt again (fully cached), 10 tokens each."""
    from dynamo.replay import run_trace_replay

    lines = [
        {"timestamp": t, "input_length": 4096, "output_length": 10, "hash_ids": list(range(8))}
        for t in (0, 10_000)
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    try:
        rep = run_trace_replay(
            [f.name],
            num_workers=1,
            router_mode="round_robin",
            trace_block_size=TRACE_BLOCK,
            trace_format="mooncake",
            extra_engine_args=engine_args(spec),
            capture_per_request=True,
        )
    finally:
        os.unlink(f.name)
    cold, warm = rep.per_request or []
    capacity = spec["num_gpu_blocks"] * TRACE_BLOCK
    return {
        "cold_4096_ttft_ms": cold["ttft_ms"],
        "cold_4096_formula_ms": prefill_ms(4096),
        "cached_4096_reused_tokens": warm["reused_input_tokens"],
        "cached_4096_ttft_ms": warm["ttft_ms"],
        "cached_4096_formula_ms": prefill_ms(4096 - warm["reused_input_tokens"]),
        "decode_step_ms": cold["ttst_ms"],
        "decode_step_formula_ms": decode_ms(4097, capacity),
    }


def inner(spec_path: str, out_path: str) -> None:
    from dynamo._core import KvRouterConfig, _normalize_mocker_config
    from dynamo.replay import run_trace_replay

    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {}
    if spec.get("probe"):
        result["probe"] = probe(spec)
        # the engines of the runs (the probe's own run at the trace's blocks: ``run`` below)
        engine = _normalize_mocker_config(engine_args({**spec, **spec.get("run", {})}))["engine"]
        result["engine_config"] = {k: v for k, v in engine.items() if k in ENGINE_KEYS}
    if spec.get("router"):
        router = spec["router"]
        config = None
        if router == "kv_router":
            config = KvRouterConfig(
                router_temperature=spec["router_temperature"],
                prefill_load_scale=spec["prefill_load_scale"],
                overlap_score_credit=spec["overlap_score_credit"],
            )
        t0 = time.perf_counter()
        rep = run_trace_replay(
            [spec["trace"]],
            num_workers=spec["instances"],
            router_mode=router,
            router_config=config,
            arrival_speedup_ratio=spec["rate_scale"],
            trace_block_size=spec.get("block_size", TRACE_BLOCK),
            trace_format="mooncake",
            extra_engine_args=engine_args(spec),
            capture_per_request=True,
            kv_event_lag_ms=spec["kv_event_lag_ms"],
            sla_ttft_ms=spec["slo_ttft_ms"],
            sla_itl_ms=spec["slo_tpot_ms"],
        )
        wall = time.perf_counter() - t0
        run = run_metrics(rep.per_request or [], spec)
        run["wall_s"] = wall
        run["sim_wall_s"] = rep.summary.get("wall_time_ms", 0.0) / 1e3
        run["sim_duration_s"] = rep.summary.get("duration_ms", 0.0) / 1e3
        # Dynamo's own counts, as a cross-check of the figures above
        run["dynamo_goodput_requests"] = rep.summary.get("goodput_completed_requests")
        run["dynamo_prefix_reused_ratio"] = rep.summary.get("prefix_cache_reused_ratio")
        if router != "kv_router":
            run["router_overlap_rate"] = None  # only the KV router looks for overlap
        result["run"] = run
    Path(out_path).write_text(json.dumps(result))


# -- kvroute's side ---------------------------------------------------------------------------


def venv_ready() -> bool:
    if not VENV_PYTHON.exists():
        return False
    check = subprocess.run(
        [str(VENV_PYTHON), "-c", "import dynamo.replay, dynamo._core"],
        capture_output=True,
    )
    return check.returncode == 0


def setup_venv() -> float:
    """(Re)create .venv-dynamo with Dynamo's wheels; returns the seconds it took."""
    t0 = time.perf_counter()
    log(f"creating {VENV} (ai-dynamo {DYNAMO_VERSION}, wheels --no-deps)")
    pip = [str(VENV_PYTHON), "-m", "pip"]

    def run(cmd: list[str]) -> None:
        log("$ " + " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=sys.stderr)

    run([sys.executable, "-m", "venv", "--clear", str(VENV)])
    with tempfile.TemporaryDirectory(prefix="dynamo-wheels-") as wheels:
        run([*pip, "download", "-q", "--no-deps", "-d", wheels, *DYNAMO_WHEELS])
        run([*pip, "install", "-q", "--no-deps", *sorted(str(p) for p in Path(wheels).iterdir())])
    run([*pip, "install", "-q", *DYNAMO_DEPS])
    if not venv_ready():
        raise RuntimeError(f"{VENV}: `import dynamo.replay` still fails after set-up")
    took = time.perf_counter() - t0
    log(f"set-up done in {took:.0f} s")
    return took


def run_inner(spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dynamo-replay-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "DYN_LOG": os.environ.get("DYN_LOG", "warn")}
        cmd = [str(VENV_PYTHON), str(Path(__file__).resolve()), "--inner", str(spec_path)]
        subprocess.run([*cmd, "--inner-out", str(out_path)], check=True, env=env, stdout=sys.stderr)
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result


def kvroute_runs(routers: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Each of ``routers`` on kvroute's cluster simulator, lined up with the mocker (see the
    module doc), measured as ``run_metrics`` measures a Dynamo replay; one run each (seeded: one
    run is every run). The trace is read once for all. Runs in kvroute's venv only."""
    from engines.profile import LatencyProfile
    from loadgen.traces import load_trace
    from loadgen.workloads import build_schedule
    from simulation.cluster import simulate
    from simulation.settings import EXACT, SimSettings

    if not routers:
        return {}
    if args.synthetic is not None:
        requests, block = args.synthetic, args.block_size
    else:
        trace = load_trace(args.trace)
        requests, block = trace.requests, trace.block_size
    plan = build_schedule(requests, time_scale=1 / args.rate_scale)
    lag_s = (args.kv_event_lag_ms or 0.0) / 1e3
    settings = SimSettings(
        instances=args.instances,
        block_size=block,
        engine={
            "num_gpu_blocks": args.num_gpu_blocks,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        perturbation=EXACT,
        event_lag_s=lag_s,
        load_lag_s=lag_s,
    )
    spec = {
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    out: dict[str, Any] = {}
    for router in routers:
        log(f"kvroute {router} (x{args.rate_scale} rate)")
        truth, prices = (LatencyProfile.load(KVROUTE_PROFILE) for _ in range(2))
        run = simulate(plan, block, truth, router, settings, router_profile=prices)
        records = []
        for r in run.records:  # as Dynamo's per-request records, for run_metrics
            records.append({
                "terminal_status": "completed" if r.ok else "failed",
                "ttft_ms": r.ttft_s * 1e3 if r.ok else None,
                "itl_ms": r.tpot_s * 1e3 if r.ok and r.output_tokens > 1 else None,
                "output_length": r.output_tokens,
                "arrival_time_ms": r.intended_s * 1e3,
                "input_length": r.input_tokens,
                "reused_input_tokens": r.cached_tokens or 0,
                "decode_worker_idx": r.instance,
            })  # fmt: skip
        metrics = {**run_metrics(records, spec), "wall_s": run.wall_s}
        log(f"  TTFT p50 {metrics['ttft_p50_ms']:.1f} ms, {run.wall_s:.1f} s wall")
        out[router] = {"runs": [metrics], "median": metrics}
    return out


def comparison(dynamo: dict[str, Any], kvroute: dict[str, Any]) -> dict[str, Any]:
    """Each kvroute router's median beside each Dynamo router's, on the headline metrics."""
    keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "goodput_rps", "prefix_hit_rate")
    out: dict[str, Any] = {}
    for k_name, k in kvroute.items():
        for d_name, d in dynamo.items():
            out[f"kvroute:{k_name} vs dynamo:{d_name}"] = {
                key: {"kvroute": k["median"][key], "dynamo": d["median"][key]} for key in keys
            }
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        out[key] = statistics.median(vals) if len(vals) == len(runs) else None
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL")
    ap.add_argument("--instances", type=int, default=16, help="mocker workers")
    ap.add_argument(
        "--num-gpu-blocks",
        type=int,
        help="KV blocks per worker (default: H100 + Llama-3.1-8B, ~440k tokens: 859 of the "
        "trace's 512 tokens, 27,488 of a synthetic workload's 16)",
    )
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"subset of {','.join(ROUTERS)}")
    ap.add_argument("--seeds", type=int, default=3, help="runs per router (Dynamo is unseeded)")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="divide arrival times by this")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput: TTFT SLO")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput: TPOT SLO")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="mocker default: 256")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="mocker default")
    ap.add_argument("--router-temperature", type=float, default=0.0, help="KvRouterConfig")
    ap.add_argument(
        "--prefill-load-scale", type=float, default=1.0, help="KvRouterConfig (overlap weight)"
    )
    ap.add_argument(
        "--overlap-score-credit",
        type=float,
        default=1.0,
        help="KvRouterConfig (how much a cached block counts against the load)",
    )
    ap.add_argument(
        "--kv-event-lag-ms", type=float, default=None, help="delay KV events to the router"
    )
    ap.add_argument(
        "--kvroute",
        default="kv_ttft,round_robin",
        help="kvroute routers to run on kvroute's simulator, lined up (empty: none)",
    )
    ap.add_argument(
        "--workload",
        help="instead of --trace: a synthetic workload of loadgen's (to-b, mix, ...), written as a "
        "Mooncake-layout trace of 16-token blocks for Dynamo and simulated as such here",
    )
    ap.add_argument("--workload-requests", type=int, default=4000, help="its requests [4000]")
    ap.add_argument("--workload-rate", type=float, default=100.0, help="its req/s at x1 [100]")
    ap.add_argument("--workload-seed", type=int, default=0, help="its seed [0]")
    ap.add_argument("--setup", action="store_true", help=f"(re)create {VENV.name} first")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--inner-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        return args
    routers = [r for r in args.routers.split(",") if r]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        ap.error(f"--routers: unknown {bad}; valid: {', '.join(ROUTERS)}")
    args.router_list = routers
    from router.placement import scorer_names  # kvroute's venv from here on

    unknown = [r for r in args.kvroute.split(",") if r and r not in scorer_names()]
    if unknown:
        ap.error(f"--kvroute: unknown {unknown}; valid: {', '.join(scorer_names())}")
    args.synthetic, args.block_size = None, TRACE_BLOCK
    if args.workload:
        from loadgen.synthetic import SYNTH_BLOCK_SIZE, WORKLOADS, generate_count

        if args.workload not in WORKLOADS:
            ap.error(f"--workload: one of {', '.join(WORKLOADS)}, got {args.workload!r}")
        if args.workload_requests <= 0 or args.workload_rate <= 0:
            ap.error("--workload-requests and --workload-rate must be > 0")
        args.synthetic = generate_count(
            args.workload, args.workload_requests, args.workload_rate, args.workload_seed
        )
        args.block_size = SYNTH_BLOCK_SIZE
    elif not args.trace.is_file():
        ap.error(f"--trace: no file {args.trace}")
    if args.num_gpu_blocks is None:
        args.num_gpu_blocks = DEFAULT_GPU_BLOCKS * TRACE_BLOCK // args.block_size
    for name in ("instances", "num_gpu_blocks", "seeds", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.rate_scale <= 0:
        ap.error("--rate-scale must be > 0")
    return args


def write_synthetic(requests: list[Any], path: Path) -> None:
    """A synthetic workload as the Mooncake layout Dynamo's replay reads (timestamps in ms; the
    hash ids of ``--workload``'s 16-token blocks, passed as the replay's trace block size)."""
    with path.open("w") as f:
        for r in requests:
            rec = {
                "timestamp": round(r.timestamp_s * 1e3, 3),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inner:
        inner(args.inner, args.inner_out)
        return
    setup_s = setup_venv() if args.setup or not venv_ready() else None
    with tempfile.TemporaryDirectory(prefix="dynamo-workload-") as tmp:
        if args.synthetic is not None:
            args.trace = Path(tmp) / f"{args.workload}.jsonl"
            write_synthetic(args.synthetic, args.trace)
        out = lined_up(args, setup_s)
    print(json.dumps(out, indent=2))


def lined_up(args: argparse.Namespace, setup_s: float | None) -> dict[str, Any]:
    """Every router's runs on both simulators, and the comparison (the JSON ``main`` prints)."""
    base = {
        "trace": str(args.trace.resolve()),
        "block_size": args.block_size,
        "instances": args.instances,
        "num_gpu_blocks": args.num_gpu_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "rate_scale": args.rate_scale,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "router_temperature": args.router_temperature,
        "prefill_load_scale": args.prefill_load_scale,
        "overlap_score_credit": args.overlap_score_credit,
        "kv_event_lag_ms": args.kv_event_lag_ms,
    }
    t0 = time.perf_counter()
    # the probe checks the mocker's timing at the Mooncake trace's blocks, whatever the workload
    probe = {
        "block_size": TRACE_BLOCK,
        "num_gpu_blocks": DEFAULT_GPU_BLOCKS,
        "probe": True,
        "run": {"block_size": args.block_size, "num_gpu_blocks": args.num_gpu_blocks},
    }
    checked = run_inner({**base, **probe})
    routers: dict[str, Any] = {}
    for router in args.router_list:
        runs = []
        for i in range(args.seeds):
            log(f"{router} run {i + 1}/{args.seeds} (x{args.rate_scale} rate)")
            runs.append(run_inner({**base, "router": router})["run"])
            log(f"  TTFT p50 {runs[-1]['ttft_p50_ms']:.1f} ms, {runs[-1]['wall_s']:.1f} s wall")
        routers[router] = {"runs": runs, "median": medians(runs)}
    ours = kvroute_runs([r for r in args.kvroute.split(",") if r], args)
    capacity = args.num_gpu_blocks * args.block_size
    workload = (
        {
            "kind": args.workload,
            "requests": args.workload_requests,
            "rate_at_x1": args.workload_rate,
            "seed": args.workload_seed,
        }
        if args.workload
        else None
    )
    return {
        "benchmark": "dynamo_replay",
        "dynamo": f"ai-dynamo {DYNAMO_VERSION} (offline replay, vLLM-style mocker)",
        "trace": None if args.workload else str(args.trace),
        "workload": workload,
        "setup": {
            "instances": args.instances,
            "block_size": args.block_size,
            "num_gpu_blocks": args.num_gpu_blocks,
            "kv_capacity_tokens": capacity,
            "rate_scale": args.rate_scale,
            "runs_per_router": args.seeds,
            "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms,
            "router_config": {
                "router_temperature": args.router_temperature,
                "prefill_load_scale": args.prefill_load_scale,
                "overlap_score_credit": args.overlap_score_credit,
                "kv_event_lag_ms": args.kv_event_lag_ms,
            },
            "engine": checked["engine_config"],
            "timing_model": {
                "type": "polynomial (aisimulate-core 0.13.0)",
                "prefill_pass_ms": "a*T^2 + b*T + c, T = new tokens in the pass",
                "prefill_abc": list(PREFILL_POLY),
                "decode_pass_ms": "max(1, a*p^2 + b*p + c), p = decoding context / capacity",
                "decode_abc": list(DECODE_POLY),
                "mixed_pass": "prefill_pass_ms + decode_pass_ms",
                "probe": checked["probe"],
            },
            "venv_setup_s": setup_s,
        },
        "routers": routers,
        "kvroute": {"profile": KVROUTE_PROFILE, "perturbation": "none", "routers": ours},
        "comparison": comparison(routers, ours),
        "total_wall_s": time.perf_counter() - t0,
    }


if __name__ == "__main__":
    main()
