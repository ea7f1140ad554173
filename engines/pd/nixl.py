"""NIXL as kvroute's second PD KV transport: vLLM 0.32's own ``NixlConnector`` (UCX).

``nixl_transfer_config(...)`` builds the ``kv_transfer_config`` dict an engine gives vLLM
(``VllmEngine(kv_transfer_config=...)``, or ``--kv-transfer-config``); the prefill and the decode
engine take the same config. The PD protocol is the one ``engines.pd.connector`` follows
(docs/architecture.md "Prefill/decode disaggregation"): the prefill request carries
``{"do_remote_decode": True}`` and ``max_tokens=1``, its output's ``kv_transfer_params`` go
unchanged to the decode request, whose worker then READs the prompt's blocks from the prefill worker
over NIXL and computes the last prompt token only.

The side channel. A NIXL decode worker first fetches the prefill engine's agent metadata over ZMQ
from the prefill engine's *side channel*, and vLLM 0.32 takes its address from the environment of
the engine-core process only, never from the config: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` (default
``localhost``: the address the listener binds and the one the prefill's ``kv_transfer_params``
advertise as ``remote_host``, so set it to an address the decode engines reach) and
``VLLM_NIXL_SIDE_CHANNEL_PORT`` (default 5600; data-parallel rank i binds port + i). Every engine
runs the listener, whatever its role, so **two engines on one host need distinct ports** (the
second one's bind fails otherwise). ``nixl_transfer_config`` records ``side_channel_host`` /
``side_channel_port`` under ``kv_connector_extra_config["kvroute"]`` (vLLM ignores that key);
``side_channel_env(config)`` turns them into those variables, and ``side_channel_environ(config)``
sets them in ``os.environ`` while an engine starts (vLLM spawns its engine-core process then, and
the process keeps the environment it started with).

Importing this module imports neither vLLM, nor torch, nor nixl; ``nixl_transfer_config`` imports
``vllm.config`` to validate its result with vLLM's own ``KVTransferConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal

from engines.environ import scoped_environ

__all__ = [
    "NIXL_CONNECTOR",
    "NIXL_EXTRA_KEYS",
    "SIDE_CHANNEL_HOST_ENV",
    "SIDE_CHANNEL_PORT_ENV",
    "NixlConfigError",
    "nixl_transfer_config",
    "side_channel_env",
    "side_channel_environ",
]

NIXL_CONNECTOR = "NixlConnector"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
_KVROUTE_KEY = "kvroute"  # our own entry in kv_connector_extra_config; vLLM never reads it

Role = Literal["kv_both", "kv_producer", "kv_consumer"]
Policy = Literal["recompute", "fail"]


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _non_negative_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _positive_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def _backends(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(b, str) and b for b in v)


# The kv_connector_extra_config keys vLLM 0.32's (pull) NixlConnector reads, with what each must
# be; vLLM itself ignores unknown keys, so a misspelt one would silently keep its default.
NIXL_EXTRA_KEYS: dict[str, tuple[Any, str]] = {
    "backends": (_backends, "a non-empty list of NIXL backend names, e.g. ['UCX']"),
    "kv_lease_duration": (_positive_int, "whole seconds > 0"),
    "kv_recompute_threshold": (_non_negative_int, "a token count >= 0"),
    "num_threads": (_positive_int, "an int > 0"),
    "engine_ttl": (_positive_number, "seconds > 0"),
    "decoder_kv_blocks_ttl": (_positive_int, "whole seconds > 0"),
    "enforce_handshake_compat": (lambda v: isinstance(v, bool), "a bool"),
    "bidirectional_kv_xfer": (lambda v: isinstance(v, bool), "a bool"),
}


class NixlConfigError(ValueError):
    """An argument of ``nixl_transfer_config`` (or a field vLLM refuses) is unusable; the
    message names it."""


def nixl_transfer_config(
    *,
    on_gpu: bool,
    side_channel_port: int | None = None,
    side_channel_host: str | None = None,
    kv_load_failure_policy: Policy = "recompute",
    role: Role = "kv_both",
    engine_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` (a dict for ``KVTransferConfig(**d)``) for its
    ``NixlConnector``, checked by vLLM's own ``KVTransferConfig``.

    ``on_gpu``: False for vLLM's CPU build (``kv_buffer_device="cpu"``: NIXL registers the KV
    cache as DRAM), True for CUDA engines (``"cuda"``: the KV cache is registered as VRAM).
    ``side_channel_port`` / ``side_channel_host``: this engine's NIXL side channel (see the
    module docstring: vLLM reads them from ``VLLM_NIXL_SIDE_CHANNEL_PORT`` / ``_HOST``, which
    ``side_channel_env`` / ``side_channel_environ`` give the engine). None keeps vLLM's defaults
    (5600, ``localhost``), fine for one engine per host only: two engines on one host need
    distinct ports. ``kv_load_failure_policy``: what a decode engine does when its NIXL read
    fails ("recompute" the prompt locally, or "fail" the request). ``role``: vLLM's ``kv_role``
    (0.32 logs that ``kv_both`` is deprecated for NIXL in favour of ``kv_producer`` /
    ``kv_consumer``, but runs it; ``kv_both`` lets any engine take either leg).
    ``extra``: more ``kv_connector_extra_config`` keys of the NIXL connector
    (``NIXL_EXTRA_KEYS``: ``kv_lease_duration``, how long a prefill engine holds blocks no decode
    reads, default 30 s; ``kv_recompute_threshold``, below how many remote tokens a decode engine
    recomputes instead of reading, default 64; ``backends``, default ``["UCX"]`` ...).

    Raises ``NixlConfigError`` naming the argument or field at fault.
    """
    if not isinstance(on_gpu, bool):
        raise NixlConfigError(f"on_gpu must be a bool: {on_gpu!r}")
    if side_channel_port is not None and not (
        _positive_int(side_channel_port) and side_channel_port < 65536
    ):
        raise NixlConfigError(f"side_channel_port must be a TCP port: {side_channel_port!r}")
    if side_channel_host is not None and not (
        isinstance(side_channel_host, str) and side_channel_host.strip()
    ):
        raise NixlConfigError(f"side_channel_host must be a host name: {side_channel_host!r}")
    if kv_load_failure_policy not in ("recompute", "fail"):
        raise NixlConfigError(
            f"kv_load_failure_policy must be 'recompute' or 'fail': {kv_load_failure_policy!r}"
        )
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise NixlConfigError(
            f"role (kv_role) must be 'kv_both', 'kv_producer' or 'kv_consumer': {role!r}"
        )
    if engine_id is not None and not (isinstance(engine_id, str) and engine_id):
        raise NixlConfigError(f"engine_id must be a non-empty string: {engine_id!r}")
    settings: dict[str, Any] = {"backends": ["UCX"]}
    for key, value in extra.items():
        if key not in NIXL_EXTRA_KEYS:
            raise NixlConfigError(
                f"kv_connector_extra_config[{key!r}]: vLLM 0.32's NixlConnector reads no such "
                f"key (it would be ignored); known keys: {sorted(NIXL_EXTRA_KEYS)}"
            )
        check, what = NIXL_EXTRA_KEYS[key]
        if not check(value):
            raise NixlConfigError(f"kv_connector_extra_config[{key!r}] must be {what}: {value!r}")
        settings[key] = list(value) if key == "backends" else value
    side_channel = {
        k: v
        for k, v in (
            ("side_channel_host", side_channel_host),
            ("side_channel_port", side_channel_port),
        )
        if v is not None
    }
    if side_channel:
        settings[_KVROUTE_KEY] = side_channel
    config: dict[str, Any] = {
        "kv_connector": NIXL_CONNECTOR,
        "kv_role": role,
        "kv_buffer_device": "cuda" if on_gpu else "cpu",
        "kv_load_failure_policy": kv_load_failure_policy,
        "kv_connector_extra_config": settings,
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    _validate_with_vllm(config)
    return config


def _validate_with_vllm(config: dict[str, Any]) -> None:
    """``KVTransferConfig(**config)``; its refusal as a ``NixlConfigError`` naming the field."""
    from vllm.config import KVTransferConfig

    try:
        # NOTE: a copy, so vLLM's defaults (a fresh engine_id ...) stay out of ``config``
        KVTransferConfig(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()})
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        errors = getattr(e, "errors", None)
        details = errors() if callable(errors) else []
        parts = [
            f"{'.'.join(map(str, d.get('loc', ()))) or 'kv_transfer_config'}: {d.get('msg')}"
            f" (got {d.get('input')!r})"
            for d in details
        ]
        raise NixlConfigError(
            "vLLM's KVTransferConfig refuses the NIXL config: " + ("; ".join(parts) or str(e))
        ) from e


def side_channel_env(config: Mapping[str, Any]) -> dict[str, str]:
    """The environment variables vLLM 0.32 reads this engine's NIXL side channel from
    (``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT``), for what ``nixl_transfer_config`` recorded
    in ``config``; empty where it recorded nothing (vLLM's defaults then)."""
    extra = config.get("kv_connector_extra_config") or {}
    for child in extra.get("connectors") or ():  # composed (MultiConnector): the NIXL child's
        if child.get("kv_connector") == "NixlConnector":
            extra = child.get("kv_connector_extra_config") or {}
    ours = extra.get(_KVROUTE_KEY) or {}
    env: dict[str, str] = {}
    if ours.get("side_channel_host") is not None:
        env[SIDE_CHANNEL_HOST_ENV] = str(ours["side_channel_host"])
    if ours.get("side_channel_port") is not None:
        env[SIDE_CHANNEL_PORT_ENV] = str(int(ours["side_channel_port"]))
    return env


def side_channel_environ(config: Mapping[str, Any]) -> AbstractContextManager[dict[str, str]]:
    """Set ``side_channel_env(config)`` in ``os.environ`` for the block (start the engine in
    it: its engine-core process inherits them), then restore what was there."""
    return scoped_environ(side_channel_env(config))
