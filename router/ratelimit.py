"""Per-client request rate limits at the ingress: a token bucket per API key (or per client
address when the endpoint has no keys), so one client's flood is refused with 429 and
``Retry-After`` while every other client is still served. Pure: time is an argument."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """``rate`` requests per second per client, bursts of up to ``burst``. At most
    ``max_clients`` buckets are kept (least recently seen dropped first: a client that comes
    back starts with a full bucket, which only errs towards serving it)."""

    def __init__(self, rate: float, burst: int, max_clients: int = 10_000) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.refused = 0

    def take(self, client: str, now: float) -> float:
        """Spend one request of ``client``'s allowance: 0.0 if allowed, else the seconds until
        one is available (nothing spent)."""
        b = self._buckets.pop(client, None)
        if b is None:
            b = _Bucket(float(self.burst), now)
        else:
            b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
            b.at = now
        self._buckets[client] = b
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0.0
        self.refused += 1
        return (1.0 - b.tokens) / self.rate
