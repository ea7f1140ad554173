"""What the two learned policies (``prefix-reuse``, ``prefix-odds``) share: how they learn.

Both sort blocks into classes and learn per class, online, the odds that an access is
followed by a reuse (``policies.class_odds``); both remember the keys they evicted in a ghost
list, so a reuse the cache missed still counts for the evicted block's class; both refit
their per-class estimates every ``refit_every`` accesses. ``OddsTuning`` holds the knobs of
that learning, with their defaults; ``ClassOddsPolicy`` does the counting.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from policies.base import EvictionPolicy, Key, RequestInfo
from policies.class_odds import ClassOdds
from policies.ghost import GhostList

# What the ghost list remembers of an evicted key: its class, last access s, access count.
Ghost = tuple[int, float, int]


@dataclass(frozen=True)
class OddsTuning:
    """The learning knobs the learned policies share. Each policy's constructor takes them as
    keywords and defaults them to these values (``OddsTuning.refit_every``, ...)."""

    ghost_factor: float = 8.0  # evicted keys remembered, per block of capacity
    refit_every: int = 2000  # accesses between refits of the per-class estimates
    prior_weight: float = 20.0  # pseudo-accesses shrinking a class towards the pooled odds
    memory_accesses: int = 200_000  # accesses counted before every count is halved


class ClassOddsPolicy(EvictionPolicy):
    """Base of the learned policies: per-class reuse odds (``_odds``), a ghost list of
    ``ghost_factor * capacity`` evicted keys (``_ghost``, what ``Ghost`` says of each), and
    ``_refit`` every ``refit_every`` accesses, after which the counts age.

    A subclass calls ``_reset_odds`` from ``_reset``, ``_accessed`` from its ``_access`` (which
    ``insert`` calls, after reporting the reuse of a key still in the ghost list), ``_reused``
    from ``touch``, and at ``end_request`` moves a prompt tail's last access to its tail class
    with ``_count_as_tail``.
    """

    def __init__(self, capacity_blocks: int, max_count: int, tuning: OddsTuning) -> None:
        self.max_count, self.tuning = max_count, tuning
        super().__init__(capacity_blocks)

    def _reset_odds(self, classes: int) -> None:
        tuning = self.tuning
        self._odds = ClassOdds(classes, tuning.prior_weight, tuning.memory_accesses)
        self._ghost: GhostList[Ghost] = GhostList(int(tuning.ghost_factor * self.capacity_blocks))
        self._since_fit = 0

    @abstractmethod
    def _access(self, key: Key, count: int, now_s: float, offset: int) -> None:
        """Record the ``count``-th access of ``key`` (at prompt ``offset``) and call
        ``_accessed`` with its class."""

    @abstractmethod
    def _refit(self) -> None:
        """Re-rank the classes from ``_odds`` (which ages right after)."""

    def _accessed(self, cls: int) -> None:
        """Count an access of class ``cls``; every ``refit_every`` accesses, refit."""
        self._odds.accesses[cls] += 1.0
        self._since_fit += 1
        if self._since_fit >= self.tuning.refit_every:
            self._since_fit = 0
            self._refit()
            self._odds.age()

    def _reused(self, cls: int, gap_s: float) -> None:
        """A block last accessed as class ``cls`` was reused ``gap_s`` later."""
        self._odds.reused(cls, gap_s)

    def _count_as_tail(self, cls: int, tail: int) -> None:
        """The access just counted in class ``cls`` was of a prompt's tail, class ``tail``."""
        accesses = self._odds.accesses
        accesses[cls] = max(0.0, accesses[cls] - 1.0)
        accesses[tail] += 1.0

    @staticmethod
    def _ends_prompt(request: RequestInfo, offset: int) -> bool:
        """Whether the block at ``offset`` is the last of ``request``'s prompt (without a prompt
        length, as through vLLM, the last block the request finished with is taken to be)."""
        return not request.num_blocks or offset == request.num_blocks - 1

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        count = 1
        ghost = self._ghost.pop(key, None)
        if ghost is not None:  # a reuse the cache missed: the evicted block's class learns it
            cls, last_s, seen = ghost
            self._reused(cls, now_s - last_s)
            count = seen + 1
        self._access(key, count, now_s, offset)
