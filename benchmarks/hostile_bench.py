"""A normal client's latency while hostile clients keep the ingress busy preparing huge
requests (issue 61, finding 1), and what a tenant learns of another's cache (finding 4). Prints
JSON.

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
- ``chat``: a chat of 100k short messages;
- ``guess``: the issue's guessing demo, with the engines' real step times (``time_scale`` 1):
  a victim key caches ``public text + a 4-digit secret + more text``; another key, which has
  the public part cached in its own requests, sends the prompt with the right secret and with
  wrong ones (``--probes`` rounds, a new secret each); reported are the ``cached_tokens`` and
  the median TTFT (streamed) of right and wrong guesses, and of the victim's own repeat.

The server has two API keys. The issue's targets: p99 at most 0.25 s with six max-size prompts
in flight (12.25 s before); every guess reads the same ``cached_tokens`` and TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import AtLeastOne, print_json

MODEL = "tiny-sim"
VICTIM, ATTACKER = "sk-bench-victim", "sk-bench-attacker"
WORDS = ("lorem ipsum dolor sit amet consectetur adipiscing " * 80_000)[:3_900_000]


def serve(port: int, context: int, time_scale: float) -> None:
    """The ingress, until killed."""
    from tests.support import Server, sim_stack

    keys = frozenset({VICTIM, ATTACKER})
    with Server(sim_stack(max_model_len=context, time_scale=time_scale, api_keys=keys), port):
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
            r = await client.post(base + path, json=body, headers=auth(ATTACKER))
            codes[r.status_code] = codes.get(r.status_code, 0) + 1

    rss_before = proc.memory_info().rss
    async with httpx.AsyncClient(timeout=120, headers=auth(VICTIM)) as client:
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


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def guess(base: str, rounds: int) -> dict[str, Any]:
    """The guessing demo (the module docstring), ``rounds`` times."""
    public = "Quarterly figures for the board, strictly confidential. " * 2
    tail = "The remaining text of the memo, which the guess must match to be read. " * 40
    out: dict[str, list[tuple[int, float]]] = {"victim_repeat": [], "right": [], "wrong": []}

    async def ask(client: httpx.AsyncClient, key: str, text: str) -> tuple[int, float]:
        body = {"model": MODEL, "prompt": text, "max_tokens": 2, "stream": True}
        body["stream_options"] = {"include_usage": True}
        t, ttft, cached = time.perf_counter(), None, 0
        async with client.stream(
            "POST", base + "/v1/completions", json=body, headers=auth(key)
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ttft = ttft or time.perf_counter() - t
                    usage = json.loads(line[6:]).get("usage") or {}
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
        await asyncio.sleep(0.3)  # its KV events reach the map
        return cached, ttft or 0.0

    async with httpx.AsyncClient(timeout=60) as client:
        for k in range(rounds):
            secret = f"{(7919 * k + 4821) % 10_000:04d}"
            memo = partial("{0} account {2}, memo {1}. {tail}".format, public, k, tail=tail)
            await ask(client, VICTIM, memo(secret))
            out["victim_repeat"].append(await ask(client, VICTIM, memo(secret)))
            await ask(client, ATTACKER, memo("xxxx"))  # the public part, in its own requests
            wrong = f"{(int(secret) + 1 + k) % 10_000:04d}"
            out["wrong"].append(await ask(client, ATTACKER, memo(wrong)))
            out["right"].append(await ask(client, ATTACKER, memo(secret)))
    return {
        name: {
            "cached_tokens_mean": round(statistics.mean(c for c, _ in rows), 1),
            "ttft_median_ms": round(1e3 * statistics.median(t for _, t in rows), 2),
        }
        for name, rows in out.items()
    }


@contextlib.contextmanager
def ingress(context: int, time_scale: float) -> Iterator[tuple[str, psutil.Process]]:
    """The ingress in a process of its own (``serve``), ready: its base URL and process."""
    from tests.support import free_port

    port = free_port()
    flags = ["--serve", str(port), "--context", str(context), "--time-scale", str(time_scale)]
    child = subprocess.Popen(
        [sys.executable, __file__, *flags],
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
        yield base, psutil.Process(child.pid)
    finally:
        child.kill()
        child.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=40, action=AtLeastOne)
    ap.add_argument("--hostile", type=int, default=6, action=AtLeastOne)
    ap.add_argument("--context", type=int, default=131072, action=AtLeastOne)
    ap.add_argument("--scenarios", default="idle,prompt,truncated,chat,guess")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--time-scale", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.context, args.time_scale)
        return
    kinds = args.scenarios.split(",")
    out: dict[str, Any] = {}
    if floods := [k for k in kinds if k != "guess"]:
        with ingress(args.context, 0.0) as (base, proc):
            for kind in floods:
                out[kind] = asyncio.run(scenario(base, kind, args.hostile, args.probes, proc))
    if "guess" in kinds:
        with ingress(4096, 1.0) as (base, _):
            out["guess"] = asyncio.run(guess(base, args.probes))
    print_json(
        {"hostile": args.hostile, "probes": args.probes, "context": args.context, **out}, args.out
    )


if __name__ == "__main__":
    main()
