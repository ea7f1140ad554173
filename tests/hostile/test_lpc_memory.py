"""Issue 61, finding 8: ``lpc``'s predictor kept one entry (~75 B) per request that could still be
continued, and a one-turn conversation never is: 10M one-turn chats held ~750 MB per engine.
Now at most ``DEFAULT_MAX_SESSIONS`` are held (``policies.lpc.HistoryPredictor``); memory
measured in-process with tracemalloc."""

from __future__ import annotations

import tracemalloc

from policies.base import RequestInfo
from policies.lpc import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_TTL_S, HistoryPredictor, LPCPolicy

PER_ENTRY_B = 100  # a held request: ~75 B measured (its id, its dict slot)


def test_one_turn_conversations_keep_lpc_state_bounded() -> None:
    n = 600_000  # over twice the bound, in 400 s of policy time: the size bound acts, not the TTL
    policy = LPCPolicy(1000)
    pred = policy.predictor
    assert isinstance(pred, HistoryPredictor)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            policy.begin_request(RequestInfo(category="text_1", session_id=i), i / 1500)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown <= DEFAULT_MAX_SESSIONS * PER_ENTRY_B, f"{grown / 1e6:.1f} MB"
    assert len(pred) <= DEFAULT_MAX_SESSIONS
    # what it learned is all there: 600k first turns, none continued
    assert pred.counts() == {"text_1": (n, 0)}


def test_a_quiet_engine_forgets_on_time() -> None:
    """One new conversation a minute for a day: only the last two hours' are held."""
    policy = LPCPolicy(1000)
    pred = policy.predictor
    assert isinstance(pred, HistoryPredictor)
    for i in range(24 * 60):
        policy.begin_request(RequestInfo(category="text_1", session_id=i), 60.0 * i)
    assert len(pred) <= 2 * DEFAULT_SESSION_TTL_S / 60 + 1
