"""``engines.offload`` read back by vLLM 0.32's own classes: the ``kv_transfer_config`` it writes
goes through ``KVTransferConfig``, the engine-args config, vLLM's KV cache sizing and
``KVConnectorFactory`` to a scheduler-side ``OffloadingConnector`` whose CPU manager runs our
policy class with the capacity we asked for and the options we set; composed with a PD
connector it becomes vLLM's ``MultiConnector`` with both children. The worker side (the copies)
is where the CPU platform refuses, and that is as far as this machine goes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import AsyncEngineArgs  # noqa: E402
from vllm.config import KVEventsConfig, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from engines import offload  # noqa: E402
from engines.base import EngineError  # noqa: E402
from engines.config import CpuTierConfig  # noqa: E402
from engines.tiny_model import build_tiny_model  # noqa: E402
from engines.vllm_engine import VllmEngine  # noqa: E402
from policies.vllm_adapter import (  # type: ignore[attr-defined]  # noqa: E402
    CLASS_NAMES,
    POLICY_OPTIONS_ENV,
    KvrouteCachePolicy,
    KvrouteLRU,
    KvrouteWA,
)
from tests import vllm_support  # noqa: E402

BLOCK = 32  # the vLLM CPU build's block sizes are multiples of 32
ON_CPU = not (current_platform.is_cuda_alike() or current_platform.is_xpu())


@pytest.fixture(scope="module")
def model() -> str:
    return str(build_tiny_model())


def vllm_config(model: str, kv_transfer: dict[str, Any]) -> VllmConfig:
    """vLLM's config for the tiny model with ``kv_transfer`` (``--kv-transfer-config``)."""
    args = AsyncEngineArgs(
        model=model,
        block_size=BLOCK,
        enable_prefix_caching=True,
        max_model_len=2048,
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(**kv_transfer),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    return args.create_engine_config()


def kv_cache_config(vc: VllmConfig, blocks: int = 128) -> KVCacheConfig:
    return vllm_support.kv_cache_config(vc, BLOCK, blocks)


def scheduler_connector(vc: VllmConfig) -> Any:
    """The connector vLLM's scheduler would build from ``vc``."""
    return KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kv_cache_config(vc))


@pytest.mark.parametrize(
    ("tier", "chunk_blocks"),
    [
        (CpuTierConfig(blocks=100, policy="wa", policy_options={"window": 500}), 1),
        (CpuTierConfig(blocks=100, policy="wa", policy_options={"window": 500}), 2),
        (CpuTierConfig(gib=0.01, policy="wa", policy_options={"window": 500}, prompt_only=True), 1),
    ],
    ids=["blocks", "blocks-2-per-chunk", "gib"],
)
def test_vllm_builds_our_policy_from_the_engines_config(
    model: str, tier: CpuTierConfig, chunk_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = VllmEngine(
        model, "v-0", block_size=BLOCK, cpu_tier=tier, cpu_chunk_blocks=chunk_blocks
    )
    cfg = engine.connector_config()
    assert cfg is not None
    extra = cfg["kv_connector_extra_config"]
    assert extra["block_size"] == BLOCK * chunk_blocks
    assert extra["offload_prompt_only"] is tier.prompt_only
    for k, v in offload.policy_options_env(tier).items():
        monkeypatch.setenv(k, v)  # what start() sets before AsyncLLM spawns the engine core
    vc = vllm_config(model, cfg)
    kcc = kv_cache_config(vc)
    off = build_offloading_config(vc, kcc)
    # Our KV bytes per token (from vLLM's model config) is vLLM's page size per token.
    assert off.worker_kv_bytes_per_block == BLOCK * engine.kv_bytes_per_token()
    assert off.cache.blocks_per_chunk == chunk_blocks
    assert type(OffloadingSpecFactory.create_spec(off)) is CPUOffloadingSpec
    conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)
    assert isinstance(conn, OffloadingConnector)
    policy = conn.connector_scheduler.manager._policy
    assert type(policy) is KvrouteWA and isinstance(policy, KvrouteCachePolicy)
    chunk_bytes = off.worker_kv_bytes_per_block * chunk_blocks
    expected = (
        tier.blocks // chunk_blocks
        if tier.blocks is not None
        else int(tier.gib * (1 << 30)) // chunk_bytes  # type: ignore[operator]
    )
    assert policy.cache_capacity == expected == policy.policy.capacity_blocks
    assert policy.policy.window == 500  # type: ignore[attr-defined]
    assert conn.connector_scheduler.config.offload_prompt_only is tier.prompt_only
    assert conn.connector_scheduler._events_tracker.self_describing_enabled


def test_the_chunk_must_be_a_multiple_of_the_gpu_block(model: str) -> None:
    """vLLM's rule for ``block_size`` (which ``engines.offload`` always meets)."""
    cfg = offload.offloading_connector_config(CpuTierConfig(gib=0.01), BLOCK)
    cfg["kv_connector_extra_config"]["block_size"] = BLOCK + 16
    vc = vllm_config(model, cfg)
    with pytest.raises(ValueError, match="must be a multiple of the GPU KV cache block size"):
        build_offloading_config(vc, kv_cache_config(vc))


def test_composed_with_the_pd_connector_vllm_runs_both(model: str) -> None:
    """PD connector first (a request with remote KV loads it from there), the CPU tier second;
    vLLM's MultiConnector builds both children, our policy in the second."""
    pd = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    tier = CpuTierConfig(blocks=64, policy="s3-fifo")
    cfg = offload.kv_transfer_config(tier, BLOCK, kv_bytes_per_token=512, other=pd)
    assert cfg is not None and cfg["kv_connector"] == "MultiConnector"
    vc = vllm_config(model, cfg)
    assert vc.kv_transfer_config is not None and vc.kv_transfer_config.kv_role == "kv_both"
    assert MultiConnector.all_children_support_hma(vc.kv_transfer_config)
    conn = scheduler_connector(vc)
    assert isinstance(conn, MultiConnector)
    first, second = conn.sub_connectors
    assert type(first) is KVConnectorFactory.get_connector_class(KVTransferConfig(**pd))
    assert isinstance(second, OffloadingConnector)
    policy = second.connector_scheduler.manager._policy
    assert type(policy).__name__ == "KvrouteS3FIFO" and policy.cache_capacity == 64
    # A MultiConnector among the configs is spliced in, not nested.
    again = offload.compose_connectors(
        cfg, {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    )
    assert [c["kv_connector"] for c in again["kv_connector_extra_config"]["connectors"]] == [
        "NixlConnector",
        "OffloadingConnector",
        "ExampleConnector",
    ]


def test_a_child_engine_id_breaks_vllms_multiconnector_so_compose_refuses_it(model: str) -> None:
    pd = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "engine_id": "x"}
    off = offload.offloading_connector_config(
        CpuTierConfig(blocks=8), BLOCK, kv_bytes_per_token=512
    )
    with pytest.raises(ValueError, match=r"connectors\[0\]\.engine_id"):
        offload.compose_connectors(pd, off)
    by_hand = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [pd, off]},
    }
    with pytest.raises(TypeError, match="engine_id"):
        scheduler_connector(vllm_config(model, by_hand))


@pytest.mark.skipif(not ON_CPU, reason="the CPU platform's refusal")
def test_the_cpu_platform_stops_at_the_worker(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On vLLM's CPU build everything above runs, but the worker side refuses to copy blocks;
    ``VllmEngine`` says so before spawning anything."""
    tier = CpuTierConfig(blocks=16)
    cfg = offload.offloading_connector_config(tier, BLOCK, kv_bytes_per_token=512)
    vc = vllm_config(model, cfg)
    spec = OffloadingSpecFactory.create_spec(build_offloading_config(vc, kv_cache_config(vc)))
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU GPUs"):
        spec.get_worker(None)
    monkeypatch.delenv(POLICY_OPTIONS_ENV, raising=False)
    engine = VllmEngine(model, "v-0", block_size=BLOCK, kv_space_gib=None, cpu_tier=tier)
    with pytest.raises(EngineError, match="CUDA-alike"):
        asyncio.run(engine.start())


def test_class_names_sizes_and_alignment() -> None:
    for cls_name, name in CLASS_NAMES.items():
        assert offload.cache_policy_class(name) == cls_name
    with pytest.raises(ValueError, match=r"cpu_tier\.policy: policy 'belady' needs the future"):
        offload.cache_policy_class("belady")
    # the registry's spelling rules: a name the config accepts, the engine can run
    assert offload.cache_policy_class(CpuTierConfig(blocks=4, policy=" LRU").policy) == "KvrouteLRU"
    assert offload.HOST_PAGE_SIZE == CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    tier = CpuTierConfig(blocks=10)
    # 10 blocks of 16 tokens at 100 B/token: 1,600 B per chunk, a page each; in chunks of 3
    # blocks, 3 chunks of 4,800 B, two pages each (vLLM pads every chunk to whole pages).
    assert offload.cpu_bytes_to_use(tier, 16, 100) == 10 * offload.HOST_PAGE_SIZE
    assert offload.cpu_bytes_to_use(tier, 16, 100, blocks_per_chunk=3) == 6 * offload.HOST_PAGE_SIZE
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        offload.cpu_bytes_to_use(tier, 16)
    assert offload.cpu_bytes_to_use(CpuTierConfig(gib=1.5), 16) == 3 << 29
    assert offload.kv_transfer_config(None, 16) is None
    assert offload.kv_bytes_per_token(32, 8, 128, 2) == 131072  # Llama-3.1-8B in bf16


def test_policy_options_reach_the_adapter_only_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = CpuTierConfig(blocks=8, policy="wa", policy_options={"min_samples": 5})
    env = offload.policy_options_env(tier)
    assert json.loads(env[POLICY_OPTIONS_ENV]) == {"KvrouteWA": {"min_samples": 5}}
    monkeypatch.setenv(POLICY_OPTIONS_ENV, env[POLICY_OPTIONS_ENV])
    assert KvrouteWA(cache_capacity=8).policy.min_samples == 5
    assert KvrouteLRU(cache_capacity=8).cache_capacity == 8  # options are keyed by class
    lru = CpuTierConfig(blocks=8, policy="lru")
    assert offload.policy_options_env(lru) == {POLICY_OPTIONS_ENV: '{"KvrouteLRU": {}}'}
    monkeypatch.setenv(POLICY_OPTIONS_ENV, '{"KvrouteWA": {"no_such": 1}}')
    with pytest.raises(ValueError, match=rf"{POLICY_OPTIONS_ENV}\['KvrouteWA'\]"):
        KvrouteWA(cache_capacity=8)
    monkeypatch.setenv(POLICY_OPTIONS_ENV, "{not json")
    with pytest.raises(ValueError, match=f"{POLICY_OPTIONS_ENV}: not JSON"):
        KvrouteWA(cache_capacity=8)
