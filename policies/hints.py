"""What a policy knows of a request, and the ``kv_transfer_params["kvroute"]`` entry it rides in.

``RequestInfo`` is what an eviction policy sees of the request whose blocks it is about to get.
The router sends its part of it to an engine as ``PolicyHints`` under ``HINTS_KEY`` of the
request's ``kv_transfer_params`` (vLLM hands that dict to the CPU tier's ``CachePolicy`` and to KV
connectors unchanged); the engines read it back with ``PolicyHints.from_params`` (the one
parser: the sim engine's CPU tier, the vLLM adapter, the PD connector, the router's dispatcher).
A decode engine's PD connector adds a ``TransferReport`` of its KV pull to the same entry of the
request's final output, which the router counts.

Pure (no vLLM, Ray or router imports), so the engines and the router both import it from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

__all__ = ["HINTS_KEY", "PolicyHints", "RequestInfo", "TransferReport"]

HINTS_KEY = "kvroute"  # kvroute's own key of kv_transfer_params (vLLM's connectors ignore it)


class TransferReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a decode engine's PD connector (``engines.pd.connector``) measured of the KV pull of
    one request, in ``PolicyHints.transfer`` of the request's final output.

    ``ok``: the blocks arrived (or were all cached here, ``cached``); ``blocks``/``bytes`` pulled;
    ``seconds``: the pull's wall time (control round trips, group setup if any, wire and
    scatter); ``wire_seconds``: the receive alone; ``remote_request_id``: the prefill engine's
    request; ``error``: why it failed; ``prompt_tokens_computed``: prompt tokens this engine
    computed itself after the load (1 when the pull worked: vLLM recomputes the last one; None:
    not measured). Fields at their default are left out of the wire form.
    """

    ok: bool
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    wire_seconds: float = 0.0
    cached: bool = False
    remote_request_id: str | None = None
    error: str | None = None
    prompt_tokens_computed: int | None = None


Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class PolicyHints(msgspec.Struct, frozen=True, omit_defaults=True):
    """The ``kv_transfer_params["kvroute"]`` entry: the router's hints to the engine's CPU-tier
    policy (``router.hints`` derives them), and what the engine reports back.

    ``category`` is ``type_turn`` (``text_2``) or ``"all"``; ``session_id`` and ``parent_id``
    identify a multi-turn conversation when the workload has one; ``continuation`` is an
    external prediction (a probability) that the session sends another turn (None: the policy
    predicts it itself). ``pin`` is an operator's order for the request's blocks (the KV
    control API): True pins them in the CPU tier (never a victim, admitted whatever the policy
    says), False unpins them, None leaves pins alone. The cache carries it out; a policy never
    sees a pinned block as a candidate. ``now_s``: the sender's clock for this request, for a
    policy in a process whose contract carries no time (the vLLM adapter; None: it reads its
    own clock); ``transfer``: a decode engine's report of its KV pull (on outputs only);
    ``pool_load``: whether to load what the engine finds in the cluster KV pool past its own
    tiers (False: the router found the link slower than recomputing; None: the connector's
    default, load). Fields at their default are left out of the wire form.
    """

    category: str = "all"
    turn: int = 1
    session_id: int | None = None
    parent_id: int | None = None
    continuation: Probability | None = None
    pin: bool | None = None
    now_s: float | None = None
    transfer: TransferReport | None = None
    pool_load: bool | None = None

    @classmethod
    def from_params(cls, kv_transfer_params: Mapping[str, Any] | None) -> PolicyHints | None:
        """The entry of ``kv_transfer_params`` (None when there is none, or it is not a JSON
        object). Missing fields take their defaults and unknown ones are ignored; numbers
        written as strings are read. Raises ``ValueError`` naming the field otherwise."""
        entry = (kv_transfer_params or {}).get(HINTS_KEY)
        if not isinstance(entry, Mapping):
            return None
        try:
            return msgspec.convert(dict(entry), PolicyHints, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params[{HINTS_KEY!r}]: {e}") from None

    def request_info(self) -> RequestInfo:
        """The request as a policy sees it: these hints, without the cache's own facts."""
        return RequestInfo(**msgspec.structs.asdict(self))

    def encode(self) -> dict[str, Any]:
        """The JSON-able wire form (fields at their default left out)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    def merged_into(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """``params`` (what a KV connector or the router put in ``kv_transfer_params``) with
        this entry under ``HINTS_KEY``, replacing any there; nothing else of ``params`` is
        touched (the caller's dict is not changed)."""
        return {**(params or {}), HINTS_KEY: self.encode()}


class RequestInfo(PolicyHints, frozen=True, omit_defaults=True):
    """What a policy may know about the request whose blocks it is about to see: the router's
    hints (``PolicyHints``, all of them optional) and the cache's own facts, which never travel:
    ``index``, the request's position in a replayed trace (the Belady oracle's clock), and
    ``num_blocks``, the prompt's length in blocks (0: unknown)."""

    index: int = -1
    num_blocks: int = 0

    @classmethod
    def from_hints(cls, kv_transfer_params: Mapping[str, Any] | None) -> RequestInfo | None:
        """The router's hints in ``kv_transfer_params`` as a policy sees them, or None without
        them (``PolicyHints.from_params``; raises ``ValueError`` naming a malformed field)."""
        hints = PolicyHints.from_params(kv_transfer_params)
        return hints.request_info() if hints is not None else None
