"""What several benchmark scripts share (they import it as ``benchmarks.common``, the
repository root on ``sys.path`` as they put it there): where the shared traces are, printing the
JSON result (and writing it to ``--out``), and flag actions that refuse an out-of-range value as
the flag is parsed, naming it, so the range is stated once, where the flag is."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the traces beside the repository (``shared/traces`` in the directory above it)
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE_TRACE = TRACES / "mooncake_conversation.jsonl"


def print_json(doc: Any, out: str | None = None, indent: int = 1) -> None:
    """``doc`` as JSON on stdout, and into the file ``out`` too when one is given."""
    text = json.dumps(doc, indent=indent)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


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
# ``add_argument(..., type=float, action=NonNegative)``: "--gib must be >= 0" (NaN and
# infinity refused too)
NonNegative = _checked(lambda v: v >= 0 and math.isfinite(v), ">= 0")
# ``add_argument(..., type=int, action=AtLeastOne)``: "--repeats must be >= 1"
AtLeastOne = _checked(lambda v: v >= 1, ">= 1")
