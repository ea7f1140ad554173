"""Helpers shared by test modules of several tiers (not fixtures, not tests)."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import uvicorn

from deploy.local import LocalStack
from engines.base import PUBLISH_INTERVAL_S, Engine
from engines.ports import free_port
from engines.sim.options import SimEngineOptions
from router.settings import DEFAULTS

if TYPE_CHECKING:
    from deploy.config import ServeConfig
    from engines.profile import LatencyProfile

__all__ = [
    "Server",
    "by_role",
    "free_port",
    "instance_gauge",
    "named_replicas",
    "ray_process_role",
    "redis_server",
    "serve_app",
    "settle",
    "sim_app_config",
    "sim_stack",
    "wait_for",
    "wait_for_async",
]

SIM_MODEL = "tiny-sim"


# the forged request: a decode engine told to pull KV from a host the client chose and
# to report a cached-token count it made up (clients may not set kv_transfer_params)
FORGED_TRANSFER_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "e",
    "remote_request_id": "r",
    "remote_block_ids": [0],
    "remote_host": "example.invalid",
    "remote_port": 1,
    "remote_prefill_cached_tokens": 999999,
}


def instance_gauge(base: str, name: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """``name``'s value per ``instance`` label on the /metrics of the router at ``base``."""
    return {
        labels.split('instance="', 1)[1].split('"', 1)[0]: value
        for labels, value in metric(base, name, headers).items()
        if 'instance="' in labels
    }


def metric(base: str, name: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """``name``'s samples on the /metrics of the router at ``base``, by their label text less
    the ``model_name`` and ``router`` labels every series carries ('' for none other), e.g.
    ``{'{path="split"}': 1.0}``."""
    import re

    import httpx

    out = {}
    for line in httpx.get(f"{base}/metrics", headers=headers, timeout=30).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key[len(name) :][:1] in ("", "{"):
                labels = re.sub(r'\b(model_name|router)="[^"]*",?', "", key[len(name) :])
                labels = labels.replace(",}", "}")
                out["" if labels == "{}" else labels] = float(value)
    return out


def span_exporter() -> Any:
    """An in-memory exporter of every span finished from now on in this process: attached to
    the process's SDK tracer provider, which is installed first if there is none (OpenTelemetry
    takes one provider per process, so tests share it)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "a non-SDK tracer provider is installed"
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def nested_json(depth: int) -> dict[str, Any]:
    """A JSON object whose dicts and lists (alternating) nest ``depth`` levels deep (>= 2)."""
    value: Any = {}
    for i in range(depth - 1):
        value = {"a": value} if (depth - 1 - i) % 2 else [value]
    return value  # type: ignore[no-any-return]


def settle() -> None:
    """Wait for KV events of requests that just finished to reach an in-process router's map:
    at most a publish interval in the forwarder, then a bus poll, at the defaults (three times
    that, for a busy box)."""
    time.sleep(3 * (PUBLISH_INTERVAL_S + DEFAULTS.bus_poll_s))


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the folder is scripts, not a package), registered in
    ``sys.modules`` so its dataclasses resolve."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.05) -> bool:
    """Poll ``cond`` until it holds or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


async def wait_for_async(
    cond: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.005
) -> bool:
    """``wait_for`` inside an event loop: polls ``cond`` between ``asyncio.sleep``s, so the
    tasks that make it hold run meanwhile; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(poll_s)
    return cond()


def sim_stack(
    n: int = 2,
    *,
    block_size: int = 32,
    max_model_len: int = 2048,
    time_scale: float = 0.05,
    engine: dict[str, Any] | None = None,
    latency: LatencyProfile | None = None,
    **stack: Any,
) -> LocalStack:
    """``n`` sim engines (``sim-0`` ...; profile ``cpu-tiny-llama``, tokens the built-in tiny
    model's tokenizer decodes; ``engine``: more ``SimEngineOptions``) behind a ``LocalStack``
    serving model ``SIM_MODEL`` (``latency``: the router's profile, the engines' unless given;
    ``stack``: more ``LocalStack`` options)."""
    from engines.profile import LatencyProfile
    from engines.sim.engine import SimEngine
    from engines.tiny_model import build_tiny_model
    from router.tokenizer import PromptTokenizer

    tok = PromptTokenizer(build_tiny_model())
    profile = LatencyProfile.load("cpu-tiny-llama")
    engines: dict[str, Engine] = {
        f"sim-{i}": SimEngine(
            f"sim-{i}",
            profile,
            time_scale=time_scale,
            options=SimEngineOptions(
                block_size=block_size,
                vocab_size=tok.vocab_size,
                token_offset=10,
                max_model_len=max_model_len,
                **engine or {},
            ),
        )
        for i in range(n)
    }
    return LocalStack(
        engines,
        model=SIM_MODEL,
        block_size=block_size,
        max_model_len=max_model_len,
        latency=latency or profile,
        tokenizer=tok,
        **stack,
    )


def sim_app_config(
    port: int,
    name: str,
    *,
    engine: dict[str, Any] | None = None,
    engines: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None,
) -> ServeConfig:
    """``kvroute serve``'s app named ``name`` on 127.0.0.1:``port``: two sim engines of the tiny
    model (32-token blocks, 4k context, the ``cpu-tiny-llama`` profile) on the Ray bus ``name``,
    kv_ttft; ``engine``, ``engines`` and ``router`` update those sections."""
    from deploy.config import ServeConfig

    return ServeConfig.validated(
        {
            "port": port,
            "app_name": name,
            "engines": {
                "instances": 2,
                "engine": {
                    "kind": "sim",
                    "model": "tiny",
                    "block_size": 32,
                    "max_model_len": 4096,
                    "profile": "cpu-tiny-llama",
                    **(engine or {}),
                },
                "bus": {"backend": "ray", "name": name},
                **(engines or {}),
            },
            "router": {"scorer": "kv_ttft", **(router or {})},
        }
    )


@contextmanager
def serve_app(cfg: ServeConfig, timeout_s: float = 60.0) -> Iterator[str]:
    """``cfg``'s app under real Ray Serve on 127.0.0.1:``cfg.port``, on the Ray unit's shared
    local Ray (tests/conftest.py starts it, in the mode ``kvroute serve`` runs Serve in), yielded
    as its base URL once every engine reported in; the app and Serve torn down afterwards."""
    from ray import serve

    from deploy.app import build_serve_app, delete_app, wait_until_ready

    serve.start(http_options={"host": "127.0.0.1", "port": cfg.port})
    try:
        serve.run(build_serve_app(cfg), name=cfg.app_name, route_prefix="/")
        base = f"http://127.0.0.1:{cfg.port}"
        wait_until_ready(base, cfg.instances, timeout_s)
        try:
            yield base
        finally:
            delete_app(cfg)
    finally:
        serve.shutdown()


def named_replicas(app: str, deployment: str) -> list[dict[str, str]]:
    """The live Serve replica actors of ``app``'s ``deployment`` (``ray.util`` rows: ``name``
    ends in ``#<replica id>``, and ``namespace``) in the running Ray."""
    import ray

    return [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")
    ]


@contextmanager
def redis_server(
    workdir: Path,
    *extra: str,
    username: str | None = None,
    password: str | None = None,
    port: int | None = None,
    tls: Path | None = None,
) -> Iterator[str]:
    """A redis-server on ``port`` (default: a free loopback port; ``extra``: more server
    arguments); yields its URL (without credentials) once it answers ``username``/``password``,
    and stops it afterwards. ``tls``: a folder with ``server.crt``, ``server.key`` and
    ``ca.crt`` (``deploy/node-setup.sh tls``): TLS only, a ``rediss://`` URL."""
    import shutil
    import subprocess

    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: `make test` installs it (apt-get)")
    port = port or free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    url = f"redis://127.0.0.1:{port}/0"
    ssl: dict[str, str] = {}
    if tls is not None:
        args[1:3] = ["--port", "0", "--tls-port", str(port)]
        args += ["--tls-cert-file", str(tls / "server.crt"), "--tls-key-file"]
        args += [str(tls / "server.key"), "--tls-ca-cert-file", str(tls / "ca.crt")]
        args += ["--tls-auth-clients", "no"]
        url = f"rediss://localhost:{port}/0"  # the certificate's name
        ssl = {"ssl_ca_certs": str(tls / "ca.crt")}
    proc = subprocess.Popen(
        [*args, "--dir", str(workdir), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(url, username=username, password=password, **ssl)
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def ray_process_role(proc: Any) -> str | None:
    """A ``psutil.Process``'s role in a Ray session: ``replica:<deployment>``, ``ServeController``,
    ``ProxyActor``, ``BusHub``, ``raylet``, ``gcs_server``, ``ray-daemons`` or ``ray-worker``
    (None: not one of Ray's processes, or gone)."""
    import re

    import psutil

    try:
        cmd = " ".join(proc.cmdline())
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    m = re.search(r"ray::ServeReplica:[^:\s]+:(\w+)", cmd)
    if m:
        return f"replica:{m.group(1)}"
    for key in ("ServeController", "ProxyActor", "BusHub", "raylet", "gcs_server"):
        if key in cmd or key in name:
            return key
    if "dashboard" in cmd or "log_monitor" in cmd or "monitor.py" in cmd:
        return "ray-daemons"
    if name.startswith("ray::"):
        return "ray-worker"
    return None


def by_role(measure: Any) -> dict[str, float]:
    """``measure(process)`` summed per ``ray_process_role`` over this process's descendants (the
    local Ray it started; another Ray session on the machine is not ours), plus this process's
    own under ``driver``. A process that is gone meanwhile is left out."""
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {"driver": float(measure(me))}
    for proc in me.children(recursive=True):
        role = ray_process_role(proc)
        if role is None:
            continue
        try:
            out[role] = out.get(role, 0.0) + float(measure(proc))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


class Server:
    def __init__(self, stack: LocalStack, port: int) -> None:
        self.stack, self.port = stack, port
        # NOTE: bound here and served once the stack has started (a vLLM engine takes seconds):
        # a port only drawn would be free all that while, for another server to draw and bind
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.server = uvicorn.Server(
            uvicorn.Config(stack.app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.stack.start())
            try:
                loop.run_until_complete(self.server.serve(sockets=[self.sock]))
            finally:
                loop.run_until_complete(self.stack.stop())
                loop.close()
        finally:
            self.sock.close()

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
