"""The Grafana dashboard (deploy/grafana-kvroute.json) against a real Prometheus server scraping
a real kvroute app: prefill/decode sim engines behind the in-process ingress (uvicorn, no Ray),
streamed and whole chat and completions requests, cache hits, an error. Every panel's PromQL,
run through Prometheus's HTTP API, returns data."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.profile import LatencyProfile
from router.pd import PdPlanner, TransferModel
from router.pools import Pool
from tests.support import SIM_MODEL, Server, free_port, sim_stack, wait_for

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is absent (Debian's package: apt-get install -y prometheus)",
)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-kvroute.json"
PROFILE = LatencyProfile.load("cpu-tiny-llama")
BS = 32
POOLS = (Pool("prefill", "prefill", BS, PROFILE, 4096), Pool("decode", "decode", BS, PROFILE, 4096))
POOL_OF = {"sim-0": "prefill", "sim-1": "decode", "sim-2": "decode"}
LONG = "You are a careful assistant who answers in full sentences. " * 30  # split: > 64 tokens


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]
    ]


@pytest.fixture(scope="module")
def kvroute() -> Iterator[Server]:
    planner = PdPlanner(
        TransferModel(PROFILE.kv_bytes_per_token), max_local_prefill_tokens=64, overload_factor=None
    )
    stack = sim_stack(3, pools=POOLS, pool_of=POOL_OF, planner=planner, max_model_len=4096)
    with Server(stack, free_port()) as s:
        assert wait_for(lambda: len(stack.state.core.members()) == 3, 30), "engines registered"
        yield s


@pytest.fixture(scope="module")
def prometheus(kvroute: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus server (its config and storage in a temporary directory, on a free loopback
    port) scraping the kvroute app every second; yields its base URL once it scraped it."""
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvroute\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{kvroute.port}']\n"
    )
    port = free_port()
    assert PROMETHEUS is not None
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        up = wait_for(lambda: _values(base, 'up{job="kvroute"}') == [1.0], 60, 0.2)
        assert up, f"prometheus never scraped kvroute: {(work / 'prometheus.log').read_text()}"
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    try:
        r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    except httpx.HTTPError:
        return []
    if r.status_code == 503:  # still starting: not ready to answer queries
        return []
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]  # type: ignore[no-any-return]


def _values(base: str, expr: str) -> list[float]:
    return [float(s["value"][1]) for s in _query(base, expr)]


def _wave(base: str) -> int:
    """Chat and completions, streamed and whole, a long prompt (split over the pools) and its
    next turn (a cache hit), and one error; the requests completed."""
    openai_ = f"{base}/v1"
    chat = [{"role": "system", "content": LONG}, {"role": "user", "content": "Tell a story."}]
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("chat/completions", {"messages": chat, "max_tokens": 6, "stream": True}),
        ("chat/completions", {"messages": chat, "max_tokens": 6}),
        ("completions", {"prompt": "Hello there, router.", "max_tokens": 5, "stream": True}),
        ("completions", {"prompt": "Hello there, router.", "max_tokens": 5}),
        ("completions", {"prompt": "Stop at x please", "max_tokens": 8, "stop": ["zz"]}),
        (
            "chat/completions",
            {
                "messages": [
                    *chat,
                    {"role": "assistant", "content": "Once."},
                    {"role": "user", "content": "More."},
                ],
                "max_tokens": 4,
                "stream": True,
                "n": 2,
            },
        ),
    ]
    done = 0
    for path, body in bodies:
        with httpx.stream(
            "POST", f"{openai_}/{path}", json={"model": SIM_MODEL, **body}, timeout=60
        ) as r:
            r.read()
            assert r.status_code == 200, r.text
            done += 1
    r404 = httpx.post(f"{openai_}/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert r404.status_code == 404
    return done


def test_every_dashboard_panel_has_data_in_a_real_prometheus(
    kvroute: Server, prometheus: str
) -> None:
    base = f"http://127.0.0.1:{kvroute.port}"
    router = httpx.get(f"{base}/health").headers["x-kvroute-router"]
    # the dashboard's variables: this replica and model ('.' made literal for the regex match)
    values = {
        "$__rate_interval": "1m",
        "$model_name": SIM_MODEL.replace(".", "[.]"),
        "$router": router.replace(".", "[.]"),
    }
    queries = []
    for title, expr in panel_queries():
        for k, v in values.items():
            expr = expr.replace(k, v)
        assert "$" not in expr, f"{title}: a variable the test does not set: {expr}"
        queries.append((title, expr))

    def empty() -> list[str]:
        return [
            f"{title}: {expr}"
            for title, expr in queries
            if not any(math.isfinite(v) for v in _values(prometheus, expr))
        ]

    sent = 0
    missing: list[str] = []
    for _ in range(6):  # waves until every panel shows a rate (a series needs two samples)
        sent += _wave(base)

        def scraped(total: int = sent) -> bool:
            return _values(prometheus, "sum(kvroute_requests_total)") == [float(total)]

        assert wait_for(scraped, 30, 0.2), "prometheus never scraped the requests"
        missing = empty()
        if not missing:
            break
    assert not missing, "panels without data:\n" + "\n".join(missing)
    assert _values(prometheus, "sum(kvroute_cached_prompt_tokens_total)")[0] > 0, "no cache hit"
    hits = _values(prometheus, 'sum(kvroute_placements_total{reason="cached_prefix"})')
    assert hits and hits[0] > 0, "no placement found a cached prefix"
    # the replica's label is on every kvroute series Prometheus holds
    unlabelled = _query(prometheus, '{__name__=~"kvroute_.+", router=""}')
    assert not unlabelled, unlabelled[:3]
