"""The KV layout the PD data path moves: per-layer views of vLLM's caches, and blocks gathered
into / scattered from the protocol's chunk format.

``engines.pd.transfer`` (the transport) builds on this; pure torch, no vLLM, Ray or ``router``.

KV caches. One tensor per layer with the block index on dim 0, which vLLM 0.32 guarantees for
every layout (RFC #42082: a layer's cache is a ``[num_blocks, H, N, C]`` view of the raw buffer,
C holding K and V, e.g. ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` for the CPU
backend; the stride order depends on ``KVCacheLayout``). When a block of a layer is one dense
run of memory (every layout whose H, N, C axes are innermost: LBHNC, LBNHC, BLHNC, BLNHC) its
bytes are moved as they lie ("page" mode, both sides must share the layout, which the
transport's header checks through ``layout_fingerprint``); otherwise the block is moved in
logical order ("logical" mode), which is always correct and slower. An older layout with blocks
on another axis works as a view with that axis moved to 0 (``t.movedim(1, 0)``).

Chunk format. A chunk holds some blocks of every layer, layer-major (layer 0's blocks, then
layer 1's ...), each block in its layer's page format (``gather_blocks``, ``scatter_blocks``).

Speed. Gather with ``index_select`` into a caller's staging buffer, scatter with
``index_copy_``; runs of consecutive block ids are copied as slices instead. Pages are indexed
as 8-byte words (bits copied, never converted): CPU ``index_copy_`` runs about twice as fast on
float64 as on bf16. A cache on a GPU with a host staging buffer is staged on the GPU first,
then copied to or from the buffer in one piece.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "LayerSpec",
    "gather_blocks",
    "layer_specs",
    "layout_fingerprint",
    "scatter_blocks",
]

_MAX_RUNS_FOR_SLICES = 4  # copy consecutive-id runs as slices when a chunk has at most this many


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """How one layer's blocks are read and written.

    ``page`` mode: ``view`` is a ``[num_blocks, page_elems]`` view of the same memory, each row one
    block as it lies in memory, typed as 8-byte words when the page allows (CPU ``index_copy_``
    is about twice as fast on float64 as on bf16; bits are copied, never converted).
    ``logical`` mode: ``view`` is the layer tensor itself, blocks on dim 0, copied in logical
    order. ``block_elems`` and ``dtype`` are the view's."""

    view: torch.Tensor
    mode: Literal["page", "logical"]
    block_elems: int
    dtype: torch.dtype
    signature: tuple[Any, ...]  # what must match between sender and receiver

    @property
    def num_blocks(self) -> int:
        return int(self.view.shape[0])

    @property
    def block_bytes(self) -> int:
        return self.block_elems * self.dtype.itemsize


def _page_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """Physical order (outermost first) of ``t``'s non-block axes if a block is one dense run."""
    dims = [d for d in range(1, t.dim()) if t.shape[d] != 1]
    dims.sort(key=lambda d: t.stride(d), reverse=True)
    expected = 1
    for d in reversed(dims):
        if t.stride(d) != expected:
            return None
        expected *= t.shape[d]
    return tuple(dims)


def layer_specs(kv_caches: Sequence[torch.Tensor]) -> list[LayerSpec]:
    """Describe per-layer KV cache tensors (blocks on dim 0) for transfer."""
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    for i, t in enumerate(kv_caches):
        if t.dim() < 2:
            raise ValueError(f"layer {i}: KV cache needs a block axis and a block, got {t.shape}")
    orders = [_page_order(t) for t in kv_caches]
    # 8-byte words for all page-mode layers or none, so every layer's part of a chunk is aligned
    words = (
        all(_words_fit(t) for t, o in zip(kv_caches, orders, strict=True) if o is not None)
        and all((t[0].numel() * t.dtype.itemsize) % _WORD.itemsize == 0 for t in kv_caches)
        and _words_copy_exactly(kv_caches[0].device)
    )
    specs = []
    for t, order in zip(kv_caches, orders, strict=True):
        block_elems = 1
        for s in t.shape[1:]:
            block_elems *= int(s)
        inner = tuple(int(s) for s in t.shape[1:])
        if order is not None:
            sig: tuple[Any, ...] = ("page", str(t.dtype), inner, order)
            view, dtype = _page_view(t, block_elems, words)
            elems = block_elems * t.dtype.itemsize // dtype.itemsize
            specs.append(LayerSpec(view, "page", elems, dtype, sig))
        else:
            sig = ("logical", str(t.dtype), inner)
            specs.append(LayerSpec(t, "logical", block_elems, t.dtype, sig))
    device = specs[0].view.device
    if any(s.view.device != device for s in specs):
        raise ValueError("all layers' KV caches must be on one device")
    return specs


_WORD = torch.float64


def _words_fit(t: torch.Tensor) -> bool:
    """Whether a dense-page layer can be viewed as 8-byte words (sizes, strides, offset)."""
    item, word = t.dtype.itemsize, _WORD.itemsize
    page = item
    for size in t.shape[1:]:
        page *= int(size)
    return (
        item < word
        and page % word == 0
        and (t.stride(0) * item) % word == 0
        and (t.storage_offset() * item) % word == 0
    )


def _page_view(t: torch.Tensor, block_elems: int, words: bool) -> tuple[torch.Tensor, torch.dtype]:
    """``[num_blocks, page]`` view of a layer whose blocks are dense pages, as 8-byte words if
    ``words`` (then ``_words_fit(t)`` holds), else in the layer's dtype."""
    if words:
        item, word = t.dtype.itemsize, _WORD.itemsize
        view = torch.empty(0, dtype=_WORD, device=t.device).set_(
            t.untyped_storage(),
            t.storage_offset() * item // word,
            (int(t.shape[0]), block_elems * item // word),
            (t.stride(0) * item // word, 1),
        )
        return view, _WORD
    return torch.as_strided(t, (int(t.shape[0]), block_elems), (t.stride(0), 1)), t.dtype


@functools.cache
def _words_copy_exactly(device: torch.device) -> bool:
    """Whether index_select/index_copy_ of float64 keep every bit pattern (NaN payloads,
    signalling NaNs, -0, denormals) on this device: they do on x86-64 and ARM, checked anyway."""
    patterns = [0x7FF0000000000001, 0x7FF4000000000000, 0x7FF8000000000001, -1, 1, -(2**63)]
    patterns += [-(2**63) + 0x7FF0000000000001, 0x000FFFFFFFFFFFFF]
    bits = torch.tensor(patterns, dtype=torch.int64, device=device)
    src = bits.view(_WORD).view(2, -1).repeat(64, 1)
    idx = torch.arange(src.shape[0] - 1, -1, -1, device=device)
    picked = torch.index_select(src, 0, idx)
    back = torch.zeros_like(src).index_copy_(0, idx, picked)
    return bool(torch.equal(back.view(torch.int64), src.view(torch.int64)))


def layout_fingerprint(specs: Sequence[LayerSpec]) -> int:
    """63-bit digest of what both sides must agree on: layers, dtypes, block shapes, order."""
    text = repr([s.signature for s in specs]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: (position in ids, first id, length)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            p, first, n = runs[-1]
            runs[-1] = (p, first, n + 1)
        else:
            runs.append((pos, b, 1))
    return runs


def _layer_slices(specs: Sequence[LayerSpec], n: int, buf: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``buf`` (uint8) as each layer's ``[n, block]`` part of a chunk, layer-major."""
    out = []
    off = 0
    for s in specs:
        size = n * s.block_bytes
        part = buf[off : off + size].view(s.dtype)
        if s.mode == "page":
            out.append(part.view(n, s.block_elems))
        else:
            out.append(part.view(n, *s.view.shape[1:]))
        off += size
    return out


def _copy_blocks(
    specs: Sequence[LayerSpec],
    ids: list[int],
    idx: torch.Tensor,
    buf: torch.Tensor,
    *,
    to_cache: bool,
) -> torch.Tensor:
    n = len(ids)
    total = n * sum(s.block_bytes for s in specs)
    cache_dev = specs[0].view.device
    staged = buf[:total]
    # A GPU cache over Gloo: stage on the GPU, then one copy to/from the pinned host buffer.
    bounce = staged if staged.device == cache_dev else torch.empty_like(staged, device=cache_dev)
    if to_cache and bounce is not staged:
        bounce.copy_(staged)
    parts = _layer_slices(specs, n, bounce)
    runs = _runs(ids)
    use_slices = len(runs) <= _MAX_RUNS_FOR_SLICES
    for s, part in zip(specs, parts, strict=True):
        if use_slices:
            for pos, first, length in runs:
                cache_rows = s.view[first : first + length]
                stage_rows = part[pos : pos + length]
                if to_cache:
                    cache_rows.copy_(stage_rows)
                else:
                    stage_rows.copy_(cache_rows)
        elif to_cache:
            s.view.index_copy_(0, idx, part)
        else:
            torch.index_select(s.view, 0, idx, out=part)
    if not to_cache and bounce is not staged:
        staged.copy_(bounce)
    return staged


def gather_blocks(
    specs: Sequence[LayerSpec],
    block_ids: Sequence[int],
    buf: torch.Tensor,
    idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into the front of ``buf`` (uint8, layer-major,
    the chunk format of the protocol) and return that part. ``idx``: the ids as a long tensor
    on the cache's device, if the caller has it already."""
    ids = [int(b) for b in block_ids]
    if idx is None:
        idx = torch.tensor(ids, dtype=torch.long, device=specs[0].view.device)
    return _copy_blocks(specs, ids, idx, buf, to_cache=False)


def scatter_blocks(
    specs: Sequence[LayerSpec],
    block_ids: Sequence[int],
    buf: torch.Tensor,
    idx: torch.Tensor | None = None,
) -> None:
    """The inverse of ``gather_blocks``: write the front of ``buf`` into blocks ``block_ids``."""
    ids = [int(b) for b in block_ids]
    if idx is None:
        idx = torch.tensor(ids, dtype=torch.long, device=specs[0].view.device)
    _copy_blocks(specs, ids, idx, buf, to_cache=True)
