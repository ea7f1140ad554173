"""What several benchmark scripts share (they import it as ``benchmarks.common``, the
repository root on ``sys.path`` as they put it there): flag actions that refuse an out-of-range
value as the flag is parsed, naming it, so the range is stated once, where the flag is."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _checked(ok: Callable[[Any], bool], rule: str) -> type[argparse.Action]:
    """An ``add_argument`` action storing the value when ``ok(value)``, else exiting through
    ``parser.error`` with "``--flag`` must be ``rule``" (status 2)."""

    class Checked(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            if not ok(values):
                parser.error(f"{self.option_strings[0]} must be {rule}")
            setattr(namespace, self.dest, values)

    return Checked


# ``add_argument(..., action=Positive)``: ``--rate 0`` exits with "--rate must be > 0"
Positive = _checked(lambda v: v > 0, "> 0")
# ``add_argument(..., type=int, action=AtLeastOne)``: "--repeats must be >= 1"
AtLeastOne = _checked(lambda v: v >= 1, ">= 1")
