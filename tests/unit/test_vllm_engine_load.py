"""VllmEngine's load accounting, without starting vLLM: queued prefill work is each waiting
prompt beyond the router's estimate of its cached prefix."""

from __future__ import annotations

from engines.vllm_engine import VllmEngine, _InFlight


def test_queued_prefill_subtracts_the_routers_cached_estimate() -> None:
    eng = VllmEngine("unused-model-dir", "v-0")
    eng._inflight = {
        "cold": _InFlight(1000),
        "warm": _InFlight(3000, expected_cached=2900),
        "running": _InFlight(500, started=True, generated=7),
    }
    snap = eng.load()
    assert snap.queued_prefill_tokens == 1000 + 100
    assert snap.running_context_tokens == 507
    assert (snap.waiting, snap.running) == (2, 1)
