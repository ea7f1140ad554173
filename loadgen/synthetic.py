"""Synthetic workloads, emitted as Bailian-shaped ``TraceRequest`` lists (16-token blocks).

- ``to-c``: multi-turn chat. Sessions arrive as a Poisson process; each has a geometric number
  of turns; turn ``k`` re-sends the whole conversation (prompt and reply of turn ``k-1``) plus a
  new user message after an exponential think time.
- ``to-b``: API programs. Each program owns a system prompt; requests pick a program by Zipf
  popularity and send its system prompt plus a fresh user part, single-turn.
- ``mix``: both, with ``to_b_fraction`` of the requests from ``to-b``.
- ``random``: unique prompts of fixed lengths (no sharing), for raw throughput.

Defaults follow "KVCache Cache in the Wild" (Wang et al., USENIX ATC'25) where it gives a number:
80% of reuses within 10 minutes for to-C (think time exponential, P(<=600 s) = 0.8, so a mean of
600/ln 5 = 373 s) and within 10 s for to-B (per-program gap mean 10/ln 5 = 6.2 s, which with
``programs`` and ``rate`` sets the program count), under 0.1% multi-turn requests in to-B, and
skewed reuse (Zipf over programs); the to-B lengths are set so its ideal hit rate lands near the
paper's 54%. Other lengths are assumed (log-normal medians below) and every
parameter can be set from the CLI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadgen.traces import FORMATS, TraceRequest

SYNTH_BLOCK_SIZE = FORMATS["bailian"][1]
WORKLOADS: tuple[str, ...] = ("to-c", "to-b", "mix", "random")


@dataclass(slots=True)
class SynthParams:
    rate: float = 5.0  # requests/s over the whole workload
    duration_s: float = 60.0
    max_requests: int | None = None
    seed: int = 0
    # to-C
    turns_mean: float = 3.0  # geometric number of turns per session, >= 1
    think_time_s: float = 600.0 / math.log(5.0)
    user_tokens: int = 300  # log-normal median of a new user message
    output_tokens: int = 250  # log-normal median of a reply
    length_sigma: float = 0.8
    # to-B
    programs: int = 20
    zipf_s: float = 1.1
    system_prompt_tokens: int = 600
    api_user_tokens: int = 500
    api_output_tokens: int = 150
    to_b_fraction: float = 0.5
    # random
    input_tokens: int = 128
    max_prompt_tokens: int = 32_768

    def validate(self) -> None:
        checks = {
            "rate": self.rate > 0,
            "duration": self.duration_s > 0,
            "turns-mean": self.turns_mean >= 1,
            "think-time-s": self.think_time_s >= 0,
            "user-tokens": self.user_tokens >= 1,
            "output-tokens": self.output_tokens >= 1,
            "length-sigma": self.length_sigma >= 0,
            "programs": self.programs >= 1,
            "zipf": self.zipf_s >= 0,
            "system-prompt-tokens": self.system_prompt_tokens >= 1,
            "api-user-tokens": self.api_user_tokens >= 1,
            "api-output-tokens": self.api_output_tokens >= 1,
            "to-b-fraction": 0 <= self.to_b_fraction <= 1,
            "input-tokens": self.input_tokens >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"--{name} is out of range")
        if self.max_requests is not None and self.max_requests <= 0:
            raise ValueError(f"--max-requests must be > 0, got {self.max_requests}")


class _Ids:
    """Fresh hash ids and chat ids, shared across generators of one workload."""

    def __init__(self) -> None:
        self.next_hash = 0
        self.next_chat = 0

    def hashes(self, n: int) -> list[int]:
        out = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        return out

    def chat(self) -> int:
        self.next_chat += 1
        return self.next_chat - 1


def _lognormal(rng: np.random.Generator, median: int, sigma: float, cap: int) -> int:
    return int(min(cap, max(1, round(median * math.exp(sigma * rng.standard_normal())))))


def _to_c(p: SynthParams, rate: float, rng: np.random.Generator, ids: _Ids) -> list[TraceRequest]:
    bs, out = SYNTH_BLOCK_SIZE, []
    session_rate = rate / p.turns_mean
    # NOTE: warm start. Sessions also begin before 0 so the run sees the steady state (later
    # turns of running conversations); turns before 0 are dropped, their children then look
    # like a trace window cut mid-session (parent not in the workload).
    t = -p.think_time_s * p.turns_mean * 4 + rng.exponential(1.0 / session_rate)
    while t < p.duration_s:
        turns = int(rng.geometric(1.0 / p.turns_mean))
        blocks: list[int] = []  # hash ids of the conversation's full prompt blocks so far
        context = 0  # tokens of the previous prompt + reply
        parent: int | None = None
        ts = t
        for turn in range(1, turns + 1):
            if ts >= p.duration_s:
                break
            length = context + _lognormal(rng, p.user_tokens, p.length_sigma, p.max_prompt_tokens)
            if length > p.max_prompt_tokens:
                break
            n = math.ceil(length / bs)
            hash_ids = blocks + ids.hashes(n - len(blocks))
            reply = _lognormal(rng, p.output_tokens, p.length_sigma, 8192)
            chat = ids.chat()
            if ts >= 0:
                req = TraceRequest(ts, length, reply, tuple(hash_ids), chat, parent, "text", turn)
                out.append(req)
            # NOTE: only full blocks of this prompt are shared with the next turn; the partial
            # last block's content changes once the reply is appended, so it gets a new id.
            blocks = hash_ids[: length // bs]
            context, parent = length + reply, chat
            ts += rng.exponential(p.think_time_s) if p.think_time_s > 0 else 0.0
        t += rng.exponential(1.0 / session_rate)
    return out


def _to_b(p: SynthParams, rate: float, rng: np.random.Generator, ids: _Ids) -> list[TraceRequest]:
    bs = SYNTH_BLOCK_SIZE
    sys_len = [
        _lognormal(rng, p.system_prompt_tokens, 0.5, p.max_prompt_tokens // 2)
        for _ in range(p.programs)
    ]
    sys_blocks = [ids.hashes(n // bs) for n in sys_len]
    weights = 1.0 / np.arange(1, p.programs + 1) ** p.zipf_s
    weights /= weights.sum()
    out: list[TraceRequest] = []
    t = rng.exponential(1.0 / rate)
    while t < p.duration_s:
        prog = int(rng.choice(p.programs, p=weights))
        length = sys_len[prog] + _lognormal(rng, p.api_user_tokens, p.length_sigma, 8192)
        shared = sys_blocks[prog]
        hash_ids = shared + ids.hashes(math.ceil(length / bs) - len(shared))
        reply = _lognormal(rng, p.api_output_tokens, p.length_sigma, 8192)
        out.append(TraceRequest(t, length, reply, tuple(hash_ids), ids.chat(), None, "api", 1))
        t += rng.exponential(1.0 / rate)
    return out


def _random(p: SynthParams, ids: _Ids) -> list[TraceRequest]:
    n = p.max_requests if p.max_requests is not None else math.ceil(p.rate * p.duration_s)
    bs, length = SYNTH_BLOCK_SIZE, p.input_tokens
    return [
        TraceRequest(i / p.rate, length, p.output_tokens, tuple(ids.hashes(math.ceil(length / bs))))
        for i in range(n)
    ]


def generate(kind: str, p: SynthParams) -> list[TraceRequest]:
    """A synthetic workload sorted by timestamp (seconds), cut at duration and max_requests."""
    if kind not in WORKLOADS:
        raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}; got {kind!r}")
    p.validate()
    rng, ids = np.random.default_rng(p.seed), _Ids()
    if kind == "random":
        reqs = _random(p, ids)
    elif kind == "to-c":
        reqs = _to_c(p, p.rate, rng, ids)
    elif kind == "to-b":
        reqs = _to_b(p, p.rate, rng, ids)
    else:
        reqs = _to_b(p, p.rate * p.to_b_fraction, rng, ids) if p.to_b_fraction > 0 else []
        if p.to_b_fraction < 1:
            reqs += _to_c(p, p.rate * (1 - p.to_b_fraction), rng, ids)
    reqs.sort(key=lambda r: r.timestamp_s)
    return reqs[: p.max_requests] if p.max_requests is not None else reqs
