# ruff: noqa: E402  (Ray Serve's environment is set before ray is imported)
"""Ingress throughput under Ray Serve, next to the ceiling of this box. Prints JSON.

    .venv/bin/python benchmarks/ingress_bench.py [--requests 3000] [--concurrency 32] \
        [--repeats 3] [--input-tokens 1024] [--output-tokens 8] [--bus ray|redis] \
        [--shared-session]

Three Serve applications on the same box, HTTP proxy port and client, one at a time, each run
in a Ray session of its own, the apps taking turns going first: a deployment lives in its own
cluster, deployed once. (``--shared-session``: all runs in one session, the apps deployed and
deleted in turn, as this script did until stop 25. kvroute's runs there read 153.9, 134.1 and
129.2 req/s, its proxy and ingress costing 3.98 and 5.87 ms per request against 3.63 and 5.37
in fresh sessions the same hour; kvroute alone, deployed and deleted four times in one session,
did not slow: 141.0-147.3. What the other apps leave behind is not known.)

- ``ceiling``: a constant-reply deployment (reads the body, answers a fixed chat completion):
  what Ray Serve's proxy, one replica and the client cost on this machine, nothing else;
- ``kvroute``: ``kvroute serve``'s app, one ingress replica (validate, chat template and
  tokenization, hashing, admission, kv_ttft placement against the live cache map, the call to
  the engine replica through Serve, the response) in front of two sim engines that answer at
  once (``time_scale`` 0: no simulated step time), KV events and load samples on the Ray bus
  (``--bus redis``: on a redis-server this script starts, the cluster configuration's bus; its
  CPU is reported as ``redis-server``).

- ``two_hop_ceiling``: kvroute's shape with nothing of kvroute: an ingress replica that reads
  the body and streams one engine output (a request nobody streams is delivered whole) from a
  second replica through a handle, then answers the constant reply (what the proxy -> ingress
  -> engine design costs).

The client is kvroute's load generator in a closed loop of ``--concurrency`` workers sending
non-streaming 1k-token chats (``random`` workload: every prompt new, so every request is
hashed, placed and prefilled in full; the synthetic text of ``--input-tokens`` 260 is ~1,020
tokens of the tiny model's tokenizer, reported as ``prompt_tokens_mean``). Per app:
completed requests per second (saturated: the loop keeps every worker busy) and latency
p50/p99, and ``cpu_ms_per_request``: the CPU time each process role (proxy, controller, each
deployment's replicas, bus hub, ...; ``driver`` is the client) spent per completed request,
which says where a saturated 2-core box goes; the apps run alternately ``--repeats`` times and
the medians are reported, with ``kvroute_over_ceiling`` = the ratio of the medians, and
``kvroute_over_ceiling_by_round`` the ratio within each round (the three apps run minutes
apart; the box's speed drifts over longer spells) with its median.
The issue's target is >= 0.5 of ``ceiling``.

Ray Serve runs as ``kvroute serve`` runs it, in its throughput mode (``deploy/config.py``
``RAY_SERVE_ENV``, reported under ``ray_serve_env``); ``RAY_SERVE_THROUGHPUT_OPTIMIZED=0`` in
the environment measures Serve's defaults instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.config import ServeConfig, apply_ray_serve_env

# NOTE: before Ray is imported: the mode ``kvroute serve`` runs Ray Serve in, for every app
SERVE_ENV = apply_ray_serve_env()

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from benchmarks.common import AtLeastOne
from deploy.app import build_serve_app, delete_app, wait_until_ready
from deploy.ray_token import use_session_token
from engines.base import EngineOutput
from loadgen.metrics import percentiles_ms, summarize
from loadgen.prompts import PromptSynth
from loadgen.runner import RunConfig, Runner
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate
from loadgen.workloads import build_schedule
from tests.support import by_role, free_port, redis_server, sim_app_config

MODEL = "tiny"

constant = FastAPI()
REPLY = {
    "id": "chatcmpl-constant",
    "object": "chat.completion",
    "created": 0,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "a constant reply of eight tokens"},
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 1024, "completion_tokens": 8, "total_tokens": 1032},
}


@serve.deployment(name="constant", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
@serve.ingress(constant)
class ConstantReply:
    """The ceiling: Serve's proxy and one replica, reading the body and answering at once."""

    @constant.post("/v1/chat/completions")
    async def chat(self, request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(REPLY)


relay = FastAPI()


@serve.deployment(name="tokens", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
class ConstantTokens:
    """The engine hop with no engine: streams ``n`` one-token outputs at once."""

    async def generate(self, n: int) -> AsyncIterator[EngineOutput]:
        for i in range(n):
            yield EngineOutput("r", [100 + i], finished=i == n - 1)


@serve.deployment(name="relay", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=2048)
@serve.ingress(relay)
class Relay:
    """kvroute's shape with no kvroute: the proxy, an ingress replica that reads the body and
    streams ``outputs`` outputs from an engine-shaped replica through a handle (as
    ``ServeEngineClient`` does), then answers the constant reply. Two Serve hops: the ceiling
    of this architecture on this machine."""

    def __init__(self, tokens: Any, outputs: int) -> None:
        self.generate = tokens.options(stream=True).generate
        self.outputs = outputs

    @relay.post("/v1/chat/completions")
    async def chat(self, request: Request) -> JSONResponse:
        await request.body()
        async for _ in self.generate.remote(self.outputs):
            pass
        return JSONResponse(REPLY)


def kvroute_config(port: int, redis_url: str | None, bus_name: str) -> ServeConfig:
    """The kvroute app: its Ray bus, or the Redis bus at ``redis_url`` (streams ``bus_name``)."""
    bus = {"backend": "redis", "name": bus_name, "redis_url": redis_url}
    return sim_app_config(
        port,
        "kvroute-bench",
        engine={"sim_options": {"time_scale": 0.0}},
        engines={"bus": bus} if redis_url else None,
        router={"max_in_flight": 1024, "max_queue": 1024},
    )


def drive(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop run of ``args.requests`` chats: req/s, latency, and the CPU time each
    process role of the Ray session (and this driver, the client) spent per completed request."""
    params = SynthParams(
        rate=1000.0,
        duration_s=args.requests / 1000.0,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    plan = build_schedule(generate("random", params), rate=1000.0, arrival="constant")
    config = RunConfig(
        url,
        MODEL,
        PromptSynth(SYNTH_BLOCK_SIZE, seed=args.seed),
        api="chat",
        stream=False,
        concurrency=args.concurrency,
        timeout_s=60.0,
    )
    before = cpu_by_role()
    result = Runner(config, plan).run_blocking()
    after = cpu_by_role()
    s = summarize(result.records, duration_s=result.duration_s, requested_span_s=0.0)
    lat = percentiles_ms([r.e2e_s for r in result.records if r.ok])
    prompts = [r.prompt_tokens for r in result.records if r.ok and r.prompt_tokens]
    return {
        "prompt_tokens_mean": round(statistics.fmean(prompts)) if prompts else None,
        "requests": s["requests"],
        "completed": s["completed"],
        "errors": s["errors"],
        "req_per_s": round(s["completed"] / result.duration_s, 1),
        "latency_ms": {k: lat[k] for k in ("p50", "p99")},
        "cpu_ms_per_request": {
            role: round((after[role] - before.get(role, 0.0)) * 1e3 / max(s["completed"], 1), 2)
            for role in sorted(after)
            if after[role] - before.get(role, 0.0) > 0.05
        },
    }


def cpu_s(proc: Any) -> float:
    """Seconds of CPU (user + system) ``proc`` used so far."""
    t = proc.cpu_times()
    return float(t.user + t.system)


def cpu_by_role() -> dict[str, float]:
    """``by_role(cpu_s)``, plus the redis-server this script started (``--bus redis``)."""
    import psutil

    out = by_role(cpu_s)
    for proc in psutil.Process().children():
        try:
            if proc.name() == "redis-server":
                out["redis-server"] = out.get("redis-server", 0.0) + cpu_s(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--requests", type=int, default=3000, action=AtLeastOne, help="requests per run"
    )
    ap.add_argument(
        "--concurrency", type=int, default=32, action=AtLeastOne, help="closed-loop workers"
    )
    ap.add_argument("--repeats", type=int, default=3, action=AtLeastOne)
    ap.add_argument(
        "--input-tokens",
        type=int,
        default=260,
        action=AtLeastOne,
        help="synthetic length (x3.9 tiny tokens)",
    )
    ap.add_argument("--output-tokens", type=int, default=8, action=AtLeastOne)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--bus",
        choices=("ray", "redis"),
        default="ray",
        help="the kvroute app's event bus: its Ray hub, or a redis-server this script starts",
    )
    ap.add_argument(
        "--shared-session",
        action="store_true",
        help="every run in one Ray session (the apps deployed and deleted in turn) instead of "
        "a fresh Ray session per run",
    )
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        redis_url = None
        if args.bus == "redis":
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            redis_url = stack.enter_context(redis_server(workdir))
        bench(args, redis_url)


APPS = ("ceiling", "two_hop_ceiling", "kvroute")


def deploy(name: str, port: int, redis_url: str | None, run: int) -> Callable[[], None]:
    """Deploy app ``name`` behind the proxy on ``port``; returns what deletes it."""
    base = f"http://127.0.0.1:{port}"
    if name == "ceiling":
        serve.run(ConstantReply.bind(), name="constant", route_prefix="/")
        return lambda: serve.delete("constant")
    if name == "two_hop_ceiling":
        serve.run(Relay.bind(ConstantTokens.bind(), 1), name="relay", route_prefix="/")
        return lambda: serve.delete("relay")
    # NOTE: a bus of its own per run: a Redis stream outlives the Ray session that wrote it
    cfg = kvroute_config(port, redis_url, f"kvroute-bench-{run}")
    serve.run(build_serve_app(cfg), name=cfg.app_name, route_prefix="/")
    wait_until_ready(base, cfg.engines.instances)
    return lambda: delete_app(cfg)


@contextlib.contextmanager
def serve_session(port: int) -> Iterator[None]:
    """A local Ray (2 CPUs) with Serve's proxy on ``port``, shut down on exit."""
    use_session_token("kvroute-bench-ray-")  # its local cluster's token: none left in HOME
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def bench(args: argparse.Namespace, redis_url: str | None) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in APPS}
    warm = argparse.Namespace(**{**vars(args), "requests": 200})
    shared = serve_session(port) if args.shared_session else contextlib.nullcontext()
    with shared:
        for repeat in range(args.repeats):
            # the apps take turns going first: a later run in one Ray session is not favoured
            order = APPS[repeat % len(APPS) :] + APPS[: repeat % len(APPS)]
            for name in order:
                own = contextlib.nullcontext() if args.shared_session else serve_session(port)
                with own:
                    delete = deploy(name, port, redis_url, repeat)
                    drive(base, warm)
                    runs[name].append(drive(base, args))
                    delete()
                print(name, json.dumps(runs[name][-1]), file=sys.stderr, flush=True)
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {
            "req_per_s": statistics.median(r["req_per_s"] for r in rs),
            "latency_p50_ms": statistics.median(r["latency_ms"]["p50"] for r in rs),
            "latency_p99_ms": statistics.median(r["latency_ms"]["p99"] for r in rs),
            "errors": sum(sum(r["errors"].values()) for r in rs),
            "prompt_tokens_mean": rs[-1]["prompt_tokens_mean"],
            "runs": [r["req_per_s"] for r in rs],
            "cpu_ms_per_request": {
                role: statistics.median(r["cpu_ms_per_request"].get(role, 0.0) for r in rs)
                for role in sorted({role for r in rs for role in r["cpu_ms_per_request"]})
            },
        }
    for ceiling in ("ceiling", "two_hop_ceiling"):
        ratio = out["kvroute"]["req_per_s"] / out[ceiling]["req_per_s"]
        out[f"kvroute_over_{ceiling}"] = round(ratio, 3)
        # NOTE: each round's apps run within minutes of each other, while this box's speed
        # drifts over longer spells (the ceiling read 165-303 req/s in one afternoon): the
        # ratio within a round, and its median over rounds, takes most of that drift out
        pairs = zip(runs["kvroute"], runs[ceiling], strict=True)
        rounds = [k["req_per_s"] / c["req_per_s"] for k, c in pairs]
        out[f"kvroute_over_{ceiling}_by_round"] = [round(r, 3) for r in rounds]
        out[f"kvroute_over_{ceiling}_round_median"] = round(statistics.median(rounds), 3)
    out["config"] = {k: getattr(args, k) for k in ("requests", "concurrency", "repeats")}
    out["config"].update(input_tokens=args.input_tokens, output_tokens=args.output_tokens)
    out["config"]["ray_serve_env"] = SERVE_ENV
    out["config"]["bus"] = args.bus
    out["config"]["shared_session"] = args.shared_session
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
