"""``ray_prefix``: Ray Serve's PrefixCacheAffinityRouter decision on Ray's real ``PrefixTree``."""

from __future__ import annotations

import pytest
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

from cachemap import Match
from engines.profile import LatencyProfile
from router.placement import InstanceView, PlacementRequest, create_scorer
from router.scorers.ray_prefix import RayPrefixScorer, block_text

BS = 16
PROFILE = LatencyProfile.load("h100-llama3.1-8b")


def view(iid: str, **kw) -> InstanceView:
    return InstanceView(iid, BS, PROFILE, **kw)


def req(hashes: list[int], rid: str = "r") -> PlacementRequest:
    return PlacementRequest(rid, len(hashes) * BS, hashes)


def shared(n_common: int, n_total: int, tail: int) -> list[int]:
    """``n_common`` leading blocks of the common prefix 1.., then blocks unique to ``tail``."""
    return list(range(1, n_common + 1)) + [tail * 1000 + i for i in range(n_total - n_common)]


def test_registered_under_ray_prefix_and_uses_rays_tree() -> None:
    s = create_scorer("ray_prefix")
    assert isinstance(s, RayPrefixScorer)
    assert type(s.tree) is PrefixTree  # the installed ray's class, not a copy
    # Ray's defaults (PrefixCacheAffinityRouter.initialize_state)
    assert s.imbalanced_threshold == float("inf")
    assert s.match_rate_threshold == 0.1
    assert s.do_eviction is False


def test_block_text_is_a_fixed_width_prefix_preserving_code() -> None:
    a, b = block_text(shared(8, 10, 1)), block_text(shared(8, 10, 2))
    assert len(a) == len(b) == 40
    assert a[:32] == b[:32] and a[32:36] != b[32:36]
    assert block_text([]) == ""
    assert block_text([7, 8], chars_per_block=2) == block_text([7, 8])[:2] + block_text([8])[:2]
    # no surrogates: every text is valid UTF-8; distinct hashes never collide
    many = block_text([*range(20_000), 2**64 - 1])
    many.encode("utf-8")
    assert max(map(ord, many)) > 0xFFFF  # surrogate code points moved to plane 1
    blocks = {many[i : i + 4] for i in range(0, len(many), 4)}
    assert len(blocks) == 20_001
    # Ray's match rate on the code is matched blocks / blocks
    tree = PrefixTree()
    tree.add_tenants(["x"], 0.0)
    tree.insert(a, "x", 1.0)
    matched, tenants = tree.prefix_match(block_text(shared(3, 10, 3)))
    assert len(matched) / 40 == pytest.approx(0.3) and tenants == ["x"]


def test_affinity_follows_the_tree_even_against_load_by_default() -> None:
    s = create_scorer("ray_prefix")
    insts = [view("a"), view("b"), view("c")]
    first = s.place(req(shared(10, 12, 1), "r1"), insts, {})
    assert first.instance_id == "a"  # empty trees: all smallest, first of the shortest queues
    assert first.detail["ray_branch"] == "smallest"
    # Shares 10 of 12 blocks with r1: Ray's prefix branch sends it to a.
    p = s.place(req(shared(10, 12, 2), "r2"), insts, {"a": Match(10, 10)})
    assert p.instance_id == "a" and p.detail["ray_branch"] == "prefix"
    assert p.detail["match_rate"] == pytest.approx(10 / 12)
    assert p.cached_blocks == 10
    # Ray's default imbalanced_threshold is inf: a far busier a still wins.
    busy = [view("a", running=40, waiting=10), view("b"), view("c")]
    assert s.place(req(shared(10, 12, 3), "r3"), busy, {}).instance_id == "a"


def test_among_tenants_holding_the_prefix_the_shortest_queue_wins() -> None:
    s = RayPrefixScorer()
    insts = [view("a", running=3), view("b", running=1), view("c")]
    r = req(shared(10, 10, 0))
    s.place(r, insts, {})  # c (all empty, c's queue is shortest)
    s.tree.insert(s.request_text(r), "b", 0.5)  # b holds the same prompt (Ray's tree API)
    s.tree.insert(s.request_text(r), "a", 0.6)
    assert s.place(r, insts, {}).instance_id == "c"
    busier_c = [view("a", running=3), view("b", running=1), view("c", running=2)]
    assert s.place(r, busier_c, {}).instance_id == "b"


def test_imbalance_falls_back_to_power_of_two_choices() -> None:
    s = RayPrefixScorer(imbalanced_threshold=20)  # the value in Ray's RequestRouterConfig docs
    two = [view("a"), view("b")]
    r = req(shared(10, 10, 0))
    assert s.place(r, two, {}).instance_id == "a"
    # queue difference 20: not more than the threshold, the tree still wins
    assert s.place(r, [view("a", running=25), view("b", running=5)], {}).instance_id == "a"
    # 21 > 20: imbalanced; with two replicas power-of-two picks the shorter queue
    p = s.place(r, [view("a", running=26), view("b", running=5)], {})
    assert p.instance_id == "b" and p.detail["ray_branch"] == "pow2"
    # with more replicas: two random candidates, the shorter queue of the pair, never the hot one
    many = [view("a", running=30)] + [view(f"i{k}", running=k) for k in range(5)]
    picks = [s.place(r, many, {}).instance_id for _ in range(200)]
    assert "a" not in picks and set(picks) == {"i0", "i1", "i2", "i3", "i4"}
    assert picks.count("i0") > picks.count("i4")  # i4 wins only when paired with a
    # seeded: the same sequence again
    again = RayPrefixScorer(imbalanced_threshold=20)
    again.place(r, two, {})
    again.place(r, [view("a", running=25), view("b", running=5)], {})
    again.place(r, [view("a", running=26), view("b", running=5)], {})
    assert [again.place(r, many, {}).instance_id for _ in range(200)] == picks


def test_low_match_rate_goes_to_the_smallest_tree_whatever_its_load() -> None:
    s = create_scorer("ray_prefix")
    insts = [view("a"), view("b", running=2), view("c", running=1)]
    assert s.place(req(shared(20, 20, 0), "r1"), insts, {}).instance_id == "a"
    # 1 of 20 blocks shared (5% < 10%): the smallest trees (b, c: empty), shorter queue of them
    p = s.place(req(shared(1, 20, 1), "r2"), insts, {})
    assert p.instance_id == "c" and p.detail["ray_branch"] == "smallest"
    # 2 of 20 (10%, not below the threshold): the prefix branch, a
    assert s.place(req(shared(2, 20, 2), "r3"), insts, {}).instance_id == "a"
    # Ray's smallest-tenant choice ignores load beyond ties: b is empty, so b, though busiest
    loaded_b = [view("a"), view("b", running=9), view("c")]
    assert s.place(req(shared(0, 20, 3), "r4"), loaded_b, {}).instance_id == "b"
    sizes = s.tree.tenant_to_char_count
    assert sizes == {"a": 4 * (20 + 18), "b": 80, "c": 80}


def test_tenants_follow_the_instance_set() -> None:
    s = RayPrefixScorer()
    r = req(shared(10, 10, 0))
    assert s.place(r, [view("a"), view("b")], {}).instance_id == "a"
    assert set(s.tree.tenant_to_char_count) == {"a", "b"}
    # a left, c joined: a's tree is gone (remove_tenants), c is a tenant (add_tenants)
    p = s.place(r, [view("b", running=1), view("c")], {})
    assert set(s.tree.tenant_to_char_count) == {"b", "c"}
    assert p.detail["ray_branch"] == "smallest" and p.instance_id == "c"
    # a is back (a new replica with an empty tree): the prompt stays on c
    back = [view("a"), view("b"), view("c", running=5)]
    assert s.place(r, back, {}).instance_id == "c"
    assert s.tree.tenant_to_char_count["a"] == 0
    # an unhealthy instance keeps its tree but is never chosen
    p = s.place(r, [view("a"), view("b"), view("c", healthy=False)], {})
    assert p.instance_id != "c" and s.tree.tenant_to_char_count["c"] == 40
    # smallest tenant unhealthy: the smallest of the healthy ones
    s2 = RayPrefixScorer()
    s2.place(req([1]), [view("a"), view("b")], {})  # a: 4 chars, b: 0
    p = s2.place(req([99]), [view("a"), view("b", healthy=False)], {})
    assert p.instance_id == "a"


def test_a_request_without_block_hashes_is_placed() -> None:
    s = create_scorer("ray_prefix")
    insts = [view("a", running=1), view("b")]
    s.place(req(shared(4, 4, 0)), insts, {})  # b
    p = s.place(PlacementRequest("e", 10, []), insts, {})
    # empty text: match rate 0 -> Ray's low-match branch (the smallest tree: a)
    assert p.instance_id == "a" and p.detail == {"ray_branch": "smallest", "match_rate": 0.0}
    assert s.tree.tenant_to_char_count == {"a": 0, "b": 16}  # inserting "" adds nothing


def test_optional_eviction_trims_a_tenant_lru_wise() -> None:
    s = RayPrefixScorer(do_eviction=True, eviction_threshold_chars=100, eviction_target_chars=60)
    one = [view("a")]
    for k in range(5):
        s.place(req([k * 100 + i for i in range(5)]), one, {})  # 20 chars each
    assert s.tree.tenant_to_char_count["a"] <= 100
    # the newest prompt is still fully matched
    matched, _ = s.tree.prefix_match(block_text([400 + i for i in range(5)]), ["a"])
    assert len(matched) == 20
