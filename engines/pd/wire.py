"""What the PD data path's header says and what a transfer reports: the ``Header`` each
transfer starts with (``HEADER_WORDS`` int64s, layout in ``engines.pd.transfer``'s docstring),
the request key it carries, the ``KVTransferError`` family the transport raises (a mismatch or
an abort carries the header that caused it; a bad header is ``KVTransportBroken``) and the
``TransferStats`` of one send or receive.

Pure records: no torch, vLLM, Ray or ``router`` import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "HEADER_WORDS",
    "Header",
    "KVTransferAborted",
    "KVTransferError",
    "KVTransferMismatch",
    "KVTransferTimeout",
    "KVTransportBroken",
    "TransferStats",
    "request_key",
]

MAGIC = 0x4B56525450440001  # "KVRTPD" + protocol version 1; fits a signed int64
HEADER_WORDS = 12
STATUS_OK = 0
STATUS_ABORT = 1


class KVTransferError(RuntimeError):
    """A KV transfer failed; the connector maps it to vLLM's ``kv_load_failure_policy``."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """The peer sent nothing (or too little) within the timeout."""


class KVTransportBroken(KVTransferError):
    """An earlier failure broke the channel to this peer; build a new transport."""


class KVTransferMismatch(KVTransferError):
    """The next transfer on the channel was not the expected one (request, sizes or layout).

    Its payload was drained: the channel is still in step and usable."""

    def __init__(self, message: str, header: Header) -> None:
        super().__init__(message)
        self.header = header


class KVTransferAborted(KVTransferError):
    """The sender aborted this request's transfer (``send_abort``); no data came."""

    def __init__(self, message: str, header: Header) -> None:
        super().__init__(message)
        self.header = header


def request_key(request_id: str) -> int:
    """63-bit key of a request id, carried in the header (stable across processes)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class Header:
    seq: int
    key: int
    status: int
    num_blocks: int
    num_layers: int
    block_bytes: int
    fingerprint: int
    blocks_per_chunk: int
    num_chunks: int
    total_bytes: int

    def to_words(self) -> list[int]:
        words = [
            MAGIC,
            self.seq,
            self.key,
            self.status,
            self.num_blocks,
            self.num_layers,
            self.block_bytes,
            self.fingerprint,
            self.blocks_per_chunk,
            self.num_chunks,
            self.total_bytes,
        ]
        return words + [0] * (HEADER_WORDS - len(words))

    @classmethod
    def from_words(cls, words: Sequence[int]) -> Header:
        if words[0] != MAGIC:
            raise KVTransportBroken(f"bad header magic {words[0]:#x}: channel out of step")
        return cls(*(int(w) for w in words[1:11]))


@dataclass(slots=True)
class TransferStats:
    """What one send or receive did; times in seconds (wall clock of this side)."""

    request_id: str
    num_blocks: int
    bytes: int
    chunks: int
    staging_s: float = 0.0  # gather (sender) or scatter (receiver), including H2D/D2H copies
    wait_s: float = 0.0  # blocked on the network (header included)
    total_s: float = 0.0
