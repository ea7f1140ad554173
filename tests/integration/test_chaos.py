"""Faults on the Redis bus, for real: two router replicas (one with the engines and their
forwarders, one more over the same streams), two sim engines, a redis-server this module kills
and restarts. Each test prints what it measured (``-s`` shows it; the closing notes quote it).

- replicas agree: after a burst, both cache maps equal the engines' truth, and place alike;
- Redis killed and restarted under load: every accepted request completes, both routers keep
  serving on stale state, then resync (the log's new epoch) to the engines' truth;
- events dropped in a forwarder: the gap is detected, a snapshot repairs the map, and routing
  follows the repaired map.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachemap import BlockHasher, Tier
from cachemap.events import InstanceEvents, decode_message
from deploy.local import LocalStack
from engines.bus.redis_bus import RedisStreamBus
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from engines.tiny_model import build_tiny_model
from router.placement import PlacementRequest
from router.tokenizer import PromptTokenizer
from tests.support import Server, free_port, redis_server, wait_for

pytestmark = pytest.mark.integration

MODEL, BS = "tiny-sim", 32
ADMIN = "sk-admin"
PROFILE = LatencyProfile.load("cpu-tiny-llama")


class Cluster:
    """Redis on a fixed port (so it can come back), engines + forwarders + router A, router B."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port = workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.tok = PromptTokenizer(build_tiny_model())
        self._redis = ExitStack()
        self.start_redis()
        engines = {
            f"sim-{i}": SimEngine(
                f"sim-{i}",
                PROFILE,
                time_scale=0.02,
                options=SimEngineOptions(
                    block_size=BS,
                    vocab_size=self.tok.vocab_size,
                    token_offset=10,
                    max_model_len=4096,
                ),
            )
            for i in range(2)
        }
        common: dict[str, Any] = dict(
            model=MODEL,
            block_size=BS,
            max_model_len=4096,
            latency=PROFILE,
            tokenizer=self.tok,
            admin_keys=frozenset({ADMIN}),
        )
        self.common = common
        self.a = LocalStack(engines, buses=self.buses(), **common)
        self.b = self.replica()

    def replica(self) -> LocalStack:
        """One more router replica over the bus (engines and forwarders are the first one's)."""
        return LocalStack(self.a.engines, buses=self.buses(), forward=False, **self.common)

    def buses(self) -> tuple[RedisStreamBus, RedisStreamBus]:
        return RedisStreamBus(self.url, "kvroute-chaos:ev"), RedisStreamBus(
            self.url, "kvroute-chaos:ld"
        )

    def start_redis(self) -> None:
        self._redis.enter_context(redis_server(self.workdir, port=self.port))

    def kill_redis(self) -> None:
        self._redis.close()  # terminates it; it kept nothing (--save '' --appendonly no)
        self._redis = ExitStack()

    def truth(self) -> dict[tuple[str, str], set[int]]:
        """What the engines hold, by their forwarders' tables (instance, tier) -> our hashes."""
        out: dict[tuple[str, str], set[int]] = {}
        for fwd in self.a.forwarders:
            snap = fwd.snapshot()
            for tier in (Tier.GPU.value, Tier.CPU.value):
                out[(fwd.instance, tier)] = {b.hash for b in snap.blocks if tier in b.tiers}
        return out

    def equal(self, stack: LocalStack) -> bool:
        return self.seen(stack) == self.truth()

    @staticmethod
    def seen(stack: LocalStack) -> dict[tuple[str, str], set[int]]:
        cmap = stack.state.cache_map
        return {
            (iid, tier): set(cmap.resident(iid, tier))
            for iid in stack.engines
            for tier in (Tier.GPU.value, Tier.CPU.value)
        }

    def converged(self, timeout_s: float = 15.0) -> float:
        """Seconds until both routers' maps equal the engines' truth (raises on timeout)."""
        start = time.monotonic()
        while True:
            truth = self.truth()
            if self.seen(self.a) == truth and self.seen(self.b) == truth:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                diff = {
                    name: {k: (len(v), len(stack_seen.get(k, set()))) for k, v in truth.items()}
                    for name, stack in (("a", self.a), ("b", self.b))
                    for stack_seen in [self.seen(stack)]
                    if stack_seen != truth
                }
                ingest = {
                    name: (stack.state.core.ingestor.gaps, sorted(stack.state.needs_resync()))
                    for name, stack in (("a", self.a), ("b", self.b))
                }
                raise AssertionError(
                    f"routers did not converge in {timeout_s} s: (truth, seen) blocks per "
                    f"(instance, tier) {diff}; (gaps, needing resync) {ingest}"
                )
            time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("chaos"))
    try:
        with Server(c.a, free_port()) as sa, Server(c.b, free_port()) as sb:
            c.base_a = f"http://127.0.0.1:{sa.port}"  # type: ignore[attr-defined]
            c.base_b = f"http://127.0.0.1:{sb.port}"  # type: ignore[attr-defined]
            yield c
    finally:
        c.kill_redis()


def complete(base: str, prompt: str) -> int:
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        timeout=60,
    )
    return r.status_code


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} system prompt {k}: " + "route me to my cache. " * 40 for k in range(n)]


def placement_request(cluster: Cluster, text: str) -> PlacementRequest:
    """What the ingress would place for completion prompt ``text``."""
    ids = cluster.tok.encode(text)
    return PlacementRequest("p", len(ids), BlockHasher(MODEL, BS)(ids), max_tokens=2)


def lookup(base: str, prompt: str) -> dict[str, int]:
    r = httpx.post(
        f"{base}/v1/kv/lookup",
        json={"text": prompt},
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return {row["instance"]: row["cached_tokens"] for row in r.json()["instances"]}


def burst(
    cluster: Cluster, texts: list[str], during: Callable[[], None] | None = None
) -> list[int]:
    base = cluster.base_a  # type: ignore[attr-defined]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, base, t) for t in texts]
        if during is not None:
            during()
        return [f.result() for f in futures]


def test_router_replicas_agree_after_a_burst(cluster: Cluster) -> None:
    texts = prompts(10, "agree") * 3
    assert burst(cluster, texts) == [200] * len(texts)
    took = cluster.converged()
    for text in set(texts):
        assert lookup(cluster.base_a, text) == lookup(cluster.base_b, text)  # type: ignore[attr-defined]
        preq = placement_request(cluster, text)
        assert cluster.a.state.place(preq).instance_id == cluster.b.state.place(preq).instance_id
    print(f"\nreplicas agree: {len(texts)} requests, maps equal the engines' {took:.2f} s later")


def test_redis_killed_and_restarted_under_load(cluster: Cluster) -> None:
    base = cluster.base_a  # type: ignore[attr-defined]
    window: dict[str, float] = {}
    sent: list[tuple[float, float, int]] = []  # (start, end, status)

    def client(worker: int) -> None:
        k = 0
        while "up" not in window or time.monotonic() < window["up"] + 1.0:
            start = time.monotonic()
            code = complete(base, prompts(1, f"outage-{worker}-{k}")[0])
            sent.append((start, time.monotonic(), code))
            k += 1

    with cf.ThreadPoolExecutor(4) as pool:
        load = [pool.submit(client, w) for w in range(4)]
        time.sleep(1.0)
        cluster.kill_redis()
        window["down"] = time.monotonic()
        time.sleep(2.0)
        cluster.start_redis()
        window["up"] = time.monotonic()
        for f in load:
            f.result()
    during = [c for s, e, c in sent if e > window["down"] and s < window["up"]]
    assert len(during) >= 10, len(during)  # the outage really was under load
    assert [c for _, _, c in sent] == [200] * len(sent)  # no accepted request lost
    assert cluster.a.state.bus_errors > 0 and cluster.b.state.bus_errors > 0  # they saw it
    took = cluster.converged(timeout_s=20.0)
    back = time.monotonic() - window["up"]
    for fwd in cluster.a.forwarders:
        assert fwd.alive  # a forwarder outlives the bus going away
    print(
        f"\nredis outage of 2 s: {len(sent)} requests, {len(during)} during it, 0 lost; both "
        f"routers equal the engines' truth {back - took:.2f}..{back:.2f} s after Redis came back"
    )


def test_dropped_events_are_detected_and_repaired(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.converged()
    gaps = cluster.a.state.core.ingestor.gaps
    fwd = cluster.a.forwarders[0]
    real = fwd.bus.publish_many
    dropped: list[bytes] = []

    def lossy(payloads: Sequence[bytes]) -> int:
        kept = []
        for payload in payloads:
            if len(dropped) < 3:
                dropped.append(payload)  # the forwarder thinks it published these
            else:
                kept.append(payload)
        return real(kept)

    monkeypatch.setattr(fwd.bus, "publish_many", lossy)
    texts = prompts(12, "gap")
    assert burst(cluster, texts) == [200] * len(texts)
    assert len(dropped) == 3
    took = cluster.converged()
    assert cluster.a.state.core.ingestor.gaps > gaps  # detected
    for text in texts:  # no stale routing: the repaired map routes each prompt to its holder
        seen = lookup(cluster.base_a, text)  # type: ignore[attr-defined]
        holder = max(seen, key=seen.__getitem__)
        assert seen[holder] > 0
        assert cluster.a.state.place(placement_request(cluster, text)).instance_id == holder
    print(f"\nevent gap: 3 batches dropped, detected and repaired by a snapshot in {took:.2f} s")


def test_a_lost_last_batch_is_seen_by_the_mark_that_follows_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every event batch published while one request runs is lost, and none follows it: only
    the forwarder's ``LastSeq`` mark after the quiet spell tells the routers that they missed
    the end of the instance's sequence (a gap is otherwise seen at the next batch only)."""
    cluster.converged()
    bus = cluster.a.kv_bus
    lost: list[int] = []
    dropping = [True]

    def kept(payloads: Sequence[bytes]) -> list[bytes]:
        out = []
        for payload in payloads:
            msg = decode_message(payload)
            if dropping[0] and isinstance(msg, InstanceEvents):
                lost.append(msg.seq)
            else:
                out.append(payload)
        return out

    many, pair = bus.publish_many, bus.publish_pair
    monkeypatch.setattr(bus, "publish_many", lambda payloads: many(kept(payloads)))
    monkeypatch.setattr(
        bus, "publish_pair", lambda payloads, other, load: pair(kept(payloads), other, load)
    )
    gaps = cluster.a.state.core.ingestor.gaps
    marks = sum(f.marks for f in cluster.a.forwarders)
    assert complete(cluster.base_a, prompts(1, "tail")[0]) == 200  # type: ignore[attr-defined]
    assert wait_for(lambda: lost and not any(f._pending for f in cluster.a.forwarders))
    dropping[0] = False
    took = cluster.converged()
    assert cluster.a.state.core.ingestor.gaps > gaps
    assert sum(f.marks for f in cluster.a.forwarders) > marks  # a mark followed the lost batches
    metrics = httpx.get(f"{cluster.base_a}/metrics", timeout=30).text  # type: ignore[attr-defined]
    exported = [line for line in metrics.splitlines() if line.startswith("kvroute_kv_event_gaps{")]
    assert [float(line.rsplit(" ", 1)[1]) for line in exported] == [
        cluster.a.state.core.ingestor.gaps
    ]
    print(f"\nlast {len(lost)} batches lost: seen and repaired by a snapshot in {took:.2f} s")


def test_a_new_router_replica_bootstraps_from_the_bus(cluster: Cluster) -> None:
    """A router replica that replaces a dead one reads the bus's log (and asks for snapshots where
    it was trimmed) and routes by prefix once its map equals the engines' truth."""
    texts = prompts(8, "replace")
    assert burst(cluster, texts) == [200] * len(texts)
    cluster.converged()
    fresh = cluster.replica()
    start = time.monotonic()
    with Server(fresh, free_port()):
        while not cluster.equal(fresh):
            assert time.monotonic() - start < 15.0, "the new replica never caught up"
            time.sleep(0.02)
        took = time.monotonic() - start
        for text in texts:
            preq = placement_request(cluster, text)
            assert fresh.state.place(preq).instance_id == cluster.a.state.place(preq).instance_id
    print(f"\nnew router replica: routes by prefix {took:.2f} s after it started")
