"""Admission: shed load with a clean 429 + Retry-After instead of letting requests time out.

Two gates, both optional:

- **SLO gate**: with a TTFT SLO, a request whose best placement estimate already breaks it is
  rejected at once; Retry-After is the estimated excess (the queue must drain that much).
- **Concurrency gate**: at most ``max_in_flight`` engine requests run (an HTTP request takes a
  slot per engine request it makes: ``n`` choices, a batch's prompts times ``n``); the next
  ``max_queue`` HTTP requests wait in FIFO order for at most ``max_wait_s``; beyond that, or
  after waiting too long, reject.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque


class Rejected(Exception):
    """The request is not admitted; ``retry_after_s`` is a hint for the client."""

    def __init__(self, reason: str, retry_after_s: float, code: str = "overloaded") -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.code = code  # the 429's error code: "overloaded", "rate_limited"

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class Admission:
    def __init__(
        self,
        slo_ttft_s: float | None = None,
        max_in_flight: int = 1024,
        max_queue: int = 1024,
        max_wait_s: float = 30.0,
    ) -> None:
        if slo_ttft_s is not None and slo_ttft_s <= 0:
            raise ValueError(f"slo_ttft_s must be positive, got {slo_ttft_s}")
        if max_in_flight < 1 or max_queue < 0 or max_wait_s <= 0:
            raise ValueError("max_in_flight >= 1, max_queue >= 0 and max_wait_s > 0 are required")
        self.slo_ttft_s = slo_ttft_s
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self._running = 0
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        self.rejected_slo = 0
        self.rejected_queue = 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def check_slo(self, estimated_ttft_s: float | None) -> None:
        """Raise ``Rejected`` when the best estimate already breaks the SLO."""
        if self.slo_ttft_s is None or estimated_ttft_s is None:
            return
        if estimated_ttft_s > self.slo_ttft_s:
            self.rejected_slo += 1
            raise Rejected(
                f"estimated TTFT {estimated_ttft_s * 1e3:.0f} ms exceeds the "
                f"{self.slo_ttft_s * 1e3:.0f} ms SLO on every instance",
                estimated_ttft_s - self.slo_ttft_s,
            )

    async def acquire(self, slots: int = 1) -> Ticket:
        """Take ``slots`` of the ``max_in_flight`` slots (one per engine request: a request's
        ``n`` choices, a batch's prompts times ``n``; at most all of them), waiting in the
        bounded FIFO queue if needed; raises ``Rejected`` when the queue is full or the wait
        exceeds ``max_wait_s``."""
        slots = max(1, min(slots, self.max_in_flight))
        if not self._waiters and self._running + slots <= self.max_in_flight:
            self._running += slots
            return Ticket(self, slots)
        if len(self._waiters) >= self.max_queue:
            self.rejected_queue += 1
            raise Rejected("server is at capacity and its queue is full", self.max_wait_s)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = (fut, slots)
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(fut, self.max_wait_s)
        except TimeoutError:
            self.rejected_queue += 1
            raise Rejected("timed out waiting for capacity", self.max_wait_s) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(slots)  # the slots were granted just as we were cancelled
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._grant()  # a large request leaving the head may let smaller ones in
        # NOTE: ``_grant`` counted the slots in ``_running`` when it granted them.
        return Ticket(self, slots)

    def _release(self, slots: int) -> None:
        self._running -= slots
        self._grant()

    def _grant(self) -> None:
        """Admit waiters in FIFO order while the one at the head fits."""
        while self._waiters:
            fut, slots = self._waiters[0]
            if fut.done():  # timed out or cancelled: it removes itself
                self._waiters.popleft()
                continue
            if self._running + slots > self.max_in_flight:
                return
            self._waiters.popleft()
            self._running += slots
            fut.set_result(None)


class Ticket:
    """One admitted request's slots; ``release`` is idempotent (streams release from several
    exits: normal end, client disconnect, background cleanup)."""

    __slots__ = ("_admission", "slots")

    def __init__(self, admission: Admission, slots: int = 1) -> None:
        self._admission: Admission | None = admission
        self.slots = slots

    def release(self) -> None:
        if self._admission is not None:
            self._admission._release(self.slots)
            self._admission = None
