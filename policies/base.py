"""The eviction-policy contract shared by the cache simulator, the sim engine and the vLLM adapter.

The cache owns the mechanics (which blocks are resident, capacity, pinning, events); a policy
owns only the order in which resident blocks should go. The cache tells the policy about every
block it stores (``insert``), every reuse (``touch``) and every removal it makes on its own
(``remove``), and asks it for victims with ``evict``. What a policy knows of a request is a
``RequestInfo`` (``policies.hints``, where the router's hints to it are parsed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Iterable, Sequence, Set
from typing import ClassVar

from policies.hints import RequestInfo

# A block identity: an ``int`` trace hash id or chained ``BlockHash``, vLLM's ``bytes`` OffloadKey.
Key = Hashable

NO_PROTECTION: frozenset[Key] = frozenset()

__all__ = [
    "NO_PROTECTION",
    "EvictionPolicy",
    "Key",
    "OfflinePolicy",
    "OperatorPins",
    "RequestInfo",
]


class EvictionPolicy(ABC):
    """Orders resident blocks for eviction. Pure: no I/O, no clock reads; time is ``now_s``.

    Lifecycle of a request (the simulator's and vLLM's offload manager's): ``begin_request``;
    ``insert`` for each block it stores, in prefix order, with ``evict`` as space is needed;
    ``end_request`` with all its blocks, where reuse is reported. ``touch`` reports a reuse
    outside that lifecycle (vLLM's ``touch``) and is what ``end_request`` calls by default.

    Invariants the cache relies on:

    - the policy tracks exactly the keys inserted and not yet removed or evicted;
    - ``evict(n, protected)`` is atomic: it returns ``n`` distinct unprotected keys and forgets
      them, or returns ``None`` and changes nothing;
    - ``insert`` is called for a key that is not resident, ``touch``/``remove`` for one that is.

    ``parent`` (the previous block of the same prompt, None for a first block) and ``offset``
    (the block's index in its prompt) describe the prefix tree: a block is only useful while
    its parent is cached. Each policy's docstring says how it treats that.
    """

    name: ClassVar[str]

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._reset()

    def begin_request(self, request: RequestInfo, now_s: float) -> None:  # noqa: B027
        """A request arrives; the ``touch``/``insert`` calls that follow are on its behalf."""

    def resume_request(self, request: RequestInfo, now_s: float) -> None:  # noqa: B027
        """The ``touch``/``insert`` calls that follow are on behalf of ``request``, which
        ``begin_request`` already announced: caches interleave requests (a block is stored or
        touched for one request while another is the latest to arrive). Counts nothing: a
        request is counted once, at ``begin_request``."""

    def end_request(
        self, request: RequestInfo, keys: Sequence[Key], reused: Sequence[Key], now_s: float
    ) -> None:
        """The request finished (vLLM: ``on_request_finished``). ``keys``: its resident blocks in
        prefix order; ``reused``: those of them that were resident when it arrived.

        This is where a reuse is reported: the default touches the reused blocks tail first,
        so the head of a prompt ends up the most recently used.
        """
        for key in reversed(reused):
            self.touch(key, now_s)

    def admit(self, key: Key, parent: Key | None, offset: int, now_s: float) -> bool:
        """Whether a missing block is worth storing at all (admission control). Default: yes."""
        return True

    @abstractmethod
    def insert(self, key: Key, now_s: float, parent: Key | None = None, offset: int = 0) -> None:
        """A block became resident."""

    @abstractmethod
    def touch(self, key: Key, now_s: float) -> None:
        """A resident block was reused."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """The cache dropped a resident block itself (failed store, invalidation)."""

    def evict(self, n: int, protected: Set[Key] = NO_PROTECTION) -> list[Key] | None:
        """Choose and forget ``n`` unprotected keys, best victim first; None if impossible.
        A policy implements ``_victims``, or overrides this whole for a faster path."""
        if n <= 0:
            return []
        if n > self.evictable_count(protected):
            return None
        return self._victims(n, protected)

    def _victims(self, n: int, protected: Set[Key]) -> list[Key]:
        """``evict`` once it is possible: choose and forget ``n`` >= 1 unprotected keys (at
        least that many are resident), best victim first."""
        raise NotImplementedError(f"{type(self).__name__} implements neither evict nor _victims")

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def evictable_count(self, protected: Set[Key] = NO_PROTECTION) -> int:
        """Resident keys outside ``protected``: the most one ``evict`` call can free."""
        if not protected:
            return len(self)
        return len(self) - sum(1 for k in protected if k in self)

    def clear(self) -> None:
        """Forget everything, learned state included (vLLM's ``reset_cache``)."""
        self._reset()

    @abstractmethod
    def _reset(self) -> None:
        """(Re)create all state; called by ``__init__`` and ``clear``."""


class OfflinePolicy(EvictionPolicy):
    """A policy that is told the future (upper bounds only, never deployable)."""

    @abstractmethod
    def load_future(self, requests: Sequence[Sequence[Key]]) -> None:
        """The block keys of every request that will be replayed, in order; ``begin_request``
        then passes ``RequestInfo.index`` into this list."""

    def _future_index(self, request: RequestInfo, loaded: int) -> int:
        """``request.index``, checked against the ``loaded`` requests of the future."""
        if request.index < 0:
            raise ValueError(
                f"{self.name} needs RequestInfo.index (the request's position in the trace)"
            )
        if request.index >= loaded:
            raise ValueError(f"{self.name}: request index {request.index} beyond the loaded future")
        return request.index


class OperatorPins:
    """An operator's pins over one cache and its policy (the KV control API): a pinned key is
    kept whatever the policy says until unpinned. A resident pinned key is out of the policy
    altogether, so eviction never considers (or steps over) it, and it re-enters the policy as
    a fresh insert when unpinned. Pins outlive residency: a key pinned before it is stored is
    pinned when it arrives. The cache asks ``key in pins`` before telling the policy about a key.
    """

    __slots__ = ("keys", "policy")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.keys: set[Key] = set()

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def pin(self, keys: Iterable[Key], resident: Container[Key]) -> None:
        pins = self.keys
        for key in keys:
            if key not in pins:
                pins.add(key)
                if key in resident:
                    self.policy.remove(key)

    def unpin(self, keys: Iterable[Key], resident: Container[Key], now_s: float) -> None:
        pins = self.keys
        for key in keys:
            if key in pins:
                pins.discard(key)
                if key in resident:
                    self.policy.insert(key, now_s)

    def clear(self) -> None:
        self.keys.clear()
