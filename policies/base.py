"""The eviction-policy contract shared by the cache simulator, the sim engine and the vLLM adapter.

The cache owns the mechanics (which blocks are resident, capacity, pinning, events); a policy
owns only the order in which resident blocks should go. The cache tells the policy about every
block it stores (``insert``), every reuse (``touch``) and every removal it makes on its own
(``remove``), and asks it for victims with ``evict``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, ClassVar

# A block identity: an ``int`` trace hash id or chained ``BlockHash``, vLLM's ``bytes`` OffloadKey.
Key = Hashable

NO_PROTECTION: frozenset[Key] = frozenset()


@dataclass(slots=True, frozen=True)
class RequestInfo:
    """What a policy may know about the request whose blocks it is about to see.

    ``category`` is ``type_turn`` (``text_2``) or ``"all"``; ``session_id`` and ``parent_id``
    identify a multi-turn conversation when the workload has one; ``index`` is the request's
    position in a replayed trace (the Belady oracle's clock); ``num_blocks`` is the prompt's
    length in blocks (0: unknown); ``continuation_p`` is an external prediction that the session
    sends another turn (None: the policy predicts it itself). ``pin`` is an operator's order
    for the request's blocks (the KV control API): True pins them in the CPU tier (never a
    victim, admitted whatever the policy says), False unpins them, None leaves pins alone. The
    cache carries it out; a policy never sees a pinned block as a candidate.
    """

    category: str = "all"
    turn: int = 1
    session_id: int | None = None
    parent_id: int | None = None
    index: int = -1
    num_blocks: int = 0
    continuation_p: float | None = None
    pin: bool | None = None

    @classmethod
    def from_hints(cls, kv_transfer_params: Mapping[str, Any] | None) -> RequestInfo | None:
        """The router's policy hints, ``kv_transfer_params["kvroute"]`` (``category``,
        ``turn``, ``session_id``, ``parent_id``, ``continuation``, ``pin``), or None without
        them. The one parser for the sim engine's CPU tier and the vLLM adapter."""
        hints = (kv_transfer_params or {}).get("kvroute")
        if not isinstance(hints, Mapping):
            return None
        cont = hints.get("continuation")
        return cls(
            category=str(hints.get("category", "all")),
            turn=int(hints.get("turn", 1)),
            session_id=hints.get("session_id"),
            parent_id=hints.get("parent_id"),
            continuation_p=float(cont) if cont is not None else None,
            pin=bool(hints["pin"]) if hints.get("pin") is not None else None,
        )


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

    @abstractmethod
    def evict(self, n: int, protected: Set[Key] = NO_PROTECTION) -> list[Key] | None:
        """Choose and forget ``n`` unprotected keys, best victim first; None if impossible."""

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
