"""Overload: 3x capacity, with and without admission control.

    .venv/bin/python benchmarks/overload_bench.py [--duration 60] [--factor 3] [--slo-ms 1500]

Two sim engines (the ``cpu-tiny-llama`` profile slowed ``--slow`` times, so the engines' step
time, not this box's two cores, sets the capacity) behind the real ingress over HTTP. First the
capacity: completions/s of a closed loop that keeps the engines full. Then ``--factor`` times
that rate, open-loop Poisson, for ``--duration`` seconds, twice: with kvroute's admission (a
TTFT SLO gate from kv_ttft's estimate, and a bounded wait queue) and without (every request
admitted). Each request has a client timeout of ``--timeout`` seconds, as a real client would.

Printed (JSON) per arm: requests sent, 200s, 429s (and whether each carried Retry-After),
client timeouts, other errors, goodput (200s whose latency met the SLO, per second of the run),
and TTFT of the 200s (``loadgen.metrics.percentiles_ms``: mean, percentiles, max). What the
issue asks: "429s with Retry-After instead of timeouts, goodput of admitted requests held".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.local import LocalStack
from engines.profile import LatencyProfile
from loadgen.metrics import percentiles_ms
from router.settings import RouterSettings
from tests.support import SIM_MODEL as MODEL
from tests.support import Server, free_port, sim_stack


def stack(slow: float, settings: RouterSettings) -> LocalStack:
    """Two ``cpu-tiny-llama`` sim engines slowed ``slow`` times, the router priced the same."""
    latency = LatencyProfile.load("cpu-tiny-llama").slowed(slow)
    return sim_stack(2, max_model_len=4096, time_scale=slow, latency=latency, settings=settings)


def prompt(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(300))  # ~600 tokens, uncached


async def one(
    client: httpx.AsyncClient, url: str, rng: random.Random, timeout: float
) -> dict[str, Any]:
    """One streamed request: its status, TTFT (first token chunk) and total seconds."""
    body = {
        "model": MODEL,
        "prompt": prompt(rng),
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    ttft = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    return {
                        "status": r.status_code,
                        "s": time.monotonic() - start,
                        "retry_after": r.headers.get("retry-after"),
                    }
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data: {"):
                        ttft = time.monotonic() - start
    except (TimeoutError, httpx.TimeoutException):
        return {"status": "timeout", "s": time.monotonic() - start}
    except httpx.HTTPError as e:
        return {"status": f"error:{type(e).__name__}", "s": time.monotonic() - start}
    return {"status": 200, "s": time.monotonic() - start, "ttft": ttft}


async def closed_loop(url: str, concurrency: int, seconds: float) -> float:
    rng = random.Random(1)
    done = 0
    stop = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop:
            if (await one(client, url, rng, 120.0))["status"] == 200:
                done += 1

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return done / seconds


async def open_loop(url: str, rate: float, seconds: float, timeout: float) -> list[dict[str, Any]]:
    rng = random.Random(2)
    tasks = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=10_000)) as client:
        t = time.monotonic()
        stop = t + seconds
        while t < stop:
            tasks.append(asyncio.create_task(one(client, url, rng, timeout)))
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.monotonic()))
        return list(await asyncio.gather(*tasks))


def run_arm(
    name: str, settings: RouterSettings, args: argparse.Namespace, rate: float
) -> dict[str, Any]:
    st = stack(args.slow, settings)
    with Server(st, free_port()) as server:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        results = asyncio.run(open_loop(url, rate, args.duration, args.timeout))
    ok = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 429]
    lat = [r["ttft"] for r in ok if r.get("ttft") is not None]
    good = [s for s in lat if s * 1e3 <= args.slo_ms]
    return {
        "arm": name,
        "sent": len(results),
        "ok": len(ok),
        "rejected_429": len(shed),
        "429_with_retry_after": sum(1 for r in shed if r.get("retry_after")),
        "client_timeouts": sum(1 for r in results if r["status"] == "timeout"),
        "other_errors": sum(1 for r in results if r["status"] not in (200, 429, "timeout")),
        "goodput_rps": round(len(good) / args.duration, 3),
        "ttft_ms": percentiles_ms(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of overload per arm")
    ap.add_argument("--factor", type=float, default=3.0, help="offered load / capacity")
    ap.add_argument("--slow", type=float, default=20.0, help="sim engines' time scale")
    ap.add_argument("--slo-ms", type=float, default=1500.0, help="TTFT SLO of the admission arm")
    ap.add_argument("--timeout", type=float, default=30.0, help="client timeout, seconds")
    args = ap.parse_args()
    st = stack(args.slow, RouterSettings())
    with Server(st, free_port()) as server:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        capacity = asyncio.run(closed_loop(url, 32, 15.0))
    rate = capacity * args.factor
    print(f"capacity {capacity:.2f} req/s; offering {rate:.2f} req/s", file=sys.stderr)
    arms = [
        run_arm(
            "admission",
            RouterSettings(
                slo_ttft_s=args.slo_ms / 1e3, max_in_flight=32, max_queue=32, max_wait_s=2
            ),
            args,
            rate,
        ),
        run_arm("no_admission", RouterSettings(max_in_flight=100_000, max_queue=0), args, rate),
    ]
    out = {
        "capacity_rps": round(capacity, 3),
        "offered_rps": round(rate, 3),
        "duration_s": args.duration,
        "slo_ttft_ms": args.slo_ms,
        "goodput_counts": "200s whose TTFT met the SLO, per second of the run",
        "arms": arms,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
