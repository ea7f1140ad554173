"""Prefix-odds: what it learns per class and the order that follows from it."""

from __future__ import annotations

import pytest

from loadgen.synthetic import synthetic_bailian
from policies import RequestInfo, create_policy
from policies.prefix_odds import PrefixOddsPolicy
from simulation.cachesim import replay


def _request(policy: PrefixOddsPolicy, keys: list[object], now: float) -> None:
    """One prompt through the simulator's lifecycle (no evictions)."""
    req = RequestInfo(num_blocks=len(keys))
    policy.begin_request(req, now)
    reused = []
    for off, key in enumerate(keys):
        if key in policy:
            reused.append(key)
        else:
            policy.insert(key, now, keys[off - 1] if off else None, off)
    policy.end_request(req, keys, reused, now)


def test_registered_with_tuned_defaults() -> None:
    policy = create_policy("prefix-odds", 10)
    assert isinstance(policy, PrefixOddsPolicy)
    assert (policy.max_count, policy.depth_buckets, policy.scale) == (2, 3, 1.0)
    with pytest.raises(ValueError, match="max_count"):
        PrefixOddsPolicy(10, max_count=0)


def test_a_prompt_leaves_tail_first_and_its_tail_before_older_blocks() -> None:
    policy = PrefixOddsPolicy(100)
    _request(policy, ["old"], 0.0)
    _request(policy, ["a", "b", "c"], 1.0)
    # Before any learning all classes share the same odds, so the oldest block goes first;
    # then the new prompt, tail first: "c" (on a tie the tail class goes first), "b", "a".
    assert policy.evict(4) == ["old", "c", "b", "a"]


def test_learns_that_reused_blocks_are_reused_again() -> None:
    """A hot shared head and one-off bodies: the head's class gets the better odds and the
    head survives a cache far smaller than the stream of one-off blocks."""
    policy = PrefixOddsPolicy(20, refit_every=50)
    now = 0.0
    for i in range(400):
        keys: list[object] = ["h0", "h1", ("body", i), ("tail", i)]
        req = RequestInfo(num_blocks=len(keys))
        policy.begin_request(req, now)
        reused = [k for k in keys[:2] if k in policy]
        for off, key in enumerate(keys):
            if key not in policy:
                policy.insert(key, now, keys[off - 1] if off else None, off)
                if len(policy) > 20:
                    assert policy.evict(len(policy) - 20) is not None
        policy.end_request(req, [k for k in keys if k in policy], reused, now)
        now += 1.0
    assert "h0" in policy and "h1" in policy
    offsets = policy._offset  # seconds of extra life per class
    once, again, tail = offsets[0], offsets[policy.depth_buckets], offsets[-1]
    assert again > once > tail


def test_a_class_with_short_reuse_times_decays_faster() -> None:
    """Same reuse odds, ten times shorter reuse interval: ten times smaller offset."""
    policy = PrefixOddsPolicy(10, depth_buckets=1, prior_weight=0.0)
    policy._odds.accesses[:] = [100.0, 100.0, 100.0]
    policy._odds.reuses[:] = [75.0, 75.0, 1.0]
    policy._odds.gaps[:] = [75.0 * 100.0, 75.0 * 10.0, 1.0]
    policy._refit()
    slow, fast, _ = policy._offset
    assert slow > 0 and fast == pytest.approx(slow / 10.0)
    policy.insert("slow", 0.0)
    policy.end_request(RequestInfo(), [], [], 0.0)
    policy.insert("fast", 0.0)
    policy.touch("fast", 0.0)  # count 2: the fast class
    assert policy.evict(1) == ["fast"]


def test_ghost_reuse_restores_the_count() -> None:
    policy = PrefixOddsPolicy(2, depth_buckets=1, ghost_factor=4.0)
    policy.insert("k", 0.0)
    policy.touch("k", 1.0)
    assert policy.evict(1) == ["k"]
    policy.insert("k", 5.0)
    assert policy._state["k"][2] == 3  # two accesses before eviction, then this one
    assert policy._odds.reuses[1] == 1.0  # the re-store counted as a reuse of its old class


def test_new_blocks_are_classed_by_depth_and_reused_ones_by_count() -> None:
    policy = PrefixOddsPolicy(100, max_count=3, depth_buckets=3)
    keys: list[object] = list(range(40))
    _request(policy, keys, 0.0)
    classes = [int(policy._state[k][0]) for k in keys]
    assert classes[:4] == [0] * 4 and classes[4:16] == [1] * 12
    assert classes[16:39] == [2] * 23 and classes[39] == policy._tail
    _request(policy, [*keys[:10], "x"], 1.0)  # a reuse: count 2 whatever the depth
    assert {int(policy._state[k][0]) for k in keys[:10]} == {3}
    _request(policy, [*keys[:10], "y"], 2.0)
    assert {int(policy._state[k][0]) for k in keys[:10]} == {4}


def test_protected_heads_are_skipped_and_evict_is_atomic() -> None:
    policy = PrefixOddsPolicy(10)
    for i, key in enumerate("abcd"):
        policy.insert(key, float(i))
    assert policy.evict(3, {"a", "b"}) is None
    assert len(policy) == 4
    assert policy.evict(2, {"a"}) == ["b", "c"]


def test_does_not_lose_to_lru_on_a_bailian_shaped_workload() -> None:
    reqs = synthetic_bailian(sessions=300, seed=7)
    odds = replay(reqs, create_policy("prefix-odds", 1500)).hit_rate
    lru = replay(reqs, create_policy("lru", 1500)).hit_rate
    assert odds >= lru - 0.01
