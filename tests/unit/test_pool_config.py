"""The serve config's ``pool`` section (issue 58): off by default, every error names its field,
the master's address reaches every engine config, and the cluster files carry the pool behind a
flag that is off."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import yaml

from deploy.commands.serve import cluster_pool
from deploy.config import ServeConfig
from deploy.pool_config import CLUSTER_POOL_PORTS, PoolConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_pool_is_off_by_default_everywhere() -> None:
    assert ServeConfig().pool.enabled is False
    assert ServeConfig().engine.pool is None
    for path in sorted(DEPLOY.glob("serve-*.yaml")):
        assert ServeConfig.from_yaml(path).pool.enabled is False, path.name


@pytest.mark.parametrize(
    ("pool", "field", "words"),
    [
        ({"segment_gib": 0.001}, "pool.segment_gib", "16 MiB"),
        ({"segment_gib": 0}, "pool.segment_gib", "greater than 0"),
        ({"link_gbps": 0}, "pool.link_gbps", "greater than 0"),
        ({"link_latency_ms": -1}, "pool.link_latency_ms", "greater than or equal to 0"),
        ({"master_host": "0.0.0.0"}, "pool.master_host", "every interface"),
        ({"master_host": "::"}, "pool.master_host", "every interface"),
        ({"master_host": "head.example"}, "pool.master_host", "an IP address"),
        ({"rpc_port": 70000}, "pool.rpc_port", "65535"),
        ({"metadata_port": -1}, "pool.metadata_port", "greater than or equal to 0"),
        ({"rpc_port": 9000, "metadata_port": 9000}, "pool.metadata_port", "pool.rpc_port"),
        ({"client_ttl_s": 0}, "pool.client_ttl_s", "greater than or equal to 1"),
        ({"eviction_high_watermark": 1.5}, "pool.eviction_high_watermark", "less than"),
        ({"eviction_ratio": 0}, "pool.eviction_ratio", "greater than 0"),
        ({"password": "x"}, "pool.password", "Extra inputs"),
        ({"enabled": "perhaps"}, "pool.enabled", "boolean"),
    ],
)
def test_pool_errors_name_the_field(pool: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(ValueError) as e:
        ServeConfig.validated({"pool": pool}, source="x.yaml")
    assert field in str(e.value) and words in str(e.value), str(e.value)


def test_the_master_config_takes_free_ports_locally_and_fixed_ones_on_a_cluster() -> None:
    pool = PoolConfig(enabled=True, client_ttl_s=30, eviction_ratio=0.1, metadata_port=8100)
    local = pool.master_config()
    assert (local.host, local.rpc_port, local.metadata_port, local.metrics_port) == (
        "127.0.0.1",
        0,
        8100,
        0,
    )
    assert (local.client_ttl_s, local.eviction_ratio) == (30, 0.1)
    cluster = pool.master_config("10.0.0.5", cluster=True)
    assert cluster.host == "10.0.0.5"
    assert cluster.rpc_port == CLUSTER_POOL_PORTS["rpc_port"]
    assert cluster.metadata_port == 8100  # the config's own port wins
    assert cluster.metrics_port == CLUSTER_POOL_PORTS["metrics_port"]


@pytest.mark.parametrize("pools", [False, True])
def test_the_masters_address_reaches_every_engine_config(pools: bool) -> None:
    data: dict[str, object] = {"pool": {"enabled": True, "segment_gib": 2}}
    if pools:
        data["pools"] = [
            {"name": "prefill", "role": "prefill"},
            {"name": "decode", "role": "decode"},
        ]
    cfg = ServeConfig.validated(data).with_pool("127.0.0.1:5", "http://127.0.0.1:6/metadata")
    for p in cfg.engine_pools:
        assert p.engine.pool is not None
        assert p.engine.pool.master_address == "127.0.0.1:5"
        assert p.engine.pool.metadata_url == "http://127.0.0.1:6/metadata"
        assert p.engine.pool.segment_gib == 2
    # what crosses into the replicas validates back with it
    again = ServeConfig.model_validate(cfg.to_dict())
    assert again.engine.pool == cfg.engine.pool


def test_on_a_cluster_serve_finds_the_heads_master_or_names_the_field() -> None:
    off = ServeConfig()
    assert cluster_pool(off, "10.0.0.5") is off
    with socket.socket() as rpc, socket.socket() as meta:
        for s in (rpc, meta):
            s.bind(("127.0.0.1", 0))
            s.listen()
        ports = {"rpc_port": rpc.getsockname()[1], "metadata_port": meta.getsockname()[1]}
        cfg = ServeConfig.validated({"pool": {"enabled": True, **ports}})
        # a loopback master_host means the head's address: here, loopback itself
        out = cluster_pool(cfg, "127.0.0.1")
        assert out.engine.pool is not None
        assert out.engine.pool.master_address == f"127.0.0.1:{ports['rpc_port']}"
        assert out.engine.pool.metadata_url == f"http://127.0.0.1:{ports['metadata_port']}/metadata"
    with pytest.raises(ValueError, match=r"pool\.rpc_port: nothing answers at 127\.0\.0\.1"):
        cluster_pool(cfg, "127.0.0.1")


def test_the_cluster_files_start_the_pool_behind_a_flag_that_is_off() -> None:
    """The head's ``node-setup.sh pool`` runs with ``KVROUTE_POOL=off`` (the serve configs'
    default), on the ports ``kvroute serve --ray-address`` looks for; Ray's workers keep out of
    Mooncake's client and transfer-engine ports (12300-14300, 15000-17000)."""
    setup = (DEPLOY / "node-setup.sh").read_text()
    for name, port in CLUSTER_POOL_PORTS.items():
        assert re.search(rf"POOL_{name.upper()}={port}\b", setup), name
    for path in sorted(DEPLOY.glob("cluster*.yaml")):
        data = yaml.safe_load(path.read_text())
        head = [c for c in data["head_setup_commands"] if "node-setup.sh pool" in c]
        assert len(head) == 1 and "KVROUTE_POOL=off " in head[0], (path.name, head)
        starts = [
            c
            for key in ("head_start_ray_commands", "worker_start_ray_commands")
            for c in data.get(key) or []
            if "ray start" in c
        ]
        for c in starts:
            lo = int(re.search(r"--min-worker-port=(\d+)", c).group(1))  # type: ignore[union-attr]
            hi = int(re.search(r"--max-worker-port=(\d+)", c).group(1))  # type: ignore[union-attr]
            assert lo <= hi and (hi < 12300 or lo > 17000), (path.name, c)
            assert not any(lo <= p <= hi for p in CLUSTER_POOL_PORTS.values()), (path.name, c)


def test_the_heads_mooncake_wheel_is_the_projects() -> None:
    pin = re.search(r'MOONCAKE_WHEEL="([^"]+)"', (DEPLOY / "node-setup.sh").read_text())
    assert pin and f'"{pin.group(1)}"' in (DEPLOY.parent / "pyproject.toml").read_text()
