"""The cache map's numba kernels (``cachemap.jit``): the passes of ``CacheMap``'s store, remove
and match over its slot columns, its holders (inline, or a row of bitmasks per tier: the layout
``cachemap.map`` describes) and the index table (``HashIndex.table``). ``CacheMap`` calls them
through this module; ``cachemap.map.warm_kernels`` runs every one of them."""

from __future__ import annotations

import numpy as np

from cachemap.index import TOMBSTONE, _insert, _probe
from cachemap.jit import jit


@jit
def _tiers_at(hold, wide, gpu, cpu, s, b):  # type: ignore[no-untyped-def]
    """The tier flags (1 GPU, 2 CPU) instance bit ``b`` holds slot ``s`` with."""
    r = wide[s]
    if r >= 0:
        w, m = b >> 6, np.uint64(b & 63)
        return np.int64((gpu[r, w] >> m) & np.uint64(1)) | np.int64(
            ((cpu[r, w] >> m) & np.uint64(1)) << np.uint64(1)
        )
    for k in range(hold.shape[1]):
        e = np.int64(hold[s, k])
        if e and e >> 2 == b:
            return e & 3
    return 0


@jit
def _drops(d, w, i, out):  # type: ignore[no-untyped-def]
    """Write ``i`` into ``out`` at the bits set in word ``d`` (word ``w`` of a bitmask)."""
    b = 0
    while d:
        if d & np.uint64(1):
            out[64 * w + b] = i
        d >>= np.uint64(1)
        b += 1


@jit
def _match(tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, scale):  # type: ignore[no-untyped-def]
    """Every instance bit's leading run of ``keys`` (found in the index table ``tk``, ``tv``,
    ``shift``, ``tmask``: ``HashIndex.table``) on GPU and on GPU or CPU, times ``scale``, packed
    as ``gpu << 32 | any``, for the bits holding the first key: as a dense array indexed by bit
    when that block is wide, else as (bits, packed runs) of its few inline holders.

    While the slots are wide, the rows are ANDed a word at a time and each bit that drops out
    at position ``i`` gets a run of ``i``; at the first narrow slot only its few inline holders
    can go on, and are followed one by one from there.

    It stays whole, one kernel past the 100 lines a function may have: probing the chain, ANDing the
    rows over the wide head, handing the bits still running to the first narrow slot's inline
    holders, following those and packing the runs are one pass over the chain, each step taking
    up the state the one before left (the slots found, the position reached, the running masks,
    the drop positions, the followed bits and their run ends). Kernels for the steps would
    each take and hand back most of that state, a dozen arrays and counters, and none would
    read on its own; and this is the placement's hot path (``CacheMap.match``, measured by
    ``benchmarks/cachemap_bench.py``)."""
    idx = np.empty(keys.shape[0], np.int64)
    n = 0
    for j in range(keys.shape[0]):
        v = _probe(tk, tv, shift, tmask, keys[j])[0]
        if v < 0:
            break
        idx[j] = v
        n += 1
    inline = hold.shape[1]
    words = gpu.shape[1]
    cand = np.empty(inline, np.int64)  # the bits followed one by one
    cg = np.empty(inline, np.int64)  # their GPU run's end (-1: still running)
    ca = np.empty(inline, np.int64)
    nc = 0
    i = 1
    dense_start = n > 0 and wide[idx[0]] >= 0
    ng = np.zeros(64 * words if dense_start else 0, np.int64)
    na = np.zeros(64 * words if dense_start else 0, np.int64)
    if dense_start:
        r0 = wide[idx[0]]
        run_g = gpu[r0].copy()
        run_a = run_g | cpu[r0]
        alive = True
        while i < n and wide[idx[i]] >= 0 and alive:
            r = wide[idx[i]]
            alive = False
            for w in range(words):
                new_g = run_g[w] & gpu[r, w]
                new_a = run_a[w] & (gpu[r, w] | cpu[r, w])
                _drops(run_g[w] & ~new_g, w, i, ng)
                _drops(run_a[w] & ~new_a, w, i, na)
                run_g[w] = new_g
                run_a[w] = new_a
                if new_a:
                    alive = True
            i += 1
        if alive and i < n:
            # a narrow slot: only its inline holders still in the run go on, from here
            s = idx[i]
            for k in range(inline):
                e = np.int64(hold[s, k])
                if not e:
                    continue
                hb = e >> 2
                hw, hm = hb >> 6, np.uint64(hb & 63)
                if not (run_a[hw] >> hm) & np.uint64(1):
                    continue
                cand[nc] = hb
                cg[nc] = -1 if (run_g[hw] >> hm) & np.uint64(1) else ng[hb]
                ca[nc] = -1
                nc += 1
                run_g[hw] &= ~(np.uint64(1) << hm)
                run_a[hw] &= ~(np.uint64(1) << hm)
        for w in range(words):  # the rest of the run ends here
            _drops(run_g[w], w, i, ng)
            _drops(run_a[w], w, i, na)
    elif n > 0:
        s = idx[0]
        for k in range(inline):
            e = np.int64(hold[s, k])
            if e:
                cand[nc] = e >> 2
                cg[nc] = -1 if e & 1 else 0
                ca[nc] = -1
                nc += 1
    left = nc
    while i < n and left:
        s = idx[i]
        for c in range(nc):
            if ca[c] >= 0:
                continue
            t = _tiers_at(hold, wide, gpu, cpu, s, cand[c])
            if cg[c] < 0 and not t & 1:
                cg[c] = i
            if not t:
                ca[c] = i
                left -= 1
        i += 1
    for c in range(1, nc):  # in bit order, as the dense form iterates
        j = c
        while j > 0 and cand[j - 1] > cand[j]:
            cand[j - 1], cand[j] = cand[j], cand[j - 1]
            cg[j - 1], cg[j] = cg[j], cg[j - 1]
            ca[j - 1], ca[j] = ca[j], ca[j - 1]
            j -= 1
    bits = np.empty(0 if dense_start else nc, np.int64)
    packed = np.empty(0 if dense_start else nc, np.int64)
    dense = np.empty(64 * words if dense_start else 0, np.int64)
    if dense_start:
        for d in range(dense.shape[0]):
            dense[d] = ng[d] * scale << 32 | na[d] * scale
    for c in range(nc):
        g = (n if cg[c] < 0 else cg[c]) * scale
        a = (n if ca[c] < 0 else ca[c]) * scale
        if dense_start:
            dense[cand[c]] = g << 32 | a
        else:
            bits[c] = cand[c]
            packed[c] = g << 32 | a
    return bits, packed, dense


@jit
def _remove(  # type: ignore[no-untyped-def]
    tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, bit, flag, has_parent, free, n_free
):
    """Take instance ``bit``'s tier ``flag`` (1 GPU, 2 CPU) off the slots of ``keys`` (found in
    the index table ``tk``, ``tv``, ``shift``, ``tmask``: ``HashIndex.table``; absent keys and
    slots without that holder are skipped, a key may repeat). The slots left with no holder
    die: their keys are tombstoned in the table afterwards, as ``HashIndex.delete`` would, and
    they are freed in ascending order (``_free_slots``). Returns (holders removed, dead slots,
    the rows they had)."""
    w, m = bit >> 6, np.uint64(bit & 63)
    one = np.uint64(1) << m
    words = gpu.shape[1]
    inline = hold.shape[1]
    cells = np.empty(keys.shape[0], np.int64)
    dead = np.empty(keys.shape[0], np.int64)
    held = 0
    n_dead = 0
    for i in range(keys.shape[0]):
        s, p = _probe(tk, tv, shift, tmask, keys[i])
        if s < 0:
            continue
        r = wide[s]
        live = False
        if r >= 0:
            rows = gpu if flag == 1 else cpu
            if not rows[r, w] & one:
                continue
            rows[r, w] &= ~one
            for v in range(words):
                if gpu[r, v] or cpu[r, v]:
                    live = True
                    break
        else:
            found = False
            for k in range(inline):
                e = np.int64(hold[s, k])
                if e and e >> 2 == bit and e & flag:
                    e &= ~flag
                    hold[s, k] = e if e & 3 else 0
                    found = True
                    break
            if not found:
                continue
            for k in range(inline):
                if hold[s, k]:
                    live = True
                    break
        held += 1
        if not live:
            dead[n_dead] = s
            cells[n_dead] = p
            n_dead += 1
    for j in range(n_dead):
        tv[cells[j]] = TOMBSTONE
    return held, n_dead, _free_slots(np.sort(dead[:n_dead]), has_parent, wide, free, n_free)


@jit
def _free_slots(dead, has_parent, wide, free, n_free):  # type: ignore[no-untyped-def]
    """Free the slots ``dead`` (distinct, ascending, out of the index): pushed in that order on
    the free stack ``free[:n_free]``, without a parent, their rows dropped. Returns those rows,
    in order (for the caller's free rows)."""
    rows = np.empty(dead.shape[0], np.int64)
    n_rows = 0
    for j in range(dead.shape[0]):
        s = dead[j]
        has_parent[s] = False
        if wide[s] >= 0:
            rows[n_rows] = wide[s]
            n_rows += 1
            wide[s] = -1
        free[n_free + j] = s
    return rows[:n_rows]


@jit
def _store_known(tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, bit, flag):  # type: ignore[no-untyped-def]
    """Add instance ``bit`` with tier ``flag`` to the slots of the ``keys`` the index table
    holds (``HashIndex.table``; a key may repeat). Returns (holders added, the position of the
    first occurrence of each absent key in ascending key order, the narrow slots with no room
    left for it)."""
    w, m = bit >> 6, np.uint64(bit & 63)
    one = np.uint64(1) << m
    inline = hold.shape[1]
    n = keys.shape[0]
    miss = np.empty(n, np.int64)
    full = np.empty(n, np.int64)
    n_miss = 0
    n_full = 0
    added = 0
    for i in range(n):
        s = _probe(tk, tv, shift, tmask, keys[i])[0]
        if s < 0:
            miss[n_miss] = i
            n_miss += 1
            continue
        r = wide[s]
        if r >= 0:
            rows = gpu if flag == 1 else cpu
            if not rows[r, w] & one:
                rows[r, w] |= one
                added += 1
            continue
        empty = -1
        found = False
        for k in range(inline):
            e = np.int64(hold[s, k])
            if not e:
                if empty < 0:
                    empty = k
            elif e >> 2 == bit:
                found = True
                if not e & flag:
                    hold[s, k] = e | flag
                    added += 1
                break
        if found:
            continue
        if empty >= 0:
            hold[s, empty] = bit << 2 | flag
            added += 1
        else:
            full[n_full] = s
            n_full += 1
    miss = miss[:n_miss]
    missing_keys = keys[miss]
    order = np.argsort(missing_keys, kind="mergesort")  # stable: equal keys keep their first
    out = np.empty(n_miss, np.int64)
    n_out = 0
    for j in range(n_miss):
        if j == 0 or missing_keys[order[j]] != missing_keys[order[j - 1]]:
            out[n_out] = miss[order[j]]
            n_out += 1
    return added, out[:n_out], full[:n_full]


@jit
def _promote(hold, wide, gpu, cpu, slots, rows, bit, flag):  # type: ignore[no-untyped-def]
    """Give each narrow slot of ``slots`` (distinct, full) the row of ``rows`` beside it: its
    inline holders move there, then instance ``bit`` joins with tier ``flag``. Returns how
    many joined (all of them)."""
    for j in range(slots.shape[0]):
        s, r = slots[j], rows[j]
        gpu[r, :] = 0
        cpu[r, :] = 0
        for k in range(hold.shape[1]):
            e = np.int64(hold[s, k])
            if e:
                b = e >> 2
                w, m = b >> 6, np.uint64(b & 63)
                if e & 1:
                    gpu[r, w] |= np.uint64(1) << m
                if e & 2:
                    cpu[r, w] |= np.uint64(1) << m
                hold[s, k] = 0
        wide[s] = r
        w, m = bit >> 6, np.uint64(bit & 63)
        if flag == 1:
            gpu[r, w] |= np.uint64(1) << m
        else:
            cpu[r, w] |= np.uint64(1) << m
    return slots.shape[0]


@jit
def _store(  # type: ignore[no-untyped-def]
    tk, tv, shift, tmask, hold, wide, gpu, cpu, hash_, parent, has_parent, depth, free, n_free,
    next_, hs, meta, bit, flag,
):  # fmt: skip
    """``CacheMap.store_chains``'s pass: add instance ``bit`` with tier ``flag`` to the known
    keys among ``hs`` (``_store_known``), then give each new key (its first position) a slot,
    from the top of the free stack ``free[:n_free]`` first (the stack's order: its last
    ``reused`` in place), then from ``next_`` on, put it in the index table (``_insert``, as
    ``HashIndex.insert`` does) and fill the slot's columns with that one holder. ``hs`` is
    the chains' hashes laid end to end, then each chain's parent (0 for none); ``meta`` is per
    chain (start in ``hs``, first block's depth, has a parent). The caller made room (slots,
    free stack and table) for every key being new. Returns (holders added, slots reused, slots
    taken from ``next_``, EMPTY table cells used, the known narrow slots with no room left for
    the holder)."""
    k = meta.shape[0] // 3
    n = hs.shape[0] - k
    keys = hs[:n]
    added, pos, full = _store_known(tk, tv, shift, tmask, keys, hold, wide, gpu, cpu, bit, flag)
    new = pos.shape[0]
    reused = min(new, n_free)
    at = np.empty(new, np.int64)
    for j in range(new):
        at[j] = free[n_free - reused + j] if j < reused else next_ + j - reused
    cells = _insert(tk, tv, shift, tmask, keys[pos], at)
    starts = np.empty(k, np.int64)
    for c in range(k):
        starts[c] = meta[3 * c]
    entry = bit << 2 | flag
    for j in range(new):
        s, p = at[j], pos[j]
        key = keys[p]
        c = np.searchsorted(starts, p, side="right") - 1
        hash_[s] = key
        if p > starts[c]:
            parent[s], has_parent[s] = keys[p - 1], True
        else:
            parent[s], has_parent[s] = hs[n + c], meta[3 * c + 2] != 0
        depth[s] = meta[3 * c + 1] + p - starts[c]
        hold[s, :] = 0
        hold[s, 0] = entry
    return added + new, reused, new - reused, cells, full
