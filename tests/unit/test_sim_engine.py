"""The real-time sim engine behind ``engines.base.Engine``: streaming, usage with cached tokens,
deterministic outputs, abort, load snapshots, and KV events on a real ZMQ PUB socket."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest
import zmq

from cachemap.events import BlockStored, decode_vllm_batch
from engines.base import EngineError, EngineOutput, EngineRequest, SamplingParams
from engines.profile import LatencyProfile
from engines.sim.engine import SimEngine
from engines.sim.options import SimEngineOptions
from tests.support import wait_for_async

BS = 32


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def request(rid: str, tokens: list[int], max_tokens: int = 8, **sp) -> EngineRequest:
    return EngineRequest(rid, tokens, SamplingParams(max_tokens=max_tokens, **sp))


async def collect(engine: SimEngine, req: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(req)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def engine(time_scale: float = 0.0, **options) -> SimEngine:
    return SimEngine(
        "sim-0",
        "cpu-tiny-llama",
        time_scale=time_scale,
        kv_events_endpoint=None,
        options=SimEngineOptions(**options),
    )


def test_generate_streams_tokens_and_reports_cached_tokens():
    async def main():
        eng = engine()
        await eng.start()
        first = await collect(eng, request("a", prompt(200), max_tokens=6))
        second = await collect(eng, request("b", prompt(200), max_tokens=6))
        await eng.stop()
        return first, second

    first, second = run(main())
    assert [len(o.token_ids) for o in first] == [1] * 6
    assert [o.finished for o in first] == [False] * 5 + [True]
    final = first[-1]
    assert final.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (200, 6)
    assert final.usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == (199 // BS) * BS
    # Same prompt, no seed: same output (deterministic); a seed changes it.
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_seeded_outputs_are_deterministic_and_multi_turn_hits():
    async def main():
        eng = engine()
        await eng.start()
        turn1 = await collect(eng, request("t1", prompt(100), max_tokens=40, seed=7))
        again = await collect(eng, request("t1b", prompt(100), max_tokens=40, seed=7))
        other = await collect(eng, request("t1c", prompt(100), max_tokens=40, seed=8))
        answer = [t for o in turn1 for t in o.token_ids]
        turn2 = await collect(eng, request("t2", prompt(100) + answer + prompt(30, 5000)))
        await eng.stop()
        return turn1, again, other, turn2

    turn1, again, other, turn2 = run(main())
    tokens = lambda outs: [t for o in outs for t in o.token_ids]  # noqa: E731
    assert tokens(turn1) == tokens(again) != tokens(other)
    # Turn 2 re-sends turn 1's prompt and answer: every full block of them is cached,
    # including blocks made of generated tokens.
    assert turn2[-1].usage.cached_tokens == ((100 + 40 - 1) // BS) * BS


def test_stop_token_ends_with_stop():
    async def main():
        eng = engine()
        await eng.start()
        free = await collect(eng, request("a", prompt(50), max_tokens=30, seed=3))
        stop_at = free[9].token_ids[0]
        stopped = await collect(
            eng, request("b", prompt(50), max_tokens=30, seed=3, stop_token_ids=[stop_at])
        )
        await eng.stop()
        return free, stopped

    free, stopped = run(main())
    first_stop = next(i for i, o in enumerate(free) if o.token_ids[0] == free[9].token_ids[0])
    assert len(stopped) == first_stop + 1 and stopped[-1].finish_reason == "stop"


def test_a_request_nobody_streams_gets_one_output_with_every_token():
    """``stream=False`` (vLLM's FINAL_ONLY): the same tokens, usage and finish as the streamed
    request's outputs merged, in one output at the end; a stop token still ends it."""

    async def main():
        eng = engine()
        await eng.start()
        streamed = await collect(eng, request("a", prompt(100), max_tokens=12, seed=5))
        whole = await collect(
            eng, msgspec.structs.replace(request("b", prompt(100), 12, seed=5), stream=False)
        )
        stop_at = streamed[4].token_ids[0]
        stopped = await collect(
            eng,
            msgspec.structs.replace(
                request("c", prompt(100), 12, seed=5, stop_token_ids=[stop_at]), stream=False
            ),
        )
        await eng.stop()
        return streamed, whole, stopped, stop_at

    streamed, whole, stopped, stop_at = run(main())
    assert len(streamed) == 12 and len(whole) == 1 and whole[0].finished
    assert whole[0].token_ids == [t for o in streamed for t in o.token_ids]
    assert whole[0].finish_reason == streamed[-1].finish_reason == "length"
    assert whole[0].usage == msgspec.structs.replace(streamed[-1].usage, cached_tokens=96)
    first_stop = next(i for i, o in enumerate(streamed) if o.token_ids[0] == stop_at)
    assert len(stopped) == 1 and stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == whole[0].token_ids[: first_stop + 1]


def test_abort_ends_the_stream_and_frees_blocks():
    async def main():
        eng = engine(time_scale=1.0)
        await eng.start()
        got: list[EngineOutput] = []

        async def consume():
            async for out in eng.generate(request("long", prompt(300), max_tokens=100_000)):
                got.append(out)

        task = asyncio.create_task(consume())
        assert await wait_for_async(lambda: bool(got)), "no output came"
        load = eng.load()
        await eng.abort("long")
        await task
        after = eng.load()
        await eng.stop()
        return got, load, after

    got, load, after = run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert got[-1].usage.prompt_tokens == 300
    assert load.running == 1 and load.gpu_kv_usage > 0
    assert after.running == 0 and after.gpu_kv_usage == 0


def test_load_snapshot_counts_waiting_and_running():
    async def main():
        eng = engine(time_scale=1.0, max_num_seqs=1)
        await eng.start()
        gens = [
            eng.generate(request(f"r{i}", prompt(64, 1000 * (i + 1)), max_tokens=1000))
            for i in range(3)
        ]
        firsts = [asyncio.create_task(anext(g)) for g in gens]
        # all three past their request overhead, at the scheduler, and a step taken since
        # (all three can be waiting for an instant before the first step admits one)
        sched = eng.scheduler
        at_scheduler = lambda: len(sched.running) == 1 and len(sched.waiting) == 2  # noqa: E731
        assert await wait_for_async(at_scheduler), "the requests never reached the scheduler"
        snap = eng.load()
        await eng.stop()
        for t in firsts:
            t.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for g in gens:
            await g.aclose()
        return snap

    snap = run(main())
    assert (snap.running, snap.waiting) == (1, 2)
    assert snap.queued_prefill_tokens == 128 and snap.instance_id == "sim-0"


def test_queued_prefill_work_leaves_out_a_waiting_requests_cached_prefix():
    async def main():
        eng = engine(time_scale=1.0, max_num_seqs=1)
        await eng.start()
        await collect(eng, request("warm", prompt(128), max_tokens=1))  # caches 4 blocks
        busy = eng.generate(request("busy", prompt(64, 5000), max_tokens=1000))
        first = await anext(busy)  # holds the only slot
        follow = eng.generate(request("follow", prompt(192), max_tokens=1))
        task = asyncio.create_task(anext(follow))
        # past its request overhead, queued behind the busy one
        assert await wait_for_async(lambda: len(eng.scheduler.waiting) == 1), "follow not queued"
        snap = eng.load()
        await eng.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await busy.aclose()
        await follow.aclose()
        return first, snap

    first, snap = run(main())
    assert first.token_ids and snap.waiting == 1
    # 192-token prompt, 128 of them cached: only 64 tokens of prefill are queued.
    assert snap.queued_prefill_tokens == 64


def test_failures_are_engine_errors_and_invalid_requests_refusals():
    async def main():
        eng = engine(max_model_len=256)
        with pytest.raises(EngineError):  # not started
            await collect(eng, request("a", prompt(10)))
        await eng.start()
        await eng.check_health()
        # a request no engine could serve is refused (a client error), as vLLM does, and the
        # engine goes on
        refused = await collect(eng, request("b", prompt(300)))
        served = await collect(eng, request("c", prompt(10)))
        await eng.check_health()
        await eng.stop()
        with pytest.raises(EngineError):
            await eng.check_health()
        return refused, served

    refused, served = run(main())
    assert [(o.finished, o.finish_reason) for o in refused] == [(True, "error")]
    assert "max_model_len" in refused[0].error and refused[0].usage.prompt_tokens == 300
    assert served[-1].finished and served[-1].finish_reason == "length"


def test_kv_events_arrive_on_a_zmq_sub_socket():
    async def main():
        eng = SimEngine(
            "sim-z", "cpu-tiny-llama", time_scale=0.0, kv_events_endpoint="tcp://127.0.0.1:*"
        )
        await eng.start()
        endpoint = eng.kv_events_endpoint
        assert endpoint and endpoint.startswith("tcp://127.0.0.1:")
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        frames = []
        # PUB drops what it sends before the subscription lands: probe until one batch arrives.
        for i in range(100):
            await collect(eng, request(f"probe{i}", prompt(40, 50_000 + 100 * i), max_tokens=1))
            if sub.poll(100):
                frames.append(sub.recv_multipart())
                break
        await collect(eng, request("main", prompt(100), max_tokens=1))
        while sub.poll(5000):
            frames.append(sub.recv_multipart())
            _, events = decode_vllm_batch(frames[-1][2])
            if any(isinstance(e, BlockStored) and e.token_ids[:1] == [1000] for e in events):
                break
        await eng.stop()
        sub.close(linger=0)
        ctx.term()
        return frames

    frames = run(main())
    assert len(frames) >= 2
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert all(f[0] == b"" and len(f) == 3 and len(f[1]) == 8 for f in frames)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    _, events = decode_vllm_batch(frames[-1][2])
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].medium == "GPU" and stored[0].block_size == BS
    assert stored[0].token_ids == prompt(96)  # 3 full blocks of the 100-token prompt


def test_abort_during_the_request_overhead():
    slow = dataclasses.replace(LatencyProfile.load("cpu-tiny-llama"), request_overhead_ms=500.0)

    async def main():
        eng = SimEngine("sim-0", slow, kv_events_endpoint=None)
        await eng.start()
        gen = eng.generate(request("a", prompt(64), max_tokens=4))
        first = asyncio.create_task(anext(gen))
        assert await wait_for_async(lambda: eng.load().waiting == 1), "the request never came"
        # still in its 500 ms overhead: counted waiting, not yet at the scheduler
        assert eng.scheduler.idle, "the request left its overhead before the abort"
        await eng.abort("a")
        out = await first
        snap = eng.load()
        await gen.aclose()
        await eng.stop()
        return out, snap

    out, snap = run(main())
    assert out.finished and out.finish_reason == "abort" and out.usage.completion_tokens == 0
    assert snap.waiting == snap.running == 0


def test_many_concurrent_requests_under_kv_pressure():
    """More work than KV blocks: requests queue and get preempted, yet every stream ends with
    all its tokens and no block stays allocated."""

    async def main():
        eng = engine(num_gpu_blocks=24, max_num_seqs=16)  # 23 usable blocks of 32 tokens
        await eng.start()
        reqs = [request(f"r{i}", prompt(100 + 7 * i, 1000 * (i % 3 + 1)), 60) for i in range(30)]
        results = await asyncio.gather(*(collect(eng, r) for r in reqs))
        snap = eng.load()
        preemptions = eng.scheduler.num_preemptions
        await eng.stop()
        return results, snap, preemptions

    results, snap, preemptions = run(main())
    for outs in results:
        assert sum(len(o.token_ids) for o in outs) == 60 and outs[-1].finish_reason == "length"
    assert preemptions > 0 and snap.gpu_kv_usage == 0 and (snap.running, snap.waiting) == (0, 0)
    assert sum(o[-1].usage.cached_tokens for o in results) > 0


def test_coalesce_merges_what_queued_up_behind_a_slow_consumer():
    """A consumer that takes 20 ms per output behind an engine stepping every ~1 ms gets fewer,
    larger outputs carrying the same tokens in order, one final with the usage; a fast one gets
    them as they come; ``whole`` gets one. Closing the coalesced stream early, or cancelling a
    wait for the whole, aborts the engine request."""
    from engines.base import coalesce, merge_outputs, whole

    async def run(delay_s: float) -> list[EngineOutput]:
        engine = SimEngine("e", kv_events_endpoint=None, time_scale=0.05)
        await engine.start()
        try:
            req = EngineRequest("r", list(range(100)), SamplingParams(max_tokens=40, seed=1))
            outs = []
            async for out in coalesce(engine.generate(req)):
                outs.append(out)
                await asyncio.sleep(delay_s)
            plain = [o async for o in engine.generate(msgspec.structs.replace(req, request_id="p"))]
            # "x" and "c" run for seconds unless aborted (4,000 tokens)
            endless = SamplingParams(max_tokens=4000, seed=1)
            early = coalesce(engine.generate(EngineRequest("x", list(range(100)), endless)))
            await anext(early)
            await early.aclose()  # closes the engine's stream on its way out
            assert engine.load().running == 0  # the early close aborted it
            one = await whole(engine.generate(msgspec.structs.replace(req, request_id="w")))
            waiting = asyncio.ensure_future(
                whole(engine.generate(EngineRequest("c", list(range(100)), endless)))
            )
            assert await wait_for_async(lambda: engine.load().running == 1), "c never ran"
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)  # its cancellation ran
            assert engine.load().running == 0  # the cancelled wait aborted it
        finally:
            await engine.stop()
        tokens = [t for o in plain for t in o.token_ids]
        assert [t for o in outs for t in o.token_ids] == tokens
        assert merge_outputs(plain).token_ids == tokens
        assert one.finished and one.token_ids == tokens
        usage = outs[-1].usage
        assert outs[-1].finished and usage is not None and usage.completion_tokens == 40
        assert sum(o.finished for o in outs) == 1
        return outs

    slow, fast = asyncio.run(run(0.02)), asyncio.run(run(0.0))
    assert len(slow) < len(fast) / 2, (len(slow), len(fast))
