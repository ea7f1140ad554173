"""The PD connector's pure parts: settings, ``kv_transfer_params``, control messages, the lease.

``engines.pd.connector`` (the vLLM connector) builds on these; nothing here imports vLLM, Ray or
``router``, so they are unit-tested without an engine.

Control channel. Each prefill worker binds a ZMQ ROUTER on ``host:port + tp_rank``; a decode
worker talks to it with a DEALER, one per (prefill worker, decode worker) pair. Messages are
msgpack (``msgspec``), tagged structs:

- ``Connect``: the decode worker hosts a ``TCPStore`` (a free port of its own) and sends its
  address; the prefill worker answers ``ConnectReply`` at once and joins the store as rank 0 of
  a new two-rank ``KVTransport`` (rank 1 is the decode worker). A ``Connect`` with a pair id the
  prefill worker already has replaces that pair (the decode side rebuilds after a failure).
- ``Pull``: send request ``request_id``'s last ``num_blocks`` blocks over the pair's transport.
  ``PullReply`` only says whether the pair is live (so a decode worker learns at once that a
  prefill worker restarted or stopped); the transfer itself, or an ABORT header if the prefill
  worker no longer holds the blocks, is the answer.
- ``Release``: no pull will come for ``request_id`` (the decode side found it all cached or the
  request ended first): free the blocks now.

Lease. ``SendLedger`` holds the block ids a prefill worker keeps for a decode worker to pull;
entries not claimed within ``lease_s`` expire and their blocks are freed.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "Connect",
    "ConnectReply",
    "ConnectorSettings",
    "ParamsError",
    "ProtocolError",
    "Pull",
    "PullParams",
    "PullReply",
    "Release",
    "SendLedger",
    "decode_message",
    "encode_message",
    "kv_transfer_config",
    "parse_pull_params",
]

CONNECTOR_MODULE = "engines.pd.connector"
CONNECTOR_NAME = "KvrouteConnector"
TRANSFER_MODE = "kvroute-pull"

Backend = Literal["auto", "gloo", "nccl"]
_BACKENDS = ("auto", "gloo", "nccl")


class ParamsError(ValueError):
    """``kv_transfer_params`` or ``kv_connector_extra_config`` are unusable (names the key)."""


class ProtocolError(ValueError):
    """A control-channel message that is not one of ours."""


# ------------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``.

    ``host``: the address other engines reach this worker at (control channel, Gloo sockets,
    the TCPStore a decode worker hosts); ``port``: the control channel's base port (TP rank r
    binds ``port + r``; None: this engine can only decode). ``backend``: "auto" (NCCL for
    CUDA caches, Gloo otherwise), "gloo" or "nccl". ``lease_s``: how long a prefill keeps
    blocks nobody pulls. ``timeout_s``: bound of every transfer wait. ``connect_timeout_s``:
    how long a decode worker waits for a prefill worker's answer to ``Connect``.
    ``claim_wait_s``: how long a prefill worker waits for a pulled request it does not know
    yet (its scheduler hands it over one step after the response left). ``chunk_bytes`` and
    ``channels`` go to ``KVTransport``. ``pull_threads``: concurrent pulls (distinct pairs).
    """

    host: str = "127.0.0.1"
    port: int | None = None
    backend: Backend = "auto"
    lease_s: float = 120.0
    timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    claim_wait_s: float = 5.0
    chunk_bytes: int = 64 << 20
    channels: int = 1
    pull_threads: int = 4

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Settings from ``kv_connector_extra_config``; unknown keys are ignored (another
        connector of a ``MultiConnector`` may share the dict), bad values raise ``ParamsError``
        naming the key."""
        extra = extra or {}
        d = cls()
        host = extra.get("host", d.host)
        if not isinstance(host, str) or not host:
            raise ParamsError(f"kv_connector_extra_config['host'] must be a host name: {host!r}")
        port = extra.get("port", d.port)
        if port is not None and (not _is_int(port) or not 0 < port < 65536):
            raise ParamsError(f"kv_connector_extra_config['port'] must be a TCP port: {port!r}")
        backend = extra.get("backend", d.backend)
        if backend not in _BACKENDS:
            raise ParamsError(
                f"kv_connector_extra_config['backend'] must be one of {_BACKENDS}: {backend!r}"
            )
        floats = {}
        for key in ("lease_s", "timeout_s", "connect_timeout_s", "claim_wait_s"):
            value = extra.get(key, getattr(d, key))
            if not _is_number(value) or not value > 0 or not math.isfinite(value):
                raise ParamsError(
                    f"kv_connector_extra_config[{key!r}] must be a positive number: {value!r}"
                )
            floats[key] = float(value)
        ints = {}
        for key in ("chunk_bytes", "channels", "pull_threads"):
            value = extra.get(key, getattr(d, key))
            if not _is_int(value) or value < 1:
                raise ParamsError(
                    f"kv_connector_extra_config[{key!r}] must be a positive integer: {value!r}"
                )
            ints[key] = int(value)
        return cls(
            host=host,
            port=port,
            backend=backend,
            lease_s=floats["lease_s"],
            timeout_s=floats["timeout_s"],
            connect_timeout_s=floats["connect_timeout_s"],
            claim_wait_s=floats["claim_wait_s"],
            chunk_bytes=ints["chunk_bytes"],
            channels=ints["channels"],
            pull_threads=ints["pull_threads"],
        )


def kv_transfer_config(
    *,
    port: int | None,
    host: str = "127.0.0.1",
    role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both",
    backend: Backend = "auto",
    lease_s: float = 120.0,
    timeout_s: float = 30.0,
    connect_timeout_s: float = 10.0,
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute",
    engine_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` (a dict for ``KVTransferConfig(**d)``, which
    ``VllmEngine(kv_transfer_config=...)`` takes) for kvroute's PD connector.

    ``port``: the control channel's base port of an engine that prefills for others (TP rank r
    binds ``port + r``); None for a decode-only engine. ``host``: the address other engines
    reach this one at. ``kv_load_failure_policy``: what the decode engine does when a pull
    fails ("recompute" the prompt locally, or "fail" the request). ``extra``: more
    ``ConnectorSettings`` fields (``claim_wait_s``, ``chunk_bytes``, ``channels`` ...)."""
    settings: dict[str, Any] = {
        "host": host,
        "port": port,
        "backend": backend,
        "lease_s": lease_s,
        "timeout_s": timeout_s,
        "connect_timeout_s": connect_timeout_s,
        **extra,
    }
    ConnectorSettings.from_extra(settings)  # fail here, not in vLLM's engine core
    if kv_load_failure_policy not in ("recompute", "fail"):
        raise ParamsError(
            f"kv_load_failure_policy must be 'recompute' or 'fail': {kv_load_failure_policy!r}"
        )
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": kv_load_failure_policy,
        "kv_connector_extra_config": settings,
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return config


# ----------------------------------------------------------------- kv_transfer_params


@dataclass(frozen=True, slots=True)
class PullParams:
    """What a decode engine needs to pull a prefill's KV (NixlConnector's key names)."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    tp_size: int
    num_tokens: int | None
    backend: str | None

    def endpoint(self, tp_rank: int) -> str:
        return f"tcp://{_zmq_host(self.host)}:{self.port + tp_rank}"


def parse_pull_params(params: Mapping[str, Any] | None) -> PullParams | None:
    """The pull a decode request asks for, or None when it asks for none (no
    ``do_remote_prefill``). Raises ``ParamsError`` naming the first missing or malformed key.
    Keys this connector does not know (``"kvroute"``, NIXL's extras) are ignored."""
    if not params or not params.get("do_remote_prefill"):
        return None

    def need(key: str, check: Callable[[Any], bool], what: str) -> Any:
        if key not in params:
            raise ParamsError(f"kv_transfer_params[{key!r}] is missing (do_remote_prefill set)")
        value = params[key]
        if not check(value):
            raise ParamsError(f"kv_transfer_params[{key!r}] must be {what}: {value!r}")
        return value

    engine_id = need("remote_engine_id", _nonempty_str, "a non-empty string")
    request_id = need("remote_request_id", _nonempty_str, "a non-empty string")
    blocks = need("remote_block_ids", _block_ids_ok, "a non-empty list of block ids")
    host = need("remote_host", _nonempty_str, "a host name")
    port = need("remote_port", lambda p: _is_int(p) and 0 < p < 65536, "a TCP port")
    tp_size = params.get("tp_size", 1)
    if not _is_int(tp_size) or tp_size < 1:
        raise ParamsError(f"kv_transfer_params['tp_size'] must be a positive integer: {tp_size!r}")
    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and (not _is_int(num_tokens) or num_tokens < 0):
        raise ParamsError(
            f"kv_transfer_params['remote_num_tokens'] must be a token count: {num_tokens!r}"
        )
    backend = params.get("remote_backend")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ParamsError(f"kv_transfer_params['remote_backend'] must be gloo or nccl: {backend!r}")
    if isinstance(blocks[0], list):  # one list per KV cache group: one group only
        if len(blocks) != 1:
            raise ParamsError(
                f"kv_transfer_params['remote_block_ids'] has {len(blocks)} KV cache groups; "
                "this connector moves one"
            )
        blocks = blocks[0]
    return PullParams(
        engine_id=engine_id,
        request_id=request_id,
        block_ids=tuple(int(b) for b in blocks),
        host=host,
        port=int(port),
        tp_size=int(tp_size),
        num_tokens=None if num_tokens is None else int(num_tokens),
        backend=backend,
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _nonempty_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


def _block_ids_ok(v: Any) -> bool:
    if not isinstance(v, list | tuple) or not v:
        return False
    if isinstance(v[0], list | tuple):  # per-group lists
        return all(isinstance(g, list | tuple) and g and all(map(_is_int, g)) for g in v)
    return all(_is_int(b) and b >= 0 for b in v)


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ----------------------------------------------------------------------- messages


class Connect(msgspec.Struct, tag="connect", frozen=True):
    pair_id: str
    decode_engine_id: str
    store_host: str
    store_port: int
    backend: str


class ConnectReply(msgspec.Struct, tag="connect_reply", frozen=True):
    pair_id: str
    ok: bool
    engine_id: str
    error: str = ""


class Pull(msgspec.Struct, tag="pull", frozen=True):
    pair_id: str
    request_id: str
    num_blocks: int


class PullReply(msgspec.Struct, tag="pull_reply", frozen=True):
    request_id: str
    ok: bool
    error: str = ""
    refused: bool = False  # the blocks are gone (the pair is fine)


class Release(msgspec.Struct, tag="release", frozen=True):
    request_id: str


Message = Connect | ConnectReply | Pull | PullReply | Release
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_message(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_message(data: bytes) -> Message:
    """One control message; ``ProtocolError`` for anything else."""
    try:
        msg: Message = _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"not a kvroute PD control message: {e}") from e
    return msg


# -------------------------------------------------------------------------- lease


@dataclass(slots=True)
class _Held:
    block_ids: list[int]
    deadline: float
    claimed: bool = False


class SendLedger:
    """The requests whose blocks a prefill worker holds for a pull, and their lease.

    ``add`` a request's blocks when its scheduler hands them over; a pull ``claim``s them
    (waiting up to ``wait_s`` for an ``add`` that is on its way), then ``finish``es; a
    ``release`` or an expired lease ends an unclaimed entry. ``take_finished`` returns the
    requests whose blocks may be freed now (once each), expiring leases first. Thread-safe: the
    control and sender threads claim and finish, vLLM's step thread adds and takes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, remember: int = 4096) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._held: dict[str, _Held] = {}
        self._finished: set[str] = set()
        self._gone: OrderedDict[str, str] = OrderedDict()  # recently ended: why
        self._remember = remember
        self.expired = 0

    def add(self, request_id: str, block_ids: list[int], lease_s: float) -> None:
        with self._cond:
            if request_id in self._held:
                return
            self._gone.pop(request_id, None)
            self._held[request_id] = _Held(list(block_ids), self._clock() + lease_s)
            self._cond.notify_all()

    def claim(self, request_id: str, wait_s: float = 0.0) -> list[int] | str:
        """The blocks of ``request_id``, now claimed (its lease stops); or, if it cannot be
        pulled, why (a string)."""
        end = time.monotonic() + wait_s
        with self._cond:
            while True:
                self._expire()
                held = self._held.get(request_id)
                if held is not None:
                    if held.claimed:
                        return f"request {request_id} is already being pulled"
                    held.claimed = True
                    return held.block_ids
                if request_id in self._gone:
                    return f"request {request_id}: {self._gone[request_id]}"
                left = end - time.monotonic()
                if left <= 0:
                    return f"request {request_id} is not held here (unknown or long gone)"
                self._cond.wait(min(left, 0.05))

    def why_gone(self, request_id: str) -> str | None:
        """Why ``request_id`` cannot be pulled any more (lease expired, pulled, released), or
        None if it is held or not known yet (its scheduler may hand it over any moment)."""
        with self._cond:
            self._expire()
            if request_id in self._held:
                return None
            why = self._gone.get(request_id)
            return None if why is None else f"request {request_id}: {why}"

    def finish(self, request_id: str, why: str = "already pulled") -> bool:
        """End ``request_id``'s hold (pulled, failed or released): its blocks may be freed."""
        with self._cond:
            if self._held.pop(request_id, None) is None:
                return False
            self._end(request_id, why)
            return True

    def release(self, request_id: str) -> bool:
        """The decode side will not pull: end the hold unless a pull has claimed it."""
        with self._cond:
            held = self._held.get(request_id)
            if held is None or held.claimed:
                return False
            del self._held[request_id]
            self._end(request_id, "released by the decode engine")
            return True

    def take_finished(self) -> set[str]:
        with self._cond:
            self._expire()
            out, self._finished = self._finished, set()
            return out

    def holding(self) -> int:
        with self._cond:
            return len(self._held)

    def _expire(self) -> None:
        now = self._clock()
        for rid in [r for r, h in self._held.items() if not h.claimed and h.deadline <= now]:
            del self._held[rid]
            self.expired += 1
            self._end(rid, "its lease expired before any pull")

    def _end(self, request_id: str, why: str) -> None:
        self._finished.add(request_id)
        self._gone[request_id] = why
        self._gone.move_to_end(request_id)
        while len(self._gone) > self._remember:
            self._gone.popitem(last=False)
