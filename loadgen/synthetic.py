"""Synthetic workloads, emitted as Bailian-shaped ``TraceRequest`` lists (16-token blocks).

- ``to-c``: multi-turn chat. Sessions arrive as a Poisson process; each has a geometric number
  of turns; turn ``k`` re-sends the whole conversation (prompt and reply of turn ``k-1``) plus a
  new user message after an exponential think time. By default one type, ``text``, with no
  system prompt; ``chat_types`` makes it a mix of types (``ChatType``: share of sessions, shared
  system prompt, mean turns, think time, user-message length), as ``BAILIAN_TYPES`` does.
- ``to-b``: API programs. Each program owns a system prompt; requests pick a program by Zipf
  popularity and send its system prompt plus a fresh user part, single-turn.
- ``mix``: both, with ``to_b_fraction`` of the requests from ``to-b``.
- ``random``: unique prompts of fixed lengths (no sharing), for raw throughput.
- ``agentic``: tool-use agents. A few long tool/system prefixes (Zipf-popular); sessions arrive
  as a Poisson process and run a geometric number of steps, each after an exponential tool time.
  A step re-sends the session's whole context (prefix, task, every earlier reply and tool
  result) plus, after its first, the last step's short tool result; with ``agent_fanout_prob``
  a step is a burst of ``k`` (uniform in 2..``agent_fanout_max``) parallel calls sent at the
  same instant, each the shared context plus its own short sub-task, whose replies and tool
  results all join the context of the next step.
- ``rag``: retrieval-augmented, single-turn. Each request is one shared system prompt, 1-3
  documents drawn without replacement from a Zipf-popular corpus (in draw order, so the same
  documents in another order share only the system prompt and the documents before the first
  difference, as a prefix cache sees them) and a short question.

Defaults follow "KVCache Cache in the Wild" (Wang et al., USENIX ATC'25) where it gives a number:
80% of reuses within 10 minutes for to-C (think time exponential, P(<=600 s) = 0.8, so a mean of
600/ln 5 = 373 s) and within 10 s for to-B (per-program gap mean 10/ln 5 = 6.2 s, which with
``programs`` and ``rate`` sets the program count), under 0.1% multi-turn requests in to-B, and
skewed reuse (Zipf over programs); the to-B lengths are set so its ideal hit rate lands near the
paper's 54%. Other lengths are assumed (log-normal medians below) and every
parameter can be set from the CLI.

``agentic`` and ``rag`` have no measured source in the paper; their defaults are assumptions,
each said below. Their block ids are given by content, by a trie over (previous block id, what
the block holds), so two prompts share a block id exactly when they agree on every token up to
the end of that block; the partial last block of a prompt is a block too (two identical prompts
share it; a longer prompt that extends it gets another id, as its content differs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.traces import FORMATS, TraceRequest

SYNTH_BLOCK_SIZE = FORMATS["bailian"][1]
WORKLOADS: tuple[str, ...] = ("to-c", "to-b", "mix", "random", "agentic", "rag")


@dataclass(frozen=True, slots=True)
class ChatType:
    """One type of to-C session. ``share``: relative weight among the types, per session;
    ``system_tokens``: a system prompt every session of the type starts with (its full blocks
    shared, 0 for none); ``turns_mean``: geometric turns, so a turn is followed by another with
    probability ``1 - 1/turns_mean``; ``think_time_s``: mean (exponential) time between turns;
    ``user_tokens``: log-normal median of a new user message."""

    name: str
    share: float
    system_tokens: int
    turns_mean: float
    think_time_s: float
    user_tokens: int


# Four types in the Qwen-Bailian trace's shape. NOTE: hand-picked after "KVCache Cache in the
# Wild"'s qualitative findings (types differ in continuation probability and in reuse time:
# under a minute for text, minutes for image and file), not fitted to its published figures.
# Next-turn probabilities 0.55/0.1/0.45/0.65; user medians are means of 12/60/40/160 blocks
# over e^(0.8^2/2) = 1.38, the log-normal's mean at the default ``length_sigma``.
BAILIAN_TYPES: tuple[ChatType, ...] = (
    ChatType("text", 0.55, 640, 1 / (1 - 0.55), 45.0, 140),
    ChatType("search", 0.15, 960, 1 / (1 - 0.1), 25.0, 700),
    ChatType("image", 0.15, 320, 1 / (1 - 0.45), 155.0, 465),
    ChatType("file", 0.15, 480, 1 / (1 - 0.65), 305.0, 1860),
)


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
    # None: one type "text" of the four fields above, no system prompt
    chat_types: tuple[ChatType, ...] | None = None
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
    # agentic (assumed: agent frameworks' system prompt plus tool schemas run to several
    # thousand tokens; steps are short tool calls and short tool outputs, a few seconds apart)
    agent_prefixes: int = 4  # distinct tool/system prefixes (one per agent kind)
    agent_prefix_tokens: int = 6000  # log-normal median (sigma 0.3) of a prefix
    agent_prefix_zipf: float = 1.0  # Zipf exponent of the prefixes' popularity
    agent_task_tokens: int = 400  # log-normal median of a session's task (first user message)
    agent_steps_mean: float = 8.0  # geometric number of steps per session, >= 1
    agent_step_s: float = 3.0  # mean (exponential) time between steps: tool run + generation
    agent_output_tokens: int = 80  # log-normal median of a reply (a tool call)
    agent_result_tokens: int = 200  # log-normal median of a tool result
    agent_subtask_tokens: int = 60  # log-normal median of a parallel call's own instruction
    agent_fanout_prob: float = 0.25  # probability that a step is a burst of parallel calls
    agent_fanout_max: int = 6  # a burst has k calls, k uniform in 2..agent_fanout_max
    # rag (assumed: RAGCache (Jin et al., 2024) reports a skewed document popularity; 1-3
    # retrieved chunks of 1-4k tokens, as issue 31 specifies the workload)
    rag_documents: int = 2000  # corpus size
    rag_zipf: float = 1.0  # Zipf exponent of document popularity
    rag_doc_tokens: int = 2000  # log-normal median (sigma 0.4) of a document, clipped below
    rag_doc_min_tokens: int = 1000
    rag_doc_max_tokens: int = 4000
    rag_docs_max: int = 3  # documents per request, uniform in 1..rag_docs_max
    rag_system_tokens: int = 300  # the one system prompt every request starts with
    rag_question_tokens: int = 40  # log-normal median of the question
    rag_output_tokens: int = 200  # log-normal median of the answer

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
            "max-prompt-tokens": self.max_prompt_tokens >= 1,
            "agent-prefixes": self.agent_prefixes >= 1,
            "agent-prefix-tokens": self.agent_prefix_tokens >= 1,
            "agent-prefix-zipf": self.agent_prefix_zipf >= 0,
            "agent-task-tokens": self.agent_task_tokens >= 1,
            "agent-steps-mean": self.agent_steps_mean >= 1,
            "agent-step-s": self.agent_step_s >= 0,
            "agent-output-tokens": self.agent_output_tokens >= 1,
            "agent-result-tokens": self.agent_result_tokens >= 1,
            "agent-subtask-tokens": self.agent_subtask_tokens >= 1,
            "agent-fanout-prob": 0 <= self.agent_fanout_prob <= 1,
            "agent-fanout-max": self.agent_fanout_max >= 2,
            "rag-documents": self.rag_documents >= 1,
            "rag-zipf": self.rag_zipf >= 0,
            "rag-doc-tokens": self.rag_doc_tokens >= 1,
            "rag-doc-min-tokens": 1 <= self.rag_doc_min_tokens <= self.rag_doc_max_tokens,
            "rag-docs-max": 1 <= self.rag_docs_max <= self.rag_documents,
            "rag-system-tokens": self.rag_system_tokens >= 0,
            "rag-question-tokens": self.rag_question_tokens >= 1,
            "rag-output-tokens": self.rag_output_tokens >= 1,
        }
        for i, ct in enumerate(self.chat_types if self.chat_types is not None else ()):
            checks[f"chat-types[{i}].share"] = ct.share > 0
            checks[f"chat-types[{i}].system-tokens"] = ct.system_tokens >= 0
            checks[f"chat-types[{i}].turns-mean"] = ct.turns_mean >= 1
            checks[f"chat-types[{i}].think-time-s"] = ct.think_time_s >= 0
            checks[f"chat-types[{i}].user-tokens"] = ct.user_tokens >= 1
        if self.chat_types is not None and not self.chat_types:
            checks["chat-types"] = False
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


class _Blocks:
    """Block ids by content: the id of a block is the trie node reached by (id of the block
    before it, the pieces of segments it holds). A piece is ``(segment key, start, end)`` in
    the segment's tokens; a segment key names one piece of content (a prefix, a document, a
    reply) wherever it appears."""

    def __init__(self, ids: _Ids, block_size: int) -> None:
        self.ids, self.bs = ids, block_size
        self.nodes: dict[tuple[int, tuple[tuple[Any, int, int], ...]], int] = {}
        self.appended: dict[Any, tuple[tuple[int, ...], tuple[tuple[Any, int, int], ...]]] = {}

    def node(self, parent: int, content: tuple[tuple[Any, int, int], ...]) -> int:
        key = (parent, content)
        got = self.nodes.get(key)
        if got is None:
            got = self.nodes[key] = self.ids.hashes(1)[0]
        return got


class _Prompt:
    """A prompt built by appending segments; its full blocks' ids are kept as it grows, so a
    session's context is never hashed twice. ``copy`` forks it (parallel calls)."""

    __slots__ = ("blocks", "full", "length", "tail", "tail_len")

    def __init__(self, blocks: _Blocks) -> None:
        self.blocks = blocks
        self.full: list[int] = []
        self.tail: list[tuple[Any, int, int]] = []
        self.tail_len = 0
        self.length = 0

    def copy(self) -> _Prompt:
        c = _Prompt(self.blocks)
        c.full, c.tail, c.tail_len, c.length = (
            list(self.full),
            list(self.tail),
            self.tail_len,
            self.length,
        )
        return c

    def append(self, key: Any, n: int) -> _Prompt:
        # NOTE: memoised on (last full block, partial tail, segment): a popular document after
        # the same prefix is walked once, not once per request
        last = self.full[-1] if self.full else -1
        memo = (last, tuple(self.tail), key, n)
        got = self.blocks.appended.get(memo)
        if got is None:
            got = self._walk(last, key, n)
            self.blocks.appended[memo] = got
        new, tail = got
        self.full.extend(new)
        self.tail, self.tail_len = list(tail), sum(e - s for _, s, e in tail)
        self.length += n
        return self

    def _walk(
        self, last: int, key: Any, n: int
    ) -> tuple[tuple[int, ...], tuple[tuple[Any, int, int], ...]]:
        blocks, bs = self.blocks, self.blocks.bs
        tail, tail_len = list(self.tail), self.tail_len
        take = min(n, bs - tail_len)
        tail.append((key, 0, take))
        if tail_len + take < bs:
            return (), tuple(tail)
        fresh = len(blocks.nodes)
        new = [blocks.node(last, tuple(tail))]
        # NOTE: past a block new to the trie every block of this walk is new too (its parent
        # is): they take fresh ids without a trie entry. Only this walk (memoised in
        # ``append``: a segment key always has one length) can reach them again.
        full, rest = divmod(n - take, bs)
        for j in range(full):
            s = take + j * bs
            if len(blocks.nodes) > fresh:
                new.extend(blocks.ids.hashes(full - j))
                break
            new.append(blocks.node(new[-1], ((key, s, s + bs),)))
        return tuple(new), (((key, n - rest, n),) if rest else ())

    def hash_ids(self) -> tuple[int, ...]:
        if not self.tail:
            return tuple(self.full)
        parent = self.full[-1] if self.full else -1
        return (*self.full, self.blocks.node(parent, tuple(self.tail)))


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w: np.ndarray = 1.0 / np.arange(1, n + 1) ** s
    return w / float(w.sum())


def _lognormal(rng: np.random.Generator, median: int, sigma: float, cap: int) -> int:
    return int(min(cap, max(1, round(median * math.exp(sigma * rng.standard_normal())))))


def _to_c(p: SynthParams, rate: float, rng: np.random.Generator, ids: _Ids) -> list[TraceRequest]:
    bs, out = SYNTH_BLOCK_SIZE, []
    types = p.chat_types or (ChatType("text", 1.0, 0, p.turns_mean, p.think_time_s, p.user_tokens),)
    weights = np.array([ct.share for ct in types]) / sum(ct.share for ct in types)
    system = [ids.hashes(ct.system_tokens // bs) for ct in types]
    session_rate = rate / float(weights @ np.array([ct.turns_mean for ct in types]))
    # NOTE: warm start. Sessions also begin before 0 so the run sees the steady state (later
    # turns of running conversations); turns before 0 are dropped, their children then look
    # like a trace window cut mid-session (parent not in the workload).
    warm_s = max(ct.think_time_s * ct.turns_mean for ct in types) * 4
    t = -warm_s + rng.exponential(1.0 / session_rate)
    while t < p.duration_s:
        # NOTE: one type draws nothing, so the default stays seed for seed what it always was
        k = int(rng.choice(len(types), p=weights)) if len(types) > 1 else 0
        ct = types[k]
        turns = int(rng.geometric(1.0 / ct.turns_mean))
        blocks = system[k]  # hash ids of the conversation's full prompt blocks so far
        context = ct.system_tokens  # tokens of the previous prompt + reply
        parent: int | None = None
        ts = t
        for turn in range(1, turns + 1):
            if ts >= p.duration_s:
                break
            length = context + _lognormal(rng, ct.user_tokens, p.length_sigma, p.max_prompt_tokens)
            if length > p.max_prompt_tokens:
                break
            n = math.ceil(length / bs)
            hash_ids = blocks + ids.hashes(n - len(blocks))
            reply = _lognormal(rng, p.output_tokens, p.length_sigma, 8192)
            chat = ids.chat()
            if ts >= 0:
                req = TraceRequest(ts, length, reply, tuple(hash_ids), chat, parent, ct.name, turn)
                out.append(req)
            # NOTE: only full blocks of this prompt are shared with the next turn; the partial
            # last block's content changes once the reply is appended, so it gets a new id.
            blocks = hash_ids[: length // bs]
            context, parent = length + reply, chat
            ts += rng.exponential(ct.think_time_s) if ct.think_time_s > 0 else 0.0
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


def _agentic(p: SynthParams, rng: np.random.Generator, ids: _Ids) -> list[TraceRequest]:
    blocks = _Blocks(ids, SYNTH_BLOCK_SIZE)
    cap = p.max_prompt_tokens
    prefix_len = [
        _lognormal(rng, p.agent_prefix_tokens, 0.3, cap // 2) for _ in range(p.agent_prefixes)
    ]
    weights = _zipf_weights(p.agent_prefixes, p.agent_prefix_zipf)
    # requests per session: steps times the mean calls of a step (a burst's k: mean of 2..max)
    calls = 1 - p.agent_fanout_prob + p.agent_fanout_prob * (2 + p.agent_fanout_max) / 2
    session_rate = p.rate / (p.agent_steps_mean * calls)
    out: list[TraceRequest] = []
    # NOTE: warm start as ``_to_c``: sessions begin before 0 so the run sees running sessions
    t = -p.agent_step_s * p.agent_steps_mean * 4 + rng.exponential(1.0 / session_rate)
    sid = 0
    while t < p.duration_s:
        sid += 1
        prefix = int(rng.choice(p.agent_prefixes, p=weights))
        ctx = _Prompt(blocks).append(("prefix", prefix), prefix_len[prefix])
        ctx.append(("task", sid), _lognormal(rng, p.agent_task_tokens, p.length_sigma, cap))
        steps = int(rng.geometric(1.0 / p.agent_steps_mean))
        ts, parent = t, None
        for step in range(1, steps + 1):
            if ts >= p.duration_s or ctx.length >= cap:
                break
            fan = rng.random() < p.agent_fanout_prob
            k = int(rng.integers(2, p.agent_fanout_max + 1)) if fan else 1
            sent: list[tuple[_Prompt, int, int]] = []  # (prompt, reply tokens, chat id)
            for j in range(k):
                prompt = ctx
                if fan:
                    sub = _lognormal(rng, p.agent_subtask_tokens, p.length_sigma, cap)
                    prompt = ctx.copy().append(("subtask", sid, step, j), sub)
                reply = _lognormal(rng, p.agent_output_tokens, p.length_sigma, 8192)
                sent.append((prompt, reply, ids.chat()))
            if any(pr.length > cap for pr, _, _ in sent):
                break
            for prompt, reply, chat in sent:
                if ts >= 0:
                    out.append(
                        TraceRequest(
                            ts, prompt.length, reply, prompt.hash_ids(), chat, parent, "agent", step
                        )
                    )
            # the next step's context: every call's reply and tool result, in call order
            for j, (_, reply, chat) in enumerate(sent):
                ctx.append(("reply", chat), reply)
                result = _lognormal(rng, p.agent_result_tokens, p.length_sigma, cap)
                ctx.append(("result", sid, step, j), result)
            parent = sent[0][2]
            ts += rng.exponential(p.agent_step_s) if p.agent_step_s > 0 else 0.0
        t += rng.exponential(1.0 / session_rate)
    return out


def _rag(p: SynthParams, rng: np.random.Generator, ids: _Ids) -> list[TraceRequest]:
    blocks = _Blocks(ids, SYNTH_BLOCK_SIZE)
    lo, hi = p.rag_doc_min_tokens, p.rag_doc_max_tokens
    doc_len = [
        min(hi, max(lo, _lognormal(rng, p.rag_doc_tokens, 0.4, hi))) for _ in range(p.rag_documents)
    ]
    weights = _zipf_weights(p.rag_documents, p.rag_zipf)
    out: list[TraceRequest] = []
    t = rng.exponential(1.0 / p.rate)
    while t < p.duration_s:
        n_docs = int(rng.integers(1, p.rag_docs_max + 1))
        docs = rng.choice(p.rag_documents, size=n_docs, replace=False, p=weights)
        prompt = _Prompt(blocks)
        if p.rag_system_tokens:
            prompt.append(("system",), p.rag_system_tokens)
        for d in docs:
            prompt.append(("doc", int(d)), doc_len[int(d)])
        chat = ids.chat()
        prompt.append(
            ("question", chat), _lognormal(rng, p.rag_question_tokens, p.length_sigma, 4096)
        )
        if prompt.length <= p.max_prompt_tokens:
            reply = _lognormal(rng, p.rag_output_tokens, p.length_sigma, 8192)
            out.append(
                TraceRequest(t, prompt.length, reply, prompt.hash_ids(), chat, None, "rag", 1)
            )
        t += rng.exponential(1.0 / p.rate)
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
    elif kind == "agentic":
        reqs = _agentic(p, rng, ids)
    elif kind == "rag":
        reqs = _rag(p, rng, ids)
    else:
        reqs = _to_b(p, p.rate * p.to_b_fraction, rng, ids) if p.to_b_fraction > 0 else []
        if p.to_b_fraction < 1:
            reqs += _to_c(p, p.rate * (1 - p.to_b_fraction), rng, ids)
    reqs.sort(key=lambda r: r.timestamp_s)  # stable: a burst's calls keep their order
    return reqs[: p.max_requests] if p.max_requests is not None else reqs


def generate_count(kind: str, requests: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """``requests`` requests of ``kind`` at ``rate`` req/s: generated over 10% more time than
    they need at the mean rate (sessions and bursts make the count per second uneven), then cut
    at the count."""
    p = SynthParams(
        rate=rate, duration_s=1.1 * requests / rate + 1.0, seed=seed, max_requests=requests
    )
    return generate(kind, p)


def synthetic_bailian(sessions: int = 2000, seed: int = 0) -> list[TraceRequest]:
    """A multi-turn workload in the Qwen-Bailian trace's shape, for tests and the WA benchmark:
    the ``to-c`` generator over its four types (``BAILIAN_TYPES``: text, search, image,
    file, which differ in shared system prompt, next-turn probability, think time and message
    length), sessions starting at 2/s for ``sessions / 2`` seconds, replies of median 100 tokens.
    Turn k re-sends turn k-1's prompt and reply plus a new message; 16-token blocks; ``chat_id``,
    ``parent_chat_id``, ``type`` and ``turn`` set.

    NOTE: a window of a running workload (``to-c``'s warm start): a turn may continue a session
    begun before it, and turns past the end are cut.
    """
    sessions_per_s = 2.0
    types = BAILIAN_TYPES
    turns = sum(ct.share * ct.turns_mean for ct in types) / sum(ct.share for ct in types)
    params = SynthParams(
        rate=sessions_per_s * turns,
        duration_s=sessions / sessions_per_s,
        seed=seed,
        output_tokens=100,
        chat_types=types,
    )
    return generate("to-c", params)
