"""The options that shape one sim engine besides its latency profile, in one record from the
deployment (``engines.config``'s ``sim_options``) or the simulator (``--engine key=value``) down
to ``engines.sim.scheduler.Scheduler``."""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import DEFAULT_TRANSFER_GBPS, DEFAULT_TRANSFER_LATENCY_MS
from engines.sim.request import TOKEN_OFFSET, VOCAB_SIZE
from policies.base import EvictionPolicy


@dataclass(frozen=True, slots=True)
class SimEngineOptions:
    """What shapes one sim engine besides its latency profile: the options that an engine
    config's ``sim_options`` (``engines.config``), ``kvroute simulate --engine key=value`` and
    the tests set, in one record from the deployment or simulator down to ``Scheduler``.

    None takes the profile's figure: ``block_size`` the profile's, ``num_gpu_blocks`` its KV
    capacity in those blocks (plus the null block), ``max_model_len`` at most what that holds,
    the limits its own. ``cpu_policy``: a policy name, or a policy object, which then serves
    one engine only (it holds that engine's CPU tier)."""

    block_size: int | None = None
    num_gpu_blocks: int | None = None
    cpu_capacity_blocks: int = 0
    cpu_policy: str | EvictionPolicy = "lru"
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    max_num_seqs: int | None = None
    vocab_size: int = VOCAB_SIZE
    token_offset: int = TOKEN_OFFSET
    transfer_gbps: float = DEFAULT_TRANSFER_GBPS
    transfer_latency_ms: float = DEFAULT_TRANSFER_LATENCY_MS
    # the load report's queued prefill as ``LoadSnapshot`` defines it and kvroute's vLLM engine
    # counts it: a prompt until its first token (``Scheduler.queued_prefill_tokens``). False:
    # what is still to schedule, a what-if of an engine that reports its chunks' progress
    # (routers read a report as the first kind: ``router.load``)
    queued_until_first_token: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.queued_until_first_token, bool):
            raise ValueError(
                "queued_until_first_token must be true or false, "
                f"got {self.queued_until_first_token!r}"
            )


DEFAULT_OPTIONS = SimEngineOptions()
