"""The router's hints to an engine's CPU-tier eviction policy: how the ingress derives them.

The record is ``policies.hints.PolicyHints`` (the ``kv_transfer_params["kvroute"]`` entry, with
its one encoder, ``merged_into``, and its one parser, ``from_params``, which the engines use);
it is re-exported here beside the helpers that fill it in.

What a workload-aware policy can use (LPC's history predictor, prefix-odds): the request's
category and turn, the id of the conversation state this request is (``session_id``) and of
the earlier turn it continues (``parent_id``), and an optional client-supplied probability
that the conversation sends another turn (``continuation``). The ids follow the traces'
convention (Bailian's ``chat_id`` / ``parent_chat_id``): every turn has its own id, and a turn
names the previous one as its parent, so a policy learns which kinds of requests are continued.

Over HTTP there are no such ids, so the ingress derives them from the conversation itself: a
chat request's id is a hash of its messages up to its last user message; its parent's is the
same hash one user message earlier, which is what the previous turn's request hashed to (the
client resends the history). The session key (``x-session-id`` header or ``user``) salts both,
so equal conversations of different users stay apart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

_ID_BITS = (1 << 63) - 1  # ids are non-negative 63-bit ints (RequestInfo's session_id type)


def conversation_ids(
    messages: Sequence[Mapping[str, Any]], session: str | None = None
) -> tuple[int | None, int | None]:
    """``(session_id, parent_id)`` of a chat request (see the module docstring): hashes of the
    messages up to the last user message and up to the one before it (None: no such message).
    Each message counts by role and content (text or parts, canonically serialised)."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None, None
    h = xxhash.xxh3_64()
    h.update((session or "").encode())
    ids: dict[int, int] = {}
    wanted = set(users[-2:])
    for i, m in enumerate(messages[: users[-1] + 1]):
        h.update(json.dumps([m.get("role"), m.get("content")], sort_keys=True).encode())
        if i in wanted:
            ids[i] = h.intdigest() & _ID_BITS
    node = ids[users[-1]]
    parent = ids[users[-2]] if len(users) > 1 else None
    return node, parent


def parse_continuation(value: Any, field: str) -> float | None:
    """A continuation probability from a header or body field: a number in [0, 1], or None
    when absent. Raises ``ValueError`` naming ``field`` otherwise."""
    if value is None or value == "":
        return None
    try:
        p = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a number in [0, 1], got {value!r}") from None
    if not (0.0 <= p <= 1.0) or math.isnan(p):
        raise ValueError(f"{field} must be a number in [0, 1], got {value!r}")
    return p
