"""CPU-tier KV events as vLLM 0.32 emits them, through the translator into the cache map.

The events come from vLLM's own code, not hand-written: GPU ``BlockStored``/``BlockRemoved`` from
its ``KVCacheManager`` (block pool), CPU ones from the scheduler-side ``OffloadingConnector``
built from ``engines.offload``'s config (its CPU manager with our policy, and its events tracker),
driven the way ``_build_store_jobs`` and the worker's completion drive them. Batches are encoded
as the ZMQ publisher sends them. A chunk of k GPU blocks on the CPU tier must land in the map on
tier CPU for each of its k blocks, outlive the GPU copies, and leave with its CPU eviction."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import AsyncEngineArgs  # noqa: E402
from vllm.config import KVEventsConfig, KVTransferConfig  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request  # noqa: E402

from cachemap import CacheMap, InstanceId, Match, Tier, block_hashes, salt_hash  # noqa: E402
from cachemap.ingest import CacheMapIngestor, EngineEventTranslator  # noqa: E402
from engines import offload  # noqa: E402
from engines.config import CpuTierConfig  # noqa: E402
from engines.tiny_model import build_tiny_model  # noqa: E402
from tests.vllm_support import kv_cache_config  # noqa: E402

BLOCK = 32
MODEL = "tiny-model"
INSTANCE = InstanceId("gpu-0")
GPU_BLOCKS = 16
_encoder = msgspec.msgpack.Encoder()


class Engine:
    """vLLM's GPU KV cache manager and scheduler-side offloading connector for one engine, and
    a translator + map fed with the batches they publish."""

    def __init__(self, model: str, chunk_blocks: int, self_describing: bool, **tr: Any) -> None:
        tier = CpuTierConfig(blocks=4, policy="wa")  # four GPU blocks' worth of chunks
        cfg = offload.offloading_connector_config(
            tier, BLOCK, kv_bytes_per_token=512, blocks_per_chunk=chunk_blocks
        )
        cfg["kv_connector_extra_config"]["self_describing_kv_events"] = self_describing
        args = AsyncEngineArgs(
            model=model,
            block_size=BLOCK,
            enable_prefix_caching=True,
            max_model_len=8 * BLOCK,
            enforce_eager=True,
            kv_transfer_config=KVTransferConfig(**cfg),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        )
        vc = args.create_engine_config()
        kcc = kv_cache_config(vc, BLOCK, GPU_BLOCKS)
        self.gpu = KVCacheManager(
            kcc,
            max_model_len=8 * BLOCK,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.connector = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)
        self.sched = self.connector.connector_scheduler
        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(BLOCK, sha256_cbor)
        self.map = CacheMap()
        self.ingest = CacheMapIngestor(self.map)
        self.tr = EngineEventTranslator(
            INSTANCE, MODEL, BLOCK, cpu_blocks_per_chunk=chunk_blocks, **tr
        )
        self.seq = 0

    def request(self, rid: str, tokens: list[int]) -> Request:
        """Admit and compute a prompt on the GPU (its full blocks are cached: BlockStored)."""
        req = Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher)
        blocks, hit, _ = self.gpu.get_computed_blocks(req)
        assert self.gpu.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        self.connector.on_new_request(req)
        return req

    def offload(self, req: Request) -> None:
        """The request's full chunks to the CPU tier, as ``_build_store_jobs`` prepares and
        records them and the worker's completion reports them (CPU BlockStored)."""
        status = self.sched._req_status[req.request_id]
        status.update_offload_keys()
        keys = list(status.group_states[0].offload_keys)
        out = self.sched.manager.prepare_store(keys, status.req_context)
        assert out is not None
        group = self.sched.config.kv_group_configs[0]
        for idx, key in enumerate(keys):
            if key in out.keys_to_store:
                self.sched._events_tracker.record_store(req, group, idx, key)
        self.sched.manager.complete_store(out.keys_to_store, status.req_context)

    def finish(self, req: Request) -> None:
        self.gpu.free(req)
        self.connector.request_finished(req, [])

    def evict_gpu(self) -> None:
        """Take every free block, evicting the cached ones (GPU BlockRemoved), and give them
        back."""
        pool = self.gpu.block_pool
        pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))

    def events(self) -> list[Any]:
        """One scheduler step's batch, in vLLM's order: block pool first, then the connector."""
        return [*self.gpu.take_events(), *self.connector.take_events()]

    def publish(self, events: list[Any]) -> None:
        payload = _encoder.encode(KVEventBatch(ts=0.0, events=events))
        msg = self.tr.feed(payload, self.seq, ts=0.0)
        self.seq += 1
        if msg is not None:
            assert self.ingest.apply(msg) is None

    def match(self, tokens: list[int]) -> Match | None:
        return self.map.match(block_hashes(tokens, BLOCK, salt_hash(MODEL))).get(INSTANCE)


@pytest.fixture(scope="module")
def model() -> str:
    return str(build_tiny_model())


PROMPT = list(range(1000, 1000 + 4 * BLOCK + 1))  # four full blocks and one token
OTHER = list(range(5000, 5000 + 4 * BLOCK + 1))


@pytest.mark.parametrize(
    ("chunk_blocks", "self_describing"),
    [(1, True), (2, True), (2, False)],
    ids=["chunk1", "chunk2", "chunk2-placeholder"],
)
def test_gpu_store_cpu_store_gpu_removal_leaves_the_blocks_on_cpu(
    model: str, chunk_blocks: int, self_describing: bool
) -> None:
    e = Engine(model, chunk_blocks, self_describing)
    req = e.request("r1", PROMPT)
    gpu_stored = e.events()
    assert [type(ev) for ev in gpu_stored] == [BlockStored] * len(gpu_stored)
    assert sum(len(ev.block_hashes) for ev in gpu_stored) == 4
    e.publish(gpu_stored)
    assert e.match(PROMPT) == Match(4, 4)

    e.offload(req)
    cpu_stored = e.events()
    assert all(isinstance(ev, BlockStored) and ev.medium == "CPU" for ev in cpu_stored)
    assert len(cpu_stored) == 4 // chunk_blocks  # one event per chunk
    per_event = chunk_blocks if self_describing else 1  # a placeholder names the last block only
    assert all(len(ev.block_hashes) == per_event for ev in cpu_stored)
    assert all(bool(ev.token_ids) is self_describing for ev in cpu_stored)
    e.publish(cpu_stored)
    e.finish(req)
    e.evict_gpu()
    gpu_removed = e.events()
    assert {ev.medium for ev in gpu_removed} == {"GPU"}
    assert all(isinstance(ev, BlockRemoved) for ev in gpu_removed)
    e.publish(gpu_removed)
    assert e.match(PROMPT) == Match(0, 4)  # all four blocks, on the CPU tier only
    ours = block_hashes(PROMPT, BLOCK, salt_hash(MODEL))
    assert all(e.map.holders(h) == {INSTANCE: frozenset({Tier.CPU})} for h in ours)
    assert not e.tr.skipped

    other = e.request("r2", OTHER)  # its chunks evict the first prompt's from the full tier
    e.offload(other)
    e.finish(other)
    batch = e.events()
    assert any(isinstance(ev, BlockRemoved) and ev.medium == "CPU" for ev in batch)
    e.publish(batch)
    assert e.match(PROMPT) is None
    assert e.match(OTHER) == Match(4, 4)
    assert not e.tr.skipped
    e.map.check_integrity()


def test_self_describing_chunk_lands_even_after_its_gpu_blocks_are_gone(model: str) -> None:
    """The store finishes after the GPU evicted the blocks (one step's batch: block pool
    removals first, then the connector's stores). The chunk's own tokens and parent place it."""
    e = Engine(model, 2, True)
    req = e.request("r1", PROMPT)
    e.publish(e.events())
    e.offload(req)
    e.finish(req)
    e.evict_gpu()
    batch = e.events()
    kinds = [(type(ev).__name__, ev.medium) for ev in batch]
    assert kinds.index(("BlockStored", "CPU")) > kinds.index(("BlockRemoved", "GPU"))
    e.publish(batch)
    assert e.match(PROMPT) == Match(0, 4)
    assert not e.tr.skipped


def test_a_cache_reset_publishes_no_cpu_removals(model: str) -> None:
    """vLLM's reset_prefix_cache with the connector: AllBlocksCleared from the block pool and
    nothing from the CPU tier, so AllBlocksCleared alone must empty every tier in the map."""
    e = Engine(model, 1, True)
    req = e.request("r1", PROMPT)
    e.offload(req)
    e.finish(req)
    e.publish(e.events())
    assert e.match(PROMPT) == Match(4, 4)
    assert e.gpu.reset_prefix_cache()
    assert e.connector.reset_cache()
    batch = e.events()
    assert [type(ev) for ev in batch] == [AllBlocksCleared]
    e.publish(batch)
    assert e.match(PROMPT) is None
    assert len(e.tr) == 0
