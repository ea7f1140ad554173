"""Latency profile of one engine instance: how long a scheduler step takes.

A step runs one forward pass over every token the scheduler picked (vLLM v1 mixes prefill
chunks and decodes in one batch). The model, in milliseconds:

    step_ms = base_ms
            + prefill_pass_ms + prefill_sq_ms * T ** 2                (if the step prefills)
            + sum over prefill chunks of  prefill_seq_ms + prefill_token_ms * n
                                          + prefill_attn_ms * n * (c + n / 2)
            + decode_pass_ms + decode_seq_ms * batch + decode_ctx_ms * context
                                                                 (if any request decodes)
            + KV bytes loaded from the CPU tier / cpu_load_gbps

where a chunk computes ``n`` new tokens after ``c`` already in the KV cache (the attention term
is the quadratic cost of attending to the prefix; ``prefill_seq_ms`` is each prefilling
request's own cost in the step, as ``decode_seq_ms`` is each decoding one's), ``T`` the new
tokens of all the step's chunks together, ``batch`` is the number of decoding requests and
``context`` the tokens they attend to in total. The two pass constants, ``prefill_sq_ms`` and
``prefill_seq_ms`` are 0 in a profile measured by ``kvroute profile`` (``base_ms`` holds a
step's fixed cost); an engine whose prefilling and decoding passes each add a fixed cost, and
whose prefill pass grows with the square of its new tokens (NVIDIA Dynamo's mocker: a mixed
pass costs both, a prefill pass ``a T^2 + b T + c``), sets them. Hence

    prefill_ms(uncached, context) = base_ms + prefill_pass_ms + prefill_seq_ms
                                    + prefill_token_ms * uncached
                                    + prefill_sq_ms * uncached ** 2
                                    + prefill_attn_ms * uncached * (context + uncached / 2)
    decode_step_ms(batch, context) = base_ms + decode_pass_ms + decode_seq_ms * batch
                                     + decode_ctx_ms * context

A request also waits ``request_overhead_ms`` (input processing, IPC to the engine core) between
its arrival and the scheduler, so an unloaded TTFT is that plus its prefill steps. Behind
queued prefill work a request first waits for that work (FCFS), unless the engine caps each
prefill at ``long_prefill_token_threshold`` tokens a step: then it shares steps with the queue
from the start, at most that many of its own tokens per step (see ``ttft_s``).

Affine in every term, so a run of pure decode steps has a closed-form duration (what lets the
virtual-time engine skip ahead instead of stepping one token at a time).

This is the project's one cost model: the sim engine's steps (``step_s``, ``decode_ms`` and
``decode_growth_ms`` for a run of decodes), the router's estimate (``ttft_s``) and the
autoscaler's capacity model (``work_ms``, ``busy_step_ms``) all price with these methods, and
none reads a coefficient itself: a new term is written here, once.
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

# NOTE: the package's directory, not ``__file__``: compiled (deploy/native.py), ``__file__`` in
# this module's code names mypyc's runtime library, elsewhere
PROFILES_DIR = Path(str(importlib.resources.files("engines"))).resolve() / "profiles"
# Measured from the tiny vLLM model on the 2-core CPU machines by `kvroute profile`.
DEFAULT_PROFILE = "cpu-tiny-llama"

# the JSON sections that hold the ``prefill_*`` and ``decode_*`` fields (``prefill.token_ms``)
_SECTIONS = ("prefill", "decode")


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError("a list of strings, not a string")
    return tuple(str(v) for v in value)


def _type_name(t: Any) -> str:
    """A field's annotation as written (a string here; a class where compiled)."""
    return t if isinstance(t, str) else t.__name__ if isinstance(t, type) else str(t)


# how a field of each annotated type is read from JSON
_PARSE: dict[str, Any] = {
    "int": int,
    "float": float,
    "str": str,
    "tuple[str, ...]": _strings,
    "tuple": _strings,  # compiled, the annotation is the bare class
}

_POSITIVE = (
    "block_size",
    "kv_capacity_tokens",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "kv_bytes_per_token",
    "cpu_load_gbps",
)
_NON_NEGATIVE = (
    "long_prefill_token_threshold",
    "request_overhead_ms",
    "base_ms",
    "prefill_pass_ms",
    "prefill_sq_ms",
    "prefill_seq_ms",
    "decode_pass_ms",
    "prefill_token_ms",
    "prefill_attn_ms",
    "decode_seq_ms",
    "decode_ctx_ms",
)


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """One engine's latency model and the scheduler limits it was measured with.

    ``kv_capacity_tokens``: GPU KV cache size in tokens (vLLM's ``num_gpu_blocks * block_size``);
    ``kv_bytes_per_token``: bytes of KV per token (all layers), used for CPU->GPU load time;
    ``cpu_load_gbps``: CPU->GPU copy bandwidth in GB/s (1e9 bytes per second);
    ``request_overhead_ms``: per-request latency outside the engine's steps (input processing,
    IPC to the engine core): a request reaches the scheduler this long after it arrives;
    ``long_prefill_token_threshold``: the engine's per-request prefill cap per step while other
    requests run or wait (vLLM's option of that name; 0: none). Like ``max_num_batched_tokens``
    it is configuration, not a measured cost: ``with_limits`` sets it to an engine's own.
    """

    name: str
    model: str
    hardware: str
    block_size: int
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    base_ms: float
    prefill_token_ms: float
    prefill_attn_ms: float
    decode_seq_ms: float
    decode_ctx_ms: float
    cpu_load_gbps: float
    request_overhead_ms: float = 0.0
    long_prefill_token_threshold: int = 0
    prefill_pass_ms: float = 0.0
    prefill_sq_ms: float = 0.0
    prefill_seq_ms: float = 0.0
    decode_pass_ms: float = 0.0
    notes: str = ""
    sources: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name!r}: {name} must be > 0")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name!r}: {name} must be >= 0")

    def __reduce__(self) -> tuple[type[LatencyProfile], tuple[Any, ...]]:
        # NOTE: compiled (deploy.native), a frozen dataclass refuses pickle's default restore,
        # which assigns each field
        return LatencyProfile, tuple(getattr(self, f.name) for f in fields(self))

    # -- the model ---------------------------------------------------------------------------

    def chunk_ms(self, new_tokens: float, context: float) -> float:
        """Cost of one prefill chunk inside a step (no ``base_ms``); none without tokens."""
        if new_tokens <= 0:
            return 0.0
        return self.prefill_seq_ms + new_tokens * (
            self.prefill_token_ms + self.prefill_attn_ms * (context + new_tokens / 2)
        )

    def pass_ms(self, new_tokens: float) -> float:
        """The fixed and squared part of a prefilling pass of ``new_tokens`` in all (no
        ``base_ms``)."""
        return self.prefill_pass_ms + self.prefill_sq_ms * new_tokens * new_tokens

    def prefill_s(self, uncached_tokens: int, context: int = 0) -> float:
        """A step that only prefills ``uncached_tokens`` after ``context`` cached ones."""
        return (
            self.base_ms + self.pass_ms(uncached_tokens) + self.chunk_ms(uncached_tokens, context)
        ) / 1e3

    def decode_ms(self, batch: int, context_tokens: float, start: float = 0.0) -> float:
        """``start`` plus the cost of a step's decodes (no ``base_ms``): ``batch`` requests
        attending ``context_tokens`` in total. Affine in both (``decode_run`` and ``work_ms`` rely
        on it). Summed onto ``start`` term by term, so a step's cost comes out the same to the
        last bit wherever it is added up."""
        return (
            start
            + self.decode_pass_ms
            + self.decode_seq_ms * batch
            + self.decode_ctx_ms * context_tokens
        )

    def decode_growth_ms(self, batch: int) -> float:
        """How much longer each pure-decode step of ``batch`` requests is than the one before:
        every request's context grew by its token."""
        return self.decode_ctx_ms * batch

    def step_s(
        self, chunks: Sequence[tuple[int, int]], batch: int, context_tokens: float, load_tokens: int
    ) -> float:
        """One scheduler step: the prefill ``chunks`` (``(new tokens, tokens before)`` each), the
        decodes of ``batch`` requests attending ``context_tokens`` in total, and the
        ``load_tokens`` of KV it loads from the CPU tier."""
        if not chunks and not batch:
            return 0.0
        ms, new = self.base_ms, 0
        for n, before in chunks:
            ms += self.chunk_ms(n, before)
            new += n
        if chunks:
            ms += self.pass_ms(new)
        if batch:
            ms += self.decode_ms(batch, context_tokens)
        return ms / 1e3 + self.load_s(load_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """A step that only decodes: ``batch`` requests attending ``context_tokens`` in total."""
        if batch <= 0:
            return 0.0
        return self.decode_ms(batch, context_tokens, self.base_ms) / 1e3

    @property
    def busy_step_ms(self) -> float:
        """The fixed cost of a busy engine's step (its steps decode), ``work_ms`` excluded."""
        return self.decode_ms(0, 0, self.base_ms)

    def work_ms(self, prompt_tokens: float, uncached_tokens: float, output_tokens: float) -> float:
        """GPU time one request adds to a busy engine's steps beyond ``busy_step_ms``: its
        ``uncached_tokens`` of prefill after the cached rest of ``prompt_tokens``, in chunks of
        ``max_num_batched_tokens`` (each with its pass cost), then ``output_tokens`` decodes at
        the request's mean context (the steady-state view of the capacity model)."""
        o, u = max(output_tokens, 1.0), max(uncached_tokens, 0.0)
        m = self.max_num_batched_tokens
        full, rest = divmod(u, m)
        chunks = [float(m)] * int(full) + ([rest] if rest else [])
        prefill, done = 0.0, prompt_tokens - u
        for n in chunks:  # each chunk a step's pass of its own
            prefill += self.chunk_ms(n, done) + self.pass_ms(n)
            done += n
        ctx = prompt_tokens + o / 2
        return prefill + o * (self.decode_ms(1, ctx) - self.decode_ms(0, 0))

    def queue_s(self, tokens: int) -> float:
        """Queued prefill work priced at the rate of full ``max_num_batched_tokens`` steps
        without context: the rate a busy engine drains its queue at (the context of queued
        prompts is unknown to whoever asks, and the attention term is second order)."""
        if tokens <= 0:
            return 0.0
        n = self.max_num_batched_tokens
        return tokens * self.prefill_s(n) / n

    def load_s(self, tokens: int) -> float:
        """Time to copy ``tokens`` of KV from the CPU tier to the GPU."""
        return tokens * self.kv_bytes_per_token / (self.cpu_load_gbps * 1e9)

    def ttft_s(
        self,
        prompt_tokens: int,
        cached_tokens: int = 0,
        cpu_tokens: int = 0,
        queued: int = 0,
        queued_requests: int = 1,
    ) -> float:
        """TTFT behind ``queued`` tokens of prefill (held by ``queued_requests`` requests) that
        already wait on the engine: the request overhead, one step per ``max_num_batched_tokens``
        chunk of the uncached tokens, and the CPU-tier load. With no cap the queue is worked off
        first (FCFS, ``queue_s``). With a ``long_prefill_token_threshold`` the request takes up
        to that many tokens a step from the start, beside the queue's own capped chunks; the
        queue is assumed to fill the steps' budget no further than its requests' caps allow."""
        done, left = cached_tokens + cpu_tokens, prompt_tokens - cached_tokens - cpu_tokens
        total = self.request_overhead_ms / 1e3 + self.load_s(cpu_tokens)
        budget, cap = self.max_num_batched_tokens, self.long_prefill_token_threshold
        if queued > 0 and not 0 < cap < budget:
            total, queued = total + self.queue_s(queued), 0
        lanes = max(1, queued_requests) * cap
        while left > 0:
            if queued > 0:  # a shared step: our capped chunk beside the queue's
                n = min(left, cap)
                other = min(queued, budget - n, lanes)
                queued -= other
                fixed = self.base_ms + self.pass_ms(n + other)
                total += (fixed + self.chunk_ms(n, done) + self.chunk_ms(other, 0)) / 1e3
            else:
                n = min(left, budget)
                total += self.prefill_s(n, done)
            done, left = done + n, left - n
        return total

    def with_limits(
        self,
        max_num_batched_tokens: int | None = None,
        long_prefill_token_threshold: int | None = None,
    ) -> LatencyProfile:
        """This profile for an engine configured with these scheduler limits (None: keep)."""
        return replace(
            self,
            max_num_batched_tokens=max_num_batched_tokens or self.max_num_batched_tokens,
            long_prefill_token_threshold=(
                self.long_prefill_token_threshold
                if long_prefill_token_threshold is None
                else long_prefill_token_threshold
            ),
        )

    def slowed(self, factor: float) -> LatencyProfile:
        """This profile on an engine ``factor`` times slower at everything it times (steps,
        request overhead, CPU->GPU loads): the truth of an engine that runs slower than it was
        profiled, e.g. one sharing its core."""
        if factor <= 0:
            raise ValueError(f"slowdown factor must be > 0, got {factor}")
        return replace(
            self,
            base_ms=self.base_ms * factor,
            prefill_pass_ms=self.prefill_pass_ms * factor,
            prefill_sq_ms=self.prefill_sq_ms * factor,
            prefill_seq_ms=self.prefill_seq_ms * factor,
            decode_pass_ms=self.decode_pass_ms * factor,
            prefill_token_ms=self.prefill_token_ms * factor,
            prefill_attn_ms=self.prefill_attn_ms * factor,
            decode_seq_ms=self.decode_seq_ms * factor,
            decode_ctx_ms=self.decode_ctx_ms * factor,
            request_overhead_ms=self.request_overhead_ms * factor,
            cpu_load_gbps=self.cpu_load_gbps / factor,
        )

    # -- I/O ---------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyProfile:
        """Build from the JSON layout ``to_dict`` writes: every field by name, but that the
        ``prefill_*`` and ``decode_*`` ones sit in ``prefill`` and ``decode`` sections (see the
        shipped files). A missing or malformed field is named as the file spells it."""
        flat: dict[str, tuple[str, Any]] = {}  # field name: (its key in the file, value)
        for key, value in data.items():
            if key in _SECTIONS:
                if not isinstance(value, dict):
                    raise ValueError(f"profile: {key!r} must be an object")
                flat.update({f"{key}_{k}": (f"{key}.{k}", v) for k, v in value.items()})
            else:
                flat[key] = (key, value)
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            section = f.name.partition("_")[0]
            if f.name not in flat:
                if f.default is MISSING and f.default_factory is MISSING:
                    key = f.name.replace("_", ".", 1) if section in _SECTIONS else f.name
                    raise ValueError(f"profile: missing field {key!r}")
                continue
            key, value = flat[f.name]
            try:
                kwargs[f.name] = _PARSE[_type_name(f.type)](value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"profile: field {key!r} is not a valid {_type_name(f.type)}"
                ) from None
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not f.name.startswith(("prefill_", "decode_")) and f.name != "sources"
        }
        out["prefill"] = {"token_ms": self.prefill_token_ms, "attn_ms": self.prefill_attn_ms}
        out["decode"] = {"seq_ms": self.decode_seq_ms, "ctx_ms": self.decode_ctx_ms}
        if self.prefill_pass_ms:
            out["prefill"]["pass_ms"] = self.prefill_pass_ms
        if self.prefill_sq_ms:
            out["prefill"]["sq_ms"] = self.prefill_sq_ms
        if self.prefill_seq_ms:
            out["prefill"]["seq_ms"] = self.prefill_seq_ms
        if self.decode_pass_ms:
            out["decode"]["pass_ms"] = self.decode_pass_ms
        out["sources"] = list(self.sources)
        return out

    @classmethod
    def load(cls, name_or_path: str | Path) -> LatencyProfile:
        """Load a shipped profile by name (``h100-llama3.1-8b``) or a JSON file by path."""
        path = Path(name_or_path)
        if path.suffix != ".json" and len(path.parts) == 1:
            path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
            raise ValueError(f"profile: no file {str(path)!r}; shipped profiles: {shipped}")
        return cls.from_dict(json.loads(path.read_text()))
