"""The pure parts of benchmarks/bus_scale_bench.py: its replayed messages are the forwarder's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec

from cachemap.events import InstanceEvents, Removed, Stored, Update, decode_message, encode_message

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bus_scale_bench.py"
_spec = importlib.util.spec_from_file_location("bus_scale_bench", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bus_scale_bench"] = bench
_spec.loader.exec_module(bench)


def test_wire_message_is_byte_identical_to_encode_message() -> None:
    updates: list[Update] = [Stored("gpu", [1, 2**63 + 5], None, 0), Removed("gpu", [7])]
    want = encode_message(InstanceEvents("e00001", 3, 1.5, updates))
    got = bench.wire_message("e00001", 3, 1.5, msgspec.msgpack.encode(updates))
    assert got == want
    assert decode_message(got) == InstanceEvents("e00001", 3, 1.5, updates)
