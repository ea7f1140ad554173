"""``free_port``: the ports an engine's KV-event publisher binds seconds after they are chosen are
drawn where nothing the kernel hands out can take them meanwhile."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from engines import ports as ports_module
from engines.ports import free_port


def _bindable_everywhere(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def test_ports_come_from_below_the_ephemeral_range_and_are_free_on_every_interface() -> None:
    lo, _ = ports_module._ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert all(20_000 <= p < lo for p in ports)
    assert all(_bindable_everywhere(p) for p in ports)


def test_a_port_in_use_on_loopback_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # the busy port is drawn first, a free one second
        monkeypatch.setattr(ports_module, "_ephemeral_ports", lambda: (taken + 1, 60_999))
        draws: Iterator[int] = iter([taken, taken - 1_000])

        class Draw:
            def randrange(self, start: int, stop: int) -> int:
                return next(draws)

        monkeypatch.setattr(ports_module.random, "SystemRandom", Draw)
        if not _bindable_everywhere(taken - 1_000):
            pytest.skip("the second draw happens to be in use on this machine")
        assert free_port() == taken - 1_000


def test_a_narrow_range_below_the_kernels_falls_back_to_the_kernels_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lo, hi = ports_module._ephemeral_ports()
    monkeypatch.setattr(ports_module, "_ephemeral_ports", lambda: (20_500, 60_999))
    port = free_port()
    assert lo <= port <= hi
    assert _bindable_everywhere(port)
