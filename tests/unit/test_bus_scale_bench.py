"""The pure parts of benchmarks/bus_scale_bench.py: its replayed messages are the forwarder's."""

from __future__ import annotations

import msgspec

from cachemap.events import InstanceEvents, Removed, Stored, Update, decode_message, encode_message
from tests.support import load_benchmark

bench = load_benchmark("bus_scale_bench")


def test_wire_message_is_byte_identical_to_encode_message() -> None:
    updates: list[Update] = [Stored("gpu", [1, 2**63 + 5], None, 0), Removed("gpu", [7])]
    want = encode_message(InstanceEvents("e00001", 3, 1.5, updates))
    got = bench.wire_message("e00001", 3, 1.5, msgspec.msgpack.encode(updates))
    assert got == want
    assert decode_message(got) == InstanceEvents("e00001", 3, 1.5, updates)
