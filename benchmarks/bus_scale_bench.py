"""The event bus at scale: many engines publishing to Redis Streams, several routers reading. JSON.

    .venv/bin/python benchmarks/bus_scale_bench.py [--engines 16,64,128,256] [--readers 1,2,4]
        [--seconds 12] [--repeats 1] [--event-stride 1] [--publishers 2] [--apply]

A harness of simulated engines: one busy H100 engine's KV events are recorded once (a
``VirtualInstance`` on the ``h100-llama3.1-8b`` profile, saturated with distinct 1-4k-token
prompts, its cache full; every vLLM batch translated by ``EngineEventTranslator`` as a forwarder
does), time-scaled to ``--stored-per-s`` blocks stored per second (as many are removed), and
replayed by every logical engine from its own random point in the recording. A logical engine
behaves as ``KvEventForwarder`` at ``PUBLISH_INTERVAL_S``: at the end of each interval (its own
phase) the batches of that interval go in one ``publish_pair`` call with a load sample, each
batch its own ``InstanceEvents`` message (the same bytes ``encode_message`` gives) stamped with
the call's wall time; an interval without a batch publishes the load sample alone.
``--publishers`` processes share the logical engines, one Redis connection each (a call per
engine per interval, never merged across engines: Redis sees the production call count).

``--readers`` router replicas (processes) each poll like ``RouterState.start``: ``read_pair`` of
the event and load streams (``max_items`` 4096) then a ``RouterSettings.bus_poll_s`` wait,
decoding every message (``--apply``: also applying it to a ``CacheMap`` through
``CacheMapIngestor``). A message's lag is the wall time once its poll's messages are decoded
(applied) minus its publish stamp: the bus's share of a block's staleness (the forwarder's hold,
up to ``PUBLISH_INTERVAL_S``, comes on top and is not the bus's). All on one machine, one clock.

Figures per point (``engines`` x ``readers``), medians over ``--repeats`` runs: offered and
carried messages, blocks and bytes per second; lag p50/p99/max; CPU (cores) of redis-server,
of the publishers and of each reader over the measured window (after ``--warmup``). The
``model`` section fits redis-server's CPU as ``engines x (pub + readers x read)`` and the
readers' CPU per block, and extrapolates to ``--target-engines`` x ``--target-readers``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import psutil

from cachemap.events import InstanceEvents, Removed, Stored, Update, decode_message
from cachemap.ingest import EngineEventTranslator
from engines.base import PUBLISH_INTERVAL_S, LoadSnapshot
from engines.bus.forwarder import encode_load
from router.settings import DEFAULTS

PROFILE = "h100-llama3.1-8b"
READ_MAX_ITEMS = 4096  # what RouterCore's read_pair asks (EventBus.read_pair's default)


class _Wire(msgspec.Struct, array_like=True, gc=False, tag="ev"):
    """``InstanceEvents`` with its updates already encoded: byte-identical on the wire, so a
    publisher stamps a recorded batch without encoding its hashes again."""

    instance: str
    seq: int
    ts: float
    updates: msgspec.Raw


_wire_encoder = msgspec.msgpack.Encoder()


def wire_message(instance: str, seq: int, ts: float, updates: bytes) -> bytes:
    return _wire_encoder.encode(_Wire(instance, seq, ts, msgspec.Raw(updates)))


@dataclass(frozen=True)
class Recording:
    """One engine's translated batches over ``span_s`` seconds of steady state: ``times[i]``
    (seconds into the span) and ``updates[i]`` (the msgpack of ``InstanceEvents.updates``)."""

    times: list[float]
    updates: list[bytes]
    blocks: list[int]  # hashes per batch, stored and removed
    span_s: float
    stored_per_s: float
    removed_per_s: float


def record(
    seconds: float = 20.0, stored_per_s: float = 1750.0, keep_every: int = 1, seed: int = 0
) -> Recording:
    """A saturated H100 engine's translated batches: run until its cache is full, then record
    ``seconds`` of it, time-scaled so that ``stored_per_s`` engine blocks are stored per second
    (before thinning to every ``keep_every``-th block)."""
    from engines.profile import LatencyProfile
    from engines.sim.request import make_request
    from engines.sim.virtual import VirtualInstance

    profile = LatencyProfile.load(PROFILE)
    bs = profile.block_size
    batches: list[tuple[float, int, bytes]] = []
    inst = VirtualInstance(
        "e", profile, on_events=lambda _i, s, p: batches.append((inst.clock, s, p))
    )
    rng = random.Random(seed)
    # the cache fills at ~1.4k blocks/s: record once it is full (evictions as many as stores)
    fill_s = profile.kv_capacity_tokens / bs / 1000.0
    end_s, t, n = fill_s + seconds, 0.0, 0
    while t < end_s:
        inst.run_until(t)
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randint(1000, 4000))]
        req = make_request(
            f"r{n}",
            block_size=bs,
            max_tokens=rng.randint(50, 300),
            prompt_token_ids=prompt,
            model=profile.model,
        )
        inst.submit(req, t)
        n, t = n + 1, t + rng.expovariate(12.0)  # ~30k prompt tokens/s: more than it prefills
    inst.run_until(end_s)
    translator = EngineEventTranslator("e", profile.model, bs)
    # the forwarder's translator at the router granularity (engines.event_stride)
    coarse = EngineEventTranslator("e", profile.model, bs, stride=keep_every)
    kept: list[tuple[float, list[Update]]] = []
    stored = removed = 0
    for clock, seq, payload in batches:
        msg = translator.feed(payload, seq, clock)
        thinned = coarse.feed(payload, seq, clock)
        if msg is None:
            continue
        updates = list(thinned.updates) if thinned is not None else []
        if clock < fill_s:
            continue
        for u in msg.updates:
            if isinstance(u, Stored):
                stored += len(u.hashes)
            elif isinstance(u, Removed):
                removed += len(u.hashes)
        if updates:
            kept.append((clock - fill_s, updates))
    scale = stored_per_s * seconds / stored  # the replay's speed-up over the recording
    enc = msgspec.msgpack.Encoder()
    return Recording(
        times=[c / scale for c, _ in kept],
        updates=[enc.encode(u) for _, u in kept],
        blocks=[sum(len(getattr(x, "hashes", ())) for x in u) for _, u in kept],
        span_s=seconds / scale,
        stored_per_s=stored_per_s,
        removed_per_s=removed * scale / seconds,
    )


# -- processes -----------------------------------------------------------------------------------

_REC: Recording | None = None  # set before forking the publishers


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def publisher(
    url: str, engines: list[int], start: float, window: float, stop: float, seed: int, out: Any
) -> None:
    """Drive ``engines`` logical engines (forwarders) from ``start`` to ``stop`` (wall time);
    how late their calls are is kept from ``window`` (the warm-up's end) on."""
    from engines.bus.redis_bus import RedisStreamBus, redis_client

    rec = _REC
    assert rec is not None
    client = redis_client(url)
    events = RedisStreamBus(url, "scale:events", client=client)
    loads = RedisStreamBus(url, "scale:loads", client=client)
    rng = random.Random(seed)
    n_rec, span, interval = len(rec.times), rec.span_s, PUBLISH_INTERVAL_S
    # per engine: name, offset into the recording, next batch index (absolute), seq
    names = [f"e{e:05d}" for e in engines]
    offset = [rng.uniform(0, span) for _ in engines]
    nxt = [0] * len(engines)
    seq = [0] * len(engines)
    for k in range(len(engines)):  # the first batch at or after the engine's offset
        i = 0
        while i < n_rec and rec.times[i] < offset[k]:
            i += 1
        nxt[k] = i
    sample = encode_load(LoadSnapshot("e", 0.0, 3, 64, 0.9, 0.0, 1024))
    heap = [(start + rng.uniform(0, interval), k) for k in range(len(engines))]
    heapq.heapify(heap)
    calls = msgs = blocks = nbytes = 0
    late: list[float] = []
    while heap:
        due, k = heapq.heappop(heap)
        if due >= stop:
            continue
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        if due >= window:
            late.append(max(0.0, -wait))
        # the batches the engine made up to this interval's end (recording time, wrapped)
        horizon = due - start + offset[k]
        batch: list[tuple[int, int]] = []
        i = nxt[k]
        while True:
            lap, j = divmod(i, n_rec)
            if lap * span + rec.times[j] > horizon:
                break
            batch.append((j, seq[k]))
            seq[k] += 1
            i += 1
        nxt[k] = i
        now = time.time()
        if batch:
            payloads = [wire_message(names[k], s, now, rec.updates[j]) for j, s in batch]
            events.publish_pair(payloads, loads, [sample])
            msgs += len(payloads)
            blocks += sum(rec.blocks[j] for j, _ in batch)
            nbytes += sum(map(len, payloads))
        else:
            loads.publish(sample)
        calls += 1
        heapq.heappush(heap, (due + interval, k))
    late.sort()
    out.put(
        {
            "kind": "publisher",
            "calls": calls,
            "msgs": msgs,
            "blocks": blocks,
            "bytes": nbytes,
            "late_p99_ms": _pct(late, 0.99) * 1e3 if late else 0.0,
        }
    )
    client.close()


def reader(url: str, start: float, stop: float, window: float, apply: bool, out: Any) -> None:
    """A router replica's bus pump from ``start`` to ``stop``; lags of messages published after
    ``window`` (the warm-up's end) are kept."""
    from cachemap import CacheMap
    from cachemap.ingest import CacheMapIngestor
    from engines.bus.redis_bus import RedisStreamBus, redis_client

    client = redis_client(url)
    events = RedisStreamBus(url, "scale:events", client=client)
    loads = RedisStreamBus(url, "scale:loads", client=client)
    ingestor = CacheMapIngestor(CacheMap()) if apply else None
    while time.time() < start - 0.2:
        time.sleep(0.01)
    cur, lcur = events.end(), loads.end()
    lags: list[float] = []
    msgs = blocks = reads = full = lost = 0
    while time.time() < stop:
        got, gl = events.read_pair(cur, loads, lcur, READ_MAX_ITEMS)
        cur, lcur = got.cursor, gl.cursor
        reads += 1
        full += len(got.items) == READ_MAX_ITEMS
        lost += got.lost
        decoded = [decode_message(p) for p in got.items]
        for p in gl.items:
            msgspec.msgpack.decode(p)
        if ingestor is not None:
            for m in decoded:
                ingestor.apply(m)
        now = time.time()
        for m in decoded:
            assert isinstance(m, InstanceEvents)
            if m.ts >= window:
                lags.append(now - m.ts)
                msgs += 1
                blocks += sum(len(getattr(u, "hashes", ())) for u in m.updates)
        time.sleep(DEFAULTS.bus_poll_s)  # RouterState.start: wait, then pump again
    lags.sort()
    out.put(
        {
            "kind": "reader",
            "msgs": msgs,
            "blocks": blocks,
            "reads": reads,
            "full_reads": full,
            "lost": lost,
            "lag_p50_ms": _pct(lags, 0.5) * 1e3,
            "lag_p99_ms": _pct(lags, 0.99) * 1e3,
            "lag_max_ms": (lags[-1] if lags else math.nan) * 1e3,
        }
    )
    client.close()


def _pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs`` (nan for none)."""
    if not xs:
        return math.nan
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_point(
    url: str, server: psutil.Process, engines: int, readers: int, args: Any
) -> dict[str, Any]:
    """One run: ``engines`` logical engines, ``readers`` router replicas."""
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = time.time() + 1.5  # time to fork and connect
    window, stop = start + args.warmup, start + args.warmup + args.seconds
    procs = [
        ctx.Process(target=reader, args=(url, start, stop + 0.3, window, args.apply, out))
        for _ in range(readers)
    ]
    n_pub = min(args.publishers, engines)
    procs += [
        ctx.Process(
            target=publisher,
            args=(url, list(range(p, engines, n_pub)), start, window, stop, args.seed + p, out),
        )
        for p in range(n_pub)
    ]
    for p in procs:
        p.start()
    ps = [psutil.Process(p.pid) for p in procs]
    time.sleep(max(0.0, window - time.time()))
    c0 = [_cpu(p) for p in ps]
    s0, t0 = _cpu(server), time.time()
    time.sleep(max(0.0, stop - time.time()))
    c1 = [_cpu(p) for p in ps]
    s1, t1 = _cpu(server), time.time()
    wall = t1 - t0
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    info = client.info("memory")
    client.close()
    rd = [g for g in got if g["kind"] == "reader"]
    pub = [g for g in got if g["kind"] == "publisher"]
    span = args.seconds  # lags and counts cover the measured window's publications
    # the per-reader CPU follows the process order: readers first
    reader_cpu = [(c1[i] - c0[i]) / wall for i in range(readers)]
    pub_cpu = sum(c1[i] - c0[i] for i in range(readers, len(ps))) / wall
    run_s = args.warmup + args.seconds
    return {
        "engines": engines,
        "readers": readers,
        "offered_calls_per_s": sum(g["calls"] for g in pub) / run_s,
        "offered_msgs_per_s": sum(g["msgs"] for g in pub) / run_s,
        "offered_blocks_per_s": sum(g["blocks"] for g in pub) / run_s,
        "offered_mb_per_s": sum(g["bytes"] for g in pub) / run_s / 1e6,
        "publisher_late_p99_ms": max(g["late_p99_ms"] for g in pub),
        "carried_msgs_per_s": statistics.mean(g["msgs"] for g in rd) / span,
        "carried_blocks_per_s": statistics.mean(g["blocks"] for g in rd) / span,
        "lag_p50_ms": statistics.median(g["lag_p50_ms"] for g in rd),
        "lag_p99_ms": max(g["lag_p99_ms"] for g in rd),
        "lag_max_ms": max(g["lag_max_ms"] for g in rd),
        "reads_per_s": sum(g["reads"] for g in rd) / (span + args.warmup),
        "full_reads": sum(g["full_reads"] for g in rd),
        "lost": sum(g["lost"] for g in rd),
        "redis_cores": (s1 - s0) / wall,
        "redis_used_mb": int(info["used_memory"]) / 1e6,
        "publisher_cores": pub_cpu,
        "reader_cores_max": max(reader_cpu),
        "reader_cores_mean": statistics.mean(reader_cpu),
    }


def _median_point(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and k not in ("engines", "readers"):
            out[k] = round(statistics.median(r[k] for r in runs), 4)
        else:
            out[k] = v
    if len(runs) > 1:
        out["lag_p99_ms_runs"] = [round(r["lag_p99_ms"], 1) for r in runs]
        out["redis_cores_runs"] = [round(r["redis_cores"], 3) for r in runs]
    return out


def fit_model(points: list[dict[str, Any]], idle: float, args: Any) -> dict[str, Any]:
    """redis-server cores = idle + engines x (pub + readers x read), least squares; reader
    cores per block carried; extrapolated to the target."""
    # least squares in (pub, read) over x1 = engines, x2 = engines * readers
    sxx = sxy = syy = bx = by = 0.0
    for p in points:
        x1, x2, y = p["engines"], p["engines"] * p["readers"], p["redis_cores"] - idle
        sxx, sxy, syy = sxx + x1 * x1, sxy + x1 * x2, syy + x2 * x2
        bx, by = bx + x1 * y, by + x2 * y
    det = sxx * syy - sxy * sxy
    if abs(det) > 1e-9 * sxx * syy:
        pub = (bx * syy - by * sxy) / det
        read = (by * sxx - bx * sxy) / det
    else:  # one reader count only: the readers' share is not separable (counted in pub)
        pub, read = bx / sxx, 0.0
    # reader cores = fixed (its polls) + per_block * blocks carried, least squares
    xs = [p["carried_blocks_per_s"] for p in points]
    ys = [p["reader_cores_mean"] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    reader_per_block = (
        sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else my / mx
    )
    reader_fixed = my - reader_per_block * mx
    # per engine, from the recording and the runs
    msgs_per_engine = statistics.median(p["offered_msgs_per_s"] / p["engines"] for p in points)
    blocks_per_engine = statistics.median(p["offered_blocks_per_s"] / p["engines"] for p in points)
    mb_per_engine = statistics.median(p["offered_mb_per_s"] / p["engines"] for p in points)
    e, r = args.target_engines, args.target_readers
    redis_at = idle + e * (pub + r * read)
    reader_at = reader_fixed + e * blocks_per_engine * reader_per_block
    # one poll's messages, read and decoded after the poll's wait (a message published just
    # after a read waits DEFAULTS.bus_poll_s plus the previous pump's time, then its own pump's)
    pump_s = reader_at * (DEFAULTS.bus_poll_s) / max(1e-9, 1 - min(reader_at, 0.999))
    shards = max(1, math.ceil(redis_at / args.redis_core_budget))
    return {
        "assumptions": {
            "redis_cores": "idle + engines * (pub + readers * read), fitted over the points",
            "reader_cores": "fixed + blocks carried per s * per block, fitted over the points",
            "lag_p99_ms": "BUS_POLL_S + 2 pumps (the previous one and its own), a pump taking "
            "reader_cores * BUS_POLL_S / (1 - reader_cores) when the reader keeps up; valid "
            "while redis-server and every reader stay below one core (no queueing there)",
            "redis_core_budget": args.redis_core_budget,
            "same_cpu": "per-core figures of this machine's (shared) cores",
        },
        "redis_idle_cores": round(idle, 4),
        "redis_pub_cores_per_engine": pub,
        "redis_read_cores_per_engine_per_reader": read,
        "redis_us_per_msg_published": pub / msgs_per_engine * 1e6,
        "redis_us_per_msg_read": read / msgs_per_engine * 1e6,
        "reader_fixed_cores": reader_fixed,
        "reader_ns_per_block": reader_per_block * 1e9,
        "per_engine": {
            "msgs_per_s": round(msgs_per_engine, 2),
            "blocks_per_s": round(blocks_per_engine, 1),
            "mb_per_s": round(mb_per_engine, 4),
        },
        "target": {
            "engines": e,
            "readers": r,
            "msgs_per_s": round(e * msgs_per_engine),
            "blocks_per_s": round(e * blocks_per_engine),
            "mb_per_s_in": round(e * mb_per_engine, 1),
            "mb_per_s_out": round(e * mb_per_engine * r, 1),
            "redis_cores": round(redis_at, 3),
            "redis_shards_needed": shards,
            "reader_cores": round(reader_at, 3),
            "reader_keeps_up": reader_at < 1.0,
            "lag_p99_ms_predicted": round((DEFAULTS.bus_poll_s + 2 * pump_s) * 1e3, 1)
            if reader_at < 1.0
            else None,
        },
    }


def idle_cores(server: psutil.Process, seconds: float = 2.0) -> float:
    s0 = _cpu(server)
    time.sleep(seconds)
    return (_cpu(server) - s0) / seconds


def main() -> None:
    global _REC
    from tests.support import redis_server

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="16,64,128,256", help="logical engines per point")
    ap.add_argument("--readers", default="1,2,4", help="router replicas per point")
    ap.add_argument("--seconds", type=float, default=12.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring")
    ap.add_argument("--repeats", type=int, default=1, help="runs per point (median)")
    ap.add_argument("--publishers", type=int, default=2, help="publisher processes")
    ap.add_argument("--stored-per-s", type=float, default=1750.0, help="blocks/s per engine")
    ap.add_argument("--event-stride", type=int, default=1, help="engines.event_stride [1]")
    ap.add_argument("--apply", action="store_true", help="readers also apply to a CacheMap")
    ap.add_argument("--target-engines", type=int, default=1024)
    ap.add_argument("--target-readers", type=int, default=4)
    ap.add_argument(
        "--redis-core-budget",
        type=float,
        default=0.7,
        help="redis-server cores one shard may use (it runs commands on one thread)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        engine_counts = [int(x) for x in args.engines.split(",")]
        reader_counts = [int(x) for x in args.readers.split(",")]
    except ValueError:
        ap.error("--engines and --readers: comma-separated integers")
    if min(engine_counts) < 1 or min(reader_counts) < 1:
        ap.error("--engines and --readers: every count must be >= 1")
    if args.seconds <= 0 or args.warmup < 0 or args.repeats < 1 or args.publishers < 1:
        ap.error("--seconds > 0, --warmup >= 0, --repeats >= 1 and --publishers >= 1")
    if args.event_stride < 1 or args.stored_per_s <= 0:
        ap.error("--event-stride >= 1 and --stored-per-s > 0")
    _REC = rec = record(stored_per_s=args.stored_per_s, keep_every=args.event_stride)
    out: dict[str, Any] = {
        "config": {
            k: getattr(args, k)
            for k in ("seconds", "warmup", "repeats", "publishers", "event_stride", "apply")
        },
        "recording": {
            "profile": PROFILE,
            "batches_per_s": round(len(rec.times) / rec.span_s, 2),
            "stored_per_s": rec.stored_per_s,
            "removed_per_s": round(rec.removed_per_s, 1),
            "bus_blocks_per_s": round(sum(rec.blocks) / rec.span_s, 1),
            "bytes_per_msg": round(sum(map(len, rec.updates)) / len(rec.updates) + 20, 1),
            "publish_interval_s": PUBLISH_INTERVAL_S,
            "bus_poll_s": DEFAULTS.bus_poll_s,
        },
        "cpus": psutil.cpu_count(),
        "points": [],
    }
    with tempfile.TemporaryDirectory() as d, redis_server(Path(d)) as url:
        import redis

        c = redis.Redis.from_url(url)
        server = psutil.Process(int(c.info("server")["process_id"]))
        c.close()
        idle = idle_cores(server)
        for e in engine_counts:
            for r in reader_counts:
                runs = [run_point(url, server, e, r, args) for _ in range(args.repeats)]
                point = _median_point(runs)
                out["points"].append(point)
                print(json.dumps(point), file=sys.stderr, flush=True)
        out["model"] = fit_model(out["points"], idle, args)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
