"""Placement: which engine instance serves a request. Scorers register by name (lazy import).

A scorer sees one ``PlacementRequest`` (token count, block hashes, session key), the live
``InstanceView`` of every candidate (engine load snapshot combined with this router's own
in-flight accounting, see ``router.load``) and the cache map's answer for the request's hashes,
and returns a ``Placement``. Scorers are synchronous and do no I/O: the caller gathers state.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from cachemap import CacheMap, Match
from engines.pool.link import PoolLink
from engines.profile import LatencyProfile


@dataclass(slots=True, frozen=True)
class PlacementRequest:
    request_id: str
    prompt_tokens: int
    block_hashes: Sequence[int]
    max_tokens: int = 16
    session_key: str | None = None  # session header or OpenAI `user`
    category: str = "all"

    def cached_tokens(self, cached_blocks: int, block_size: int) -> int:
        return cached_tokens(self.prompt_tokens, cached_blocks, block_size)

    def __reduce__(self) -> tuple[type[PlacementRequest], tuple[Any, ...]]:
        return PlacementRequest, _fields(self)


def placement_request(
    request_id: str,
    prompt_tokens: int,
    block_hashes: Sequence[int],
    block_size: int,
    max_tokens: int,
    session_key: str | None = None,
    category: str = "all",
) -> PlacementRequest:
    """What the router places for a prompt of ``prompt_tokens`` tokens, the one way the ingress
    (``router.dispatch``) and the simulator (``simulation.cluster``) build it: the hashes of the
    prompt's full blocks (a partial last block is never cached, so never matched) and at least
    one output token."""
    return PlacementRequest(
        request_id,
        prompt_tokens,
        block_hashes[: prompt_tokens // block_size],
        max(max_tokens, 1),
        session_key,
        category,
    )


def cached_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Tokens of a ``prompt_tokens`` prompt that a leading run of ``cached_blocks`` cached blocks
    spares the engine: it always computes the prompt's last token, and hits whole blocks only,
    so a fully cached prompt of whole blocks recomputes its last block (vLLM's
    ``num_tokens - 1`` rule)."""
    return min(cached_blocks, max(prompt_tokens - 1, 0) // block_size) * block_size


@dataclass(slots=True)
class InstanceView:
    """What the router knows about one instance right now."""

    instance_id: str
    block_size: int
    latency: LatencyProfile
    kv_capacity_blocks: int = 0  # GPU KV blocks (0: unknown)
    waiting: int = 0
    running: int = 0
    gpu_kv_usage: float = 0.0  # 0..1
    pending_prefill_tokens: int = 0  # engine-reported queue + this router's newer assignments
    healthy: bool = True


@dataclass(slots=True, frozen=True)
class Placement:
    instance_id: str
    estimated_ttft_s: float | None = None  # set by scorers that estimate it
    cached_blocks: int = 0  # leading blocks the chosen instance holds (GPU or CPU)
    detail: Mapping[str, Any] = field(default_factory=dict)
    # prefill/decode (router.pd): where the prompt is computed first, its KV then handed to
    # ``instance_id`` (the decode engine); None: the request runs whole on ``instance_id``
    prefill: Placement | None = None
    transfer_tokens: int = 0  # prompt tokens whose KV the decode engine loads

    def __reduce__(self) -> tuple[type[Placement], tuple[Any, ...]]:
        return Placement, _fields(self)


def _fields(record: Any) -> tuple[Any, ...]:
    """A frozen record's fields, in order, for pickling: compiled (``deploy.native``), a frozen
    dataclass refuses pickle's default restore, which assigns each field."""
    return tuple(getattr(record, f.name) for f in fields(record))


def profile_ttft(
    request: PlacementRequest,
    inst: InstanceView,
    m: Match | None,
    *,
    idle: bool = False,
    pool_blocks: int = 0,
    link: PoolLink | None = None,
) -> tuple[float, int]:
    """(``inst``'s latency model's TTFT in seconds, leading cached blocks) of ``request`` there:
    its prompt beyond the instance's leading cached run (GPU, then CPU-tier blocks loaded),
    behind the instance's queued prefill (``idle``: as if none were queued, which is the engine
    time the request's own prefill takes).

    ``pool_blocks``: the prompt's leading blocks in the cluster KV pool, loadable over ``link``.
    Where they reach past the instance's own run, the rest of them is either loaded (the bytes
    over the link, the tokens not computed; on a busy engine one step more, since a load is
    asynchronous) or recomputed, whichever is quicker: the cached blocks returned count the
    pool's run when the load is the answer. With ``idle``, the comparison is of engine time
    alone: whether the link beats the engine at producing those blocks."""
    bs = inst.block_size
    gpu = m.gpu_blocks if m else 0
    total = m.total_blocks if m else 0
    cached = request.cached_tokens(total, bs)
    gpu_tokens = min(gpu * bs, cached)
    latency = inst.latency
    queued = 0 if idle else inst.pending_prefill_tokens
    queued_requests = 1 if idle else inst.waiting
    ttft = latency.ttft_s(
        request.prompt_tokens,
        gpu_tokens,
        cached - gpu_tokens,
        queued=queued,
        queued_requests=queued_requests,
    )
    parts = pool_load_parts(request, inst, m, pool_blocks, link, idle=idle)
    if parts is not None:
        loaded = parts[0] + parts[1]
        if not idle and (queued or inst.running):
            # the load is asynchronous (vLLM's connectors): the request joins the batch at
            # the first step after it, so it waits for the step it could have been in
            loaded += latency.ttft_s(min(queued, latency.max_num_batched_tokens) or 1)
        if loaded < ttft:
            return loaded, pool_blocks
    return ttft, total


def pool_load_parts(
    request: PlacementRequest,
    inst: InstanceView,
    m: Match | None,
    pool_blocks: int,
    link: PoolLink | None,
    *,
    idle: bool = False,
) -> tuple[float, float] | None:
    """Where the pool's ``pool_blocks`` reach past ``inst``'s own run (``m``): (the latency
    model's TTFT with them not computed, the seconds their load takes over ``link``); None
    when there is nothing to load (or no link)."""
    bs = inst.block_size
    total = m.total_blocks if m else 0
    if pool_blocks <= total or link is None:
        return None
    cached = request.cached_tokens(total, bs)
    pooled = request.cached_tokens(pool_blocks, bs) - cached
    if pooled <= 0:
        return None
    gpu_tokens = min((m.gpu_blocks if m else 0) * bs, cached)
    latency = inst.latency
    ttft = latency.ttft_s(
        request.prompt_tokens,
        gpu_tokens + pooled,
        cached - gpu_tokens,
        queued=0 if idle else inst.pending_prefill_tokens,
        queued_requests=1 if idle else inst.waiting,
    )
    return ttft, link.load_s(pooled * latency.kv_bytes_per_token)


def kv_fits(request: PlacementRequest, inst: InstanceView, cached_blocks: int = 0) -> bool:
    """Whether ``inst``'s free GPU KV blocks hold ``request`` (prompt and every output token)
    beyond the ``cached_blocks`` it already holds; True when its capacity is unknown."""
    if not inst.kv_capacity_blocks:
        return True
    need = -(-(request.prompt_tokens + request.max_tokens) // inst.block_size) - cached_blocks
    return need <= inst.kv_capacity_blocks * (1.0 - inst.gpu_kv_usage)


@mypyc_attr(native_class=False)
class NoInstanceError(RuntimeError):
    """No healthy instance can take the request."""


@mypyc_attr(allow_interpreted_subclasses=True)
class Scorer(ABC):
    """Chooses an instance. Implementations may keep state (round-robin cursor, approximate
    trees) but must be cheap: they run on every request."""

    name: ClassVar[str]

    @abstractmethod
    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        """Pick one of the healthy ``instances`` (non-empty; unhealthy ones may be among them:
        ``healthy`` filters them and raises ``NoInstanceError`` when none is left)."""

    def attach(self, cache_map: CacheMap) -> None:  # noqa: B027
        """The routing core's cache map, for scorers that read more of it than a request's
        match (what each instance holds in all); called when the scorer joins a core."""

    def attach_pool(self, link: PoolLink | None) -> None:  # noqa: B027
        """The engines' link to the cluster KV pool (None: none, or not to be priced), for
        scorers that price loads from it; called when the scorer joins a core."""

    def on_finished(self, request: PlacementRequest, instance_id: str) -> None:  # noqa: B027
        """The request ended (scorers with their own bookkeeping override this)."""

    def as_replica(self, index: int, count: int) -> None:  # noqa: B027
        """The scorer serves router replica ``index`` of ``count`` (0 of 1: the only one), all
        deciding from the same view: scorers that break ties may break them apart."""

    def on_first_token(self, placement: Placement, ttft_s: float) -> None:  # noqa: B027
        """The request placed by ``placement`` got its first token ``ttft_s`` after it was sent
        (scorers that learn from outcomes override this)."""


_SCORERS: dict[str, tuple[str, str]] = {
    "kv_ttft": ("router.scorers.kv_ttft", "KvTtftScorer"),
    "round_robin": ("router.scorers.baselines", "RoundRobinScorer"),
    "least_loaded": ("router.scorers.baselines", "LeastLoadedScorer"),
    "session": ("router.scorers.baselines", "SessionScorer"),
    "sglang_cache_aware": ("router.scorers.sglang", "SglangCacheAwareScorer"),
    "dynamo_cost": ("router.scorers.dynamo", "DynamoCostScorer"),
    "llmd_weighted": ("router.scorers.llmd", "LlmdWeightedScorer"),
    "ray_prefix": ("router.scorers.ray_prefix", "RayPrefixScorer"),
}


def scorer_names() -> list[str]:
    return list(_SCORERS)


def parse_options(items: Sequence[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` items as a dict, each value JSON where it parses (numbers, booleans) and a
    string otherwise; raises ``ValueError`` naming ``flag`` and the bad item."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def parse_spec(spec: str, flag: str) -> tuple[str, dict[str, Any]]:
    """A component spec as the CLIs take scorers and autoscaling policies: ``NAME`` or
    ``NAME@key=value+key=value``, as ``(name, options)``."""
    name, _, opts = spec.partition("@")
    return name.strip(), parse_options([o for o in opts.split("+") if o], f"{flag} {spec}")


def create_scorer(name: str, **options: Any) -> Scorer:
    """The scorer registered as ``name``; a ``module:Class`` path loads an out-of-tree one.
    Unknown names raise ``ValueError`` listing the valid ones."""
    entry = _SCORERS.get(name)
    if entry is None and ":" in name:
        entry = (name.split(":", 1)[0], name.split(":", 1)[1])
    if entry is None:
        raise ValueError(f"router: unknown scorer {name!r}; valid: {', '.join(_SCORERS)}")
    cls = getattr(importlib.import_module(entry[0]), entry[1])
    if not (isinstance(cls, type) and issubclass(cls, Scorer)):
        raise ValueError(f"router: {entry[0]}.{entry[1]} is not a Scorer")
    scorer: Scorer = cls(**options)
    return scorer


def queued_past_a_step(view: InstanceView) -> bool:
    """More prefill waits on ``view``'s instance than one engine step of its computes: every
    step there is a full prefill chunk, shared with its decoding sequences, and a request sent
    now is admitted after the work ahead of it is computed (``router.inflight`` counts an
    in-flight prompt there, ``kv_ttft``'s ``interference`` charges the sequences it stalls)."""
    return view.pending_prefill_tokens > view.latency.max_num_batched_tokens


def healthy(instances: Sequence[InstanceView]) -> list[InstanceView]:
    alive = [i for i in instances if i.healthy]
    if not alive:
        raise NoInstanceError("no healthy engine instance")
    return alive
