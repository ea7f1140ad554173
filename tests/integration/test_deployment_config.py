"""Engine deployment configs: defaults, and errors that name the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engines.config import EngineConfig, EngineDeploymentConfig

pytestmark = pytest.mark.integration


def test_defaults_round_trip_through_a_dict() -> None:
    cfg = EngineDeploymentConfig(engine={"kind": "vllm", "model": "tiny"}, instances=2)
    again = EngineDeploymentConfig.model_validate(cfg.model_dump())
    assert again == cfg
    assert cfg.engine.model_name == "tiny" and cfg.engine.block_size == 32
    assert cfg.bus.events_name != cfg.bus.loads_name


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"engine": {"kind": "vllm", "block_size": 48}}, "block_size"),
        ({"engine": {"kind": "gpu-magic"}}, "kind"),
        ({"engine": {"block_size": 0}}, "block_size"),
        ({"engine": {"kv_space_gib": 0}}, "kv_space_gib"),
        ({"engine": {"kind": "vllm", "sim_options": {"x": 1}}}, "sim_options"),
        ({"engine": {"sim_options": {"kv_events_endpoint": None}}}, "kv_events_endpoint"),
        ({"engine": {"sim_options": {"block_size": 16}}}, "block_size"),  # the config's own
        ({"engine": {"max_num_batched_tokens": 16}}, "max_num_batched_tokens"),
        ({"instances": 0}, "instances"),
        ({"resources": {"num_cpus": -1}}, "num_cpus"),
        ({"engine": {"kind": "vllm", "on_gpu": True, "tensor_parallel_size": 2}}, "num_gpus"),
        ({"bus": {"backend": "kafka"}}, "backend"),
        ({"engine": {"typo_field": 1}}, "typo_field"),
    ],
)
def test_errors_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValidationError) as e:
        EngineDeploymentConfig(**kwargs)
    assert field in str(e.value)


def test_gpu_block_sizes_need_only_a_multiple_of_16() -> None:
    assert EngineConfig(kind="vllm", on_gpu=True, block_size=16).block_size == 16
    assert EngineConfig(kind="sim", block_size=16).block_size == 16
