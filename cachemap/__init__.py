"""Block hashing, the global cache map with per-instance per-tier residency, and vLLM KV event
ingestion (the events' wire records and their application to the map; the bus that carries
them is ``engines.bus``). Pure: no Ray, asyncio, sockets or clock reads."""

from cachemap.hashing import (
    POOL_INSTANCE,
    BlockHash,
    BlockHasher,
    InstanceId,
    Tier,
    block_hashes,
    salt_hash,
)
from cachemap.map import CacheMap, CacheMapStats
from cachemap.match import Match, MatchResult

__all__ = [
    "POOL_INSTANCE",
    "BlockHash",
    "BlockHasher",
    "CacheMap",
    "CacheMapStats",
    "InstanceId",
    "Match",
    "MatchResult",
    "Tier",
    "block_hashes",
    "salt_hash",
]
