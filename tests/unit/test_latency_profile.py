"""``LatencyProfile`` transformations the simulator's truth is built from."""

from __future__ import annotations

import pytest

from engines.sim.profile import LatencyProfile


@pytest.mark.parametrize("name", ["cpu-small-llama", "h100-llama3.1-8b"])
def test_slowed_scales_every_timed_cost(name: str) -> None:
    p = LatencyProfile.load(name)
    slow = p.slowed(1.7)
    # every term of the model is a time: TTFT (with a queue and a CPU-tier load) and a decode
    # step scale exactly, and the limits do not move
    for args in [(4000, 0), (4000, 1024, 512, 2048, 3), (32, 0)]:
        assert slow.ttft_s(*args) == pytest.approx(1.7 * p.ttft_s(*args))
    assert slow.decode_step_s(8, 9000) == pytest.approx(1.7 * p.decode_step_s(8, 9000))
    assert slow.max_num_batched_tokens == p.max_num_batched_tokens
    assert slow.kv_capacity_tokens == p.kv_capacity_tokens
    with pytest.raises(ValueError, match="slowdown factor"):
        p.slowed(0)
