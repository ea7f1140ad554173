"""vLLM's ``kv_transfer_config`` for a CPU KV tier: vLLM 0.32's ``OffloadingConnector`` with a
kvroute eviction policy, alone or beside another connector (the PD connector) in ``MultiConnector``.

What vLLM 0.32 does with these keys (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/
config.py``, ``vllm/v1/kv_offload/cpu/spec.py``, ``vllm/v1/kv_offload/cpu/policies/factory.py``):

- ``block_size`` in ``kv_connector_extra_config`` is the offload chunk in tokens; it must be a
  multiple of the GPU KV block size (vLLM raises ``ValueError`` otherwise; ``blocks_per_chunk`` is
  the same in blocks, and giving both is an error). The tier stores, looks up and evicts whole
  chunks, each keyed by the hash of its last GPU block.
- ``cpu_bytes_to_use`` sizes the tier across all workers: vLLM keeps
  ``cpu_bytes_to_use // round_up(KV bytes of one chunk on all workers, host page size)`` chunks.
- ``eviction_policy`` is a class name looked up in ``cache_policy_module_path``; vLLM builds it
  with ``cache_capacity`` (chunks) alone and hands it nothing else of this config. The policy's
  options therefore travel in the environment variable ``POLICY_OPTIONS_ENV``, which the engine
  core process (where the scheduler and the policy live) inherits from the process that starts
  ``AsyncLLM`` (``policy_options_env``).
- ``offload_prompt_only`` defaults to True in vLLM, so it is always written.
- ``self_describing_kv_events``: CPU-tier ``BlockStored`` events carry every GPU block hash of the
  chunk with its tokens and parent, and ``BlockRemoved`` names them all; without it vLLM emits one
  placeholder per chunk naming only its last engine hash. On, so the cache map can place a chunk
  even when the GPU copy of its blocks was evicted before the store finished.
- ``MultiConnector`` loads a request's KV through the first child that reports tokens for it and
  saves through all; a child config must not carry ``engine_id`` (vLLM passes the parent's one
  beside it and the constructor call fails).

Pure: no vLLM import (the adapter's class names come from ``policies.registry``).
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Mapping
from typing import Any

from engines.config import CpuTierConfig
from policies.registry import POLICY_OPTIONS_ENV, engine_policy_class

OFFLOADING_CONNECTOR = "OffloadingConnector"
MULTI_CONNECTOR = "MultiConnector"
POLICY_MODULE = "policies.vllm_adapter"
# vLLM rounds each chunk's bytes up to this (CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT).
HOST_PAGE_SIZE = mmap.PAGESIZE


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache bytes one token takes across the whole model: K and V of every layer."""
    for name, v in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def cache_policy_class(policy: str) -> str:
    """The ``policies.vllm_adapter`` class vLLM loads for kvroute policy ``policy``."""
    try:
        return engine_policy_class(policy)
    except ValueError as e:
        raise ValueError(f"cpu_tier.policy: {e}") from None


def cpu_bytes_to_use(
    cpu_tier: CpuTierConfig,
    block_size: int,
    kv_bytes_per_token: int | None = None,
    blocks_per_chunk: int = 1,
) -> int:
    """vLLM's ``cpu_bytes_to_use`` for the tier: ``gib`` as bytes, or, for ``blocks``, exactly
    enough bytes for ``blocks // blocks_per_chunk`` chunks (at least one) at vLLM's page
    alignment. ``kv_bytes_per_token`` (the whole model's) is needed only for ``blocks``."""
    if cpu_tier.gib is not None:
        return int(cpu_tier.gib * (1 << 30))
    if kv_bytes_per_token is None or kv_bytes_per_token <= 0:
        raise ValueError(
            f"kv_bytes_per_token: a positive value is needed to size cpu_tier.blocks, "
            f"got {kv_bytes_per_token}"
        )
    assert cpu_tier.blocks is not None
    chunk = block_size * blocks_per_chunk * kv_bytes_per_token
    aligned = -(-chunk // HOST_PAGE_SIZE) * HOST_PAGE_SIZE
    return max(1, cpu_tier.blocks // blocks_per_chunk) * aligned


def offloading_connector_config(
    cpu_tier: CpuTierConfig,
    block_size: int,
    *,
    kv_bytes_per_token: int | None = None,
    blocks_per_chunk: int = 1,
) -> dict[str, Any]:
    """``kv_transfer_config`` (as a dict for ``vllm.config.KVTransferConfig(**d)``) of vLLM's
    ``OffloadingConnector`` holding ``cpu_tier`` with kvroute's policy (imports vLLM).

    ``block_size``: the engine's GPU KV block size in tokens; ``blocks_per_chunk``: GPU blocks
    per offloaded chunk (1: a chunk is a block, so CPU-tier events map block for block).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if blocks_per_chunk < 1:
        raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    return {
        "kv_connector": OFFLOADING_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cpu_bytes_to_use(
                cpu_tier, block_size, kv_bytes_per_token, blocks_per_chunk
            ),
            "block_size": block_size * blocks_per_chunk,
            "eviction_policy": cache_policy_class(cpu_tier.policy),
            "cache_policy_module_path": POLICY_MODULE,
            "offload_prompt_only": cpu_tier.prompt_only,
            "self_describing_kv_events": True,
        },
    }


def compose_connectors(*configs: Mapping[str, Any]) -> dict[str, Any]:
    """One ``kv_transfer_config`` running every connector in ``configs`` through vLLM's
    ``MultiConnector``, in that order (a ``MultiConnector`` among them is spliced in). vLLM loads
    a request's KV through the first that reports tokens for it, so put the PD connector first:
    a request with remote KV must take it from there. One config is returned as it is."""
    children: list[dict[str, Any]] = []
    for i, cfg in enumerate(configs):
        if not cfg.get("kv_connector"):
            raise ValueError(f"configs[{i}].kv_connector: a connector name is needed")
        if cfg["kv_connector"] == MULTI_CONNECTOR:
            children.extend(
                dict(c) for c in (cfg.get("kv_connector_extra_config") or {}).get("connectors", [])
            )
        else:
            children.append(dict(cfg))
    for i, child in enumerate(children):
        if "engine_id" in child:
            raise ValueError(
                f"connectors[{i}].engine_id: MultiConnector gives each child its own engine_id; "
                "set it on the composed config instead"
            )
    if not children:
        raise ValueError("configs: at least one connector is needed")
    if len(children) == 1:
        return children[0]
    return {
        "kv_connector": MULTI_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": children},
    }


def kv_transfer_config(
    cpu_tier: CpuTierConfig | None,
    block_size: int,
    *,
    kv_bytes_per_token: int | None = None,
    blocks_per_chunk: int = 1,
    other: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The engine's whole ``kv_transfer_config``: ``other`` (another connector's config, e.g.
    the PD connector) and the CPU tier's, composed when both are there; None with neither."""
    configs: list[Mapping[str, Any]] = [other] if other is not None else []
    if cpu_tier is not None:
        configs.append(
            offloading_connector_config(
                cpu_tier,
                block_size,
                kv_bytes_per_token=kv_bytes_per_token,
                blocks_per_chunk=blocks_per_chunk,
            )
        )
    return compose_connectors(*configs) if configs else None


def policy_options_env(cpu_tier: CpuTierConfig) -> dict[str, str]:
    """Environment variables that carry ``cpu_tier.policy_options`` to the adapter class in
    vLLM's engine core process; set them before ``AsyncLLM`` starts."""
    return {
        POLICY_OPTIONS_ENV: json.dumps(
            {cache_policy_class(cpu_tier.policy): dict(cpu_tier.policy_options)}
        )
    }
