"""The shipped profile of Dynamo's mocker engine (dynamo-mocker-h100) against the mocker's own
default timing model (aisimulate-core 0.13.0, as replayed by benchmarks/dynamo_replay.py)."""

from __future__ import annotations

import pytest

from engines.profile import LatencyProfile

CAPACITY = 859 * 512  # --num-gpu-blocks 859 of the trace's 512-token blocks


def mocker_prefill_ms(tokens: int) -> float:
    """One pass prefilling ``tokens`` new tokens (cached context is free)."""
    return 4.209989e-07 * tokens**2 + 1.518344e-02 * tokens + 1.650142e01


def mocker_decode_ms(context_tokens: int) -> float:
    """One pass decoding requests whose sequence lengths sum to ``context_tokens``."""
    p = min(context_tokens / CAPACITY, 1.0)
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return LatencyProfile.load("dynamo-mocker-h100")


def test_limits_are_the_replayed_mockers(profile: LatencyProfile) -> None:
    assert profile.kv_capacity_tokens == CAPACITY
    assert profile.block_size == 512
    assert (profile.max_num_batched_tokens, profile.max_num_seqs) == (8192, 256)
    assert profile.long_prefill_token_threshold == 0


def test_pass_constants_are_the_mockers(profile: LatencyProfile) -> None:
    # a pass costs the prefill constant if it prefills and the decode constant if it decodes
    # (a mixed pass: both), nothing per step or per request besides
    assert (profile.base_ms, profile.request_overhead_ms) == (0.0, 0.0)
    assert profile.prefill_pass_ms == pytest.approx(16.50142, abs=1e-9)
    assert profile.decode_pass_ms == pytest.approx(5.74, abs=1e-9)


@pytest.mark.parametrize("tokens", [1, 256, 512, 1024, 2048, 4096, 6144, 8192])
def test_idle_single_chunk_ttft_is_the_mockers(profile: LatencyProfile, tokens: int) -> None:
    assert profile.ttft_s(tokens) == pytest.approx(mocker_prefill_ms(tokens) / 1e3, rel=1e-9)


def test_a_long_prompt_costs_the_mockers_passes(profile: LatencyProfile) -> None:
    # 126k tokens: fifteen full passes and one of the rest, each its own quadratic
    tokens = 126_000
    full, rest = divmod(tokens, 8192)
    want = full * mocker_prefill_ms(8192) + mocker_prefill_ms(rest)
    assert profile.ttft_s(tokens) == pytest.approx(want / 1e3, rel=1e-9)


def test_prefill_ignores_cached_context_like_the_mocker(profile: LatencyProfile) -> None:
    assert profile.prefill_s(2000, 100_000) == profile.prefill_s(2000, 0)


@pytest.mark.parametrize("occupancy", [0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5])
def test_decode_step_within_7_percent_up_to_half_full(
    profile: LatencyProfile, occupancy: float
) -> None:
    ctx = round(occupancy * CAPACITY)
    want = mocker_decode_ms(ctx) / 1e3
    for batch in (1, 8, 64):  # no batch-size term, as in the mocker
        assert profile.decode_step_s(batch, ctx) == pytest.approx(want, rel=0.07)
    if occupancy == 0.0:
        assert profile.decode_step_s(1, 0) == pytest.approx(want, rel=1e-9)
