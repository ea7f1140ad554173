"""The serving replicas' garbage-collector setting."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from engines import gc_tuning


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_young_generation_is_collected_less_often_and_the_older_ratios_kept(
    restore_gc: None,
) -> None:
    gc.set_threshold(700, 7, 9)
    gc_tuning.tune_for_serving()
    assert gc.get_threshold() == (gc_tuning.YOUNG_THRESHOLD, 7, 9)
    gc_tuning.tune_for_serving(5000)
    assert gc.get_threshold() == (5000, 7, 9)


def test_a_threshold_below_one_is_refused(restore_gc: None) -> None:
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="young must be >= 1"):
        gc_tuning.tune_for_serving(0)
    assert gc.get_threshold() == before
