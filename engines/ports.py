"""Free TCP ports for servers that bind them later (engines' KV-event publishers, the PD
connector's side channels, test servers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

# The lowest port ``free_port`` draws from: above Ray's worker ports (10002-19999 by default).
_FIXED_PORTS_FROM = 20_000


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (Linux's default where unreadable)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32_768, 60_999


def free_port() -> int:
    """A TCP port that was free on every interface a moment ago, for a server that binds it
    later (vLLM's KV-event publisher binds seconds later, in its engine core process).

    It is drawn below the kernel's ephemeral range where that leaves room: what the kernel hands
    out meanwhile (``bind(0)``, outgoing connections: vLLM's own ``get_open_port``, gloo, Ray)
    comes from that range and so cannot take it. Only another explicit bind of the same port
    can, a chance of one in thousands; a port from ``bind(0)`` is the fallback.
    """
    lo = _ephemeral_ports()[0]
    draw = random.SystemRandom()
    for _ in range(64 if lo - _FIXED_PORTS_FROM >= 1_024 else 0):
        port = draw.randrange(_FIXED_PORTS_FROM, lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
