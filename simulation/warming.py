"""Which prefixes the cluster simulator warms on an engine that joins (KV-aware scale-up,
``SimSettings.warm_prefixes``) and hands over to the survivors when one leaves (KV-aware
scale-down, ``SimSettings.handover_prefixes``), by trace block ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.sim.request import SimRequest
from engines.sim.virtual import trace_arrival
from loadgen.workloads import Planned
from simulation.cachesim import request_info


def hot_prefixes(recent: Sequence[Planned], k: int) -> list[tuple[Any, tuple[int, ...]]]:
    """The ``k`` prefixes (trace block ids) of ``recent`` whose caching saves the most prefill:
    per first block, the prefix length maximising length x the requests sharing it (at least
    two), ranked by that; each with one request that carries it (its category and info)."""
    groups: dict[int, list[tuple[int, ...]]] = {}
    carrier: dict[int, Any] = {}
    for p in recent:
        h = p.req.hash_ids
        if h:
            groups.setdefault(h[0], []).append(h)
            carrier.setdefault(h[0], p.req)
    ranked = []
    for first, hs in groups.items():
        if len(hs) < 2:
            continue
        best, best_len, prefix = 0, 0, hs[0][:1]
        length = 1
        while True:
            counts: dict[tuple[int, ...], int] = {}
            for h in hs:
                if len(h) >= length:
                    key = h[:length]
                    counts[key] = counts.get(key, 0) + 1
            if not counts:
                break
            key, c = max(counts.items(), key=lambda kv: kv[1])
            if c < 2:
                break
            if c * length > best:
                best, best_len, prefix = c * length, length, key
            length = length * 2 if length < 8 else length + max(1, length // 4)
        if best_len:
            ranked.append((best, first, prefix))
    ranked.sort(key=lambda x: (-x[0], x[1]))
    return [(carrier[first], prefix) for _, first, prefix in ranked[:k]]


def longest_prompts(served: Sequence[Planned], k: int) -> list[tuple[Any, tuple[int, ...]]]:
    """The ``k`` longest prompts (trace block ids) among ``served`` (a leaving engine's recent
    requests), none a prefix of another taken (a conversation's later turn carries its earlier
    ones), longest first; each with its request (its category and info). A session's next
    turn on a survivor then finds what the leaving engine held for it."""
    taken: list[tuple[Any, tuple[int, ...]]] = []
    for p in sorted(served, key=lambda p: (-len(p.req.hash_ids), -p.offset_s)):
        h = tuple(p.req.hash_ids)
        if h and not any(t[: len(h)] == h for _, t in taken):
            taken.append((p.req, h))
            if len(taken) == k:
                break
    return taken


def warm_request(
    request_id: str,
    at: float,
    carrier: Any,
    blocks: tuple[int, ...],
    trace_block_size: int,
    block_size: int,
    max_model_len: int,
) -> SimRequest | None:
    """A one-token request prefilling the prefix ``blocks`` (trace block ids; ``carrier``: a
    request that holds it, for its category and info), arriving ``at``, as the KV control
    API's warm path sends one; None when the prefix is under one engine block or is refused."""
    length = min(len(blocks) * trace_block_size, max_model_len - 1)
    if length < block_size:
        return None
    try:
        _, req = trace_arrival(
            request_id,
            at,
            length,
            1,
            blocks,
            trace_block_size,
            block_size,
            max_model_len,
            request_info(carrier, -1),
        )
    except ValueError:
        return None
    return req
