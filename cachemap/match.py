"""``CacheMap.match``'s answer: per instance, the leading blocks of a prompt it holds, read lazily
from the run lengths the match kernel packs per instance bit (``cachemap.kernels._match``)."""

from __future__ import annotations

from array import array
from collections.abc import ItemsView, Iterator, Mapping
from typing import NamedTuple, TypeVar, overload

import numpy as np

from cachemap.hashing import InstanceId

_new_tuple = tuple.__new__
_LOW = (1 << 32) - 1
_T = TypeVar("_T")


class Match(NamedTuple):
    """Leading blocks of a prompt resident on one instance."""

    gpu_blocks: int  # leading blocks on GPU
    total_blocks: int  # leading blocks on GPU or CPU (>= gpu_blocks)

    @property
    def cpu_blocks(self) -> int:
        """Blocks after the GPU run that would be loaded from the CPU tier."""
        return self.total_blocks - self.gpu_blocks


class MatchResult(Mapping[str, Match]):
    """``match``'s answer: a read-only mapping built lazily from per-instance-bit run lengths, so
    a prefix held by dozens of instances costs nothing until a scorer asks about them. Keyed by
    plain ``str``, as scorers and views name instances (its keys are ``InstanceId``s)."""

    __slots__ = ("_bit_of", "_instance_at", "_runs")

    def __init__(
        self,
        bit_of: dict[str, int],
        instance_at: dict[int, InstanceId],
        runs: array[int] | dict[int, int],
    ) -> None:
        """``runs``: per instance bit its runs packed as ``gpu_blocks << 32 | total_blocks``
        (0: none), as an int64 ``array`` indexed by bit (many holders: a copy of the kernel's
        answer, where a list would make an int object per bit) or a dict of the bits that have
        one (a few)."""
        self._bit_of, self._instance_at, self._runs = bit_of, instance_at, runs

    def __getitem__(self, instance: str) -> Match:
        m = self.get(instance)
        if m is None:
            raise KeyError(instance)
        return m

    # NOTE: scorers call ``get`` once per candidate on every placement; the Mapping mixin's
    # version goes through ``__getitem__`` and a raised KeyError for every instance without a hit.
    @overload
    def get(self, instance: str, /) -> Match | None: ...
    @overload
    def get(self, instance: str, /, default: Match | _T) -> Match | _T: ...
    def get(self, instance: str, /, default: object = None) -> object:
        b = self._bit_of.get(instance)
        if b is None:
            return default
        runs = self._runs
        v = runs.get(b, 0) if isinstance(runs, dict) else runs[b]
        if not v:
            return default
        # NOTE: ``Match(g, a)`` is this through the namedtuple's Python-level ``__new__``
        return _new_tuple(Match, (v >> 32, v & _LOW))

    def __contains__(self, instance: object) -> bool:
        return isinstance(instance, str) and self.get(instance) is not None

    def __iter__(self) -> Iterator[InstanceId]:
        inst, runs = self._instance_at, self._runs
        if isinstance(runs, dict):
            return (inst[b] for b, v in runs.items() if v and b in inst)
        held = np.flatnonzero(np.frombuffer(runs, np.int64)).tolist()
        return (inst[b] for b in held if b in inst)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"MatchResult({dict(self.items())!r})"

    def items(self) -> ItemsView[str, Match]:
        return _MatchItems(self)

    def _pairs(self) -> Iterator[tuple[str, Match]]:
        inst, runs = self._instance_at, self._runs
        if isinstance(runs, dict):
            held = [b for b, v in runs.items() if v]
        else:
            held = np.flatnonzero(np.frombuffer(runs, np.int64)).tolist()
        for b in held:
            iid = inst.get(b)
            if iid is not None:
                v = runs[b]
                yield iid, _new_tuple(Match, (v >> 32, v & _LOW))


class _MatchItems(ItemsView[str, Match]):
    """``MatchResult.items()``: the pairs straight from the runs (a scorer walks them on every
    placement), not a ``get`` per key."""

    _mapping: MatchResult

    def __iter__(self) -> Iterator[tuple[str, Match]]:
        return self._mapping._pairs()
