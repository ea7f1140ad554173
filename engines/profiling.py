"""Measuring a real vLLM engine for the sim engine's latency profile (``kvroute profile`` runs
it): the grids of points, their timings and the fit.

The profile is ``engines.profile.LatencyProfile``'s JSON (see that module for the model):

    prefill_ms(n uncached, c cached) = base_ms + token_ms * n + attn_ms * n * (c + n / 2)
    decode_step_ms(batch, context)   = base_ms + seq_ms * batch + ctx_ms * context
    ttft_ms = request_overhead_ms + prefill_ms     (an extra key; see ``fit``)

Prefill points are timed as the TTFT of ``max_tokens=1`` requests: fresh random tokens (no
accidental hits) after a warmed prefix of ``c`` tokens, whose hit is checked against
``usage.cached_tokens``; ``n`` stays within one scheduler step (``max_num_batched_tokens``).
Decode points are the median gap between consecutive tokens while ``batch`` requests of the
same length all decode. One non-negative least-squares fit over both sets gives the five
coefficients. The raw points and the fit's errors are written next to them (``measurements``,
``fit``; ``LatencyProfile`` ignores both). ``cpu_load_gbps`` cannot be measured on the CPU build
(no offloading connector there) and comes from ``--cpu-load-gbps``.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

GRIDS: dict[str, dict[str, Any]] = {
    # (uncached tokens, cached context) and (batch, prompt tokens)
    "full": {
        "prefill": [(n, 0) for n in (32, 128, 512, 1024, 2048)]
        + [(n, c) for c in (1024, 3072) for n in (64, 512)],
        "decode": [(b, n) for b in (1, 8, 32) for n in (128, 1024)],
        "decode_tokens": 24,
    },
    "quick": {
        "prefill": [(32, 0), (2048, 0), (64, 1024)],
        "decode": [(1, 128), (8, 128)],
        "decode_tokens": 12,
    },
}


@dataclass(slots=True)
class Measurements:
    prefill: list[dict[str, float]] = field(default_factory=list)  # n, c, ms, cached
    decode: list[dict[str, float]] = field(default_factory=list)  # batch, context, ms
    engine: dict[str, Any] = field(default_factory=dict)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (drop the most negative coefficient and refit until none)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def fit(m: Measurements) -> dict[str, float]:
    """The coefficients (ms) from the measured points, and the fit's median relative errors.

    NOTE: a TTFT also carries a per-request latency outside the engine's step (input
    processing, the IPC to the engine core and back) that decode steps, pipelined, do not show;
    it is fitted as ``request_overhead_ms`` so that ``base_ms`` stays the step's own cost.
    """
    rows, ys = [], []
    for p in m.prefill:
        n, c = p["uncached"], p["context"]
        rows.append([1.0, 1.0, n, n * (c + n / 2), 0.0, 0.0])
        ys.append(p["ms"])
    for d in m.decode:
        rows.append([1.0, 0.0, 0.0, 0.0, d["batch"], d["context"]])
        ys.append(d["ms"])
    a, y = np.array(rows), np.array(ys)
    x = nnls(a, y)
    rel = np.abs(a @ x - y) / y
    k = len(m.prefill)
    return {
        "base_ms": float(x[0]),
        "request_overhead_ms": float(x[1]),
        "token_ms": float(x[2]),
        "attn_ms": float(x[3]),
        "seq_ms": float(x[4]),
        "ctx_ms": float(x[5]),
        "prefill_median_rel_err": float(np.median(rel[:k])) if k else 0.0,
        "decode_median_rel_err": float(np.median(rel[k:])) if len(rel) > k else 0.0,
    }


async def measure(engine: Any, grid: dict[str, Any], repeats: int, seed: int = 0) -> Measurements:
    """Time ``grid`` on a started ``VllmEngine`` (its prefix cache gets filled with noise)."""
    from engines.base import EngineRequest, SamplingParams

    rng = np.random.default_rng(seed)
    vocab = int(engine.vocab_size)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = iter(range(10**9))

    def fresh(n: int) -> list[int]:
        tokens: list[int] = rng.integers(10, vocab, n).tolist()
        return tokens

    async def timed(tokens: list[int], sp: SamplingParams = one) -> tuple[list[float], Any]:
        t0, stamps, last = time.perf_counter(), [], None
        async for o in engine.generate(EngineRequest(f"profile-{next(ids)}", tokens, sp)):
            stamps.append(time.perf_counter() - t0)
            last = o
        assert last is not None, "the engine yielded no output"
        return stamps, last.usage

    await timed(fresh(64))  # warm-up
    out = Measurements()
    for n, c in grid["prefill"]:
        runs = []
        for _ in range(repeats):
            prefix = fresh(c)
            if c:
                await timed(prefix)
            stamps, usage = await timed(prefix + fresh(n))
            runs.append((stamps[0] * 1e3, usage.cached_tokens))
        ms = statistics.median(r[0] for r in runs)
        cached = min(r[1] for r in runs)
        out.prefill.append({"uncached": n + c - cached, "context": cached, "ms": ms})
    t = grid["decode_tokens"]
    for batch, n in grid["decode"]:
        for _ in range(repeats):
            sp = SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            res = await asyncio.gather(*(timed(fresh(n), sp) for _ in range(batch)))
            firsts = [t0 + s[0] for s, _ in res]
            start = max(firsts) - t0  # every request decodes from here on
            gaps = [
                b - a for s, _ in res for a, b in itertools.pairwise(s) if a >= start and len(s) > 2
            ]
            if gaps:
                ms = statistics.median(gaps) * 1e3
                context = batch * (n + t / 2)
                out.decode.append({"batch": batch, "context": context, "ms": ms})
    return out
