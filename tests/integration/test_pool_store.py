"""The cluster KV pool's foundation against a real Mooncake master on 127.0.0.1: two clients
(two segments) share blocks; faults (missing, wrong size, full pool, master killed) are counted
misses, never exceptions; the pool works again after the master restarts. The module's processes
are stopped by the module (checked when it ends). Without the Mooncake wheel or libibverbs the
tests fail (``PoolUnavailable`` says what to install), as `make test` installs both."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engines.pool import (
    MasterConfig,
    PoolMaster,
    PoolNamespace,
    PoolStore,
    StoreConfig,
    pool_keys,
    prompt_pool_keys,
)
from engines.ports import free_port

_MiB = 1 << 20
BLOCK = 64 * 1024  # bytes of one test block
SEGMENT = 16 * _MiB  # Mooncake's smallest segment
CLIENT_TTL_S = 3

# Another node: joins the pool, stores four blocks in its own segment, says so, then waits.
HOLDER = """
import sys, time
import numpy as np
from engines.pool import PoolStore, StoreConfig
s = PoolStore(StoreConfig(sys.argv[1], sys.argv[2]))
assert s.connect()
keys = sys.argv[3:]
ok = s.put_blocks(keys, [np.full(65536, i, np.uint8) for i in range(len(keys))], s.segment_name)
print(s.segment_name if all(ok) else "", flush=True)
time.sleep(600)
"""
NS = PoolNamespace("tiny-llama", "test/NHD/layers=2", "bfloat16", 32)


def _children_named(name: str) -> list[int]:
    """Pids of this process's children whose command is ``name``."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        if ppid == me and comm == name:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module", autouse=True)
def _no_master_survives() -> Iterator[None]:
    """The module's processes are stopped by the module (its master fixture)."""
    yield
    left = _children_named("mooncake_master")
    assert not left, f"a test left mooncake_master running: pids {left}"


@pytest.fixture(scope="module")
def master(_no_master_survives: None) -> Iterator[PoolMaster]:
    # a dead client's segment leaves the pool CLIENT_TTL_S after its last heartbeat
    with PoolMaster(MasterConfig(host="127.0.0.1", client_ttl_s=CLIENT_TTL_S)) as m:
        yield m


def _client(m: PoolMaster) -> PoolStore:
    cfg = StoreConfig(
        master_address=m.master_address,
        metadata_url=m.metadata_url,
        local_hostname="127.0.0.1",
        segment_bytes=SEGMENT,
        local_buffer_bytes=4 * _MiB,
        staging_bytes=4 * _MiB,
        master_backoff_s=0.3,
    )
    store = PoolStore(cfg)
    assert store.connect()
    return store


@pytest.fixture(scope="module")
def two_clients(master: PoolMaster) -> Iterator[tuple[PoolStore, PoolStore]]:
    """Two clients, two segments of one pool, shared by the module's tests (a client's close
    takes 1-2 s in Mooncake 0.3.13: unmount and transfer-engine shutdown). Each test uses keys
    of its own."""
    a, b = _client(master), _client(master)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n)]


def test_the_master_listens_on_loopback_only(master: PoolMaster) -> None:
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    ours = [
        line.split()[3]
        for line in listening.splitlines()
        if any(f"pid={pid}," in line for pid in master.pids)
    ]
    assert len(ours) >= 3  # RPC, metrics, metadata
    assert all(addr.startswith("127.0.0.1:") for addr in ours), ours


def test_a_block_put_by_one_client_is_read_by_another(
    two_clients: tuple[PoolStore, PoolStore],
) -> None:
    a, b = two_clients
    values = _blocks(8, seed=1)
    keys = pool_keys(NS, list(range(1, 9)))
    assert a.put_blocks(keys, values) == [True] * 8
    assert b.exists([*keys, pool_keys(NS, [99])[0]]) == [True] * 8 + [False]
    out = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert b.get_blocks(keys, out) == [True] * 8
    for got, want in zip(out, values, strict=True):
        assert np.array_equal(got, want)
    assert b.stats()["get_hit"] == 8
    # every connection of this process (the clients') runs between loopback addresses
    conns = subprocess.run(["ss", "-Htnp"], capture_output=True, text=True, check=True).stdout
    mine = [line.split()[3:5] for line in conns.splitlines() if f"pid={os.getpid()}," in line]
    assert mine
    assert [
        c for c in mine if not all(x.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for x in c)
    ] == []


def test_registered_memory_moves_without_staging(
    two_clients: tuple[PoolStore, PoolStore],
) -> None:
    """Blocks inside registered buffers (an engine's KV memory) go through batch_put_from /
    batch_get_into directly; more blocks than the staging buffer holds, in one call."""
    a, b = two_clients
    n = 96  # 6 MiB: more than the 4 MiB staging buffer
    src = np.random.default_rng(2).integers(0, 256, (n, BLOCK), dtype=np.uint8)
    dst = np.zeros_like(src)
    assert a.register(src) and b.register(dst)
    keys = pool_keys(NS, list(range(1000, 1000 + n)))
    assert all(a.put_blocks(keys, list(src)))
    assert all(b.get_blocks(keys, list(dst)))
    assert np.array_equal(src, dst)
    # and unregistered values larger than staging in total are cut into runs
    keys2 = pool_keys(NS, list(range(2000, 2000 + n)))
    assert all(a.put_blocks(keys2, [row.copy() for row in src]))
    out = [np.zeros(BLOCK, np.uint8) for _ in keys2]
    assert all(b.get_blocks(keys2, out))
    assert np.array_equal(np.stack(out), src)


def test_a_put_lands_in_the_segment_asked_for(two_clients: tuple[PoolStore, PoolStore]) -> None:
    a, b = two_clients
    assert a.segment_name != b.segment_name
    for i, target in enumerate((a, b)):
        key = pool_keys(NS, [600 + i])
        assert a.put_blocks(key, _blocks(1, seed=10 + i), segment=target.segment_name) == [True]
        assert b.locate(key[0]) == [target.segment_name]
    assert b.locate(pool_keys(NS, [699])[0]) == []


def test_missing_and_wrong_size_blocks_are_counted_misses(
    two_clients: tuple[PoolStore, PoolStore],
) -> None:
    a, b = two_clients
    keys = pool_keys(NS, [700, 701])
    assert a.put_blocks(keys[:1], _blocks(1, seed=3)) == [True]
    small, big = np.zeros(BLOCK // 2, np.uint8), np.zeros(BLOCK * 2, np.uint8)
    assert b.get_blocks([keys[1]], [np.zeros(BLOCK, np.uint8)]) == [False]
    assert b.get_blocks([keys[0]], [small]) == [False]
    assert b.get_blocks([keys[0]], [big]) == [False]
    stats = b.stats()
    assert stats["get_missing"] == 1
    assert stats["fault_size_mismatch"] == 2
    assert stats["get_miss"] == 3


def test_a_full_pool_is_a_counted_failure_not_an_exception(
    two_clients: tuple[PoolStore, PoolStore],
) -> None:
    a, _ = two_clients
    n = 3 * SEGMENT // BLOCK  # 48 MiB into a 32 MiB pool, from registered memory
    src = np.ones((n, BLOCK), np.uint8)
    assert a.register(src)
    keys = pool_keys(NS, list(range(5000, 5000 + n)))
    try:
        ok = a.put_blocks(keys, list(src))
        assert not all(ok)
        assert a.stats()["fault_pool_full"] >= 1
    finally:
        a.remove_blocks(keys, force=True)  # room for the module's other tests


def test_cache_salt_keeps_tenants_apart_in_the_pool(
    two_clients: tuple[PoolStore, PoolStore],
) -> None:
    a, b = two_clients
    tokens = list(range(3, 3 + 4 * 32))
    mine = prompt_pool_keys(NS, tokens, cache_salt="tenant-a")
    theirs = prompt_pool_keys(NS, tokens, cache_salt="tenant-b")
    assert a.put_blocks(mine, _blocks(4, seed=5)) == [True] * 4
    assert b.exists(mine) == [True] * 4
    assert b.exists(theirs) == [False] * 4


def test_a_killed_master_is_a_miss_and_the_pool_returns_after_a_restart(
    two_clients: tuple[PoolStore, PoolStore], master: PoolMaster
) -> None:
    a, b = two_clients
    keys = pool_keys(NS, [11, 12])
    assert a.put_blocks(keys, _blocks(2, seed=6)) == [True, True]
    master.kill_master()

    out = [np.zeros(BLOCK, np.uint8) for _ in keys]
    t0 = time.monotonic()
    assert b.get_blocks(keys, out) == [False, False]
    assert b.exists(keys) == [False, False]
    assert a.put_blocks(pool_keys(NS, [13]), _blocks(1, seed=7)) == [False]
    assert time.monotonic() - t0 < 2.0  # misses at once, not Mooncake's ~4 s RPC retries
    assert b.stats()["fault_master_unreachable"] >= 1
    assert b.stats()["get_miss"] >= 2

    master.restart_master()
    # the clients reconnect and remount their segments within a heartbeat or two; the old
    # master's contents are gone
    fresh = pool_keys(NS, [14])
    value = _blocks(1, seed=8)
    deadline = time.monotonic() + 15
    while not a.put_blocks(fresh, value)[0]:
        assert time.monotonic() < deadline, f"the pool did not come back: {a.stats()}"
        time.sleep(0.2)
    got = [np.zeros(BLOCK, np.uint8)]
    while not b.get_blocks(fresh, got)[0]:
        assert time.monotonic() < deadline, f"the pool did not come back: {b.stats()}"
        time.sleep(0.2)
    assert np.array_equal(got[0], value[0])
    assert b.exists(keys) == [False, False]


def test_a_dead_nodes_blocks_are_misses_then_leave_the_pool(
    two_clients: tuple[PoolStore, PoolStore], master: PoolMaster
) -> None:
    """The node holding a block dies: reading it is a transfer fault at once (a miss, not a
    hang); after the master's client TTL its blocks are gone from the pool."""
    _, b = two_clients
    keys = pool_keys(NS, [800, 801])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, master.master_address, master.metadata_url, *keys],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None
        segment = holder.stdout.readline().strip()
        assert segment, "the holder could not store its blocks"
        assert b.locate(keys[0]) == [segment]
        out = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert b.get_blocks(keys, out) == [True, True]
        assert out[1][0] == 1
    finally:
        holder.kill()
        holder.wait()
    before = b.stats().get("fault_transfer", 0)
    t0 = time.monotonic()
    assert b.get_blocks(keys, out) == [False, False]
    assert time.monotonic() - t0 < 1.0
    assert b.stats()["fault_transfer"] == before + 2
    deadline = time.monotonic() + CLIENT_TTL_S + 10
    while b.exists(keys) != [False, False]:
        assert time.monotonic() < deadline, "the dead node's blocks stayed in the pool"
        time.sleep(0.5)


def test_a_client_without_a_master_answers_misses() -> None:
    """No master at all: connect fails (logged, counted), and every call is a miss."""
    store = PoolStore(
        StoreConfig(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}/metadata")
    )
    assert not store.connect()
    assert store.put_blocks(pool_keys(NS, [1]), _blocks(1, seed=9)) == [False]
    assert store.get_blocks(pool_keys(NS, [1]), [np.zeros(BLOCK, np.uint8)]) == [False]
    assert store.exists(pool_keys(NS, [1])) == [False]
    assert store.stats()["fault_setup"] == 1
    assert store.stats()["fault_not_connected"] == 3
    store.close()
    assert store.exists(pool_keys(NS, [1])) == [False]
    assert store.stats()["skipped_closed"] == 1
