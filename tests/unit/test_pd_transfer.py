"""The PD data path (``engines.pd.transfer``) for real: processes talking Gloo over loopback.

One spawn of three ranks covers the transfer scenarios: rank 0 receives; rank 1 sends, then
leaves without sending; rank 2 sends once, then stays silent. The rest is in-process.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import threading
import time
import traceback
from typing import Any

import pytest
import torch

from engines.pd.layout import layer_specs, layout_fingerprint
from engines.pd.transfer import KVTransport
from engines.pd.wire import (
    Header,
    KVTransferAborted,
    KVTransferError,
    KVTransferMismatch,
    KVTransferTimeout,
    KVTransportBroken,
    request_key,
)
from engines.ports import free_port

NUM_BLOCKS = 10
SILENT_TIMEOUT_S = 1.0
DEAD_TIMEOUT_S = 3.0


def _caches(seed: int) -> list[torch.Tensor]:
    """Random per-layer caches, blocks on dim 0, in three layouts: two layers whose blocks are
    dense pages (vLLM's CPU layout [B, H, N, 2*D] and an N/H-swapped stride order, bf16) and one
    whose blocks are not (heads outermost, fp32: moved in logical order)."""
    g = torch.Generator().manual_seed(seed)
    lbhnc = torch.randn(NUM_BLOCKS, 2, 4, 16, generator=g).to(torch.bfloat16)
    lbnhc = torch.randn(NUM_BLOCKS, 4, 2, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
    lhbnc = torch.randn(2, NUM_BLOCKS, 4, 8, generator=g).transpose(0, 1)
    # bit patterns a float copy could alter: signalling and payload NaNs, -0, a denormal
    specials = torch.tensor([0x7F81, 0x7FC1, -0x7F, -0x8000, 0x0001], dtype=torch.int16)
    lbhnc.view(torch.int16)[:, 0, 0, :5] = specials
    return [lbhnc, lbnhc, lhbnc]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN patterns included, which ``torch.equal`` calls unequal)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _moved_ok(
    dst: list[torch.Tensor],
    before: list[torch.Tensor],
    src: list[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> bool:
    """Destination blocks equal the source blocks exactly; every other block is unchanged."""
    for d, b, s in zip(dst, before, src, strict=True):
        if not _same(d[dst_ids], s[src_ids]):
            return False
        others = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
        if not _same(d[others], b[others]):
            return False
    return True


def _receiver(t: KVTransport, store: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    src = _caches(seed=1)  # what rank 1 holds
    dst = _caches(seed=2)

    def snapshot() -> list[torch.Tensor]:
        return [x.clone() for x in dst]

    # 1. one request, random block ids; then a chunked one with consecutive ids (slice path)
    before = snapshot()
    st = t.recv_blocks(1, "req-a", dst, [0, 5, 2], timeout_s=10)
    out["basic"] = _moved_ok(dst, before, src, [3, 7, 1], [0, 5, 2])
    out["basic_bytes"] = st.bytes
    before = snapshot()
    st = t.recv_blocks(1, "req-b", dst, [1, 2, 3], timeout_s=10)
    out["chunked"] = _moved_ok(dst, before, src, [4, 5, 6], [1, 2, 3]) and st.chunks == 3

    # 2. two requests sent concurrently from two threads, received in whatever order they come
    before = snapshot()
    expected = {"req-c": [6, 8], "req-d": [9, 4, 7]}
    got = [t.recv_next(1, expected, dst, timeout_s=10)[0] for _ in range(2)]
    out["interleaved_ids"] = sorted(got)
    out["interleaved"] = _moved_ok(dst, before, src, [0, 2, 9, 8, 5], [6, 8, 9, 4, 7])

    # 3. the wrong request first: drained, nothing written, the channel stays usable
    before = snapshot()
    try:
        t.recv_blocks(1, "req-f", dst, [0, 1], timeout_s=10)
        out["mismatch"] = "no error"
    except KVTransferMismatch as exc:
        out["mismatch"] = "ok" if exc.header.key == request_key("req-e") else repr(exc)
    out["mismatch_untouched"] = all(_same(a, b) for a, b in zip(dst, before, strict=True))
    t.recv_blocks(1, "req-f", dst, [0, 1], timeout_s=10)
    out["after_mismatch"] = _moved_ok(dst, before, src, [2, 3], [0, 1])

    # 4. an aborted request
    try:
        t.recv_blocks(1, "req-g", dst, [0], timeout_s=10)
        out["abort"] = "no error"
    except KVTransferAborted:
        out["abort"] = "ok"

    # 5. a peer that exits without sending
    store.wait(["sender-exiting"])
    t0 = time.monotonic()
    try:
        t.recv_blocks(1, "req-i", dst, [0], timeout_s=DEAD_TIMEOUT_S)
        out["dead"] = "no error"
    except KVTransferError as exc:
        out["dead"] = "ok"
        out["dead_error"] = f"{type(exc).__name__}: {exc}"
    out["dead_s"] = time.monotonic() - t0

    # 6. the other peer is unaffected
    before = snapshot()
    t.recv_blocks(2, "req-j", dst, [3], timeout_s=10)
    out["other_peer"] = _moved_ok(dst, before, _caches(seed=3), [8], [3])

    # 7. a silent peer: timeout, then the group is marked broken
    t0 = time.monotonic()
    try:
        t.recv_blocks(2, "req-h", dst, [0], timeout_s=SILENT_TIMEOUT_S)
        out["silent"] = "no error"
    except KVTransferTimeout:
        out["silent"] = "ok"
    out["silent_s"] = time.monotonic() - t0
    try:
        t.recv_blocks(2, "req-h", dst, [0], timeout_s=SILENT_TIMEOUT_S)
        out["broken"] = "no error"
    except KVTransportBroken:
        out["broken"] = "ok"
    store.set("silent-done", "1")
    out["imports"] = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "vllm", "router"))
    return out


def _sender(t: KVTransport, store: Any) -> None:
    src = _caches(seed=1)
    t.send_blocks(0, "req-a", src, [3, 7, 1])
    block_bytes = sum(s.block_bytes for s in layer_specs(src))
    t.chunk_bytes = block_bytes  # one block per chunk: req-b goes in 3 chunks
    t.send_blocks(0, "req-b", src, [4, 5, 6])
    threads = [
        threading.Thread(target=t.send_blocks, args=(0, "req-c", src, [0, 2])),
        threading.Thread(target=t.send_blocks, args=(0, "req-d", src, [9, 8, 5])),
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t.send_blocks(0, "req-e", src, [1, 2])  # the receiver expects req-f: drained
    t.send_blocks(0, "req-f", src, [2, 3])
    t.send_abort(0, "req-g")
    store.set("sender-exiting", "1")
    # exits without sending req-i


def _rank_main(rank: int, port: int, results: Any) -> None:
    try:
        t = KVTransport(rank=rank, world_size=3, port=port, timeout_s=15, channels=2)
        store = t.store
        if rank == 0:
            results.put(("result", _receiver(t, store)))
        elif rank == 1:
            _sender(t, store)
        else:
            t.send_blocks(0, "req-j", _caches(seed=3), [8])
            store.wait(["silent-done"])  # silent meanwhile
        results.put(("done", rank))
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def test_transfer_between_processes() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(3)]
    for p in procs:
        p.start()
    out: dict[str, Any] | None = None
    errors: list[str] = []
    done = 0
    deadline = time.monotonic() + 60
    try:
        while done < 3 and time.monotonic() < deadline:
            try:
                kind, value = results.get(timeout=1)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            if kind == "result":
                out = value
            elif kind == "error":
                errors.append(value)
                break
            else:
                done += 1
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert not errors, errors[0]
    assert out is not None, "receiver gave no result"
    page_bytes = 2 * 4 * 16 * 2
    assert out["basic_bytes"] == 3 * (2 * page_bytes + 2 * 4 * 8 * 4)
    assert out["basic"]
    assert out["chunked"]
    assert out["interleaved_ids"] == ["req-c", "req-d"]
    assert out["interleaved"]
    assert out["mismatch"] == "ok"
    assert out["mismatch_untouched"]
    assert out["after_mismatch"]
    assert out["abort"] == "ok"
    assert out["silent"] == "ok"
    assert SILENT_TIMEOUT_S * 0.8 <= out["silent_s"] < SILENT_TIMEOUT_S + 2
    assert out["broken"] == "ok"
    assert out["dead"] == "ok", out
    assert out["dead_s"] < DEAD_TIMEOUT_S + 2
    assert out["other_peer"]
    assert out["imports"] == []


def test_layer_specs_modes_and_fingerprint() -> None:
    caches = _caches(seed=0)
    specs = layer_specs(caches)
    assert [s.mode for s in specs] == ["page", "page", "logical"]
    assert specs[0].dtype == torch.float64  # pages moved as 8-byte words
    assert specs[1].signature != layer_specs([caches[1].contiguous()])[0].signature
    # page views alias the cache: writing a row writes the block
    specs[0].view[3].zero_()
    assert torch.count_nonzero(caches[0][3]) == 0
    other = _caches(seed=5)
    assert layout_fingerprint(layer_specs(other)) == layout_fingerprint(specs)
    swapped = [other[0], other[1].contiguous(), other[2]]
    assert layout_fingerprint(layer_specs(swapped)) != layout_fingerprint(specs)


def test_header_and_keys() -> None:
    h = Header(7, request_key("r"), 0, 3, 4, 1024, 99, 2, 2, 3072)
    assert Header.from_words(h.to_words()) == h
    assert request_key("r") == request_key("r") != request_key("s")
    assert 0 <= request_key("x" * 1000) < 2**63
    with pytest.raises(KVTransportBroken):
        Header.from_words([0] * 12)


def test_argument_checks() -> None:
    with pytest.raises(ValueError):
        KVTransport(rank=2, world_size=2, port=1)
    with pytest.raises(ValueError):
        KVTransport(rank=0, world_size=2)  # neither store nor port
    with pytest.raises(ValueError):
        layer_specs([])
