"""LPC-style eviction ("Learned Prefix Caching", NeurIPS'25): continuation odds with decay."""

from __future__ import annotations

import math
from typing import Protocol

from policies.base import Key, RequestInfo
from policies.scored import ScoredPolicy

# A request's category is kept until a next turn names it, for at least this long (of the
# policy's time) and at most twice it: a conversation's next turn comes within minutes (the
# Bailian statistics: think times of a few minutes, few past 20), and one that comes later
# counts as not continued. At most this many requests are held (~75 B each, ~20 MB): past it
# the older half goes, so each is held for at least ``DEFAULT_MAX_SESSIONS / 2`` later ones
# (22 minutes at 100 new conversations a second on one engine).
DEFAULT_SESSION_TTL_S = 3600.0
DEFAULT_MAX_SESSIONS = 1 << 18


class ContinuationPredictor(Protocol):
    """Predicts the probability that a conversation sends another turn after ``request``."""

    def observe(self, request: RequestInfo, now_s: float) -> None: ...

    def predict(self, request: RequestInfo) -> float: ...


class HistoryPredictor:
    """Empirical next-turn probability per category (type and turn), learned online.

    A request counts as continued once a request naming it as ``parent_id`` arrives; the
    estimate is smoothed towards ``prior`` with weight ``prior_weight`` requests. Requests
    without a session id say nothing about continuation and get the prior.

    Bounded: a request waits for its next turn in one of two generations (dicts in arrival
    order). The young one becomes the old one, and the old one is dropped, once it is
    ``session_ttl_s`` old (of ``now_s``) or holds ``max_sessions / 2`` requests; so a request
    is remembered for at least ``session_ttl_s`` (unless ``max_sessions / 2`` others came
    after it) and at most twice that, and never more than ``max_sessions`` are. A request
    that is never continued is the least recently used, and it is what goes (in bulk, the
    older half at a time). A turn that comes after its parent went counts as a new
    conversation's (its parent's category is not credited).
    """

    def __init__(
        self,
        prior: float = 0.5,
        prior_weight: float = 10.0,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be positive, got {session_ttl_s}")
        if max_sessions < 2:
            raise ValueError(f"max_sessions must be at least 2, got {max_sessions}")
        self.prior, self.prior_weight = prior, prior_weight
        self.session_ttl_s, self.max_sessions = session_ttl_s, max_sessions
        self._seen: dict[str, int] = {}
        self._continued: dict[str, int] = {}
        self._young: dict[int, str] = {}  # session id -> category, awaiting a next turn
        self._old: dict[int, str] = {}
        self._young_since: float | None = None  # when the young generation began

    def __len__(self) -> int:
        """Requests remembered while they wait for a next turn."""
        return len(self._young) + len(self._old)

    def _age(self, now_s: float) -> None:
        since = self._young_since
        if since is None:
            self._young_since = now_s
        elif now_s - since >= 2 * self.session_ttl_s:
            # every young request came before since + ttl (or the young one would have aged)
            self._young, self._old, self._young_since = {}, {}, now_s
        elif now_s - since >= self.session_ttl_s:
            self._young, self._old, self._young_since = {}, self._young, now_s

    def observe(self, request: RequestInfo, now_s: float | None = None) -> None:
        """Count ``request`` (at ``now_s``: None ages nothing, as for a trace without times)."""
        if now_s is not None:
            self._age(now_s)
        if request.parent_id is not None:
            parent_cat = self._young.pop(request.parent_id, None)
            if parent_cat is None:
                parent_cat = self._old.pop(request.parent_id, None)
            if parent_cat is not None:
                self._continued[parent_cat] = self._continued.get(parent_cat, 0) + 1
        if request.session_id is not None:
            if len(self._young) >= self.max_sessions // 2:
                self._young, self._old = {}, self._young
                if now_s is not None:
                    self._young_since = now_s
            self._old.pop(request.session_id, None)
            self._young[request.session_id] = request.category
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

    ``session_ttl_s`` and ``max_sessions`` bound what the default predictor remembers of
    conversations (``HistoryPredictor``); a ``predictor`` given keeps its own bounds.
    """

    name = "lpc"

    def __init__(
        self,
        capacity_blocks: int,
        decay_per_s: float = 1.0 / 120.0,
        predictor: ContinuationPredictor | None = None,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if decay_per_s <= 0:
            raise ValueError(f"decay_per_s must be positive, got {decay_per_s}")
        self.decay_per_s = decay_per_s
        self.predictor: ContinuationPredictor = predictor or HistoryPredictor(
            session_ttl_s=session_ttl_s, max_sessions=max_sessions
        )
        super().__init__(capacity_blocks)

    def _reset(self) -> None:
        super()._reset()
        self._logit_p = 0.0  # each block's state: its offset in its prompt

    def begin_request(self, request: RequestInfo, now_s: float) -> None:
        self.predictor.observe(request, now_s)
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
