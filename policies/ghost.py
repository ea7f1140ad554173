"""A bounded ghost list: keys a policy evicted, with what it remembers of them."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

from policies.base import Key

V = TypeVar("V")


class GhostList(OrderedDict[Key, V]):
    """Evicted keys, oldest first; past ``limit`` keys the oldest is forgotten (``limit`` 0:
    nothing is remembered). A policy pops a key when it is stored again."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def add(self, key: Key, value: V) -> None:
        self[key] = value
        if len(self) > self.limit:
            self.popitem(last=False)
