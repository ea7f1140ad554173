"""The ingress's TTFT counts every request (issue 59): a non-streamed one, which its engine
delivers whole, is dated by the engine's first-token interval, not left out; inter-token
latencies stay with outputs that stream to the ingress."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support import Server, free_port, metric, sim_stack

MODEL = "tiny-sim"
TTFT = "kvroute_time_to_first_token_seconds"
E2E = "kvroute_e2e_request_latency_seconds"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # time_scale 0.5: a decode step of the tiny profile takes milliseconds, so a request's
    # first token comes well before its end
    with Server(sim_stack(time_scale=0.5), free_port()) as s:
        yield s


def _total(base: str, name: str) -> float:
    return sum(metric(base, name).values())


def test_non_streamed_requests_count_in_ttft_and_time_per_output_token(server: Server) -> None:
    base = f"http://127.0.0.1:{server.port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "how long until the first token?"}]
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16)
        assert r.usage.completion_tokens == 16
    assert _total(base, f"{TTFT}_count") == 2
    assert _total(base, "kvroute_request_time_per_output_token_seconds_count") == 2
    # the first token came before the whole answer did: TTFT is less than the latency by the
    # 15 decode steps after it, and the time per output token is that over 15
    ttft, e2e = _total(base, f"{TTFT}_sum"), _total(base, f"{E2E}_sum")
    tpot = _total(base, "kvroute_request_time_per_output_token_seconds_sum")
    assert 0 < ttft < e2e
    assert tpot * 15 == pytest.approx(e2e - ttft, rel=0.25, abs=0.01)
    # a whole response has no gaps the ingress sees: no inter-token samples
    assert _total(base, "kvroute_inter_token_latency_seconds_count") == 0

    chunks = list(
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, stream=True)
    )
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1
    assert _total(base, f"{TTFT}_count") == 3
    assert _total(base, f"{E2E}_count") == 3
    assert _total(base, "kvroute_inter_token_latency_seconds_count") > 0
