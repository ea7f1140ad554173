"""``kv_ttft``'s online calibration: its profile estimate, fitted to the first tokens the router
sees (the model is in ``router.scorers.kv_ttft``'s docstring)."""

from __future__ import annotations

import numpy as np

__all__ = ["TtftCalibration"]


class TtftCalibration:
    """Online least squares of observed TTFT on (profile estimate, running sequences, waiting
    requests, 1)."""

    # (low, high) per coefficient: a (scale), b (s per running sequence), d (s per waiting
    # request), c (s)
    BOUNDS = ((0.25, 20.0), (0.0, 2.0), (0.0, 2.0), (0.0, 5.0))

    def __init__(self, window: int = 512, refit_every: int = 16, min_samples: int = 32) -> None:
        if min(window, refit_every, min_samples) < 1 or min_samples > window:
            raise ValueError("window, refit_every, min_samples must be >= 1, min_samples <= window")
        self.window, self.refit_every, self.min_samples = window, refit_every, min_samples
        # NOTE: the window is a ring of design rows (estimate, running, waiting, 1) and their
        # observations: a refit (every few first tokens) then slices arrays, row order kept.
        self._rows = np.empty((window, 4))
        self._obs = np.empty(window)
        self._filled = 0
        self._next = 0  # the ring's next row: its oldest once full
        self._since = 0
        self.a, self.b, self.d, self.c = 1.0, 0.0, 0.0, 0.0
        self.samples = 0

    def correct(self, estimate_s: float, running: int, waiting: int) -> float:
        return self.a * estimate_s + self.b * running + self.d * waiting + self.c

    def observe(self, estimate_s: float, running: int, waiting: int, observed_s: float) -> None:
        if not (observed_s >= 0.0 and estimate_s >= 0.0):  # also drops NaN
            return
        i = self._next
        self._rows[i] = (estimate_s, running, waiting, 1.0)
        self._obs[i] = observed_s
        self._next = (i + 1) % self.window
        self._filled = min(self._filled + 1, self.window)
        self.samples += 1
        self._since += 1
        if self._since >= self.refit_every and self._filled >= self.min_samples:
            self._refit()

    def _refit(self) -> None:
        self._since = 0
        if self._filled < self.window:
            design, observed = self._rows[: self._filled], self._obs[: self._filled]
        else:  # oldest first, as the samples came
            i = self._next
            design = np.concatenate((self._rows[i:], self._rows[:i]))
            observed = np.concatenate((self._obs[i:], self._obs[:i]))
        coef, *_ = np.linalg.lstsq(design, observed, rcond=None)
        if np.all(np.isfinite(coef)):
            self.a, self.b, self.d, self.c = (
                float(min(max(v, lo), hi)) for v, (lo, hi) in zip(coef, self.BOUNDS, strict=True)
            )
