"""``kvroute serve``: the main job. With no arguments: an embedded local Ray, two sim engines and
the OpenAI-compatible ingress on 127.0.0.1:8000. Ctrl-C shuts everything down."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from deploy.config import RAY_PREFIX_ROUTER, ServeConfig, apply_ray_serve_env, is_loopback


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file (see deploy/*.yaml); flags override it")
    p.add_argument("--engine", choices=["sim", "vllm"], help="engine kind (default: sim)")
    p.add_argument(
        "--model",
        help="HF model directory, or a built-in random model: 'tiny' or 'small'",
    )
    p.add_argument("--instances", type=int, help="engine instances (default: 2)")
    p.add_argument(
        "--router",
        help="placement: kv_ttft (default), round_robin, least_loaded, session, "
        f"sglang_cache_aware, dynamo_cost, llmd_weighted or {RAY_PREFIX_ROUTER}",
    )
    p.add_argument("--host", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default: 8000)")
    p.add_argument("--slo-ttft-ms", type=float, help="reject (429) requests estimated above it")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting one")


def build_config(args: argparse.Namespace) -> ServeConfig:
    base = ServeConfig.from_yaml(args.config) if args.config else ServeConfig()
    data: dict[str, Any] = base.to_dict()
    pools = data.get("pools") or [data["engines"]]
    for pool in pools:
        if args.engine:
            pool.setdefault("engine", {})["kind"] = args.engine
        if args.model:
            pool.setdefault("engine", {})["model"] = args.model
    if args.instances is not None:
        if data.get("pools"):
            raise ValueError("--instances: the config has pools; set each pool's instances in it")
        data["engines"]["instances"] = args.instances
    if args.router:
        data["router"]["scorer"] = args.router
    if args.slo_ttft_ms is not None:
        data["router"]["slo_ttft_ms"] = args.slo_ttft_ms
    if args.host:
        data["host"] = args.host
    if args.port is not None:
        data["port"] = args.port
    return ServeConfig.validated(data, source="settings")


def check_local_models(cfg: ServeConfig) -> None:
    """Fail in a second, naming the field, when a model or tokenizer this machine should load is
    a path that is not there: otherwise every engine replica and the ingress fail in turn and Serve
    retries them for minutes. Only a path-like name (``/``, ``.``, ``~``) is checked: anything else
    is a built-in preset or a hub id, and on a cluster (``--ray-address``) the nodes hold the
    files."""
    from pathlib import Path

    from engines.tiny_model import MODEL_PRESETS

    named = [("engines.engine.model", p.engine.model) for p in cfg.engine_pools]
    if cfg.tokenizer:
        named.append(("tokenizer", cfg.tokenizer))
    for field, name in named:
        if name in MODEL_PRESETS or not name.startswith(("/", ".", "~")):
            continue
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ValueError(
                f"{field} (--model): {name!r} is not a directory on this machine: give an HF "
                f"model directory, a hub id or a built-in model ({', '.join(MODEL_PRESETS)})"
            )


@contextlib.contextmanager
def local_pool(cfg: ServeConfig) -> Iterator[ServeConfig]:
    """With ``pool.enabled``: start the pool's master and metadata server on
    ``pool.master_host`` (free ports where the config says 0), yield ``cfg`` with their address
    in every engine config, and stop both on the way out (an error, Ctrl-C). Without: ``cfg``."""
    if not cfg.pool.enabled:
        yield cfg
        return
    from engines.pool.master import PoolMaster, PoolUnavailable

    master = PoolMaster(cfg.pool.master_config())
    try:
        master.start()
    except PoolUnavailable as e:
        raise ValueError(f"pool.enabled: {e}") from None
    except BaseException:  # Ctrl-C while it starts: nothing of it stays
        master.stop()
        raise
    try:
        print(
            f"kvroute: pool master {master.master_address}, metadata {master.metadata_url}",
            flush=True,
        )
        yield cfg.with_pool(master.master_address, master.metadata_url)
    finally:
        master.stop()


def cluster_pool(cfg: ServeConfig, head_host: str) -> ServeConfig:
    """On a cluster the head runs the master (``deploy/node-setup.sh pool``, on the fixed
    ports of ``deploy.pool_config.CLUSTER_POOL_PORTS`` where the config says 0): ``cfg`` with
    its address, after checking that it answers. A loopback ``master_host`` means
    ``head_host``."""
    if not cfg.pool.enabled:
        return cfg
    host = head_host if is_loopback(cfg.pool.master_host) else cfg.pool.master_host
    mc = cfg.pool.master_config(host, cluster=True)
    for field, port in (("rpc_port", mc.rpc_port), ("metadata_port", mc.metadata_port)):
        try:
            socket.create_connection((host, port), timeout=2).close()
        except OSError as e:
            raise ValueError(
                f"pool.{field}: nothing answers at {host}:{port} ({e}); the cluster's head "
                "starts the master: KVROUTE_POOL=on in deploy/cluster*.yaml (node-setup.sh pool)"
            ) from None
    return cfg.with_pool(f"{host}:{mc.rpc_port}", f"http://{host}:{mc.metadata_port}/metadata")


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    if not args.ray_address:  # a cluster's processes take theirs from its ray start
        check_local_models(cfg)
        apply_ray_serve_env()  # Serve's mode, and its proxy's guard (deploy.proxy_guard)
    stop = threading.Event()
    unwind = threading.Event()  # set: a signal unwinds at once (the pool's master stops too)
    unwind.set()

    def on_signal(*_: object) -> None:
        stop.set()
        if unwind.is_set():
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    with contextlib.ExitStack() as stack:
        if not args.ray_address:  # before Ray: its workers may inherit nothing of it
            cfg = stack.enter_context(local_pool(cfg))
        _serve(args, cfg, stop, unwind)
    return 0


def _serve(
    args: argparse.Namespace, cfg: ServeConfig, stop: threading.Event, unwind: threading.Event
) -> None:
    import ray
    from ray import serve

    from deploy.app import build_serve_app, wait_until_ready

    # NOTE: a ray.init interrupted half-way leaves Ray's agents running (measured): a signal
    # while it starts is acted on once it returns
    unwind.clear()
    try:
        if args.ray_address:
            ray.init(address=args.ray_address)
        else:
            need = sum(p.instances * p.resources.num_cpus for p in cfg.engine_pools) + 1
            ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False)
        if stop.is_set():
            return
        unwind.set()
        if args.ray_address:
            head = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
            cfg = cluster_pool(cfg, head)
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_serve_app(cfg), name=cfg.app_name, route_prefix="/")
        local = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
        try:
            wait_until_ready(f"http://{local}:{cfg.port}", cfg.instances)
        except TimeoutError as e:  # serve anyway: the ingress reports 503 until engines join
            print(f"kvroute: warning: {e}", file=sys.stderr, flush=True)
        print(
            f"kvroute serving {cfg.engine.model_name!r} on "
            + ", ".join(
                f"{p.instances} {p.engine.kind} {'' if p.role == 'both' else p.role + ' '}engine(s)"
                for p in cfg.engine_pools
            )
            + ", "
            f"router {cfg.router.scorer}: http://{cfg.host}:{cfg.port}/v1",
            flush=True,
        )
        unwind.clear()
        stop.wait()
        print("kvroute: shutting down", flush=True)
    finally:
        unwind.clear()
        if ray.is_initialized():
            serve.shutdown()
        ray.shutdown()
