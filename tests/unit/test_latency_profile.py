"""``LatencyProfile`` transformations the simulator's truth is built from, and its file layout."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from engines.profile import PROFILES_DIR, LatencyProfile


@pytest.mark.parametrize("name", ["cpu-small-llama", "h100-llama3.1-8b", "dynamo-mocker-h100"])
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


def test_a_capped_prompt_shares_one_squared_pass_with_the_queue() -> None:
    """With a per-request prefill cap the request's chunk and the queue's share each step, and
    ``prefill_sq_ms`` squares their tokens together, as the sim engine's step does."""
    p = LatencyProfile.load("dynamo-mocker-h100").with_limits(100, 40)
    # one step: the request's 30 tokens beside 40 of the queue's 200 (one request's cap)
    want_ms = p.pass_ms(70) + p.chunk_ms(30, 0) + p.chunk_ms(40, 0)
    assert p.ttft_s(30, queued=200, queued_requests=1) == pytest.approx(want_ms / 1e3)
    assert p.pass_ms(70) == pytest.approx(p.prefill_pass_ms + p.prefill_sq_ms * 70**2)


def test_every_shipped_profile_reads_back_what_to_dict_writes() -> None:
    for path in sorted(PROFILES_DIR.glob("*.json")):
        profile = LatencyProfile.load(path)
        assert LatencyProfile.from_dict(profile.to_dict()) == profile
        assert LatencyProfile.from_dict(json.loads(path.read_text())) == profile


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["prefill"].pop("token_ms"), "missing field 'prefill.token_ms'"),
        (lambda d: d.pop("block_size"), "missing field 'block_size'"),
        (lambda d: d.update(block_size="sixteen"), "field 'block_size' is not a valid int"),
        (lambda d: d["decode"].update(ctx_ms=[1]), "field 'decode.ctx_ms' is not a valid float"),
        (lambda d: d.update(sources="one"), "field 'sources' is not a valid tuple"),
        (lambda d: d.update(decode=3), "'decode' must be an object"),
    ],
)
def test_a_bad_profile_file_names_the_field_as_the_file_spells_it(edit, message) -> None:  # type: ignore[no-untyped-def]
    data = LatencyProfile.load("h100-llama3.1-8b").to_dict()
    edit(data)
    with pytest.raises(ValueError, match=re.escape(message)):
        LatencyProfile.from_dict(data)


def test_a_request_works_what_its_steps_add_to_a_busy_engine() -> None:
    """``work_ms`` (the capacity model's view of one request) is what the request's own steps
    add to a busy engine's: its prefill chunks, each a pass of its own, and its decodes at
    the request's mean context; ``busy_step_ms`` is that engine's step without them."""
    p = LatencyProfile.load("dynamo-mocker-h100")
    m = p.max_num_batched_tokens
    prompt, u, out = 3 * m, 2 * m + 100, 7

    def added_ms(chunks: list[tuple[int, int]], batch: int = 0, ctx: float = 0) -> float:
        return (p.step_s(chunks, 4 + batch, 1000 + ctx, 0) - p.step_s([], 4, 1000, 0)) * 1e3

    before = prompt - u
    chunks = [(m, before), (m, before + m), (100, before + 2 * m)]
    prefill = sum(added_ms([c]) for c in chunks)
    decode = out * added_ms([], 1, prompt + out / 2)
    assert p.work_ms(prompt, u, out) == pytest.approx(prefill + decode)
    assert p.busy_step_ms == pytest.approx(
        p.step_s([], 1, 0, 0) * 1e3 - p.decode_ms(1, 0) + p.decode_ms(0, 0)
    )
    assert p.step_s([], 0, 0, 4096) == 0.0  # no work, no step


def test_each_prefilling_request_pays_its_own_cost_in_a_step() -> None:
    """``prefill_seq_ms``: a step pays it once per prefill chunk it runs, so the sim engine's
    step, the router's TTFT and the capacity model's work all count it per chunk, a slower
    engine pays it slower, and a profile file keeps it."""
    base = LatencyProfile.load("dynamo-mocker-h100")
    p = replace(base, prefill_seq_ms=2.0)
    m = p.max_num_batched_tokens
    two = p.step_s([(100, 0), (50, 400)], 3, 900, 0) - base.step_s([(100, 0), (50, 400)], 3, 900, 0)
    assert two * 1e3 == pytest.approx(2 * 2.0)
    assert (p.ttft_s(2 * m + 1) - base.ttft_s(2 * m + 1)) * 1e3 == pytest.approx(3 * 2.0)
    assert p.work_ms(3 * m, 2 * m + 1, 5) - base.work_ms(3 * m, 2 * m + 1, 5) == pytest.approx(6.0)
    assert p.chunk_ms(0, 100) == 0.0  # no chunk, no cost
    assert p.slowed(1.5).prefill_seq_ms == pytest.approx(3.0)
    assert LatencyProfile.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="prefill_seq_ms must be >= 0"):
        replace(base, prefill_seq_ms=-1.0)
