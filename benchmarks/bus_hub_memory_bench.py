"""Memory of the Ray bus hub actor under soak-like traffic with engines replaced, sped up. Prints
JSON.

    flock /tmp/kvroute-ray.lock .venv/bin/python benchmarks/bus_hub_memory_bench.py \
        [--record-s 40] [--engines 2] [--speedup 40] [--wall-s 200] [--churn-s 300]

1. Record: one sim engine of the soak's config (``soak_bench.soak_config``) in this process, fed
   its share of the soak's ``mix`` workload (``--rate`` / ``--engines`` req/s, Poisson) for
   ``--record-s`` seconds, its forwarder publishing to recording buses at the production cadence
   (``PUBLISH_INTERVAL_S``, ``LOAD_INTERVAL_S``): every bus call (KV-event messages and load
   samples, paired as the forwarder pairs them) with its time, and a ``Snapshot`` of the engine
   at the end (what a resync publishes).
2. Replay: the real hub actor (``RayEventBus``, the deployment's two logs at their default
   lengths) in a fresh local Ray session; ``--engines`` engine actors, each replaying the
   recording in a loop under its own instance id (messages re-encoded), ``--speedup`` times
   faster, answering resync requests with the snapshot; every ``--churn-s`` seconds of soak time
   one engine actor is killed (``ray.kill``, as the soak kills a replica) and a new one with a
   new instance id replaces it. A router in this process reads both logs every
   ``RouterSettings.bus_poll_s`` / speedup, and asks a resync of every instance it sees appear
   and of every engine just before it is killed (the worst case: a request its forwarder never
   takes).
   Every ``--sample-s`` wall seconds: the hub process's RSS (psutil) and ``BusHub.stats()``.

Reported: the recording (calls and messages per second per engine, payload sizes), then per sample
the soak-equivalent time (wall x speedup), RSS, and the hub's structures (entries and payload bytes
per log, pending resyncs, Python's allocated blocks), and RSS slopes in MiB per hour of soak time
over the second half and over each quarter: a leak shows as a steady slope to the end, a log still
filling as a slope that stops once it holds ``maxlen`` entries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray

from benchmarks.common import Positive
from benchmarks.soak_bench import soak_config, tiny_synth
from cachemap.events import InstanceEvents, Snapshot, decode_message, encode_message
from cachemap.ingest import EngineEventTranslator
from deploy.ray_token import use_session_token
from engines.base import EngineRequest, SamplingParams
from engines.bus.base import InProcessBus
from engines.bus.forwarder import KvEventForwarder, decode_load, encode_load
from engines.bus.ray_bus import RayEventBus
from engines.deployment import build_engine
from loadgen.synthetic import SynthParams, generate
from router.settings import DEFAULTS

# one recorded bus call: (seconds since the recording began, KV-event payloads, load payloads)
Call = tuple[float, list[bytes], list[bytes]]


class _RecordingBus(InProcessBus):
    """Records every call into ``calls``: the KV-event bus (``loads`` is its load-bus twin)."""

    def __init__(self, calls: list[Call], t0: float, loads: bool = False) -> None:
        super().__init__()
        self.calls, self.t0, self.loads = calls, t0, loads

    def _rec(self, payloads: list[bytes], loads: list[bytes]) -> None:
        self.calls.append((time.monotonic() - self.t0, payloads, loads))

    def publish(self, payload: bytes) -> int:
        return self.publish_many([payload])

    def publish_many(self, payloads: Any) -> int:
        p = list(payloads)
        self._rec([], p) if self.loads else self._rec(p, [])
        return super().publish_many(p)

    def publish_pair(self, payloads: Any, other: Any, other_payloads: Any) -> tuple[int, int]:
        self._rec(list(payloads), list(other_payloads))
        return InProcessBus.publish_many(self, list(payloads)), InProcessBus.publish_many(
            other, list(other_payloads)
        )


async def _record(args: argparse.Namespace) -> tuple[list[Call], bytes]:
    ecfg = soak_config(8000).engines.engine  # the port is not used
    engine = build_engine(ecfg, "rec-engine")
    await engine.start()
    calls: list[Call] = []
    t0 = time.monotonic()
    events, loads = _RecordingBus(calls, t0), _RecordingBus(calls, t0, loads=True)
    assert engine.kv_events_endpoint is not None
    fwd = KvEventForwarder(
        EngineEventTranslator("rec-engine", ecfg.model_name, ecfg.block_size),
        events,
        engine.kv_events_endpoint,
        load_bus=loads,
        load_fn=engine.load,
    )
    fwd.start()
    rate = args.rate / args.engines
    reqs = generate("mix", SynthParams(rate=rate, duration_s=args.record_s, seed=args.seed))
    synth = tiny_synth(args.seed)
    arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1 / rate, len(reqs)))

    async def one(i: int, at: float) -> None:
        r = reqs[i]
        if r.input_length + r.output_length > ecfg.max_model_len:
            return
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        prompt = synth.token_ids(r.hash_ids, r.input_length).tolist()
        sp = SamplingParams(max_tokens=max(1, r.output_length), ignore_eos=True)
        async for _ in engine.generate(EngineRequest(f"r{i}", prompt, sp)):
            pass

    tasks = [asyncio.create_task(one(i, at)) for i, at in enumerate(arrivals) if at < args.record_s]
    await asyncio.sleep(args.record_s)
    calls_done = [c for c in calls if c[0] <= args.record_s]
    snapshot = encode_message(fwd.snapshot())
    fwd.stop(gone=False)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.stop()
    return calls_done, snapshot


def _as_instance(calls: list[Call], snapshot: bytes, instance: str) -> tuple[list[Call], bytes]:
    """The recording re-encoded under ``instance`` (KV-event batches, load samples, snapshot)."""

    def ev(p: bytes) -> bytes:
        msg = decode_message(p)
        assert isinstance(msg, (InstanceEvents, Snapshot))
        return encode_message(msgspec.structs.replace(msg, instance=instance))

    def ld(p: bytes) -> bytes:
        return encode_load(msgspec.structs.replace(decode_load(p), instance_id=instance))

    out = [(t, [ev(p) for p in e], [ld(p) for p in lo]) for t, e, lo in calls]
    return out, ev(snapshot)


@ray.remote(num_cpus=0, max_restarts=0)
class FakeEngine:
    """Replays a recording under ``instance`` on the hub, ``speedup`` times faster, in a loop;
    publishes the snapshot when a resync was asked (polled every second of soak time)."""

    def __init__(
        self,
        events: RayEventBus,
        loads: RayEventBus,
        instance: str,
        calls: list[Call],
        snapshot: bytes,
        span_s: float,
        speedup: float,
    ) -> None:
        self.calls, self.snapshot = _as_instance(calls, snapshot, instance)
        self.events, self.loads, self.instance = events, loads, instance
        self.span_s, self.speedup = span_s, speedup
        self.sent = self.messages = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        t0, lap, next_poll = time.monotonic(), 0, 0.0
        while True:
            for t, ev, lo in self.calls:
                at = (lap * self.span_s + t) / self.speedup
                now = time.monotonic() - t0
                if at > now:
                    time.sleep(at - now)
                if ev and lo:
                    self.events.publish_pair(ev, self.loads, lo)
                elif ev:
                    self.events.publish_many(ev)
                else:
                    self.loads.publish_many(lo)
                self.sent += 1
                self.messages += len(ev) + len(lo)
                if self.sent % 50 == 0:  # backpressure: never run ahead of the hub
                    self.events.flush(None)
                    self.loads.flush(None)
                if now >= next_poll:
                    next_poll = now + 1.0 / self.speedup
                    if self.events.take_resync(self.instance):
                        self.events.publish(self.snapshot)
            lap += 1

    def progress(self) -> tuple[int, int]:
        return self.sent, self.messages


def _slope_per_h(ts: list[float], ys: list[float]) -> float | None:
    if len(ts) < 3:
        return None
    return round(float(np.polyfit(np.asarray(ts), np.asarray(ys), 1)[0] * 3600), 1)


def _replay(args: argparse.Namespace, calls: list[Call], snapshot: bytes) -> dict[str, Any]:
    use_session_token("kvroute-bench-ray-")  # its local cluster's token: none left in HOME
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="kvroute")
    hub_name = "bench-hub"
    events = RayEventBus("bench-events", hub=hub_name, maxlen=args.maxlen)
    loads = RayEventBus("bench-loads", hub=hub_name, maxlen=args.load_maxlen)
    hub = ray.get_actor(hub_name, namespace="kvroute")
    span_s = args.record_s
    serial = 0

    def spawn() -> tuple[str, Any]:
        nonlocal serial
        serial += 1
        inst = f"engine-{serial:04d}"
        return inst, FakeEngine.remote(events, loads, inst, calls, snapshot, span_s, args.speedup)

    engines = [spawn() for _ in range(args.engines)]
    stats = ray.get(hub.stats.remote())
    proc = psutil.Process(stats["pid"])
    samples: list[dict[str, Any]] = []
    kills: list[float] = []
    cur_ev, cur_lo = events.end(), loads.end()
    lost = read_items = 0
    seen: set[str] = set()
    t0 = time.monotonic()
    next_sample, next_kill, victim = t0, t0 + args.churn_s / args.speedup, 0
    poll_s = DEFAULTS.bus_poll_s / args.speedup
    while (now := time.monotonic()) - t0 < args.wall_s:
        got_ev, got_lo = events.read_pair(cur_ev, loads, cur_lo)
        cur_ev, cur_lo = got_ev.cursor, got_lo.cursor
        lost += got_ev.lost + got_lo.lost
        read_items += len(got_ev.items) + len(got_lo.items)
        for p in got_lo.items:
            inst = decode_load(p).instance_id
            if inst not in seen:  # a new instance: its first resync
                seen.add(inst)
                events.request_resync(inst)
        if now >= next_kill:
            inst, actor = engines[victim]
            events.request_resync(inst)  # asked just before it dies: never taken
            ray.kill(actor, no_restart=True)
            engines[victim] = spawn()
            victim = (victim + 1) % args.engines
            kills.append(round((now - t0) * args.speedup, 1))
            next_kill = now + args.churn_s / args.speedup
        if now >= next_sample:
            s = ray.get(hub.stats.remote())
            samples.append(
                {
                    "wall_s": round(now - t0, 1),
                    "soak_s": round((now - t0) * args.speedup, 1),
                    "rss_mib": round(proc.memory_info().rss / 2**20, 1),
                    **{k: v for k, v in s.items() if k != "pid"},
                }
            )
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
            next_sample = now + args.sample_s
        time.sleep(max(0.0, poll_s - (time.monotonic() - now)))
    progress = ray.get([a.progress.remote() for _, a in engines])
    ray.shutdown()
    ts = [s["soak_s"] for s in samples]
    rss = [s["rss_mib"] for s in samples]
    n = len(samples)
    quarters = [
        _slope_per_h(ts[i * n // 4 : (i + 1) * n // 4], rss[i * n // 4 : (i + 1) * n // 4])
        for i in range(4)
    ]
    return {
        "soak_equivalent_s": ts[-1] if ts else 0.0,
        "engines_replaced": len(kills),
        "router": {"items_read": read_items, "lost": lost, "instances_seen": len(seen)},
        "live_engines_progress_calls_messages": progress,
        "rss_mib": {"first": rss[0], "max": max(rss), "last": rss[-1]} if rss else {},
        "rss_slope_mib_per_soak_h": {
            "second_half": _slope_per_h(ts[n // 2 :], rss[n // 2 :]),
            "quarters": quarters,
        },
        "hub_last": {k: v for k, v in samples[-1].items() if k not in ("wall_s", "soak_s")},
        "samples": samples,
    }


def _summarize_recording(calls: list[Call], snapshot: bytes, seconds: float) -> dict[str, Any]:
    ev = [len(p) for _, e, _ in calls for p in e]
    lo = [len(p) for _, _, lo in calls for p in lo]
    return {
        "seconds": seconds,
        "calls_per_s": round(len(calls) / seconds, 1),
        "event_messages_per_s": round(len(ev) / seconds, 1),
        "event_payload_bytes": {
            "mean": round(float(np.mean(ev)), 1) if ev else 0,
            "p99": int(np.percentile(ev, 99)) if ev else 0,
            "max": max(ev, default=0),
        },
        "event_bytes_per_s": round(sum(ev) / seconds),
        "load_samples_per_s": round(len(lo) / seconds, 1),
        "load_payload_bytes": round(float(np.mean(lo)), 1) if lo else 0,
        "snapshot_bytes": len(snapshot),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--record-s", type=float, default=40.0, action=Positive, help="seconds of recorded traffic"
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=4.0,
        action=Positive,
        help="the soak's requests/s (all engines)",
    )
    ap.add_argument("--engines", type=int, default=2, action=Positive, help="engines live at once")
    ap.add_argument(
        "--speedup", type=float, default=40.0, action=Positive, help="replay this many times faster"
    )
    ap.add_argument(
        "--wall-s", type=float, default=200.0, action=Positive, help="wall seconds of replay"
    )
    ap.add_argument(
        "--churn-s", type=float, default=300.0, action=Positive, help="soak seconds between kills"
    )
    ap.add_argument(
        "--sample-s", type=float, default=5.0, action=Positive, help="wall seconds between samples"
    )
    ap.add_argument("--maxlen", type=int, default=100_000, help="KV-event log length")
    ap.add_argument("--load-maxlen", type=int, default=10_000, help="load log length")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    calls, snapshot = asyncio.run(_record(args))
    if not calls:
        sys.exit("bus_hub_memory_bench: the recording holds no bus call")
    out = {
        "config": vars(args),
        "recording": _summarize_recording(calls, snapshot, args.record_s),
        "replay": _replay(args, calls, snapshot),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
