"""Test tiers by folder: tests/unit -> unit, tests/integration -> integration, tests/engine ->
engine (also marked explicitly in those modules). `make test-*` selects by folder or marker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TIERS = {"unit", "integration", "engine"}


def pytest_configure(config: pytest.Config) -> None:
    """Never test old code: compiled modules older than the sources (deploy/native.py) are
    rebuilt first (or removed, where compiling fails: the suite then tests pure Python). A tree
    with nothing compiled is left as it is."""
    from deploy import native

    if native.stale():
        ok = native.build()
        print(f"kvroute native: sources changed, {'rebuilt' if ok else 'removed'}", file=sys.stderr)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
