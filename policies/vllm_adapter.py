# mypy: disallow-subclassing-any=False, warn-return-any=False
"""Every kvroute policy as a vLLM 0.32 out-of-tree CPU-tier ``CachePolicy``.

Load one with the offloading connector's extra config::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000, "block_size": 64,
        "eviction_policy": "KvrouteS3FIFO",
        "cache_policy_module_path": "policies.vllm_adapter",
        "offload_prompt_only": false}}'

vLLM builds the policy with only ``cache_capacity`` (chunks) and passes it nothing else of the
connector's config, so the policy's constructor options come from the environment variable
``POLICY_OPTIONS_ENV`` (JSON ``{"KvrouteWA": {"window": 500}}``, keyed by class name), which the
engine core process inherits from the process that starts ``AsyncLLM``
(``engines.offload.policy_options_env``). The request category comes from
``ReqContext.kv_transfer_params["kvroute"]`` (``policies.hints.PolicyHints``, parsed once per
request by ``PolicyHints.from_params``), which the router sets per request.

This is the shell around the pure policies: vLLM's contract carries no time, so the adapter
reads ``PolicyHints.now_s`` from the request when the sender gives one and otherwise its clock
(``time.monotonic``, replaceable per class for tests). It owns the chunks and two kinds of pins,
kept apart: a chunk with ``ref_cnt != 0`` is in transfer, and an operator's pin
(``RequestInfo.pin``) holds a request's chunks until a request for the same prefix unpins them;
neither is ever a victim. The wrapped policy owns the order.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from policies.base import EvictionPolicy, OperatorPins, RequestInfo
from policies.hints import PolicyHints
from policies.registry import ENGINE_POLICY_CLASSES, POLICY_OPTIONS_ENV, create_policy

# vLLM class name -> kvroute policy name (the engine-runnable ones; the registry owns the list).
CLASS_NAMES: dict[str, str] = {cls: name for name, cls in ENGINE_POLICY_CLASSES.items()}


def request_hints(req_context: ReqContext | None) -> PolicyHints:
    """The router's ``kv_transfer_params["kvroute"]`` of a request (defaults if absent)."""
    params = req_context.kv_transfer_params if req_context is not None else None
    return PolicyHints.from_params(params if isinstance(params, dict) else None) or PolicyHints()


def request_info(req_context: ReqContext | None) -> RequestInfo:
    """The request as the policy sees it (``request_hints``)."""
    return request_hints(req_context).request_info()


@dataclass(frozen=True, slots=True)
class _Request:
    """A request's hints, parsed once (kept in its ``ReqContext``'s state)."""

    info: RequestInfo
    now_s: float | None  # PolicyHints.now_s


def policy_options(class_name: str) -> dict[str, Any]:
    """The constructor options ``POLICY_OPTIONS_ENV`` gives class ``class_name`` ({} if none)."""
    raw = os.environ.get(POLICY_OPTIONS_ENV)
    if not raw:
        return {}
    try:
        table = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{POLICY_OPTIONS_ENV}: not JSON ({e})") from None
    options = table.get(class_name, {}) if isinstance(table, dict) else None
    if not isinstance(options, dict):
        raise ValueError(
            f"{POLICY_OPTIONS_ENV}: a JSON object of option objects by class name is needed, "
            f"got {raw!r}"
        )
    return options


class _Pinned(Set[OffloadKey]):
    """Caller-protected keys plus chunks in transfer, without copying either."""

    def __init__(self, a: Set[OffloadKey], b: Set[OffloadKey]) -> None:
        self._a, self._b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self._a or key in self._b

    def __iter__(self) -> Any:
        yield from self._a
        yield from (k for k in self._b if k not in self._a)

    def __len__(self) -> int:
        return len(self._a) + sum(1 for k in self._b if k not in self._a)


class KvrouteCachePolicy(CachePolicy):
    """A vLLM ``CachePolicy`` delegating the eviction order to a kvroute ``EvictionPolicy``.

    Operator pins (``RequestInfo.pin``): a pinning request's keys (those it stores, from its
    store miss on, and every key it touched, as ``on_request_finished`` lists them) join
    ``operator_pins``, resident or not, so a later store of one is pinned too; a request with
    ``pin`` False for the same prefix takes them out. A resident pinned chunk is out of the
    wrapped policy altogether (it never sees a pinned chunk as a candidate, and eviction does not
    step over pins), and re-enters it, as a fresh insert, when unpinned. Transfer pins
    (``ref_cnt != 0``, ``mark_non_evictable``/``mark_evictable``) are separate: ending a
    transfer never drops an operator pin. ``clear`` drops both.
    """

    policy_name: ClassVar[str] = "lru"
    clock: ClassVar[Callable[[], float]] = time.monotonic

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        options = policy_options(type(self).__name__)
        try:
            self.policy: EvictionPolicy = create_policy(
                self.policy_name, max(1, cache_capacity), **options
            )
        except TypeError as e:
            raise ValueError(f"{POLICY_OPTIONS_ENV}[{type(self).__name__!r}]: {e}") from None
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._pinned: set[OffloadKey] = set()  # in transfer (ref_cnt != 0)
        self.operator_pins = OperatorPins(self.policy)
        self._current: ReqContext | None = None
        self._now = 0.0

    def _begin(self, req_context: ReqContext) -> RequestInfo:
        req = req_context.get_state(_Request)
        first = req is None
        if req is None:
            hints = request_hints(req_context)
            req = _Request(hints.request_info(), hints.now_s)
            req_context.set_state(req)
        info = req.info
        self._now = max(self._now, req.now_s if req.now_s is not None else type(self).clock())
        if req_context is not self._current:
            self._current = req_context
            # NOTE: requests interleave; a request is counted (begin) once, then resumed
            if first:
                self.policy.begin_request(info, self._now)
            else:
                self.policy.resume_request(info, self._now)
        return info

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        if chunk.ref_cnt != 0:
            self._pinned.add(key)
        if key not in self.operator_pins:
            self.policy.insert(key, self._now)

    def remove(self, key: OffloadKey) -> None:
        # NOTE: an operator pin outlives its chunk (a failed store): a later store is pinned too.
        del self.chunks[key]
        self._pinned.discard(key)
        if key not in self.operator_pins:
            self.policy.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._begin(req_context)
        for key in keys:
            if key in self.chunks and key not in self.operator_pins:
                self.policy.touch(key, self._now)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        info = self._begin(req_context)  # the stores that follow are on this request's behalf
        if info.pin:
            self.operator_pins.pin(keys, self.chunks)  # pinned from the moment they are stored

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        info = self._begin(req_context)
        all_keys = order_request_keys(key_groups, req_context)
        if info.pin is not None:
            if info.pin:
                self.operator_pins.pin(all_keys, self.chunks)
            else:
                self.operator_pins.unpin(all_keys, self.chunks, self._now)
        pins = self.operator_pins
        keys = [k for k in all_keys if k in self.chunks and k not in pins]
        reused = [k for k in keys if k in reused_keys]
        self.policy.end_request(info, keys, reused, self._now)
        self._current = None

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        victims = self.policy.evict(n, _Pinned(protected, self._pinned))
        if victims is None:
            return None
        return [(key, self.chunks.pop(key)) for key in cast(list[OffloadKey], victims)]

    def clear(self) -> None:
        self.chunks.clear()
        self._pinned.clear()
        self.operator_pins.clear()
        self.policy.clear()
        self._current = None

    def mark_evictable(self, key: OffloadKey) -> None:
        self._pinned.discard(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._pinned.add(key)


def _subclass(class_name: str, policy_name: str) -> type[KvrouteCachePolicy]:
    return type(
        class_name,
        (KvrouteCachePolicy,),
        {
            "__module__": __name__,
            "policy_name": policy_name,
            "__doc__": (f"kvroute's {policy_name!r} eviction order as a vLLM CachePolicy."),
        },
    )


for _cls_name, _policy in CLASS_NAMES.items():
    globals()[_cls_name] = _subclass(_cls_name, _policy)

__all__ = [
    "CLASS_NAMES",
    "POLICY_OPTIONS_ENV",
    "KvrouteCachePolicy",
    "policy_options",
    "request_hints",
    "request_info",
    *CLASS_NAMES,
]
