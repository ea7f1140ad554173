"""One request inside the sim engine: its tokens (or only their block hashes), progress and blocks.

A request carries either real prompt token ids (the real-time engine, tests, KV events) or only
the chained hashes of its full prompt blocks (trace replay, where no tokens exist). Output tokens
are a pure function of ``(seed, index)``, so a request's whole output is known up front, is the
same on every run, and never has to be stored when nobody reads it.

Its vLLM ``kv_transfer_params`` (``parse_kv_transfer_params``) may make it the prefill half of a
disaggregated request (``remote_decode``) or the decode half (``remote_prefill``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import xxhash

from cachemap.hashing import as_u32, block_hashes, hash_block, mix64, salt_hash
from engines.pd.protocol import parse_pull_params
from policies.base import RequestInfo

if TYPE_CHECKING:
    from engines.sim.blocks import Block

_HIGH_BIT = 1 << 63
# NOTE: the sim's engine hashes are opaque to consumers, like vLLM's; they differ from
# cachemap's chained hashes (the forwarder must translate from token_ids, not pass them through).
_SIM_SALT = 0x51A5_1A5E_0000_0001


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_REMOTE_KVS = 4  # PD decode: holds its blocks while the prompt's KV is pulled


# the ids a sim engine's output tokens take by default: [TOKEN_OFFSET, VOCAB_SIZE), clear of
# a tokenizer's special tokens
VOCAB_SIZE = 32_000
TOKEN_OFFSET = 1_000


def output_token(seed: int, index: int, vocab_size: int, token_offset: int) -> int:
    """The ``index``-th output token of a request seeded with ``seed`` (deterministic)."""
    return token_offset + mix64(seed ^ mix64(index)) % (vocab_size - token_offset)


def engine_salt(model: str, lora_name: str | None, cache_salt: str | None) -> int:
    """Root of the sim's engine-hash chain for one model / LoRA / cache salt."""
    return salt_hash(model, lora_name, cache_salt) ^ _SIM_SALT


def prompt_seed(tokens: Sequence[int]) -> int:
    """Default output seed: a hash of the prompt (same prompt, same output)."""
    return xxhash.xxh3_64_intdigest(as_u32(tokens[-4096:]).tobytes())


@dataclass(slots=True, eq=False)
class SimRequest:
    """Scheduler state of one request. ``target_output`` is fixed at creation: the output length
    at which the request finishes (``finish_reason`` ``"length"`` or ``"stop"``)."""

    request_id: str
    prompt_len: int
    block_hashes: list[int]
    target_output: int
    finish_reason: str = "length"
    token_ids: list[int] | None = None  # prompt + output so far; None: hash-only request
    seed: int = 0
    root: int = 0  # the hash chain's root (the parent of block 0)
    arrival_s: float = 0.0
    info: RequestInfo | None = None  # for the CPU-tier policy
    lora_name: str | None = None
    cache_salt: str | None = None
    tag: Any = None  # caller's handle (an output queue, a trace index)
    # progress
    status: Status = Status.WAITING
    num_output: int = 0
    num_computed: int = 0
    num_preemptions: int = 0
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0
    # prompt tokens served from this engine's cache at first admission (-1: not yet); a PD
    # decode's pulled tokens are not in it (``remote_tokens``, ``reported_cached_tokens``)
    cached_tokens: int = -1
    cpu_cached_tokens: int = 0  # of which loaded from the CPU tier
    cpu_reused: list[int] = field(default_factory=list)  # CPU-tier hashes it loaded
    begun: bool = False  # the CPU-tier policy has seen its begin_request
    # when a step first scheduled it (-1: not yet); vLLM's queue time ends there
    scheduled_s: float = -1.0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    # prefill/decode disaggregation (vLLM's kv_transfer_params, NixlConnector semantics)
    remote_decode: bool = False  # prefill side: hand the KV over at finish
    remote_prefill: bool = False  # decode side: pull the prompt's KV instead of computing it
    remote_cached_tokens: int = -1  # the prefill's cached tokens (its remote_prefill_cached_tokens)
    remote_tokens: int = 0  # decode side: prompt tokens pulled from the prefill engine
    transfer_s: float = 0.0  # decode side: seconds the pull took (profile time)
    kv_ready_s: float = -1.0  # decode side: when the pulled KV arrives (-1: no pull started)
    # prefill side, once finished: the params for the decode engine (``handover_params``)
    kv_transfer_params: dict[str, Any] | None = None
    # the router's hint: load from the cluster KV pool what the lookup finds there (False:
    # recompute it, the link being slower; ``PolicyHints.pool_load``)
    pool_load: bool = True
    pool_loaded: bool = False  # its load from the pool is done (the next admission takes it)
    pool_hit_tokens: int = 0  # the prompt tokens its GPU, CPU-tier and pool hit covered then

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def reported_cached_tokens(self) -> int:
        """Prompt tokens the engine reports as cached (vLLM's ``num_cached_tokens``, the usage's
        ``cached_tokens``): its GPU or CPU-tier hit, plus the tokens a PD decode pulled (vLLM's
        ``PrefillStats``: local + external), unless the prefill engine reported its own hit
        (``remote_prefill_cached_tokens``), which vLLM's output processor then reports."""
        if self.remote_cached_tokens >= 0:
            return self.remote_cached_tokens
        return max(self.cached_tokens, 0) + self.remote_tokens

    @property
    def ttft_s(self) -> float:
        """Arrival to first token in seconds (meaningless before the first token)."""
        return self.first_token_s - self.arrival_s

    def extend_hashes(self, block_size: int) -> None:
        """Hash every output block that became full (vLLM appends to ``block_hashes`` as tokens
        arrive). Real tokens hash by content; hash-only requests get unique synthetic hashes."""
        full = self.num_tokens // block_size
        hashes = self.block_hashes
        while len(hashes) < full:
            i = len(hashes)
            prev = hashes[-1] if hashes else self.root
            if self.token_ids is not None:
                hashes.append(
                    hash_block(prev, self.token_ids[i * block_size : (i + 1) * block_size])
                )
            else:
                hashes.append(mix64(prev ^ mix64(i)) | _HIGH_BIT)

    def append_outputs(self, n: int, vocab_size: int, token_offset: int) -> list[int]:
        """Generate the next ``n`` output tokens; returns them when the request has token ids."""
        start = self.num_output
        self.num_output += n
        if self.token_ids is None:
            return []
        new = [
            output_token(self.seed, k, vocab_size, token_offset) for k in range(start, start + n)
        ]
        self.token_ids.extend(new)
        return new


def make_request(
    request_id: str,
    *,
    block_size: int,
    max_tokens: int,
    prompt_token_ids: Sequence[int] | None = None,
    prompt_len: int | None = None,
    prompt_block_hashes: Sequence[int] | None = None,
    model: str = "sim",
    lora_name: str | None = None,
    cache_salt: str | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    min_tokens: int = 0,
    max_model_len: int | None = None,
    vocab_size: int = VOCAB_SIZE,
    token_offset: int = TOKEN_OFFSET,
    arrival_s: float = 0.0,
    info: RequestInfo | None = None,
    tag: Any = None,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> SimRequest:
    """Build a request from token ids, or from ``prompt_len`` and full-block hashes (trace replay).

    ``kv_transfer_params`` (vLLM's, see ``parse_kv_transfer_params``) makes it the prefill or the
    decode half of a disaggregated request. Raises ``ValueError`` for an empty prompt, a prompt
    at or over ``max_model_len``, hashes that do not cover exactly the prompt's full blocks, or
    malformed PD params (naming the key).
    """
    remote_decode, remote_prefill, remote_cached = parse_kv_transfer_params(kv_transfer_params)
    root = engine_salt(model, lora_name, cache_salt)
    hashes: list[int]
    if prompt_token_ids is not None:
        tokens = list(prompt_token_ids)
        n = len(tokens)
        hashes = list(block_hashes(tokens, block_size, root))
        default_seed = prompt_seed(tokens)
    else:
        if prompt_len is None or prompt_block_hashes is None:
            raise ValueError("give prompt_token_ids, or prompt_len with prompt_block_hashes")
        tokens, n, hashes = None, prompt_len, list(prompt_block_hashes)
        if len(hashes) != n // block_size:
            raise ValueError(
                f"prompt_block_hashes: {len(hashes)} hashes for {n} tokens, "
                f"expected {n // block_size} (full blocks of {block_size})"
            )
        default_seed = mix64(hashes[-1] if hashes else n)
    if n < 1:
        raise ValueError("prompt must have at least one token")
    if max_model_len is not None and n >= max_model_len:
        raise ValueError(f"prompt of {n} tokens leaves no room under max_model_len {max_model_len}")
    seed_v = default_seed if seed is None else mix64(seed)
    target = max_tokens
    if max_model_len is not None:
        target = min(target, max_model_len - n)
    reason = "length"
    if stop_token_ids:
        stops = set(stop_token_ids)
        for k in range(min_tokens, target):
            if output_token(seed_v, k, vocab_size, token_offset) in stops:
                target, reason = k + 1, "stop"
                break
    return SimRequest(
        request_id=request_id,
        prompt_len=n,
        block_hashes=hashes,
        target_output=target,
        finish_reason=reason,
        token_ids=tokens,
        seed=seed_v,
        root=root,
        arrival_s=arrival_s,
        info=info,
        lora_name=lora_name,
        cache_salt=cache_salt,
        tag=tag,
        remote_decode=remote_decode,
        remote_prefill=remote_prefill,
        remote_cached_tokens=remote_cached,
    )


def parse_kv_transfer_params(params: Mapping[str, Any] | None) -> tuple[bool, bool, int]:
    """``(remote_decode, remote_prefill, remote_cached_tokens)`` of vLLM ``kv_transfer_params``.

    ``do_remote_decode``: this engine prefills for another one. ``do_remote_prefill``: another
    engine prefilled; its ``remote_*`` keys must all be present and typed as vLLM's
    NixlConnector writes them (checked by the PD connector's own parser,
    ``engines.pd.protocol.parse_pull_params``), else ``ValueError`` naming the key (vLLM would
    log a warning and recompute; a sim caller wants to know); the sim reads none of their
    values. ``remote_prefill_cached_tokens``, when
    an int, is what the decode engine reports as the cached tokens (-1: absent). Unknown keys
    (the router's ``"kvroute"`` hints, NIXL's ``tp_size`` ...) are ignored.
    """
    if not params:
        return False, False, -1
    remote_decode = bool(params.get("do_remote_decode"))
    remote_prefill = bool(params.get("do_remote_prefill"))
    cached = -1
    if remote_prefill:
        parse_pull_params(params)  # raises naming the first missing or malformed key
        value = params.get("remote_prefill_cached_tokens")
        # NOTE: as vLLM's output processor, which ignores a value that is not an int
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            cached = value
    return remote_decode, remote_prefill, cached
