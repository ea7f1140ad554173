"""``engines.pd.nixl``: the NixlConnector ``kv_transfer_config`` builder and its side channel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engines.pd.nixl import (
    NIXL_CONNECTOR,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_PORT_ENV,
    NixlConfigError,
    nixl_transfer_config,
    side_channel_env,
    side_channel_environ,
)

pytest.importorskip("vllm")  # the builder checks its result with vLLM's KVTransferConfig


def test_cpu_config_is_what_vllm_takes() -> None:
    from vllm.config import KVTransferConfig

    d = nixl_transfer_config(on_gpu=False, side_channel_port=5601)
    assert d == {
        "kv_connector": NIXL_CONNECTOR,
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "backends": ["UCX"],
            "kvroute": {"side_channel_port": 5601},
        },
    }
    ktc = KVTransferConfig(**d)
    assert ktc.kv_connector == "NixlConnector" and ktc.kv_buffer_device == "cpu"
    assert ktc.is_kv_producer and ktc.is_kv_consumer
    assert ktc.kv_load_failure_policy == "recompute"
    assert ktc.get_from_extra_config("backends", None) == ["UCX"]
    assert "engine_id" not in d  # vLLM gives each engine a fresh one


def test_gpu_config_and_nixl_extra_keys() -> None:
    from vllm.config import KVTransferConfig

    d = nixl_transfer_config(
        on_gpu=True,
        kv_load_failure_policy="fail",
        role="kv_consumer",
        engine_id="d-0",
        kv_lease_duration=60,
        kv_recompute_threshold=0,
        backends=["UCX", "GDS"],
    )
    assert d["kv_buffer_device"] == "cuda" and d["kv_role"] == "kv_consumer"
    assert d["engine_id"] == "d-0" and d["kv_load_failure_policy"] == "fail"
    assert d["kv_connector_extra_config"] == {
        "backends": ["UCX", "GDS"],
        "kv_lease_duration": 60,
        "kv_recompute_threshold": 0,
    }
    ktc = KVTransferConfig(**d)
    assert ktc.engine_id == "d-0" and not ktc.is_kv_producer
    assert ktc.get_from_extra_config("kv_lease_duration", 30) == 60


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"on_gpu": "yes"}, "on_gpu"),
        ({"on_gpu": False, "side_channel_port": 0}, "side_channel_port"),
        ({"on_gpu": False, "side_channel_port": 70000}, "side_channel_port"),
        ({"on_gpu": False, "side_channel_port": True}, "side_channel_port"),
        ({"on_gpu": False, "side_channel_host": ""}, "side_channel_host"),
        ({"on_gpu": False, "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({"on_gpu": False, "role": "kv_both_ways"}, "kv_role"),
        ({"on_gpu": False, "engine_id": ""}, "engine_id"),
        ({"on_gpu": False, "kv_lease_duraton": 10}, "'kv_lease_duraton'"),
        ({"on_gpu": False, "kv_lease_duration": 0}, "'kv_lease_duration'"),
        ({"on_gpu": False, "kv_recompute_threshold": -1}, "'kv_recompute_threshold'"),
        ({"on_gpu": False, "backends": []}, "'backends'"),
        ({"on_gpu": False, "backends": "UCX"}, "'backends'"),
        ({"on_gpu": False, "enforce_handshake_compat": 1}, "'enforce_handshake_compat'"),
    ],
)
def test_errors_name_the_field(kwargs: dict, names: str) -> None:
    with pytest.raises(NixlConfigError, match=names):
        nixl_transfer_config(**kwargs)


def test_vllm_refusal_names_the_field() -> None:
    from engines.pd.nixl import _validate_with_vllm

    with pytest.raises(NixlConfigError, match="kv_buffer_device") as e:
        _validate_with_vllm(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": 3}
        )
    assert "KVTransferConfig" in str(e.value)
    with pytest.raises(NixlConfigError, match="kv_role"):
        _validate_with_vllm({"kv_connector": "NixlConnector", "kv_role": "both"})


def test_side_channel_env_and_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    d = nixl_transfer_config(on_gpu=False, side_channel_port=5611, side_channel_host="10.0.0.7")
    assert side_channel_env(d) == {SIDE_CHANNEL_HOST_ENV: "10.0.0.7", SIDE_CHANNEL_PORT_ENV: "5611"}
    assert side_channel_env(nixl_transfer_config(on_gpu=False)) == {}
    monkeypatch.setenv(SIDE_CHANNEL_PORT_ENV, "5600")
    monkeypatch.delenv(SIDE_CHANNEL_HOST_ENV, raising=False)
    with side_channel_environ(d) as env:
        assert os.environ[SIDE_CHANNEL_PORT_ENV] == "5611" == env[SIDE_CHANNEL_PORT_ENV]
        assert os.environ[SIDE_CHANNEL_HOST_ENV] == "10.0.0.7"
    assert os.environ[SIDE_CHANNEL_PORT_ENV] == "5600"
    assert SIDE_CHANNEL_HOST_ENV not in os.environ


def test_vllm_reads_the_port_from_the_environment() -> None:
    # vLLM's own env accessor, in a fresh process started with the variables set
    d = nixl_transfer_config(on_gpu=False, side_channel_port=5633)
    code = (
        "import vllm.envs as e; print(e.VLLM_NIXL_SIDE_CHANNEL_PORT, e.VLLM_NIXL_SIDE_CHANNEL_HOST)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **side_channel_env(d)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[-2:] == ["5633", "localhost"]


def test_importing_the_module_imports_neither_nixl_nor_torch() -> None:
    code = (
        "import sys, engines.pd.nixl; "
        "print(sorted(m for m in ('nixl', 'torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
