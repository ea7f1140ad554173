"""Block identity: chained 64-bit hashes over token ids. The only module that defines them.

``h[i] = xxh3_64(h[i-1] as 8 little-endian bytes || tokens of block i as little-endian uint32,
seed=HASH_SEED)``, with ``h[-1]`` the salt of (model name, LoRA name, cache_salt). Only full blocks
get a hash: a prompt of ``n`` tokens has ``n // block_size`` hashes. Because every hash covers the
whole prefix before it, equal hashes mean equal prefixes (up to 64-bit collisions), so a dict
lookup per block answers "is this prefix cached".
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from enum import StrEnum
from typing import NewType

import numpy as np
import numpy.typing as npt
import xxhash

BlockHash = NewType("BlockHash", int)
InstanceId = NewType("InstanceId", str)
# The cluster KV pool (``engines.pool``) in the cache map: one more holder, whose blocks are on
# the CPU tier. Its match is the prompt's leading run that any engine could load from the pool;
# scorers skip it like any holder that is no candidate. No engine replica is named so (Serve's
# replica ids and ``sim-<i>`` never are).
POOL_INSTANCE = InstanceId("kv-pool")

HASH_SEED = 0x6B76726F75746521  # b"kvroute!"
MAX_TOKEN_ID = 2**32 - 1

_MASK64 = (1 << 64) - 1
# splitmix64's constants: the golden-ratio increment and the finaliser's two multipliers
GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_xxh3 = xxhash.xxh3_64_intdigest
_U32_FAST = array("I").itemsize == 4 and sys.byteorder == "little"
_pack_u64 = struct.Struct("<Q").pack_into


class Tier(StrEnum):
    """Where a block is resident. Values equal vLLM's KV event ``medium`` strings."""

    GPU = "GPU"
    CPU = "CPU"


_TIER_OF: dict[str, Tier] = {t.value: t for t in Tier}


def as_tier(value: str) -> Tier:
    """``Tier(value)``, without the enum call's cost on the hot path (it runs per KV event).

    Raises ``ValueError`` for a value that is no tier, as ``Tier(value)`` does."""
    tier = _TIER_OF.get(value)
    return tier if tier is not None else Tier(value)


def salt_hash(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> BlockHash:
    """The chain's root ``h[-1]``: distinct per model, LoRA adapter and per-request cache salt."""
    key = "\x00".join((model, lora_name or "", cache_salt or "")).encode()
    return BlockHash(_xxh3(key, HASH_SEED))


def as_u32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a little-endian uint32 array (the bytes every block hash is taken over);
    raises ``ValueError`` for ids outside ``[0, MAX_TOKEN_ID]`` or a non-1-D array."""
    if isinstance(tokens, list | tuple) and _U32_FAST:
        # NOTE: array('I') converts a list ~3x faster than numpy and range-checks as it goes.
        try:
            return np.frombuffer(array("I", tokens), dtype="<u4")
        except (OverflowError, TypeError) as e:
            raise ValueError(f"token_ids must be integers in [0, {MAX_TOKEN_ID}]: {e}") from None
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype != np.uint32:
        if arr.dtype.kind not in "iu":
            raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
        if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
            raise ValueError(f"token_ids must lie in [0, {MAX_TOKEN_ID}]")
    return arr.astype("<u4", copy=False)


def block_hashes(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: int
) -> list[BlockHash]:
    """Chained hashes of every full block of ``tokens``, continuing the chain from ``parent``.

    ``parent`` is the salt (``salt_hash``) for a prompt's first block, or the hash of the block
    just before ``tokens`` when hashing a continuation.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arr = as_u32(tokens)
    n_blocks = arr.size // block_size
    if n_blocks == 0:
        return []
    row = 8 + 4 * block_size
    # NOTE: one buffer, each row = 8 bytes of parent hash + the block's tokens; the parent slot
    # is filled in as the chain advances, so each block costs one pack and one xxh3 call.
    buf = np.empty((n_blocks, 2 + block_size), dtype="<u4")
    buf[:, 2:] = arr[: n_blocks * block_size].reshape(n_blocks, block_size)
    mem = buf.data.cast("B")
    out: list[BlockHash] = []
    append = out.append
    h = parent
    for off in range(0, n_blocks * row, row):
        _pack_u64(mem, off, h)
        h = _xxh3(mem[off : off + row], HASH_SEED)
        append(h)  # type: ignore[arg-type]
    return out


def hash_block(parent: int, block_tokens: Sequence[int] | np.ndarray) -> BlockHash:
    """The hash of one block given its parent's hash (the ingestor's per-event path)."""
    arr = as_u32(block_tokens)
    return BlockHash(_xxh3(struct.pack("<Q", parent) + arr.tobytes(), HASH_SEED))


class BlockHasher:
    """Hashes prompts for one served model and block size (what the router holds)."""

    __slots__ = ("_salts", "block_size", "model")

    def __init__(self, model: str, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model = model
        self.block_size = block_size
        self._salts: dict[tuple[str | None, str | None], BlockHash] = {}

    def salt(self, lora_name: str | None = None, cache_salt: str | None = None) -> BlockHash:
        key = (lora_name, cache_salt)
        s = self._salts.get(key)
        if s is None:
            s = self._salts[key] = salt_hash(self.model, lora_name, cache_salt)
        return s

    def __call__(
        self,
        tokens: Sequence[int] | np.ndarray,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockHash]:
        return block_hashes(tokens, self.block_size, self.salt(lora_name, cache_salt))


def mix64(x: int) -> int:
    """splitmix64: a cheap, well-spread 64-bit hash of an int, and a bijection on 64 bits (the
    sim's synthetic hashes and output tokens; the text ``ray_prefix`` builds from hashes)."""
    x = (x + GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def mix64_finish(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser (``mix64`` without adding ``GOLDEN`` first) over a uint64 array,
    wrapping: the synthetic prompts' token ids (``loadgen.prompts``)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))
