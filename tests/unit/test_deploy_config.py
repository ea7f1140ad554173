"""Every shipped serve YAML validates; bad settings name their field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy.config import ServeConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("serve-*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    cfg = ServeConfig.from_yaml(path)
    assert cfg.engines.instances >= 1


def test_defaults_are_two_sim_engines_on_localhost() -> None:
    cfg = ServeConfig()
    assert (cfg.host, cfg.port, cfg.engines.instances) == ("127.0.0.1", 8000, 2)
    assert cfg.engines.engine.kind == "sim" and cfg.router.scorer == "kv_ttft"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"port": 0}, "port"),
        ({"router": {"scorer": "nope"}}, "router.scorer"),
        ({"engines": {"instances": 0}}, "engines.instances"),
        ({"engines": {"engine": {"kind": "vllm", "block_size": 16}}}, "engines.engine"),
        ({"surprise": 1}, "surprise"),
        ({"router": {"scorer_options": {"nope": 1}}}, "scorer_options"),
        ({"router": {"scorer_options": {"kv_veto": 2}}}, "scorer_options"),
        ({"engines": {"engine": {"kind": "vllm", "cpu_bind": ["0", "x"]}}}, r"cpu_bind\[1\]"),
        ({"engines": {"engine": {"kind": "vllm", "cpu_bind": []}}}, "cpu_bind"),
        ({"engines": {"engine": {"long_prefill_token_threshold": 0}}}, "long_prefill_token"),
        ({"engines": {"engine": {"long_prefill_token_threshold": 8192}}}, "long_prefill_token"),
        ({"engines": {"engine": {"cpu_tier": {}}}}, "exactly one of gib and blocks"),
        ({"engines": {"engine": {"cpu_tier": {"blocks": 8, "policy": "nope"}}}}, "cpu_tier.policy"),
        ({"engines": {"engine": {"cpu_tier": {"blocks": 8, "policy": "belady"}}}}, "future"),
        (
            {"engines": {"engine": {"cpu_tier": {"blocks": 8, "policy_options": {"zz": 1}}}}},
            "cpu_tier.policy: .*zz",
        ),
        ({"engines": {"engine": {"kind": "vllm", "cpu_tier": {"gib": 4}}}}, "CPU build refuses"),
        ({"router": {"admin_key": "plain"}}, "admin_key"),
        ({"engines": {"role": "prefill"}}, "engines.role"),
        (
            {
                "pools": [
                    {"name": "p", "role": "prefill", "engine": {"kind": "vllm"}},
                    {"name": "d", "role": "decode", "engine": {"kind": "vllm"}},
                ]
            },
            "engine.pd: a prefill pool of vLLM engines needs a KV connector",
        ),
        (
            {
                "pools": [
                    {"name": "p", "role": "prefill", "engine": {"kind": "vllm", "pd": {}}},
                    {"name": "d", "role": "decode", "engine": {"kind": "vllm", "pd": {}}},
                ]
            },
            "engine.pd.port",
        ),
        ({"engines": {"engine": {"pd": {"port": 15600}}}}, "pd: only for kind 'vllm'"),
        ({"pools": [{"name": "p", "role": "prefill"}]}, "needs a decode"),
        ({"pools": [{"name": "d", "role": "decode"}]}, "needs a prefill"),
        ({"pools": [{"name": "a"}, {"name": "a"}]}, "'a' is used twice"),
        ({"pools": [{"name": "a"}], "engines": {"instances": 1}}, "either 'engines'"),
        ({"pools": [{"name": "a", "bus": {"name": "x"}}]}, r"pools\.0\.bus"),
        ({"bus": {"name": "x"}, "engines": {"bus": {"name": "y"}}}, "either 'bus'"),
        (
            {"pools": [{"name": "a"}, {"name": "b", "engine": {"block_size": 16}}]},
            r"pools\.1\.engine\.block_size",
        ),
        (
            {"pools": [{"name": "a"}, {"name": "b", "engine": {"event_stride": 4}}]},
            r"pools\.1\.engine\.event_stride",
        ),
        ({"engines": {"engine": {"event_stride": 0}}}, "event_stride"),
        (
            {"engines": {"engine": {"sim_options": {"queued_until_first_token": "yes"}}}},
            "sim_options: queued_until_first_token must be true or false",
        ),
        ({"engines": {"engine": {"sim_options": {"gpu_blocks": 1}}}}, "sim_options: unknown"),
        (
            {"pools": [{"name": "a"}, {"name": "b"}], "router": {"scorer": "ray_prefix"}},
            "router.scorer",
        ),
    ],
)
def test_bad_settings_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ServeConfig.validated(data)


def test_yaml_errors_are_value_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        ServeConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="no such file"):
        ServeConfig.from_yaml(tmp_path / "missing.yaml")


def test_a_sim_engine_gets_the_configured_cpu_tier() -> None:
    from engines.deployment import build_engine
    from engines.profile import LatencyProfile

    tier = {"gib": 0.5, "policy": "lpc", "prompt_only": True}
    cfg = ServeConfig.validated({"engines": {"engine": {"cpu_tier": tier}}}).engines.engine
    engine = build_engine(cfg, "sim-0")
    per_block = LatencyProfile.load("cpu-tiny-llama").kv_bytes_per_token * cfg.block_size
    cpu = engine.blocks.cpu  # type: ignore[attr-defined]
    assert cpu.capacity_blocks == (1 << 29) // per_block
    assert cpu.policy.name == "lpc" and cpu.prompt_only


def test_admin_keys_come_from_the_environment_and_a_file(tmp_path: Path, monkeypatch) -> None:
    from deploy.config import RouterConfig, admin_keys

    monkeypatch.delenv("KVROUTE_ADMIN_KEY", raising=False)
    assert admin_keys(RouterConfig()) == frozenset()
    monkeypatch.setenv("KVROUTE_ADMIN_KEY", "k1, k2")
    keys = tmp_path / "admin.keys"
    keys.write_text("k3\n\n")
    assert admin_keys(RouterConfig(admin_key_file=str(keys))) == {"k1", "k2", "k3"}
    with pytest.raises(ValueError, match="admin_key_file"):
        admin_keys(RouterConfig(admin_key_file=str(tmp_path / "missing")))


def test_api_keys_come_from_the_config_the_environment_and_a_file(
    tmp_path: Path, monkeypatch
) -> None:
    from deploy.config import RouterConfig, api_keys

    monkeypatch.setenv("KVROUTE_API_KEYS", "e1,e2")
    keys = tmp_path / "api.keys"
    keys.write_text("f1\nteam-a  sk-a\nteam-b sk-b\n")
    cfg = RouterConfig(
        api_keys=["y1"],
        api_key_file=str(keys),
        rate_limit_rps=5,
        key_namespaces={"shared": ["team-a", "team-b"]},
    )
    got = api_keys(cfg)
    assert len(got) == 6 and all(got.identify(s) for s in ("y1", "e1", "e2", "f1", "sk-a"))
    a, b, f1 = got.identify("sk-a"), got.identify("sk-b"), got.identify("f1")
    assert a is not None and b is not None and f1 is not None
    assert (a.id, a.namespace, b.namespace) == ("team-a", "shared", "shared")
    # a bare key is named by its fingerprint, its own namespace; the secret is in neither
    assert f1.id.startswith("fp-") and f1.namespace == f1.id and "f1" not in repr(f1)
    assert got.identify("Bearer sk-a") is None and got.identify("sk-") is None
    bad = RouterConfig(api_keys=["k1"], key_namespaces={"ns": ["nobody"]})
    with pytest.raises(ValueError, match=r"key_namespaces.*nobody"):
        api_keys(bad)


def test_ray_serve_env_is_set_where_the_operator_set_nothing_and_on_every_ray_start(
    monkeypatch,
) -> None:
    """``kvroute serve`` and the cluster files start Ray in the same Serve mode: the local Ray
    through ``apply_ray_serve_env`` (an operator's own value wins), every ``ray start`` line of
    ``deploy/cluster*.yaml`` with ``RAY_SERVE_ENV`` in front."""
    import yaml

    from deploy.config import RAY_SERVE_ENV, apply_ray_serve_env

    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    monkeypatch.delenv("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", raising=False)
    assert apply_ray_serve_env() == {
        **RAY_SERVE_ENV,
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0",
    }
    prefix = " ".join(f"{k}={v}" for k, v in RAY_SERVE_ENV.items())
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    starts = []
    for path in sorted(deploy.glob("cluster*.yaml")):
        data = yaml.safe_load(path.read_text())
        for key in ("head_start_ray_commands", "worker_start_ray_commands"):
            starts += [(path.name, c) for c in data.get(key) or [] if "ray start" in c]
    assert {name for name, _ in starts} == {"cluster.yaml", "cluster-local.yaml"}
    assert all(c.startswith(prefix + " ") for _, c in starts), starts


def test_pools_share_the_deployment_bus_and_the_flags_reach_every_pool() -> None:
    import argparse

    from deploy.commands.serve import add_arguments, build_config

    cfg = ServeConfig.validated(
        {
            "pools": [
                {"name": "prefill", "role": "prefill", "instances": 1},
                {"name": "decode", "role": "decode", "instances": 2},
            ],
            "bus": {"backend": "redis", "name": "pd"},
        }
    )
    assert cfg.instances == 3 and cfg.engine.block_size == 32
    assert [p.bus.name for p in cfg.engine_pools] == ["pd", "pd"]
    back = ServeConfig.validated(cfg.to_dict())  # what crosses into the replicas
    assert back.engine_pools == cfg.engine_pools and back.router == cfg.router
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "small"])
    args.config = None
    single = build_config(args)
    assert single.engines.instances == 2 and single.engine.model == "small"


def test_pool_flags_refuse_instances_without_a_single_pool(tmp_path: Path) -> None:
    import argparse

    from deploy.commands.serve import add_arguments, build_config

    f = tmp_path / "pd.yaml"
    f.write_text("pools:\n  - {name: p, role: prefill}\n  - {name: d, role: decode}\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = build_config(parser.parse_args(["--config", str(f), "--engine", "sim"]))
    assert [p.role for p in cfg.engine_pools] == ["prefill", "decode"]
    with pytest.raises(ValueError, match="--instances"):
        build_config(parser.parse_args(["--config", str(f), "--instances", "3"]))


def test_a_pools_pd_settings_become_the_engines_kv_transfer_config() -> None:
    from engines.config import EngineConfig
    from engines.deployment import pd_transfer_config
    from engines.pd.nixl import side_channel_env

    kvroute = EngineConfig(kind="vllm", pd={"port": 15600, "host": "10.0.0.5", "backend": "gloo"})
    cfg = pd_transfer_config(kvroute, local_rank=2)
    assert cfg is not None and cfg["kv_connector"] == "KvrouteConnector"
    assert cfg["kv_connector_extra_config"]["port"] == 15602  # replica 2 on its node
    assert cfg["kv_connector_extra_config"]["host"] == "10.0.0.5"
    nixl = EngineConfig(kind="vllm", pd={"transport": "nixl", "port": 15700, "host": "10.0.0.5"})
    cfg = pd_transfer_config(nixl, local_rank=1)
    assert cfg is not None and cfg["kv_connector"] == "NixlConnector"
    assert cfg["kv_buffer_device"] == "cpu"
    assert side_channel_env(cfg) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "15701",
    }
    assert pd_transfer_config(EngineConfig(kind="vllm")) is None
    with pytest.raises(ValueError, match=r"engine\.pd\.port: every NIXL engine"):
        ServeConfig.validated(
            {
                "pools": [
                    {
                        "name": "p",
                        "role": "prefill",
                        "engine": {"kind": "vllm", "pd": {"transport": "nixl", "port": 15700}},
                    },
                    {
                        "name": "d",
                        "role": "decode",
                        "engine": {"kind": "vllm", "pd": {"transport": "nixl"}},
                    },
                ]
            }
        )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "kvroute.example.com"])
def test_a_host_off_loopback_needs_api_keys_or_says_it_is_open(host: str) -> None:
    with pytest.raises(ValueError, match=r"router\.api_key_file: host .* is not loopback"):
        ServeConfig.validated({"host": host})
    for router in (
        {"api_key_file": "/secrets/api.keys"},
        {"api_keys": ["k1"]},
        {"allow_unauthenticated": True},
    ):
        assert ServeConfig.validated({"host": host, "router": router}).host == host
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ServeConfig.validated({"host": loopback}).router.api_key_file is None


def test_the_cluster_files_start_ray_with_its_token_and_keep_secrets_out() -> None:
    """Every ``ray start`` of ``deploy/cluster*.yaml`` runs with token auth and the token file
    the head made (``node-setup.sh ray-token``, before it starts); no secret is in a YAML."""
    import yaml

    for path in sorted(DEPLOY.glob("cluster*.yaml")):
        data = yaml.safe_load(path.read_text())
        starts = [
            c
            for key in ("head_start_ray_commands", "worker_start_ray_commands")
            for c in data.get(key) or []
            if "ray start" in c
        ]
        assert starts, path.name
        for c in starts:
            assert "RAY_AUTH_MODE=token" in c and "RAY_AUTH_TOKEN_PATH=" in c, (path.name, c)
            assert "/.kvroute/ray.token" in c, (path.name, c)
        head = " ".join(data["head_setup_commands"])
        assert "node-setup.sh ray-token" in head and "node-setup.sh redis" in head
        text = path.read_text()
        assert "RAY_AUTH_TOKEN=" not in text and "requirepass" not in text
    aws = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    for node_type in aws["available_node_types"].values():
        assert node_type["node_config"]["SecurityGroupIds"], "explicit security groups"


def test_no_password_goes_on_a_command_line() -> None:
    """Secrets reach redis-cli through REDISCLI_AUTH and redis-server through its ACL file, never
    through argv, which every user on the node reads in ``ps`` (``redis-cli --pass`` did)."""
    import re

    for path in [*DEPLOY.glob("*.sh"), *DEPLOY.glob("*.py"), *DEPLOY.glob("*.yaml")]:
        text = path.read_text()
        assert not re.search(r"""["']?--pass["']?\b|redis-cli[^\n]*\s-a\s""", text), path.name
        assert "--requirepass" not in text, path.name


def test_a_session_ray_token_lives_in_a_temporary_directory(monkeypatch, tmp_path) -> None:
    """What the tests and the benchmarks that start a local Ray use instead of ~/.ray: a random
    token readable by its owner only, named by RAY_AUTH_TOKEN_PATH; an environment that already
    says how to authenticate is left alone."""
    import tempfile

    from deploy.ray_token import use_session_token

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    use_session_token("kvroute-test-")
    path = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert path.parent.parent == tmp_path and path.parent.name.startswith("kvroute-test-")
    assert len(bytes.fromhex(path.read_text())) == 32
    assert path.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/elsewhere/token")
    use_session_token()
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == "/elsewhere/token"


def test_the_kv_pool_joins_the_engines_connectors(tmp_path) -> None:
    from engines.config import EngineConfig
    from engines.deployment import transfer_config
    from engines.pd.nixl import side_channel_env

    pool = {"master_address": "10.0.0.2:50051", "metadata_url": "http://10.0.0.2:8080/metadata"}
    cpu = EngineConfig(kind="vllm", pool={**pool, "segment_gib": 2})
    cfg = transfer_config(cpu)
    assert cfg is not None and cfg["kv_connector"] == "KvroutePoolConnector"
    extra = cfg["kv_connector_extra_config"]
    assert extra["master_address"] == "10.0.0.2:50051" and extra["segment_mib"] == 2048
    both = EngineConfig(
        kind="vllm",
        on_gpu=True,
        pool={**pool, "segment_gib": 2},
        pd={"transport": "nixl", "port": 15700, "host": "10.0.0.5"},
    )
    cfg = transfer_config(both)
    assert cfg is not None and cfg["kv_connector"] == "MultiConnector"
    children = cfg["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["NixlConnector", "MooncakeStoreConnector"]
    assert side_channel_env(cfg)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "15700"
    import json

    from engines.pool.connector import mooncake_store_env

    # the store's settings reach vLLM's connector as a file the engine core's environment names
    env = mooncake_store_env(cfg, str(tmp_path))
    written = json.loads(Path(env["MOONCAKE_CONFIG_PATH"]).read_text())
    assert written["master_server_address"] == "10.0.0.2:50051"
    assert written["global_segment_size"] == 2048 << 20
    assert mooncake_store_env(transfer_config(cpu) or {}, str(tmp_path)) == {}
    assert transfer_config(EngineConfig(kind="vllm")) is None
