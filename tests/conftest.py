"""Test tiers by folder: tests/unit -> unit, tests/integration -> integration, tests/engine ->
engine (also marked explicitly in those modules). `make test-*` selects by folder or marker."""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = {"unit", "integration", "engine"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
