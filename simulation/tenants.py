"""Tenants in a simulated workload: every request belongs to one of ``K`` tenants (one API key
each), and with isolation its blocks are keyed per tenant, as the ingress keys them.

The ingress hashes a keyed request's prompt under the cache salt of its key's namespace
(``router.keys.tenant_salt``): the chain's root is ``cachemap.hashing.salt_hash`` of that salt,
so two tenants sending the same prompt get disjoint block hashes and never share KV. The
simulator's requests carry no tokens, only the trace's block ids (which name whole prefixes, and
serve as the chained hashes): ``isolate`` re-hashes each request's ids as a chain from its
tenant's root, with ``cachemap.hashing.block_hashes`` (each id stands for its block's content),
so within a tenant equal prefixes stay equal and across tenants none are. It rewrites the
schedule's ``hash_ids``, from which every block the simulator uses is derived (the engines'
prompts, the cache map's events, the ideal TTFT, the what-if runs), so they all see the tenant.

Which tenant: a session's turns come from one client key, so the tenant is drawn from the
session: for a trace with chat ids (Bailian, the CSV traces' prefix model, the synthetic
workloads) the first turn's chat id; for a session-less trace (Mooncake) the request's second
block id. Every Mooncake request opens with the same block (a 512-token system prompt) and the
second block is the conversation's own first one: a later turn re-sends the earlier ones, so it
has the same second block, and no two conversations share one (the ids name whole prefixes).
A request of one block is keyed by it. The draw is a seeded hash of the session, uniform over
the tenants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cachemap.hashing import BlockHash, block_hashes, mix64, salt_hash
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned
from router.keys import tenant_salt

# the model name in every tenant's chain root: any fixed name (the sim serves one model)
TENANT_MODEL = "sim"
# keyed ids are kept under 2**48: the what-if runs add laps above it (``simulation.whatif``)
ID_BITS = 48
_ID_MASK = (1 << ID_BITS) - 1
_MASK64 = (1 << 64) - 1


def check_tenants(value: int, flag: str = "--tenants") -> int:
    """``value`` as a tenant count (0 or 1: one shared namespace, no isolation); raises
    ``ValueError`` naming ``flag`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{flag} must be a whole number >= 0 (0 or 1: no isolation), got {value}")
    return value


def tenant_namespace(tenant: int) -> str:
    """Tenant ``tenant``'s key namespace (a name ``router.keys`` accepts)."""
    return f"tenant-{tenant}"


def tenant_root(tenant: int, model: str = TENANT_MODEL) -> BlockHash:
    """The chain root the ingress gives a keyed request of ``tenant`` without a client salt."""
    return salt_hash(model, None, tenant_salt(tenant_namespace(tenant), None))


def keyed_hash_ids(hash_ids: Sequence[int], root: int) -> tuple[int, ...]:
    """``hash_ids`` chained from ``root``: each keyed id covers the root and every id up to its
    own (an id's 64 bits are its block's content), kept to ``ID_BITS`` bits."""
    if not hash_ids:
        return ()
    words = np.asarray(hash_ids, dtype=np.uint64).astype("<u8").view("<u4")
    return tuple(h & _ID_MASK for h in block_hashes(words, 2, root))


def session_keys(plan: Sequence[Planned]) -> list[int]:
    """Each request's session as an int (see the module): its first turn's chat id (even), or,
    without chat ids, its second block id (odd)."""
    roots: dict[int, int] = {}
    out = []
    for p in plan:
        r = p.req
        if r.chat_id is not None:
            parent = r.parent_chat_id
            roots[r.chat_id] = root = r.chat_id if parent is None else roots.get(parent, parent)
            out.append(2 * root)
        else:
            ids = r.hash_ids
            out.append(2 * (ids[1] if len(ids) > 1 else ids[0] if ids else 0) + 1)
    return out


def tenant_of(session: int, tenants: int, seed: int = 0) -> int:
    """The tenant of ``session`` among ``tenants``: a seeded hash, uniform over them."""
    return mix64((session ^ mix64(seed)) & _MASK64) % tenants


def tenants_of(plan: Sequence[Planned], tenants: int, seed: int = 0) -> list[int]:
    """Each request's tenant (all 0 with ``tenants`` <= 1)."""
    if tenants <= 1:
        return [0] * len(plan)
    return [tenant_of(s, tenants, seed) for s in session_keys(plan)]


def isolate(plan: list[Planned], tenants: int, seed: int = 0) -> list[Planned]:
    """``plan`` with each request's ``hash_ids`` keyed by its tenant (``tenants`` of them,
    drawn with ``seed``); with ``tenants`` <= 1, ``plan`` itself, untouched (one namespace)."""
    if check_tenants(tenants) <= 1:
        return plan
    roots = [tenant_root(t) for t in range(tenants)]
    out = []
    for p, t in zip(plan, tenants_of(plan, tenants, seed), strict=True):
        req: TraceRequest = replace(p.req, hash_ids=keyed_hash_ids(p.req.hash_ids, roots[t]))
        out.append(Planned(p.index, p.offset_s, req, p.parent))
    return out
