"""``benchmarks/autoscale_suite.py``'s command line: a day too short to score is refused by name."""

from __future__ import annotations

import pytest

from tests.support import load_benchmark


def test_a_day_no_longer_than_its_training_cycle_is_refused_naming_duration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    suite = load_benchmark("autoscale_suite")
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--workloads", "to-b", "--duration", "600"])
    assert exit_info.value.code == 2
    assert "--duration must be > 600" in capsys.readouterr().err
