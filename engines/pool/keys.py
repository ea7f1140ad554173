"""Pool keys: the name a KV block has in the cluster KV pool (Mooncake Store).

A key is ``kvr1/<namespace>/<block hash>``:

- ``<block hash>``: the block's chained hash (``cachemap.hashing``), 16 hex digits. The chain
  covers the whole prefix up to and including the block, and its root ``h[-1]`` is
  ``salt_hash(model, lora_name, cache_salt)``. So two requests with different ``cache_salt``
  (or LoRA adapter) share no block hash, and hence no pool key, from their first block on:
  that is why tenant isolation by ``cache_salt`` holds although the salt is not spelled in the
  key (and must not be: it is client text).
- ``<namespace>``: 32 hex digits of xxh3-128 over everything else that makes the bytes of a
  block's KV differ for equal tokens: the served model (and its revision), the KV layout, the
  KV dtype, the block size and the tensor-parallel shard. Two engines whose KV bytes would not
  be interchangeable never read each other's blocks, even when their token hashes agree
  (same model name served at another dtype, block size, layout or TP degree).
- ``kvr1``: the key format's version; a change of format changes it, so old blocks are
  simply not found.

No key contains text a client sent: the only client-controlled inputs (``cache_salt``, the
prompt's tokens) enter through hashes. The namespace's fields are server configuration, hashed
as well so that any spelling (slashes, spaces) yields a key of fixed shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from cachemap.hashing import BlockHash, block_hashes, salt_hash

__all__ = ["KEY_VERSION", "PoolNamespace", "pool_key", "pool_keys", "prompt_pool_keys"]

KEY_VERSION = "kvr1"
# the namespace hash's seed: another seed than the block chain's, so a namespace never equals
# a digest computed for some other purpose
_NS_SEED = 0x6B76706F6F6C6E73  # b"kvpoolns"


def _encode(fields: Sequence[str]) -> bytes:
    """Length-prefixed fields: no two different tuples encode alike (a field's own separators
    cannot fake a boundary)."""
    return b"".join(f"{len(b)}:".encode() + b for b in (f.encode() for f in fields))


@dataclass(frozen=True, slots=True)
class PoolNamespace:
    """What, besides the tokens (and the chain's salt), a block's KV bytes depend on.

    ``kv_layout`` names the arrangement of one block's bytes as the connector stores them
    (e.g. ``"vllm-cpu/NHD/layers=2/kv_heads=1/head_dim=64"``): two layouts never share keys.
    ``tp_rank``/``tp_size``: a tensor-parallel engine stores one shard per rank.
    """

    model: str
    kv_layout: str
    kv_dtype: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    revision: str = ""
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        for name in ("model", "kv_layout", "kv_dtype"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        encoded = _encode(
            (
                self.model,
                self.revision,
                self.kv_layout,
                self.kv_dtype,
                str(self.block_size),
                str(self.tp_rank),
                str(self.tp_size),
            )
        )
        object.__setattr__(self, "digest", xxhash.xxh3_128_hexdigest(encoded, _NS_SEED))

    @property
    def prefix(self) -> str:
        """The common start of this namespace's keys (``kvr1/<digest>/``)."""
        return f"{KEY_VERSION}/{self.digest}/"


def pool_key(ns: PoolNamespace, block_hash: int) -> str:
    """The pool key of the block whose chained hash is ``block_hash``."""
    if not 0 <= block_hash < 1 << 64:
        raise ValueError(f"a block hash is a 64-bit unsigned int, got {block_hash}")
    return f"{KEY_VERSION}/{ns.digest}/{block_hash:016x}"


def pool_keys(ns: PoolNamespace, hashes: Sequence[int]) -> list[str]:
    """``pool_key`` of each hash, in order."""
    prefix = ns.prefix
    for h in hashes:
        if not 0 <= h < 1 << 64:
            raise ValueError(f"a block hash is a 64-bit unsigned int, got {h}")
    return [f"{prefix}{h:016x}" for h in hashes]


def prompt_pool_keys(
    ns: PoolNamespace,
    tokens: Sequence[int] | np.ndarray,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[str]:
    """The pool keys of every full block of a prompt: its chained hashes from the root of
    (``ns.model``, ``lora_name``, ``cache_salt``), the same chain the router's map uses."""
    root: BlockHash = salt_hash(ns.model, lora_name, cache_salt)
    return pool_keys(ns, block_hashes(tokens, ns.block_size, root))
