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


def test_thin_keeps_every_kth_block_and_its_removals() -> None:
    depth_of: dict[int, int] = {}
    stored = [Stored("gpu", [10, 11, 12, 13, 14, 15, 16, 17], None, 0)]  # depths 0..7
    kept = bench.thin(stored, 4, depth_of)
    assert kept == [Stored("gpu", [13, 17], None, 0)]  # the blocks ending 4-block spans
    assert bench.thin([Removed("gpu", [10, 13, 16, 17])], 4, depth_of) == [Removed("gpu", [13, 17])]
    assert bench.thin(stored, 1, {}) == stored
