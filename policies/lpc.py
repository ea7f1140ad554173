"""LPC-style eviction ("Learned Prefix Caching", NeurIPS'25): continuation odds with decay."""

from __future__ import annotations

import math
from typing import Protocol

from policies.base import Key, RequestInfo
from policies.scored import ScoredPolicy


class ContinuationPredictor(Protocol):
    """Predicts the probability that a conversation sends another turn after ``request``."""

    def observe(self, request: RequestInfo) -> None: ...

    def predict(self, request: RequestInfo) -> float: ...


class HistoryPredictor:
    """Empirical next-turn probability per category (type and turn), learned online.

    A request counts as continued once a request naming it as ``parent_id`` arrives; the
    estimate is smoothed towards ``prior`` with weight ``prior_weight`` requests. Requests
    without a session id say nothing about continuation and get the prior.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 10.0) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self._seen: dict[str, int] = {}
        self._continued: dict[str, int] = {}
        self._category_of: dict[int, str] = {}

    def observe(self, request: RequestInfo) -> None:
        if request.parent_id is not None:
            parent_cat = self._category_of.pop(request.parent_id, None)
            if parent_cat is not None:
                self._continued[parent_cat] = self._continued.get(parent_cat, 0) + 1
        if request.session_id is not None:
            self._category_of[request.session_id] = request.category
            self._seen[request.category] = self._seen.get(request.category, 0) + 1

    def counts(self) -> dict[str, tuple[int, int]]:
        """What it learned so far: ``{category: (requests seen, of which continued)}`` (a
        copy; the raw counts, without the prior)."""
        return {c: (n, self._continued.get(c, 0)) for c, n in self._seen.items()}

    def predict(self, request: RequestInfo) -> float:
        seen = self._seen.get(request.category, 0)
        cont = self._continued.get(request.category, 0)
        return (cont + self.prior * self.prior_weight) / (seen + self.prior_weight)


class LPCPolicy(ScoredPolicy[int]):
    """Each request carries a continuation probability ``p`` (``RequestInfo.continuation``
    or the predictor's); a block's priority is ``p d / (p d + 1 - p)`` with
    ``d = exp(-decay_per_s * (now - last access))``, the max over the requests sharing it.

    NOTE: the priority is increasing in ``logit(p) - decay_per_s * (now - t)``, and ``now`` is
    common to every block, so the heap key ``logit(p) + decay_per_s * t`` orders blocks the
    same at every instant; a block keeps the larger of its old and new key (the max over
    sharing requests), and nothing is rescored as time passes.

    Prefix semantics: ties go to the deeper block, so a prompt's blocks leave tail first and a
    shared parent holds the max of all its children's requests.
    """

    name = "lpc"

    def __init__(
        self,
        capacity_blocks: int,
        decay_per_s: float = 1.0 / 120.0,
        predictor: ContinuationPredictor | None = None,
    ) -> None:
        if decay_per_s <= 0:
            raise ValueError(f"decay_per_s must be positive, got {decay_per_s}")
        self.decay_per_s = decay_per_s
        self.predictor: ContinuationPredictor = predictor or HistoryPredictor()
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        super()._reset()
        self._logit_p = 0.0  # each block's state: its offset in its prompt

    def begin_request(self, request: RequestInfo, now_s: float) -> None:
        self.predictor.observe(request)
        self.resume_request(request, now_s)

    def resume_request(self, request: RequestInfo, now_s: float) -> None:
        p = request.continuation
        if p is None:
            p = self.predictor.predict(request)
        p = min(max(p, 1e-6), 1.0 - 1e-6)
        self._logit_p = math.log(p / (1.0 - p))

    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        self._state[key] = offset
        self._heap.push(key, self._logit_p + self.decay_per_s * now_s, -offset)

    def touch(self, key: Key, now_s: float) -> None:
        score = self._logit_p + self.decay_per_s * now_s
        if score > self._heap.priority(key):
            self._heap.push(key, score, -self._state[key])
