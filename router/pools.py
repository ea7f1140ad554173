"""Engine pools: the groups of engine instances a deployment runs, each with a role.

A colocated deployment has one pool of role ``both`` (every engine prefills and decodes its
own requests). A disaggregated one (docs/architecture.md "Prefill/decode disaggregation") has a
``prefill`` pool, whose engines compute prompts and hand their KV over, and a ``decode`` pool,
whose engines load that KV and generate; a ``both`` pool beside them takes either part.

The router knows each instance's pool, and through it the instance's role, block size, latency
model and KV capacity (``RouterCore.pool_of``). Membership is kept per pool: Serve reports each
pool's replica set on its own (one engine deployment, one request router per pool), and a pool's
report never drops another pool's instances. The event bus belongs to the deployment: every pool
publishes KV events and load samples on the same one, and a load sample names its pool
(``LoadSnapshot.pool``) so that a router learning an instance from the bus files it right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from engines.profile import LatencyProfile

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = get_args(Role)
DEFAULT_POOL = "engine"  # the pool of a single-pool deployment (its Serve deployment name)

# which roles can serve which part of a request
PREFILL_ROLES: frozenset[Role] = frozenset({"both", "prefill"})
DECODE_ROLES: frozenset[Role] = frozenset({"both", "decode"})


@dataclass(frozen=True, slots=True)
class Pool:
    """What the router knows of every instance of one pool."""

    name: str
    role: Role
    block_size: int
    latency: LatencyProfile | None = None  # None: instances cannot be added (no cost model)
    kv_capacity_blocks: int = 0  # GPU KV blocks per instance (0: unknown)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pool {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if self.block_size < 1:
            raise ValueError(f"pool {self.name!r}: block_size must be >= 1")


def check_pools(pools: tuple[Pool, ...]) -> None:
    """Raise ``ValueError`` naming the problem unless ``pools`` make one servable deployment:
    distinct names, one block size (the router hashes each prompt once), and both halves of a
    request covered (a prefill pool needs a decode-capable one and the other way round)."""
    if not pools:
        raise ValueError("pools: at least one pool is needed")
    names = [p.name for p in pools]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"pools: the name {name!r} is used twice")
    sizes = {p.block_size for p in pools}
    if len(sizes) > 1:
        raise ValueError(
            f"pools: every pool needs the same block_size (prompts are hashed once), got "
            f"{sorted(sizes)}"
        )
    roles = {p.role for p in pools}
    if "prefill" in roles and not roles & DECODE_ROLES:
        raise ValueError("pools: a prefill pool needs a decode (or both) pool to hand KV to")
    if "decode" in roles and not roles & PREFILL_ROLES:
        raise ValueError("pools: a decode pool needs a prefill (or both) pool to take KV from")
