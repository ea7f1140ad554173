"""The sim engine's CPU KV tier: blocks evicted from the GPU are offloaded here, and a later
request can load them back instead of recomputing. The tier owns residency, capacity and events;
an ``EvictionPolicy`` from ``policies/`` owns only the order (CONVENTIONS: "the cache owns the
mechanics, the policy owns only the order")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachemap.events import BlockRemoved, BlockStored
from policies.base import EvictionPolicy, OperatorPins, RequestInfo
from policies.registry import create_policy

CPU = "CPU"


class CPUTier:
    """``capacity_blocks`` blocks ordered by ``policy`` (a registered name or an instance).
    ``events`` is the owning block manager's event list (None: events off)."""

    def __init__(
        self,
        capacity_blocks: int,
        policy: str | EvictionPolicy,
        block_size: int,
        events: list[Any] | None,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"cpu capacity_blocks must be > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy = create_policy(policy, capacity_blocks) if isinstance(policy, str) else policy
        self.block_size = block_size
        self.events = events
        self._resident: dict[int, None] = {}
        # NOTE: blocks a request is loading right now; an offload must not evict them.
        self.protected: frozenset[int] = frozenset()
        # Operator pins (KV control API): admitted whatever the policy says, never a victim
        self.pinned = OperatorPins(self.policy)
        self.evictions = 0
        self.prompt_only = False  # offload only blocks of prompt tokens (vLLM's option)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def hashes(self) -> set[int]:
        return set(self._resident)

    def usage(self) -> float:
        return len(self._resident) / self.capacity_blocks

    def pin(self, hashes: Sequence[int]) -> None:
        self.pinned.pin(hashes, self._resident)

    def unpin(self, hashes: Sequence[int], now_s: float) -> None:
        self.pinned.unpin(hashes, self._resident, now_s)

    def clear(self) -> None:
        """Drop every block and pin (vLLM's connector reset: no removal events; the engine's
        ``AllBlocksCleared`` stands for every tier)."""
        self._resident.clear()
        self.pinned.clear()
        self.policy.clear()

    def begin_request(self, info: RequestInfo, now_s: float) -> None:
        self.policy.begin_request(info, now_s)

    def end_request(
        self, info: RequestInfo, hashes: Sequence[int], loaded: Sequence[int], now_s: float
    ) -> None:
        """A request finished: ``hashes`` are all its blocks, ``loaded`` those it read from
        this tier. The policy hears which are resident here, and the reuse (policy contract)."""
        self.policy.resume_request(info, now_s)
        res, pinned = self._resident, self.pinned
        keys = [h for h in hashes if h in res and h not in pinned]
        reused = [h for h in loaded if h in res and h not in pinned]
        self.policy.end_request(info, keys, reused, now_s)

    def offload(
        self,
        h: int,
        parent: int | None,
        depth: int,
        now_s: float,
        tokens: list[int],
        lora_name: str | None = None,
        extra_keys: tuple[Any, ...] | None = None,
        info: RequestInfo | None = None,
    ) -> bool:
        """Store a block the GPU just evicted, evicting per the policy if full; ``info`` is the
        last request that held it (the policy stores it on that request's behalf). False if the
        policy refused it or nothing unprotected (unpinned, not being loaded) could make room."""
        if info is not None:
            self.policy.resume_request(info, now_s)
        pinned = self.pinned
        if h in self._resident or (
            h not in pinned and not self.policy.admit(h, parent, depth, now_s)
        ):
            return False
        over = len(self._resident) + 1 - self.capacity_blocks
        if over > 0:
            victims = self.policy.evict(over, self.protected)
            if victims is None:
                return False
            for v in victims:
                del self._resident[v]  # type: ignore[arg-type]
            self.evictions += len(victims)
            if self.events is not None:
                self.events.append(BlockRemoved(block_hashes=[*victims], medium=CPU))  # type: ignore[list-item]
        self._resident[h] = None
        if h not in pinned:
            self.policy.insert(h, now_s, parent, depth)
        if self.events is not None:
            self.events.append(
                BlockStored(
                    block_hashes=[h],
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=self.block_size,
                    lora_id=None,
                    medium=CPU,
                    lora_name=lora_name,
                    extra_keys=[extra_keys] if extra_keys else None,
                )
            )
        return True
