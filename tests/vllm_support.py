"""Helpers for tests that build vLLM's own objects without starting an engine (not fixtures)."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig


def kv_cache_config(vc: VllmConfig, block_size: int, blocks: int) -> KVCacheConfig:
    """vLLM's own KV cache layout and sizing of ``blocks`` blocks for ``vc``'s model (what the
    engine core does with the specs its workers report)."""
    mc = vc.model_config
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        dtype=mc.dtype,
    )
    layers = {
        f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_total_num_hidden_layers())
    }
    resolve_kv_cache_layout(vc, [["LBNHC", "LBHNC"]], layers.values())
    per_block = spec.page_size_bytes * len(layers)
    return get_kv_cache_configs(vc, [layers], [blocks * per_block])[0]
