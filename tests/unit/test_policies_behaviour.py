"""What each policy promises beyond the contract: its order and its prefix semantics."""

from __future__ import annotations

import math

import pytest

from policies import RequestInfo, create_policy
from policies.arc import ARCPolicy
from policies.belady import BeladyPolicy
from policies.lpc import HistoryPredictor, LPCPolicy
from policies.prefix_reuse import PrefixReusePolicy
from policies.reuse_oracle import ReuseOraclePolicy
from policies.s3fifo import S3FIFOPolicy
from policies.wa import WAPolicy

REQ = RequestInfo()


def _fill(policy_name: str, keys: list[int], capacity: int = 100):  # type: ignore[no-untyped-def]
    policy = create_policy(policy_name, capacity)
    for i, k in enumerate(keys):
        policy.insert(k, float(i))
    return policy


def test_lru_evicts_least_recent_and_ranks_a_request_tail_first() -> None:
    lru = _fill("lru", [1, 2, 3, 4])
    lru.touch(1, 5.0)
    assert lru.evict(2) == [2, 3]
    # A finished request re-ranks its blocks tail first: its head is the most recent.
    lru.end_request(REQ, [1, 4], [1], 6.0)
    assert lru.evict(2) == [4, 1]


def test_fifo_ignores_reuse() -> None:
    fifo = _fill("fifo", [1, 2, 3])
    fifo.touch(1, 5.0)
    fifo.end_request(REQ, [1], [1], 6.0)
    assert fifo.evict(1) == [1]


def test_lfu_keeps_the_frequent_block() -> None:
    lfu = _fill("lfu", [1, 2, 3])
    for t in range(3):
        lfu.touch(1, 4.0 + t)
    lfu.touch(2, 9.0)
    assert lfu.evict(2) == [3, 2]


def test_gdsf_inflation_lets_new_blocks_beat_stale_popular_ones() -> None:
    gdsf = _fill("gdsf", [1], capacity=4)
    for t in range(3):
        gdsf.touch(1, float(t))  # H(1) = 4
    for k in range(2, 12):  # each eviction inflates L to the victim's H
        gdsf.insert(k, 10.0 + k)
        gdsf.touch(k, 10.0 + k)
        gdsf.touch(k, 10.0 + k)
        gdsf.evict(1)
    assert 1 not in gdsf


def test_aging_lfu_forgets_old_popularity_where_lfu_does_not() -> None:
    survivors = {}
    for name in ("aging-lfu", "lfu"):
        policy = create_policy(name, 4)
        policy.insert("old", 0.0)
        for t in range(3):
            policy.touch("old", float(t))  # 4 accesses, then idle
        for k in range(40):  # ten turnovers of blocks used twice each
            policy.insert(k, 10.0 + k)
            policy.touch(k, 10.0 + k)
            while len(policy) > 4:
                assert policy.evict(1) is not None
        survivors[name] = "old" in policy
    assert survivors == {"aging-lfu": False, "lfu": True}


def test_arc_ghost_hit_promotes_and_adapts() -> None:
    arc = ARCPolicy(4)
    for k in range(4):
        arc.insert(k, 0.0)
    assert arc.evict(1) == [0]  # T1's LRU goes to ghost list B1
    arc.insert(0, 1.0)  # ghost hit: p grows, the block goes straight to T2
    assert arc._p > 0 and 0 in arc._t2
    arc.touch(1, 2.0)  # 1 moves to T2 as well
    # T1 = [2, 3] is above its target p = 1: it gives one block, then T2's LRU (0) goes.
    assert arc._p == 1.0
    assert arc.evict(2) == [2, 0]
    assert 2 in arc._b1 and 0 in arc._b2


def test_s3fifo_drops_one_hit_wonders_before_reused_blocks() -> None:
    s3 = S3FIFOPolicy(10)
    s3.insert("hot", 0.0)
    s3.touch("hot", 0.5)
    for k in range(12):
        s3.insert(k, 1.0 + k)
        if len(s3) > 10:
            s3.evict(1)
    assert "hot" in s3 and 0 not in s3
    # A ghost's next store goes to the main FIFO.
    s3.insert(0, 20.0)
    assert 0 in s3._main


def test_belady_evicts_furthest_next_use_and_needs_the_index() -> None:
    bel = BeladyPolicy(2)
    bel.load_future([[1, 2, 3], [3], [2], [1]])
    bel.begin_request(RequestInfo(index=0), 0.0)
    for off, k in enumerate([1, 2, 3]):
        bel.insert(k, 0.0, None, off)
    assert bel.evict(1) == [1]  # next uses: 1 -> request 3, 2 -> 2, 3 -> 1
    try:
        bel.begin_request(RequestInfo(), 0.0)
    except ValueError as e:
        assert "index" in str(e)
    else:
        raise AssertionError("belady accepted a request without an index")


def _reuse_oracle_after(label_error: float) -> ReuseOraclePolicy:
    """Request 0 stores [1, 2, 3], request 1 stores [4]; only block 1 is used again (request 2)."""
    oracle = ReuseOraclePolicy(10, label_error=label_error)
    oracle.load_future([[1, 2, 3], [4], [1]])
    for index, keys in enumerate([[1, 2, 3], [4]]):
        info = RequestInfo(index=index)
        oracle.begin_request(info, float(index))
        for off, k in enumerate(keys):
            oracle.insert(k, float(index), keys[off - 1] if off else None, off)
        oracle.end_request(info, keys, [], float(index))
    return oracle


def test_reuse_oracle_evicts_never_again_blocks_before_older_live_ones() -> None:
    # Dead blocks go first, oldest first and a prompt tail first; the older live 1 goes last.
    assert _reuse_oracle_after(0.0).evict(4) == [3, 2, 4, 1]
    # Every label inverted: the live block is the first victim, the dead ones follow as LRU.
    assert _reuse_oracle_after(1.0).evict(4) == [1, 3, 2, 4]


def test_reuse_oracle_validates_its_options_and_needs_the_index() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="label_error"):
            ReuseOraclePolicy(10, label_error=bad)
    oracle = ReuseOraclePolicy(10)
    oracle.load_future([[1]])
    with pytest.raises(ValueError, match="index"):
        oracle.begin_request(RequestInfo(), 0.0)
    with pytest.raises(ValueError, match="beyond the loaded future"):
        oracle.begin_request(RequestInfo(index=1), 0.0)


def _wa_trained() -> WAPolicy:
    """Category fast_1 is reused after ~1 s, slow_1 after ~1000 s."""
    wa = WAPolicy(1000, refit_every=50, min_samples=5)
    t = 0.0
    for i in range(60):
        for cat, gap, key in (("fast_1", 1.0, ("f", i)), ("slow_1", 1000.0, ("s", i))):
            wa.begin_request(RequestInfo(category=cat), t)
            wa.insert(key, t)
            wa.touch(key, t + gap)
            wa.remove(key)
        t += 0.01
    return wa


def test_wa_prefers_the_category_likely_to_be_reused_within_the_lifespan() -> None:
    wa = _wa_trained()
    now = 5000.0
    wa.begin_request(RequestInfo(category="slow_1"), now)
    wa.insert("slow", now)
    wa.begin_request(RequestInfo(category="fast_1"), now + 0.1)
    wa.insert("fast", now + 0.1)
    # One second later the fast category's reuse chance has passed; the slow one's has not.
    wa.begin_request(RequestInfo(category="fast_1"), now + 3.0)
    assert wa.evict(1) == ["fast"]


def test_wa_ties_go_to_the_deeper_block() -> None:
    wa = WAPolicy(10)
    wa.begin_request(RequestInfo(category="text_1"), 0.0)
    for off, key in enumerate("abc"):
        wa.insert(key, 0.0, None, off)
    assert wa.evict(3) == ["c", "b", "a"]


def test_lpc_priority_is_continuation_odds_decayed_and_shared_blocks_keep_the_max() -> None:
    lpc = LPCPolicy(10, decay_per_s=0.1)
    lpc.begin_request(RequestInfo(continuation=0.9), 0.0)
    lpc.insert("likely", 0.0)
    lpc.insert("shared", 0.0)
    lpc.begin_request(RequestInfo(continuation=0.1), 1.0)
    lpc.insert("unlikely", 1.0)
    lpc.touch("shared", 1.0)  # the low-p request does not lower the shared block
    assert lpc.evict(1) == ["unlikely"]
    # p d / (p d + 1 - p) for p=0.9 falls below a fresh p=0.1 block after log(81)/0.1 s.
    later = 1.0 + math.log(81) / 0.1 + 1.0
    lpc.insert("fresh", later)
    assert lpc.evict(2) == ["likely", "shared"]


def test_history_predictor_learns_next_turn_probability() -> None:
    pred = HistoryPredictor(prior=0.5, prior_weight=1.0)
    for s in range(20):
        first = RequestInfo(category="text_1", session_id=100 + s)
        pred.observe(first)
        if s % 4 == 0:  # a quarter of first turns continue
            pred.observe(RequestInfo(category="text_2", session_id=200 + s, parent_id=100 + s))
    p = pred.predict(RequestInfo(category="text_1"))
    assert abs(p - (5 + 0.5) / (20 + 1)) < 1e-9


def test_history_predictor_remembers_a_turn_for_its_ttl_and_forgets_it_after_twice() -> None:
    pred = HistoryPredictor(session_ttl_s=100.0)
    pred.observe(RequestInfo(category="text_1", session_id=1), 0.0)
    pred.observe(RequestInfo(category="text_1", session_id=2), 99.0)
    pred.observe(RequestInfo(category="text_1", session_id=3), 150.0)  # 1 and 2 grow old
    pred.observe(RequestInfo(category="text_2", session_id=4, parent_id=2), 198.0)
    assert pred.counts()["text_1"] == (3, 1)  # 99 s later: still known
    pred.observe(RequestInfo(category="text_1", session_id=5), 350.0)  # over 2 ttl: all go
    assert len(pred) == 1
    pred.observe(RequestInfo(category="text_2", session_id=6, parent_id=3), 351.0)
    assert pred.counts()["text_1"] == (4, 1)  # 201 s later: forgotten, not credited
    with pytest.raises(ValueError, match="session_ttl_s"):
        HistoryPredictor(session_ttl_s=0.0)
    with pytest.raises(ValueError, match="max_sessions"):
        HistoryPredictor(max_sessions=1)


def test_history_predictor_holds_at_most_max_sessions_oldest_going_first() -> None:
    pred = HistoryPredictor(max_sessions=4)
    for s in range(1, 8):
        pred.observe(RequestInfo(category="text_1", session_id=s), float(s))
        assert len(pred) <= 4
    for parent in range(1, 8):  # 1-4 went (two halves of 2); 5-7 are still held
        pred.observe(RequestInfo(category="text_2", parent_id=parent))  # (holds nothing)
    assert pred.counts()["text_1"] == (7, 3)
    lpc = LPCPolicy(10, session_ttl_s=5.0, max_sessions=8)
    assert isinstance(lpc.predictor, HistoryPredictor)
    assert (lpc.predictor.session_ttl_s, lpc.predictor.max_sessions) == (5.0, 8)


def test_prefix_reuse_sends_a_prompt_tail_first_and_learns_counts() -> None:
    pr = PrefixReusePolicy(100, refit_every=10)
    now = 0.0
    for i in range(200):  # shared head "h" always reused, tails never
        req = RequestInfo(num_blocks=2)
        pr.begin_request(req, now)
        reused = ["h"] if "h" in pr else []
        if not reused:
            pr.insert("h", now, None, 0)
        pr.insert(("t", i), now, "h", 1)
        pr.end_request(req, ["h", ("t", i)], reused, now)
        while len(pr) > 50:
            victims = pr.evict(1)
            assert victims is not None and victims != ["h"]
        now += 1.0
    assert pr.evict(1) != ["h"]
    assert pr._logit[pr.max_count] > pr._logit[pr.max_count + 2]  # hot interior > tail


def test_router_hints_parse_the_same_for_the_sim_and_the_vllm_adapter() -> None:
    from types import SimpleNamespace

    from policies.vllm_adapter import request_info

    params = {"kvroute": {"category": "text_2", "turn": 2, "continuation": 0.6}}
    info = RequestInfo.from_hints(params)
    assert info == RequestInfo(category="text_2", turn=2, continuation=0.6)
    assert request_info(SimpleNamespace(kv_transfer_params=params)) == info  # type: ignore[arg-type]
    assert RequestInfo.from_hints({"other": 1}) is None and RequestInfo.from_hints(None) is None
