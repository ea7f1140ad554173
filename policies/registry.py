"""Policies by name: a lazy registry with a module-path fallback for out-of-tree policies."""

from __future__ import annotations

import importlib
from typing import Any

from policies.base import EvictionPolicy

# name: (module path, class name); modules are imported only when a policy is asked for.
_REGISTRY: dict[str, tuple[str, str]] = {
    "lru": ("policies.lru", "LRUPolicy"),
    "fifo": ("policies.fifo", "FIFOPolicy"),
    "lfu": ("policies.lfu", "LFUPolicy"),
    "arc": ("policies.arc", "ARCPolicy"),
    "s3-fifo": ("policies.s3fifo", "S3FIFOPolicy"),
    "gdsf": ("policies.gdsf", "GDSFPolicy"),
    "aging-lfu": ("policies.aging_lfu", "AgingLFUPolicy"),
    "wa": ("policies.wa", "WAPolicy"),
    "lpc": ("policies.lpc", "LPCPolicy"),
    "prefix-reuse": ("policies.prefix_reuse", "PrefixReusePolicy"),
    "prefix-odds": ("policies.prefix_odds", "PrefixOddsPolicy"),
    "belady": ("policies.belady", "BeladyPolicy"),
    "reuse-oracle": ("policies.reuse_oracle", "ReuseOraclePolicy"),
}


# The policies an engine can run (the oracles need the future), by the name of their vLLM
# ``CachePolicy`` class in ``policies.vllm_adapter``.
ENGINE_POLICY_CLASSES: dict[str, str] = {
    "lru": "KvrouteLRU",
    "fifo": "KvrouteFIFO",
    "lfu": "KvrouteLFU",
    "arc": "KvrouteARC",
    "s3-fifo": "KvrouteS3FIFO",
    "gdsf": "KvrouteGDSF",
    "aging-lfu": "KvrouteAgingLFU",
    "wa": "KvrouteWA",
    "lpc": "KvrouteLPC",
    "prefix-reuse": "KvroutePrefixReuse",
    "prefix-odds": "KvroutePrefixOdds",
}
# The environment variable that carries a CPU-tier policy's constructor options into vLLM's
# engine-core process (JSON keyed by class name; vLLM builds the policy with its capacity alone).
POLICY_OPTIONS_ENV = "KVROUTE_CPU_POLICY_OPTIONS"


def engine_policy_class(name: str) -> str:
    """The vLLM ``CachePolicy`` class name of engine-runnable policy ``name``; ``ValueError``
    naming the valid ones otherwise (an offline oracle needs the future)."""
    key = name.strip().lower()
    cls = ENGINE_POLICY_CLASSES.get(key)
    if cls is None:
        why = "needs the future and cannot run in an engine" if key in _REGISTRY else "is unknown"
        raise ValueError(f"policy {name!r} {why}; valid: {', '.join(ENGINE_POLICY_CLASSES)}")
    return cls


def policy_names() -> list[str]:
    """Registered names, in registration order."""
    return list(_REGISTRY)


def register_policy(name: str, module_path: str, class_name: str) -> None:
    """Add a policy under ``name`` (lower-case); re-registering a name is an error."""
    key = name.lower()
    if key in _REGISTRY:
        raise ValueError(f"policy {name!r} is already registered")
    _REGISTRY[key] = (module_path, class_name)


def get_policy_class(name: str, module_path: str | None = None) -> type[EvictionPolicy]:
    """The class registered as ``name``, or class ``name`` of ``module_path`` when given.

    Raises ``ValueError`` listing the valid names for an unknown one.
    """
    entry = _REGISTRY.get(name.strip().lower())
    if entry is None:
        if module_path is None:
            raise ValueError(
                f"policy: unknown name {name!r}; valid: {', '.join(_REGISTRY)} "
                "(or give a module path for an out-of-tree policy)"
            )
        entry = (module_path, name)
    cls = getattr(importlib.import_module(entry[0]), entry[1], None)
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise ValueError(f"policy: {entry[0]}.{entry[1]} is not an EvictionPolicy")
    return cls


def create_policy(name: str, capacity_blocks: int, **options: Any) -> EvictionPolicy:
    """Instantiate the policy registered as ``name`` for a cache of ``capacity_blocks``."""
    return get_policy_class(name)(capacity_blocks, **options)
