"""Pure eviction policies for the CPU KV tier, resolved by name, and the vLLM adapter.

``create_policy("s3-fifo", capacity_blocks)`` returns an ``EvictionPolicy``; the cache that
owns it reports inserts, touches and removals and asks it for victims (see ``policies.base``).
``policies.vllm_adapter`` exposes every policy as a vLLM 0.32 out-of-tree ``CachePolicy``.
"""

from policies.base import NO_PROTECTION, EvictionPolicy, Key, OfflinePolicy, RequestInfo
from policies.registry import create_policy, get_policy_class, policy_names, register_policy

__all__ = [
    "NO_PROTECTION",
    "EvictionPolicy",
    "Key",
    "OfflinePolicy",
    "RequestInfo",
    "create_policy",
    "get_policy_class",
    "policy_names",
    "register_policy",
]
