"""Trace-driven cache simulation: replay a trace's block accesses through an eviction policy.

Counting follows an engine's prefix cache and the trace README's reference figures:

- a request hits the leading run of its ``hash_ids`` that are resident when it arrives;
  the hit rate is hit blocks over all blocks of all requests;
- then, as in vLLM's offload manager, it stores its missing blocks head to tail (each offered
  to the policy's admission check first), and whenever the cache is over capacity the policy
  evicts the excess right away; nothing is pinned, so a policy may evict a block of the
  request being stored, even the one just stored (a bypass);
- when it finishes, the policy gets its resident blocks in prefix order and the reused ones
  among them (``end_request``, vLLM's ``on_request_finished``): lookups alone change nothing.

The cache (this module) owns residency and capacity; the policy only picks victims.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.traces import TraceRequest
from loadgen.workloads import ideal_hit_rate
from policies.base import NO_PROTECTION, EvictionPolicy, OfflinePolicy, RequestInfo
from policies.registry import create_policy


@dataclass(slots=True, frozen=True)
class SimResult:
    policy: str
    capacity_blocks: int
    hit_rate: float
    hit_blocks: int
    total_blocks: int
    evictions: int
    seconds: float


def request_info(req: TraceRequest, index: int) -> RequestInfo:
    return RequestInfo(
        category=req.category,
        turn=req.turn or 1,
        session_id=req.chat_id,
        parent_id=req.parent_chat_id,
        index=index,
        num_blocks=len(req.hash_ids),
    )


def infinite_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Hit rate of an unbounded cache over blocks: the ceiling for every policy."""
    return ideal_hit_rate(requests, 1)[0]


def replay(requests: Sequence[TraceRequest], policy: EvictionPolicy, name: str = "") -> SimResult:
    """Replay ``requests`` (time-ordered) through ``policy`` at its ``capacity_blocks``."""
    start = time.perf_counter()
    if isinstance(policy, OfflinePolicy):
        policy.load_future([req.hash_ids for req in requests])
    cap = policy.capacity_blocks
    resident: set[int] = set()
    add, discard = resident.add, resident.discard
    insert, evict = policy.insert, policy.evict
    begin, end = policy.begin_request, policy.end_request
    admit = None if type(policy).admit is EvictionPolicy.admit else policy.admit
    hits = total = evictions = size = 0
    for index, req in enumerate(requests):
        now = req.timestamp_s
        ids = req.hash_ids
        info = request_info(req, index)
        begin(info, now)
        n = len(ids)
        total += n
        k = 0
        while k < n and ids[k] in resident:
            k += 1
        hits += k
        reused = list(ids[:k])
        evicted_before = evictions
        parent = ids[k - 1] if k else None
        for offset in range(k, n):
            h = ids[offset]
            if h in resident:
                reused.append(h)
            elif admit is None or admit(h, parent, offset, now):
                insert(h, now, parent, offset)
                add(h)
                size += 1
                if size > cap:
                    victims = evict(size - cap, NO_PROTECTION)
                    if victims is None:
                        raise RuntimeError(f"{policy.name}: evict() failed with nothing pinned")
                    evictions += len(victims)
                    size -= len(victims)
                    for v in victims:
                        discard(v)
            parent = h
        keys: Sequence[int] = ids
        if evictions != evicted_before or admit is not None:
            keys = [h for h in ids if h in resident]
            reused = [h for h in reused if h in resident]
        end(info, keys, reused, now)
    if len(resident) != len(policy):
        raise RuntimeError(
            f"{policy.name}: policy tracks {len(policy)} keys, cache holds {len(resident)}"
        )
    return SimResult(
        name or policy.name,
        cap,
        hits / total if total else 0.0,
        hits,
        total,
        evictions,
        time.perf_counter() - start,
    )


def simulate(
    requests: Sequence[TraceRequest], policies: Sequence[str], capacities: Sequence[int]
) -> list[SimResult]:
    """Every policy at every capacity, policy-major."""
    return [
        replay(requests, create_policy(name, cap), name) for name in policies for cap in capacities
    ]


__all__ = ["SimResult", "infinite_hit_rate", "replay", "simulate"]
