"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from policies.base import EvictionPolicy, Key
from policies.ghost import GhostList


class S3FIFOPolicy(EvictionPolicy):
    """New blocks enter the small FIFO S (``small_fraction`` of the capacity); one reused
    while in S moves to the main FIFO M when it reaches S's head, others leave (their key is
    remembered in the ghost FIFO G, and a ghost's next store goes straight to M). M is a
    CLOCK-like FIFO: a reused head is reinserted with its counter (max 3) decremented.

    Prefix semantics: a one-off tail leaves from S quickly; a shared prefix is reused and
    lives in M. Orphaned children are not chased; they leave S or age out of M.
    """

    name = "s3-fifo"

    def __init__(self, capacity_blocks: int, small_fraction: float = 0.1) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must lie in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: GhostList[None] = GhostList(self.capacity_blocks)
        self._freq: dict[Key, int] = {}
        self._small_target = max(1, int(self.capacity_blocks * self.small_fraction))

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Key, now_s: float) -> None:
        self._freq[key] = min(self._freq[key] + 1, 3)

    def remove(self, key: Key) -> None:
        del self._freq[key]
        if self._small.pop(key, _ABSENT) is _ABSENT:
            del self._main[key]

    def _victims(self, n: int, protected: Set[Key]) -> list[Key]:
        victims: list[Key] = []
        while len(victims) < n:
            key = None
            if len(self._small) >= self._small_target or not self._main:
                key = self._evict_small(protected)
            if key is None:
                key = self._evict_main(protected)
            if key is None:
                key = self._evict_small(protected)
            if key is None:  # only protected keys left anywhere, contradicting the count above
                raise RuntimeError("s3-fifo: fewer unprotected keys than evictable_count said")
            victims.append(key)
        return victims

    def _evict_small(self, protected: Set[Key]) -> Key | None:
        skipped: list[Key] = []
        victim: Key | None = None
        while self._small:
            key = next(iter(self._small))
            del self._small[key]
            if key in protected:
                skipped.append(key)
            elif self._freq[key] > 0:
                self._freq[key] = 0
                self._main[key] = None
            else:
                victim = key
                del self._freq[key]
                self._ghost.add(key, None)
                break
        for key in reversed(skipped):  # protected keys keep their place at the head
            self._small[key] = None
            self._small.move_to_end(key, last=False)
        return victim

    def _evict_main(self, protected: Set[Key]) -> Key | None:
        skipped: list[Key] = []
        victim: Key | None = None
        # NOTE: each pass lowers every counter; four passes empty them all.
        for _ in range(4 * len(self._main) + 1):
            if not self._main:
                break
            key = next(iter(self._main))
            if key in protected:
                del self._main[key]
                skipped.append(key)
                continue
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            del self._main[key]
            del self._freq[key]
            victim = key
            break
        for key in reversed(skipped):
            self._main[key] = None
            self._main.move_to_end(key, last=False)
        return victim


_ABSENT = object()
