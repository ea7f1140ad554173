"""Online autoscaling under real Ray Serve (deploy/autoscaling.py): a sim pool autoscaled
between 1 and 3 replicas by the core's policy in Serve's controller, on what its replicas
report. A burst of concurrent requests scales it up to 3; the lull after it (one client going
on) scales it back to 1, the leaving replicas drained; every request succeeds; the decisions
are in the ingress's /metrics. Prints its figures (``-s``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from deploy.config import ServeConfig
from tests.support import free_port, metric, serve_app, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.ray]

POOL = "engine"
# Ray Serve's default rule as the core runs it, with short windows and delays: the test's
# burst lasts seconds, not Ray's 30 s look-back and 600 s downscale delay
POLICY = "ray_default@target_ongoing_requests=2+look_back_s=1+upscale_delay_s=0+downscale_delay_s=2"


def config(port: int) -> ServeConfig:
    return ServeConfig.validated(
        {
            "port": port,
            "app_name": "kvroute-as",
            "engines": {
                "name": POOL,
                "instances": 1,
                "engine": {
                    "kind": "sim",
                    "model": "tiny",
                    "served_model_name": "sim-tiny",
                    "block_size": 32,
                    "max_model_len": 4096,
                    "profile": "cpu-tiny-llama",
                    # 10x the tiny profile's step time: a 48-token answer takes ~0.5 s, so the
                    # burst's requests sit in the engines (what the policy counts)
                    "sim_options": {"time_scale": 10.0},
                },
                "resources": {"num_cpus": 0.5},
                "bus": {"backend": "ray", "name": "kvroute-as"},
                "health_check_period_s": 1.0,
            },
            "router": {"scorer": "kv_ttft"},
            "autoscaling": {
                POOL: {
                    "policy": POLICY,
                    "min_replicas": 1,
                    "max_replicas": 3,
                    "interval_s": 0.5,
                    "metrics_interval_s": 0.5,
                    "cold_start_s": 2.0,
                    "drain_timeout_s": 30.0,
                }
            },
        }
    )


class Clients:
    """``n`` closed-loop clients sending completions until stopped; every answer is checked."""

    def __init__(self, base: str, n: int, max_tokens: int = 48) -> None:
        self.base, self.max_tokens, self.ok = base, max_tokens, 0
        self.t0 = time.monotonic()
        self.failed: list[Any] = []  # (seconds since the clients started, what went wrong)
        self.instances: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as http:
            k = 0
            while not self._stop.is_set():
                k += 1
                body = {
                    "model": "sim-tiny",
                    "prompt": f"client {i} request {k}: " + "tell me about routing. " * 20,
                    "max_tokens": self.max_tokens,
                    "ignore_eos": True,
                }
                try:
                    r = http.post("/v1/completions", json=body)
                    good = (
                        r.status_code == 200
                        and r.json()["usage"]["completion_tokens"] == self.max_tokens
                    )
                    err: Any = None if good else (r.status_code, r.text[:200])
                except httpx.HTTPError as e:
                    err = repr(e)
                with self._lock:
                    if err is None:
                        self.ok += 1
                    else:
                        self.failed.append((round(time.monotonic() - self.t0, 1), err))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


class Routable:
    """The ingress's routable engine count over time, sampled every ``poll_s`` until stopped:
    ``changes`` holds (seconds since start, count) at each change, for a failure's message."""

    def __init__(self, base: str, poll_s: float = 0.25) -> None:
        self.t0 = time.monotonic()
        self.changes: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base, poll_s))
        self._thread.start()

    def _run(self, base: str, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            n = routable(base)
            if not self.changes or self.changes[-1][1] != n:
                self.changes.append((round(time.monotonic() - self.t0, 1), n))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def routable(base: str) -> int:
    try:
        return int(httpx.get(f"{base}/ready", timeout=10).json()["routable_instances"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def decisions(base: str, direction: str) -> float:
    return sum(
        v
        for labels, v in metric(base, "kvroute_autoscale_decisions_total").items()
        if f'pool="{POOL}"' in labels and f'direction="{direction}"' in labels
    )


def target(base: str) -> float | None:
    return metric(base, "kvroute_autoscale_target_replicas").get(f'{{pool="{POOL}"}}')


def test_burst_scales_up_and_lull_scales_down_without_losing_a_request() -> None:
    t0 = time.monotonic()
    with serve_app(config(free_port())) as base:
        assert routable(base) == 1
        seen = Routable(base)
        burst = Clients(base, 12)
        try:
            # the burst: the policy asks for 3, Serve starts them, the router routes to them
            assert wait_for(lambda: target(base) == 3, timeout_s=30, poll_s=0.2), metric(
                base, "kvroute_autoscale_last_decision_info"
            )
            assert wait_for(lambda: routable(base) == 3, timeout_s=30, poll_s=0.2)
            up_at = time.monotonic() - t0
            served_at_peak = burst.ok
            # the new engines serve: requests keep completing with three engines routable
            assert wait_for(lambda: burst.ok >= served_at_peak + 12, timeout_s=30, poll_s=0.2)
        finally:
            burst.stop()
            seen.stop()
        # on a failure: when the requests failed and how many engines the router saw meanwhile
        # (both in seconds since the burst began)
        assert not burst.failed, (burst.failed[:3], len(burst.failed), seen.changes)
        # the lull: one client goes on while the pool scales down, its ~2 s requests in flight
        # across the scale-down (on a leaving replica, which drains it)
        lull = Clients(base, 1, max_tokens=200)
        try:
            assert wait_for(lambda: target(base) == 1, timeout_s=30, poll_s=0.2), metric(
                base, "kvroute_autoscale_last_decision_info"
            )
            assert wait_for(lambda: routable(base) == 1, timeout_s=45, poll_s=0.2)
            down_at = time.monotonic() - t0
            served_at_low = lull.ok
            assert wait_for(lambda: lull.ok >= served_at_low + 2, timeout_s=30, poll_s=0.2)
        finally:
            lull.stop()
        assert not lull.failed, lull.failed[:3]
        assert decisions(base, "up") >= 1 and decisions(base, "down") >= 1
        info = metric(base, "kvroute_autoscale_last_decision_info")
        assert any("ray_default:" in labels for labels in info), info
        assert not metric(base, "kvroute_errors")
        print(
            f"\nautoscale: 3 replicas routable at {up_at:.1f} s, back to 1 at {down_at:.1f} s; "
            f"{burst.ok} burst + {lull.ok} lull requests, 0 failed; "
            f"decisions up {decisions(base, 'up'):g}, down {decisions(base, 'down'):g}, "
            f"hold {decisions(base, 'hold'):g}"
        )
