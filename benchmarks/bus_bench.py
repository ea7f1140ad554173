"""What one event-bus call costs, on each backend. Prints JSON.

    .venv/bin/python benchmarks/bus_bench.py [--calls 3000] [--repeats 3] [--messages 1,8]

A KV-event forwarder publishes a busy engine's batches once per ``publish_interval_s`` and a
router replica reads both logs once per ``bus_poll_s``, so at load the bus costs calls per
second, whatever they carry. This measures one call's CPU time on both sides, at a steady rate
(one call per millisecond, as a busy cluster sends them, not back to back):

- ``ray``: the ``RayEventBus`` of ``kvroute serve`` (one ``BusHub`` actor in a local Ray):
  ``caller_us`` is the publishing (or reading) thread's CPU per call, ``server_us`` the hub
  process's;
- ``redis``: the ``RedisStreamBus`` on a redis-server this script starts: ``caller_us`` is
  redis-py's client CPU per call, ``server_us`` redis-server's.

``publish_many`` is measured with ``--messages`` encoded KV-event messages per call (each what a
forwarder publishes for one 1k-token prompt's prefill: 32 blocks stored, ~0.3 kB),
``publish_pair`` with the last of those counts and a load sample (a busy forwarder's call, both
logs at once), ``read_pair`` (the router's poll of the event and load logs) with nothing new to
read. Server figures have the server's idle CPU taken off. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from cachemap.events import InstanceEvents, Stored, encode_message
from cachemap.hashing import BlockHasher, Tier
from deploy.ray_token import use_session_token
from engines.base import LoadSnapshot
from engines.bus.base import EventBus
from engines.bus.forwarder import encode_load
from tests.support import redis_server


def messages(n: int) -> list[bytes]:
    """``n`` encoded KV-event messages, each storing a 1,024-token prompt's 32 blocks."""
    hasher = BlockHasher("bench", 32)
    out = []
    for i in range(n):
        hashes = hasher(list(range(i, i + 1024)))
        update = Stored(Tier.GPU.value, hashes, None, 0)
        out.append(encode_message(InstanceEvents("e0", i, 0.0, [update])))
    return out


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def per_call(call: Callable[[], object], calls: int, server: psutil.Process) -> dict[str, float]:
    """CPU per call of ``call`` made ``calls`` times, one per millisecond: this thread's and
    ``server``'s (both in microseconds)."""
    for _ in range(min(200, calls)):
        call()
    s0, c0 = cpu_s(server), time.thread_time()
    for _ in range(calls):
        call()
        time.sleep(0.001)
    c1 = time.thread_time()
    time.sleep(0.05)  # the server's last calls
    s1 = cpu_s(server)
    return {"caller_us": (c1 - c0) / calls * 1e6, "server_us": (s1 - s0) / calls * 1e6}


def idle_server_us(server: psutil.Process, seconds: float = 2.0) -> float:
    """The server's own CPU per millisecond while nobody calls it (its background work)."""
    s0 = cpu_s(server)
    time.sleep(seconds)
    return (cpu_s(server) - s0) / (seconds * 1e3) * 1e6


def measure(bus: EventBus, load: EventBus, server: psutil.Process, args: Any) -> dict[str, Any]:
    idle = idle_server_us(server)
    out: dict[str, Any] = {"server_idle_us_per_ms": round(idle, 1)}
    cases: dict[str, Callable[[], object]] = {}
    for n in args.messages:
        payloads = messages(n)
        cases[f"publish_many_{n}"] = lambda p=payloads: bus.publish_many(p)  # type: ignore[misc]
    sample = encode_load(LoadSnapshot("e0", 0.0, 1, 2, 0.5, 0.0, 1024))
    last = messages(args.messages[-1])
    cases["publish_pair"] = lambda: bus.publish_pair(last, load, [sample])
    ends: list[int] = []
    cases["read_pair"] = lambda: bus.read_pair(ends[0], load, ends[1])
    for name, call in cases.items():
        flush = getattr(bus, "flush", None)
        if flush is not None:
            flush()  # a fire-and-forget publisher's calls are all in the log
        ends[:] = [bus.end(), load.end()]  # the poll finds nothing new
        runs = [per_call(call, args.calls, server) for _ in range(args.repeats)]
        caller_us = statistics.median(r["caller_us"] for r in runs)
        server_us = statistics.median(r["server_us"] for r in runs) - idle
        out[name] = {"caller_us": round(caller_us, 1), "server_us": round(server_us, 1)}
    return out


@contextlib.contextmanager
def ray_buses() -> Iterator[tuple[EventBus, EventBus, psutil.Process]]:
    import ray

    from engines.bus.ray_bus import RayEventBus

    use_session_token("kvroute-bench-ray-")  # its local cluster's token: none left in HOME
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        bus = RayEventBus("bench-events", hub="bench-hub")
        load = RayEventBus("bench-loads", hub="bench-hub")
        pid = ray.get(bus._hub.__ray_call__.remote(lambda _: __import__("os").getpid()))
        yield bus, load, psutil.Process(pid)
    finally:
        ray.shutdown()


@contextlib.contextmanager
def redis_buses() -> Iterator[tuple[EventBus, EventBus, psutil.Process]]:
    import redis

    from engines.bus.redis_bus import RedisStreamBus

    with tempfile.TemporaryDirectory() as d, redis_server(Path(d)) as url:
        client = redis.Redis.from_url(url)
        pid = int(client.info("server")["process_id"])
        bus = RedisStreamBus(url, "bench:events", client=client)
        load = RedisStreamBus(url, "bench:loads", client=client)
        yield bus, load, psutil.Process(pid)
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="calls per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--messages", default="1,8", help="messages per publish_many, e.g. 1,8")
    ap.add_argument("--backends", default="ray,redis", help="ray, redis or both")
    args = ap.parse_args()
    try:
        args.messages = [int(x) for x in args.messages.split(",")]
    except ValueError:
        ap.error(f"--messages: comma-separated integers, got {args.messages!r}")
    if args.calls < 1 or args.repeats < 1 or min(args.messages) < 1:
        ap.error("--calls, --repeats and every --messages count must be >= 1")
    backends = {"ray": ray_buses, "redis": redis_buses}
    chosen = [b for b in args.backends.split(",") if b]
    unknown = [b for b in chosen if b not in backends]
    if unknown:
        ap.error(f"--backends: unknown {unknown}; choose from {sorted(backends)}")
    out: dict[str, Any] = {"config": {k: getattr(args, k) for k in ("calls", "repeats")}}
    out["config"]["messages"] = args.messages
    for name in chosen:
        with backends[name]() as (bus, load, server):
            out[name] = measure(bus, load, server, args)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
