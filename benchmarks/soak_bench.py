"""Soak: ``--duration`` seconds (default 1800) of mixed load on sim engines under Ray Serve, with
engines coming and going; memory of every process and the cache map's size over time. Prints
JSON. Not part of CI (it runs for half an hour).

    .venv/bin/python benchmarks/soak_bench.py [--duration 1800] [--rate 4] [--churn-s 300]

The app is ``kvroute serve``'s (one ingress replica, kv_ttft, two sim engines on the Ray bus,
each with a CPU tier), driven by kvroute's load generator (``mix`` workload: multi-turn chats
and API programs sharing system prompts, Poisson arrivals at ``--rate`` req/s, streamed
completions with token-id prompts).
Every ``--churn-s`` seconds one engine replica is killed; Serve starts a new one under a new
instance id, so the router must forget the dead instance's blocks or its map grows without
bound. Every ``--sample-s`` seconds: resident memory (RSS) of each process of the Ray session
by role (controller, proxy, ingress, engine, raylet, GCS, ...; a replaced engine counts as the
same role) and of this driver, and the router's map size (``kvroute_cache_map_blocks``) and
live instances (``/health``).

Reported per role: RSS at the end of warm-up (``--warmup-s``), the maximum, the last, and the
growth rate of the second half of the run (a least-squares slope, MiB/hour): a leak shows as a
steady slope, a bounded process as a flat one. The map: the maximum and last block count next
to what the live engines can hold (GPU + CPU blocks per engine), and the instance count.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray

from benchmarks.common import Positive
from deploy.config import ServeConfig
from engines.tiny_model import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS
from loadgen.metrics import summarize
from loadgen.prompts import PromptSynth
from loadgen.runner import RunConfig, Runner
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from tests.support import by_role, free_port, named_replicas, serve_app, sim_app_config

MODEL = "tiny"
GPU_BLOCKS, CPU_BLOCKS = 512, 1024
BLOCK_SIZE = 32  # tests.support.sim_app_config's


def soak_config(port: int) -> ServeConfig:
    return sim_app_config(
        port,
        "kvroute-soak",
        engine={
            "kv_blocks": GPU_BLOCKS,
            # NOTE: the mix workload's longest conversations (up to 14.3k tokens of prompt and
            # reply at the default seed): the whole GPU pool less its null block. At 8192, 68
            # of the 7,230 requests of a 30-minute run got a 400 context_length_exceeded.
            "max_model_len": (GPU_BLOCKS - 1) * BLOCK_SIZE,
            "sim_options": {"time_scale": 0.05},
            "cpu_tier": {"blocks": CPU_BLOCKS, "policy": "wa"},
        },
        engines={"resources": {"num_cpus": 0.5}, "health_check_period_s": 1.0},
        router={"max_in_flight": 256, "max_queue": 512},
    )


def sample_rss() -> dict[str, float]:
    """MiB of resident memory per role (``tests.support.ray_process_role``), summed over its
    processes, plus this driver's."""
    return by_role(lambda p: p.memory_info().rss / 2**20)


def map_state(base: str) -> tuple[int, int]:
    """(blocks in the router's cache map, live instances)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("kvroute_cache_map_blocks{"))
    instances = httpx.get(f"{base}/health", timeout=30).json()["instances"]
    return int(float(line.split()[1])), int(instances)


def kill_one_engine(app: str) -> str:
    victim = named_replicas(app, "engine")[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    return str(victim["name"].rsplit("#", 1)[1])


def slope_mib_per_hour(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 3:
        return 0.0
    return float(np.polyfit(np.asarray(ts), np.asarray(ys), 1)[0] * 3600)


def tiny_synth(seed: int) -> PromptSynth:
    """Token-id prompts of the workload's exact lengths inside the tiny model's vocabulary, past
    its special tokens (synthetic text would tokenize to ~4x as many tiny tokens and overflow
    the context)."""
    offset = len(SPECIAL_TOKENS)
    return PromptSynth(
        SYNTH_BLOCK_SIZE, seed=seed, vocab_size=DEFAULT_VOCAB_SIZE - offset, token_offset=offset
    )


def load(base: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    params = SynthParams(rate=args.rate, duration_s=args.duration, seed=args.seed)
    plan = build_schedule(generate("mix", params), rate=args.rate, arrival="poisson")
    config = RunConfig(base, MODEL, tiny_synth(args.seed), api="completions", timeout_s=120.0)
    run = Runner(config, plan).run_blocking()
    s = summarize(run.records, duration_s=run.duration_s, requested_span_s=run.requested_span_s)
    result.update(
        requests=s["requests"], completed=s["completed"], errors=s["errors"], ttft_ms=s["ttft_ms"]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--duration", type=float, default=1800.0, action=Positive, help="seconds of load"
    )
    ap.add_argument("--rate", type=float, default=4.0, action=Positive, help="requests/s (Poisson)")
    ap.add_argument(
        "--churn-s", type=float, default=300.0, action=Positive, help="kill an engine this often"
    )
    ap.add_argument("--sample-s", type=float, default=30.0, action=Positive)
    ap.add_argument("--warmup-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = soak_config(free_port())
    samples: list[dict[str, Any]] = []
    killed: list[tuple[float, str]] = []
    traffic: dict[str, Any] = {}
    with serve_app(cfg) as base:
        loader = threading.Thread(target=load, args=(base, args, traffic), daemon=True)
        t0 = time.monotonic()
        loader.start()
        next_kill = t0 + args.churn_s
        while loader.is_alive():
            loader.join(timeout=args.sample_s)
            now = time.monotonic()
            blocks, instances = map_state(base)
            samples.append(
                {"t": now - t0, "rss": sample_rss(), "blocks": blocks, "instances": instances}
            )
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
            if now >= next_kill and now - t0 < args.duration - args.churn_s / 2:
                killed.append((round(now - t0, 1), kill_one_engine(cfg.app_name)))
                next_kill = now + args.churn_s
    warm = [s for s in samples if s["t"] >= args.warmup_s] or samples
    second = [s for s in samples if s["t"] >= samples[-1]["t"] / 2]
    roles = sorted({r for s in samples for r in s["rss"]})
    memory = {}
    for r in roles:
        series = [(s["t"], s["rss"][r]) for s in second if r in s["rss"]]
        memory[r] = {
            "after_warmup_mib": round(next((s["rss"][r] for s in warm if r in s["rss"]), 0.0), 1),
            "max_mib": round(max(s["rss"].get(r, 0.0) for s in samples), 1),
            "last_mib": round(samples[-1]["rss"].get(r, 0.0), 1),
            "second_half_slope_mib_per_h": round(
                slope_mib_per_hour([t for t, _ in series], [y for _, y in series]), 1
            ),
        }
    out = {
        "duration_s": round(samples[-1]["t"], 1),
        "traffic": traffic,
        "engines_killed": killed,
        "memory_by_role": memory,
        "cache_map": {
            "max_blocks": max(s["blocks"] for s in samples),
            "last_blocks": samples[-1]["blocks"],
            "capacity_of_live_engines": cfg.engines.instances * (GPU_BLOCKS + CPU_BLOCKS),
            "instances_seen": sorted({s["instances"] for s in samples}),
        },
        "samples": len(samples),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
