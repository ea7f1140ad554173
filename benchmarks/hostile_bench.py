"""A normal client's latency while hostile clients keep the ingress busy preparing huge
requests (issue 61, finding 1). Prints JSON.

    .venv/bin/python benchmarks/hostile_bench.py [--probes 40] [--hostile 6] [--context 131072]

One router replica (the real ingress, two sim engines that answer at once, in a process of its
own under uvicorn, as one Serve ingress replica is), 128k context. Per scenario, ``--hostile``
clients each keep one huge request in flight (sent again as soon as it is answered), while a
normal client sends ``--probes`` 4-token completions one after the other; its latency p50/p99
and max are reported, and the ingress process's RSS before, at the end of the scenario and 3 s
after it. Scenarios:

- ``idle``: no hostile client (the reference);
- ``prompt``: a completions prompt of 3.9 MB of words, without truncation (too long for the
  context: the issue's repro);
- ``truncated``: the same prompt with ``truncate_prompt_tokens`` 1000: it must be tokenized
  whole, and is served;
- ``chat``: a chat of 100k short messages.

The issue's target: p99 at most 0.25 s with six max-size prompts in flight (12.25 s before).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import AtLeastOne, print_json

MODEL = "tiny-sim"
WORDS = ("lorem ipsum dolor sit amet consectetur adipiscing " * 80_000)[:3_900_000]


def serve(port: int, context: int) -> None:
    """The ingress, until killed."""
    from tests.support import Server, sim_stack

    with Server(sim_stack(max_model_len=context, time_scale=0.0), port):
        while True:
            time.sleep(3600)


def hostile_body(kind: str) -> tuple[str, dict[str, Any]]:
    if kind == "chat":
        return "/v1/chat/completions", {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}] * 100_000,
            "max_tokens": 1,
        }
    body = {"model": MODEL, "prompt": WORDS, "max_tokens": 1}
    if kind == "truncated":
        body["truncate_prompt_tokens"] = 1000
    return "/v1/completions", body


async def scenario(
    base: str, kind: str, hostile: int, probes: int, proc: psutil.Process
) -> dict[str, Any]:
    stop = asyncio.Event()
    codes: dict[int, int] = {}

    async def attacker(client: httpx.AsyncClient) -> None:
        path, body = hostile_body(kind)
        while not stop.is_set():
            r = await client.post(base + path, json=body)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1

    rss_before = proc.memory_info().rss
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [
            asyncio.create_task(attacker(client)) for _ in range(hostile if kind != "idle" else 0)
        ]
        await asyncio.sleep(1.0 if tasks else 0)  # the huge requests are in flight
        latencies = []
        for i in range(probes):
            t = time.perf_counter()
            r = await client.post(
                base + "/v1/completions",
                json={"model": MODEL, "prompt": f"probe {i}", "max_tokens": 4},
            )
            latencies.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)
        rss_end = proc.memory_info().rss
        stop.set()
        await asyncio.gather(*tasks)
    await asyncio.sleep(3.0)
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "probe_p50_s": round(statistics.median(latencies), 4),
        "probe_p99_s": round(q[98], 4),
        "probe_max_s": round(max(latencies), 4),
        "hostile_statuses": codes,
        "rss_mb_before": round(rss_before / 2**20),
        "rss_mb_end": round(rss_end / 2**20),
        "rss_mb_3s_after": round(proc.memory_info().rss / 2**20),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=40, action=AtLeastOne)
    ap.add_argument("--hostile", type=int, default=6, action=AtLeastOne)
    ap.add_argument("--context", type=int, default=131072, action=AtLeastOne)
    ap.add_argument("--scenarios", default="idle,prompt,truncated,chat")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.context)
        return
    from tests.support import free_port

    port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--context", str(args.context)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit("the ingress did not start")
            time.sleep(0.2)
        proc = psutil.Process(child.pid)
        out = {
            kind: asyncio.run(scenario(base, kind, args.hostile, args.probes, proc))
            for kind in args.scenarios.split(",")
        }
    finally:
        child.kill()
        child.wait()
    print_json(
        {"hostile": args.hostile, "probes": args.probes, "context": args.context, **out}, args.out
    )


if __name__ == "__main__":
    main()
