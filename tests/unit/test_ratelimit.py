"""The per-client token bucket: bursts, refill, independence of clients, bounded memory."""

from __future__ import annotations

import pytest

from router.admission import Rejected
from router.ratelimit import RateLimiter


def test_a_burst_then_the_rate_and_an_honest_wait() -> None:
    lim = RateLimiter(rate=2.0, burst=3)
    assert [lim.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = lim.take("a", 0.0)
    assert wait == pytest.approx(0.5) and lim.refused == 1
    assert lim.take("a", 0.49) > 0  # not yet
    assert lim.take("a", 0.5) == 0.0  # one token refilled by then
    assert Rejected("", 0.01).retry_after_header == "1"
    assert Rejected("", 2.2).retry_after_header == "3"


def test_one_clients_flood_leaves_the_others_alone() -> None:
    lim = RateLimiter(rate=1.0, burst=2)
    flood = [lim.take("noisy", 0.1 * i) for i in range(50)]
    assert sum(1 for w in flood if w == 0.0) <= 2 + 5  # burst + 5 s of refill
    assert all(lim.take("quiet", 5.0 + i) == 0.0 for i in range(5))


def test_buckets_are_bounded() -> None:
    lim = RateLimiter(rate=1.0, burst=1, max_clients=100)
    for i in range(1000):
        lim.take(f"c{i}", 0.0)
    assert len(lim._buckets) == 100


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (1.0, 0)])
def test_bad_settings(rate: float, burst: int) -> None:
    with pytest.raises(ValueError):
        RateLimiter(rate, burst)
