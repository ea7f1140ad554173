"""Where a routing suite cell's excess TTFT sits, against references on one plain queueing model.

The model: one FCFS server per engine; a request's service is its prefill alone at the cache
hit it gets there (``LatencyProfile.ttft_s``), times that engine's speed factor
(``Perturbation.slowdowns``); excess is finish minus arrival minus the request's ideal TTFT
(``simulation.settings.ideal_ttfts``). It leaves out what the simulator's engines do beyond
that (batching many prefills into one step, decode steps, chunking), so it overstates short
prompts, whose steps the engines share; it is a yardstick for placement, not a simulator.
Per cell (the suite's ``make_plan`` at ``--loads``' rate scale, seeds 0..``--seeds``-1, mean
excess in ms, mean and p99):

- ``routers``: each router's real excess in the cluster simulator, and its own assignments
  replayed through the model (``model``) at the hits it got; ``parts`` splits the real mean
  excess (ms) three ways: ``waited``, from arrival to the engine step that first scheduled the
  request (the step in flight when it arrived, and any queue: vLLM's queue time); ``shared``,
  from there to its first token beyond its prefill alone at the hit it got (the other
  requests' tokens in its steps: continuous batching); ``cache``, that prefill alone beyond
  its ideal (the hit it missed, the engine's speed);
- ``greedy``: a clairvoyant router on the model: each request to the engine that finishes it
  first, knowing every engine's free time and cache (every prompt sent there, kept);
- ``pooled``: the same with every earlier prefix on every engine (services at the ideal);
- ``hold``: requests held at the router and, whenever an engine frees, the waiting one with
  the least ``service there - age x time waited`` sent to it, for each ``--ages`` weight (0:
  shortest first); a request arriving at no queue goes as ``greedy``'s does.
- ``reorder``: ``greedy``'s placement, each engine then serving its own queue shortest first
  (what a router could ask of an engine by request priority) except that a request waiting
  ``--caps`` seconds or more goes first, oldest first: the cap bounds how long shortest-first
  may pass a request over.

Prints JSON. Usage: .venv/bin/python benchmarks/fcfs_reference.py --loads SUITE.json
    [--workloads mix,rag] [--load L2] [--routers kv_ttft,llmd_weighted] [--seeds 3]
    [--ages 0,0.5] [--caps 0.2,0.5]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.common import print_json
from benchmarks.routing_suite import REQUESTS, WORKLOADS, make_plan, settings_for
from engines.profile import LatencyProfile
from loadgen.workloads import Planned
from simulation.cluster import simulate
from simulation.settings import engine_profile, ideal_ttfts

Service = Callable[[int, Planned], float]  # (engine, request) -> seconds on the model


class Caches:
    """Each engine's blocks (every prompt sent there, kept) and the service a request gets."""

    def __init__(self, prof: LatencyProfile, slow: Sequence[float], block: int) -> None:
        self.prof, self.slow, self.block = prof, slow, block
        self.held: list[set[int]] = [set() for _ in slow]

    def service(self, k: int, p: Planned) -> float:
        r, n = p.req, 0
        for h in r.hash_ids:
            if h not in self.held[k]:
                break
            n += 1
        cached = min(n * self.block, r.input_length - 1)
        return self.prof.ttft_s(r.input_length, cached) * self.slow[k]

    def send(self, k: int, p: Planned) -> None:
        self.held[k].update(p.req.hash_ids)


def _place(free: list[float], p: Planned, service: Service) -> tuple[int, float]:
    """Queue ``p`` on the engine that finishes it first (the lowest of a tie), FCFS behind
    what ``free`` says each engine has: (that engine, ``p``'s service there)."""
    k = min(range(len(free)), key=lambda e: max(free[e], p.offset_s) + service(e, p))
    s = service(k, p)
    free[k] = max(free[k], p.offset_s) + s
    return k, s


def greedy(plan: Sequence[Planned], engines: int, service: Service, sent: Callable) -> dict:
    """Finish time per plan index: each request to the engine that finishes it first."""
    free, out = [0.0] * engines, {}
    for p in plan:
        k, _ = _place(free, p, service)
        out[p.index] = free[k]
        sent(k, p)
    return out


def hold(
    plan: Sequence[Planned], engines: int, service: Service, sent: Callable, age: float
) -> dict:
    """Finish time per plan index with requests held at the router (see the module)."""
    free, out, waiting, j = [0.0] * engines, {}, [], 0
    while j < len(plan) or waiting:
        k = min(range(engines), key=lambda e: free[e])
        now = free[k]
        while j < len(plan) and plan[j].offset_s <= now:
            waiting.append(plan[j])
            j += 1
        if not waiting:  # an engine is idle before the next arrival: it goes as greedy's does
            p, j = plan[j], j + 1
            k, _ = _place(free, p, service)
            out[p.index] = free[k]
        else:
            q = min(
                range(len(waiting)),
                key=lambda i: service(k, waiting[i]) - age * (now - waiting[i].offset_s),
            )
            p = waiting.pop(q)
            free[k] = out[p.index] = now + service(k, p)
        sent(k, p)
    return out


def reorder(
    plan: Sequence[Planned], engines: int, service: Service, sent: Callable, cap: float
) -> dict:
    """Finish time per plan index: ``greedy``'s placement, each engine's queue served shortest
    first, oldest first among those that waited ``cap`` seconds or more (see the module)."""
    free: list[float] = [0.0] * engines
    queues: list[list[tuple[Planned, float]]] = [[] for _ in range(engines)]
    for p in plan:
        k, s = _place(free, p, service)
        queues[k].append((p, s))
        sent(k, p)
    out = {}
    for todo in queues:  # in arrival order
        now, j, waiting = 0.0, 0, []
        while j < len(todo) or waiting:
            if not waiting:
                now = max(now, todo[j][0].offset_s)
            while j < len(todo) and todo[j][0].offset_s <= now:
                waiting.append(todo[j])
                j += 1
            old = [x for x in waiting if now - x[0].offset_s >= cap]
            x = min(old, key=_arrival) if old else min(waiting, key=_service)
            waiting.remove(x)
            now = out[x[0].index] = now + x[1]
    return out


def _arrival(x: tuple[Planned, float]) -> float:
    return x[0].offset_s


def _service(x: tuple[Planned, float]) -> float:
    return x[1]


def excess_ms(finish: dict, plan: Sequence[Planned], ideal: list[float]) -> list[float]:
    return [
        (finish[p.index] - p.offset_s - ideal[p.index]) * 1e3
        for p in plan
        if p.index in finish and not math.isnan(ideal[p.index])
    ]


def stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(float(np.mean(values)), 1),
        "p99": round(float(np.percentile(values, 99)), 1),
    }


def cell(
    workload: str,
    scale: float,
    seed: int,
    routers: list[str],
    ages: list[float],
    caps: list[float],
    n: int,
    requests: int,
    truth: LatencyProfile,
) -> dict[str, Any]:
    plan, block = make_plan(workload, scale, seed, requests)
    settings = settings_for(seed, n)
    ideal = ideal_ttfts(plan, block, truth, settings)
    prof, _ = engine_profile(truth, settings)
    slow = settings.perturbation.slowdowns(n)
    ok = [p for p in plan if not math.isnan(ideal[p.index])]
    out: dict[str, Any] = {"routers": {}}
    for router in routers:
        sim = simulate(plan, block, truth, router, settings)
        real = [
            (r.ttft_s - ideal[r.index]) * 1e3
            for r in sim.records
            if r.ok and not math.isnan(ideal[r.index])
        ]
        free, finish = [0.0] * n, {}
        parts: dict[str, list[float]] = {"waited": [], "shared": [], "cache": []}
        for r in sorted((r for r in sim.records if r.ok), key=lambda r: r.intended_s):
            k, length = int(str(r.instance).rpartition("-")[2]), r.input_tokens
            cached = min(r.cached_tokens or 0, length - 1)
            service = prof.ttft_s(length, cached, r.cpu_cached_tokens or 0) * slow[k]
            free[k] = finish[r.index] = max(free[k], r.intended_s) + service
            if not math.isnan(ideal[r.index]):
                parts["waited"].append(r.scheduled_s - r.intended_s)
                parts["shared"].append(r.first_token_s - r.scheduled_s - service)
                parts["cache"].append(service - ideal[r.index])
        out["routers"][router] = {
            "real": stats(real),
            "model": stats(excess_ms(finish, plan, ideal)),
            "parts": {k: round(float(np.mean(v)) * 1e3, 1) for k, v in parts.items()},
        }
    caches = Caches(prof, slow, block)
    out["greedy"] = stats(excess_ms(greedy(ok, n, caches.service, caches.send), plan, ideal))

    def ideal_service(k: int, p: Planned) -> float:
        return ideal[p.index] * slow[k]

    out["pooled"] = stats(excess_ms(greedy(ok, n, ideal_service, lambda k, p: None), plan, ideal))
    out["hold"] = {}
    for age in ages:
        caches = Caches(prof, slow, block)
        out["hold"][f"{age:g}"] = stats(
            excess_ms(hold(ok, n, caches.service, caches.send, age), plan, ideal)
        )
    out["reorder"] = {}
    for cap in caps:
        caches = Caches(prof, slow, block)
        out["reorder"][f"{cap:g}"] = stats(
            excess_ms(reorder(ok, n, caches.service, caches.send, cap), plan, ideal)
        )
    return out


def mean_over(runs: list[Any]) -> Any:
    """The element-wise mean of equally shaped nested dicts of numbers."""
    if isinstance(runs[0], dict):
        return {k: mean_over([r[k] for r in runs]) for k in runs[0]}
    return round(float(np.mean(runs)), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=Path, required=True, help="a routing_suite output JSON")
    ap.add_argument("--workloads", default="mix,to-b,rag,azure-conv", help="comma-separated")
    ap.add_argument("--load", choices=("L1", "L2"), default="L2")
    ap.add_argument("--routers", default="kv_ttft", help="comma-separated scorers")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ages", default="0,0.5", help="hold's age weights, comma-separated")
    ap.add_argument("--caps", default="0.2,0.5", help="reorder's wait caps in seconds")
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--profile", default="h100-llama3.1-8b")
    args = ap.parse_args(argv)
    loads = json.loads(args.loads.read_text())["loads"]
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS or w not in loads:
            ap.error(f"--workloads: {w!r} is not a workload of {args.loads} ({', '.join(loads)})")
    try:
        ages = [float(a) for a in args.ages.split(",") if a]
    except ValueError:
        ap.error(f"--ages: {args.ages!r} is not a list of numbers")
    try:
        caps = [float(c) for c in args.caps.split(",") if c]
    except ValueError:
        ap.error(f"--caps: {args.caps!r} is not a list of numbers")
    if any(not c >= 0 for c in caps):
        ap.error(f"--caps: {args.caps!r}: each cap must be a number of seconds >= 0")
    truth = LatencyProfile.load(args.profile)
    key = "l1_scale" if args.load == "L1" else "l2_scale"
    routers = [r for r in args.routers.split(",") if r]
    results = {
        w: mean_over(
            [
                cell(w, loads[w][key], s, routers, ages, caps, args.instances, REQUESTS[0], truth)
                for s in range(args.seeds)
            ]
        )
        for w in workloads
    }
    print_json({"load": args.load, "seeds": args.seeds, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
