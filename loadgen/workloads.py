"""Send schedules: which request goes out when, relative to the start of a run.

A schedule is a list of ``Planned`` items in send order. Offsets come from the trace's own
timestamps (scaled by ``time_scale``) or, with a rate override, from Poisson or constant
arrivals at ``rate`` req/s that keep the trace's order and content. ``duration_s`` and
``max_requests`` cut the schedule. Multi-turn sessions (Bailian ``parent_chat_id``) are linked
so the runner can wait for a parent's reply in live mode.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.traces import TraceRequest

ARRIVALS: tuple[str, ...] = ("poisson", "constant")


@dataclass(slots=True, frozen=True)
class Planned:
    """One request of a schedule: intended send offset (s from start), the request, and the
    schedule index of its parent turn (None for a first turn or a parent outside the schedule)."""

    index: int
    offset_s: float
    req: TraceRequest
    parent: int | None = None


def arrival_offsets(n: int, rate: float, arrival: str, seed: int) -> np.ndarray:
    """``n`` send offsets in seconds at ``rate`` req/s; the first request goes at 0."""
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"--rate must be a positive number of requests per second, got {rate}")
    if arrival not in ARRIVALS:
        raise ValueError(f"--arrival must be one of {', '.join(ARRIVALS)}; got {arrival!r}")
    if n == 0:
        return np.zeros(0)
    if arrival == "constant":
        return np.arange(n, dtype=np.float64) / rate
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def build_schedule(
    requests: Sequence[TraceRequest],
    *,
    time_scale: float = 1.0,
    rate: float | None = None,
    arrival: str = "poisson",
    duration_s: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
) -> list[Planned]:
    """Turn requests (sorted by time) into a schedule.

    ``time_scale`` multiplies the trace's gaps (0.5 replays twice as fast); ``rate`` replaces
    them with synthetic arrivals. Requests with equal timestamps get equal offsets.
    """
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"--time-scale must be > 0, got {time_scale}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"--duration must be > 0 seconds, got {duration_s}")
    if max_requests is not None and max_requests <= 0:
        raise ValueError(f"--max-requests must be > 0, got {max_requests}")
    reqs = list(requests[:max_requests] if max_requests is not None else requests)
    if rate is not None:
        offsets = arrival_offsets(len(reqs), rate, arrival, seed).tolist()
    else:
        t0 = reqs[0].timestamp_s if reqs else 0.0
        offsets = [(r.timestamp_s - t0) * time_scale for r in reqs]
    plan: list[Planned] = []
    for i, (req, off) in enumerate(zip(reqs, offsets, strict=True)):
        if duration_s is not None and off >= duration_s:
            break
        plan.append(Planned(i, off, req))
    return link_sessions(plan)


def link_sessions(plan: Iterable[Planned]) -> list[Planned]:
    """Resolve each request's ``parent_chat_id`` to the schedule index of that parent turn."""
    by_chat: dict[int, int] = {}
    out: list[Planned] = []
    for i, p in enumerate(plan):
        parent = None
        r = p.req
        if r.parent_chat_id is not None:
            parent = by_chat.get(r.parent_chat_id)
        if r.chat_id is not None:
            by_chat[r.chat_id] = i
        out.append(Planned(i, p.offset_s, r, parent))
    return out


def ideal_hits(requests: Iterable[TraceRequest]) -> Iterator[tuple[TraceRequest, int]]:
    """Each request with its hit in an infinite cache, in blocks: the leading run of its
    ``hash_ids`` that earlier requests carried."""
    seen: set[int] = set()
    for r in requests:
        ids = r.hash_ids
        n = len(ids)
        k = 0
        while k < n and ids[k] in seen:
            k += 1
        seen.update(ids)
        yield r, k


def ideal_hit_rate(requests: Iterable[TraceRequest], block_size: int) -> tuple[float, float]:
    """Hit rate with an infinite cache (``ideal_hits``). Returns ``(over blocks, over
    tokens)``; the block figure counts every block (as the traces README does), the token figure
    weights the partial last block by its length."""
    hit_blocks = total_blocks = hit_tokens = total_tokens = 0
    for r, k in ideal_hits(requests):
        total_blocks += len(r.hash_ids)
        hit_blocks += k
        total_tokens += r.input_length
        hit_tokens += min(r.input_length, k * block_size)
    if total_blocks == 0:
        return 0.0, 0.0
    return hit_blocks / total_blocks, hit_tokens / total_tokens
