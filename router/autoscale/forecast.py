"""Short-term forecasts of the arrival rate for the autoscaling policies."""

from __future__ import annotations

from collections import deque


class Forecaster:
    """Arrival rates of the recent windows (one per decision), and the rate ``ahead_s`` after
    the latest: a linear trend over the last ``points`` windows, never below the latest rate
    while rising and never below the mean of the window while falling (a lull forecast ends
    in the next burst's cold start otherwise)."""

    def __init__(self, points: int = 4, within_span: bool = False) -> None:
        """``within_span``: the trend is extrapolated no further ahead than the windows it was
        fitted on span (a step in the rate is a slope only over the windows that saw it)."""
        self.history: deque[tuple[float, float]] = deque(maxlen=max(2, points))
        self.within_span = within_span

    def add(self, now: float, rate: float) -> None:
        self.history.append((now, rate))

    def latest(self) -> float:
        """The latest window's rate (0 before any)."""
        return self.history[-1][1] if self.history else 0.0

    def predict(self, ahead_s: float) -> float:
        h = self.history
        if not h:
            return 0.0
        last = h[-1][1]
        if len(h) < 2:
            return last
        n = len(h)
        mt = sum(t for t, _ in h) / n
        mr = sum(r for _, r in h) / n
        var = sum((t - mt) ** 2 for t, _ in h)
        slope = sum((t - mt) * (r - mr) for t, r in h) / var if var > 0 else 0.0
        if self.within_span:
            ahead_s = min(ahead_s, h[-1][0] - h[0][0])
        ahead = last + slope * ahead_s
        return max(ahead, last) if slope > 0 else max(ahead, mr, 0.0)


class SeasonalForecaster:
    """The arrival rate over a coming span of time: a trend forecast (``Forecaster``) and,
    with a known cycle (``period_s`` > 0: a day in production, the suite's burst-and-lull
    cycle in the simulator), the highest rate observed at the same time of the cycle in the
    last ``periods`` cycles: the higher of the two. With ``cycle_caps_trend``, where the cycle
    has something to say and the latest rate is within it, the cycle's rate is the forecast: a
    rise the cycle has seen is taken as the cycle's step, not a trend to extrapolate (on to-b a
    linear fit over a step from 10 to 40 requests/s forecast 90-112 a cold start ahead); where
    the latest rate exceeds what the cycle saw, the higher of the two again. Only what was
    observed before ``now`` is used; before one full cycle has been seen the seasonal part has
    nothing to say."""

    def __init__(
        self,
        period_s: float = 0.0,
        points: int = 4,
        periods: int = 2,
        cycle_caps_trend: bool = False,
        trend_within_span: bool = False,
    ) -> None:
        self.period_s, self.periods = period_s, max(1, periods)
        self.cycle_caps_trend = cycle_caps_trend
        self.trend = Forecaster(points, trend_within_span)
        # (window's start, window's end, rate), oldest first, at most ``periods`` cycles
        self.history: deque[tuple[float, float, float]] = deque()

    @property
    def windows(self) -> int:
        """The windows the trend forecast stands on (at most ``max(2, points)``)."""
        return len(self.trend.history)

    def add(self, now: float, window_s: float, rate: float) -> None:
        self.trend.add(now, rate)
        if self.period_s > 0:
            self.history.append((now - window_s, now, rate))
            keep = now - self.period_s * self.periods - window_s
            while self.history and self.history[0][1] < keep:
                self.history.popleft()

    def peak(self, now: float, until_s: float) -> tuple[float, str]:
        """The highest rate forecast over ``[now, now + until_s]``, and where it comes from."""
        trend = self.trend.predict(until_s)
        if self.period_s <= 0 or not self.history:
            return trend, "trend"
        seasonal = 0.0
        for k in range(1, self.periods + 1):
            lo, hi = now - k * self.period_s, now + until_s - k * self.period_s
            seen = [r for a, b, r in self.history if b > lo and a < hi]
            if seen:
                seasonal = max(seasonal, max(seen))
        if seasonal > trend or (
            self.cycle_caps_trend and seasonal > 0.0 and self.trend.latest() <= seasonal
        ):
            return seasonal, "cycle"
        return trend, "trend"
