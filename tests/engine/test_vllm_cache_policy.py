"""kvroute policies inside vLLM 0.32's CPU offload tier, loaded the way the connector loads them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

from cachemap.hashing import block_hashes, salt_hash
from policies.vllm_adapter import CLASS_NAMES, KvrouteCachePolicy
from policies.wa import WAPolicy

pytestmark = pytest.mark.engine
MODULE = "policies.vllm_adapter"


def _key(i: int):  # type: ignore[no-untyped-def]
    return make_offload_key(i.to_bytes(8, "big"), 0)


def _ctx(req_id: str, category: str = "text_1", now_s: float | None = None) -> ReqContext:
    params: dict[str, object] = {"category": category, "turn": int(category.rsplit("_")[-1])}
    if now_s is not None:
        params["now_s"] = now_s
    return ReqContext(req_id=req_id, kv_transfer_params={"kvroute": params})


def _ready(policy: CachePolicy, i: int) -> ChunkStatus:
    chunk = ChunkStatus(i)
    policy.insert(_key(i), chunk)  # not ready yet: ref_cnt -1, never a victim
    chunk.ref_cnt = 0
    policy.mark_evictable(_key(i))
    return chunk


@pytest.mark.parametrize("class_name", list(CLASS_NAMES))
def test_factory_loads_every_policy_out_of_tree(class_name: str) -> None:
    cls = CachePolicyFactory.get_cache_policy_cls(class_name, MODULE)
    assert issubclass(cls, CachePolicy) and issubclass(cls, KvrouteCachePolicy)
    policy = cls(cache_capacity=8)
    assert policy.cache_capacity == 8 and policy.policy.name == CLASS_NAMES[class_name]


@pytest.mark.parametrize("class_name", list(CLASS_NAMES))
def test_cache_policy_contract(class_name: str) -> None:
    policy = CachePolicyFactory.get_cache_policy_cls(class_name, MODULE)(cache_capacity=6)
    ctx = _ctx("r1", "text_2", now_s=10.0)
    policy.on_store_miss([_key(i) for i in range(6)], ctx)
    chunks = {i: _ready(policy, i) for i in range(5)}
    pending = ChunkStatus(5)
    policy.insert(_key(5), pending)  # store in flight
    assert policy.get(_key(3)) is chunks[3] and policy.get(_key(99)) is None
    policy.touch([_key(0), _key(1)], ctx)
    policy.on_request_finished(
        [[_key(i) for i in range(6)]], {_key(i) for i in range(2, 6)}, {_key(0), _key(1)}, ctx
    )
    # Atomic: 5 evictable chunks, 2 protected, so 4 cannot be freed and nothing changes.
    protected = {_key(0), _key(1)}
    assert policy.evict(4, protected) is None
    assert all(policy.get(_key(i)) is not None for i in range(6))
    policy.mark_non_evictable(_key(2))  # a load in progress pins it
    victims = policy.evict(2, protected)
    assert victims is not None and len(victims) == 2
    got = {k for k, _ in victims}
    assert got == {_key(3), _key(4)}
    assert all(policy.get(k) is None for k in got)
    assert [c for _, c in victims] == [chunks[int.from_bytes(k[:8], "big")] for k, _ in victims]
    assert policy.evict(1, protected) is None  # 2 pinned, 5 in flight, 0 and 1 protected
    policy.mark_evictable(_key(2))
    assert policy.evict(1, protected) == [(_key(2), chunks[2])]
    policy.remove(_key(5))  # a failed store is cleaned up
    assert policy.get(_key(5)) is None
    policy.clear()
    assert policy.get(_key(0)) is None and policy.evict(1, set()) is None


def test_the_request_category_reaches_the_policy() -> None:
    policy = CachePolicyFactory.get_cache_policy_cls("KvrouteWA", MODULE)(cache_capacity=4)
    ctx = _ctx("r1", "file_2", now_s=5.0)
    policy.on_store_miss([_key(1)], ctx)
    _ready(policy, 1)
    policy.on_request_finished([[_key(1)]], {_key(1)}, set(), ctx)
    inner = policy.policy
    assert isinstance(inner, WAPolicy) and "file_2" in inner._cats
    assert len(inner._cats["file_2"].blocks) == 1


@pytest.mark.parametrize(
    "class_name", ["KvrouteS3FIFO", "KvrouteLRU", "KvroutePrefixReuse", "KvroutePrefixOdds"]
)
def test_through_vllms_cpu_offloading_manager(class_name: str) -> None:
    """The real manager drives the policy: stores, evictions, loads and request ends (no
    offsets, no prompt length: prefix-odds sees every new block at depth 0)."""
    manager = CPUOffloadingManager(
        num_chunks=4, cache_policy=class_name, cache_policy_module_path=MODULE, enable_events=True
    )
    hot = [_key(0), _key(1)]
    for r in range(6):
        ctx = _ctx(f"r{r}", "text_1", now_s=float(r))
        manager.on_new_request(ctx)
        keys = [*hot, _key(100 + r)]
        hits = [k for k in hot if manager.lookup(k, ctx) == LookupResult.HIT]
        if hits:
            manager.prepare_load(hits, ctx)
            manager.complete_load(hits, ctx)
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        if r:  # the shared head was reused and is still there
            assert hits == hot
    removed = [k for e in manager.take_events() if e.removed for k in e.keys]
    assert removed and not set(hot) & set(removed)


# -- operator pins (RequestInfo.pin) through vLLM's manager ----------------------------------------

CHUNK = 16  # tokens per offloaded chunk


def _prompt(tokens: list[int], cache_salt: str | None = None) -> list:  # type: ignore[type-arg]
    """The prompt's offload keys, chained over its tokens the way block hashes chain."""
    root = salt_hash("m", None, cache_salt)
    return [make_offload_key(h.to_bytes(8, "big"), 0) for h in block_hashes(tokens, CHUNK, root)]


def _serve(manager: CPUOffloadingManager, keys: list, req_id: str, now_s: float, **hints) -> int:  # type: ignore[no-untyped-def,type-arg]
    """One request through the manager as vLLM's connector drives it: load its leading hits,
    store the rest (a refused store is skipped, as vLLM does), finish. Returns the hits."""
    ctx = ReqContext(
        req_id=req_id,
        kv_transfer_params={"kvroute": {"category": "text_1", "now_s": now_s, **hints}},
    )
    manager.on_new_request(ctx)
    hits = 0
    while hits < len(keys) and manager.lookup(keys[hits], ctx) == LookupResult.HIT:
        hits += 1
    if hits:
        manager.prepare_load(keys[:hits], ctx)
        manager.complete_load(keys[:hits], ctx)
    out = manager.prepare_store(keys[hits:], ctx)
    if out is not None:
        manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return hits


def _resident(manager: CPUOffloadingManager, keys: list) -> int:  # type: ignore[type-arg]
    ctx = ReqContext(req_id="probe")
    return sum(manager.lookup(k, ctx) == LookupResult.HIT for k in keys)


def test_a_pinned_system_prompt_survives_a_flood_and_unpins() -> None:
    """WA through vLLM's manager: a pinned 2,000-token system prompt outlives a flood of other
    prompts 12x the tier and is a full hit after it (loading it, a transfer pin that comes and
    goes, leaves the operator pin alone); its unpinned twin (same tokens, another cache salt)
    is flooded out. Once unpinned, it goes like anything else."""
    manager = CPUOffloadingManager(
        num_chunks=400, cache_policy="KvrouteWA", cache_policy_module_path=MODULE
    )
    system = list(range(1, 2_001))
    pinned, control = _prompt(system), _prompt(system, cache_salt="control")
    assert len(pinned) == len(control) == 125
    t = 0.0
    assert _serve(manager, pinned, "pin", t, pin=True) == 0
    assert _serve(manager, control, "control", t + 1) == 0
    policy = manager._policy
    assert isinstance(policy, KvrouteCachePolicy) and policy.operator_pins.keys == set(pinned)

    def flood(tag: str, n: int = 40) -> None:
        nonlocal t
        for i in range(n):  # 40 prompts of 125 chunks: 5,000 chunks through a 400-chunk tier
            t += 1.0
            _serve(
                manager, _prompt([10_000 + 97 * i + j for j in range(2_000)], tag), tag + str(i), t
            )

    flood("a")
    assert _resident(manager, pinned) == 125
    assert _resident(manager, control) == 0
    t += 1.0
    assert _serve(manager, pinned, "again", t) == 125  # a full hit, loaded (transfer pins)
    flood("b")
    assert _resident(manager, pinned) == 125
    assert _serve(manager, pinned, "unpin", t + 1, pin=False) == 125
    assert not policy.operator_pins
    flood("c")
    assert _resident(manager, pinned) == 0


def test_pins_refuse_stores_they_cannot_make_room_for_and_clear_drops_them() -> None:
    """With every resident chunk pinned, eviction finds nothing: vLLM's prepare_store refuses
    the store (None) and the pinned chunks stay. A cache reset (clear) drops the pins."""
    manager = CPUOffloadingManager(
        num_chunks=4, cache_policy="KvrouteLRU", cache_policy_module_path=MODULE
    )
    pinned = _prompt(list(range(64)))
    assert _serve(manager, pinned, "pin", 0.0, pin=True) == 0
    ctx = ReqContext(req_id="other", kv_transfer_params={"kvroute": {"now_s": 1.0}})
    manager.on_new_request(ctx)
    other = _prompt(list(range(500, 516)))
    assert manager.prepare_store(other, ctx) is None
    assert _resident(manager, pinned) == 4
    manager.reset_cache()
    policy = manager._policy
    assert isinstance(policy, KvrouteCachePolicy) and not policy.operator_pins
    assert _serve(manager, pinned, "after", 2.0) == 0
    assert _serve(manager, other, "other2", 3.0) == 0  # unpinned now: LRU makes room
    assert _resident(manager, pinned) == 3


def test_an_interleaved_request_is_counted_once() -> None:
    """vLLM calls the policy for request A, then B, then A again (stores and touches interleave):
    LPC must count A once, or its continuation odds are diluted by its own re-entries."""
    policy = CachePolicyFactory.get_cache_policy_cls("KvrouteLPC", MODULE)(cache_capacity=8)
    a = ReqContext(
        req_id="a", kv_transfer_params={"kvroute": {"category": "text_1", "session_id": 1}}
    )
    b = ReqContext(
        req_id="b", kv_transfer_params={"kvroute": {"category": "text_1", "session_id": 2}}
    )
    for i, ctx in enumerate((a, b, a, b, a)):
        policy.on_store_miss([_key(i)], ctx)
    predictor = policy.policy.predictor  # type: ignore[attr-defined]
    assert predictor._seen == {"text_1": 2}
