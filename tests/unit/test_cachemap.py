"""CacheMap against a naive reference model: random operation sequences, integrity after each."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cachemap import CacheMap, Match, Tier

INSTANCES = [f"e{i}" for i in range(70)]  # > 64 so the mask grows a second word
# Small hash space so operations collide; chains are runs of ids (a prompt = a path).
chains = st.lists(st.integers(1, 40), min_size=1, max_size=8)


class Reference:
    def __init__(self) -> None:
        self.res: dict[tuple[str, Tier], set[int]] = {}

    def match(self, hashes: list[int]) -> dict[str, Match]:
        out = {}
        for inst in {i for i, _ in self.res}:
            gpu = self.res.get((inst, Tier.GPU), set())
            cpu = self.res.get((inst, Tier.CPU), set())
            n_gpu = n_any = 0
            for h in hashes:
                if h not in gpu:
                    break
                n_gpu += 1
            for h in hashes:
                if h not in gpu and h not in cpu:
                    break
                n_any += 1
            if n_any:
                out[inst] = Match(n_gpu, n_any)
        return out


class CacheMapMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.map = CacheMap(initial_slots=4)
        self.ref = Reference()

    @rule(
        inst=st.sampled_from(INSTANCES[:5] + INSTANCES[60:]),
        tier=st.sampled_from(Tier),
        hashes=chains,
    )
    def store(self, inst: str, tier: Tier, hashes: list[int]) -> None:
        before = set(self.ref.res.get((inst, tier), set()))
        added = self.map.store(inst, tier, hashes)
        self.ref.res.setdefault((inst, tier), set()).update(hashes)
        assert added == len(set(hashes) - before)

    @rule(
        inst=st.sampled_from(INSTANCES[:5] + INSTANCES[60:]),
        tier=st.sampled_from(Tier),
        runs=st.lists(chains, max_size=4),
    )
    def store_chains(self, inst: str, tier: Tier, runs: list[list[int]]) -> None:
        before = set(self.ref.res.get((inst, tier), set()))
        added = self.map.store_chains(inst, tier, [(h, None, 0) for h in runs])
        new = set().union(*runs) if runs else set()
        if new:
            self.ref.res.setdefault((inst, tier), set()).update(new)
        assert added == len(new - before)

    @rule(
        inst=st.sampled_from(INSTANCES[:5] + INSTANCES[60:]),
        tier=st.sampled_from(Tier),
        hashes=chains,
    )
    def remove(self, inst: str, tier: Tier, hashes: list[int]) -> None:
        held = self.ref.res.get((inst, tier), set())
        expect = len(held & set(hashes))
        assert self.map.remove(inst, tier, hashes) == expect
        held -= set(hashes)

    @rule(
        inst=st.sampled_from(INSTANCES[:5] + INSTANCES[60:]),
        tier=st.one_of(st.none(), st.sampled_from(Tier)),
    )
    def clear(self, inst: str, tier: Tier | None) -> None:
        for t in Tier if tier is None else (tier,):
            self.ref.res.get((inst, t), set()).clear()
        self.map.clear(inst, tier)

    @rule(inst=st.sampled_from(INSTANCES[:5] + INSTANCES[60:]))
    def drop(self, inst: str) -> None:
        for t in Tier:
            self.ref.res.pop((inst, t), None)
        self.map.drop_instance(inst)
        assert inst not in self.map.instances()

    @rule(hashes=chains)
    def match(self, hashes: list[int]) -> None:
        assert self.map.match(hashes) == self.ref.match(hashes)

    @invariant()
    def integrity(self) -> None:
        self.map.check_integrity()
        live = set().union(*self.ref.res.values()) if self.ref.res else set()
        assert len(self.map) == len(live)
        assert self.map.stats().residency == sum(len(v) for v in self.ref.res.values())
        for (inst, tier), held in self.ref.res.items():
            if inst in self.map.instances():
                assert sorted(self.map.resident(inst, tier)) == sorted(held)
                assert self.map.count(inst, tier) == len(held)


TestCacheMap = CacheMapMachine.TestCase
TestCacheMap.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_parent_links_and_depth() -> None:
    m = CacheMap()
    m.store("a", Tier.GPU, [10, 11, 12])
    m.store("b", Tier.CPU, [13], parent=12, depth=3)
    assert m.node(10) == (None, 0)
    assert m.node(12) == (11, 2)
    assert m.node(13) == (12, 3)
    assert m.node(99) is None
    assert m.holders(12) == {"a": frozenset({Tier.GPU})}


def test_chains_stored_in_one_pass_are_the_stores_one_after_another() -> None:
    """``store_chains`` leaves the map ``store`` after ``store`` would: the same nodes (a hash
    in two chains defined where it first stands), holders, counts and matches, through known
    blocks, blocks whose inline holders are full and hashes that repeat."""
    runs = [
        ([1, 2, 3], None, 0),
        ([4, 5], 3, 3),
        ([], 9, 1),
        ([5, 6, 2], 77, 7),  # 5 again (a child of 4 stays), 2 again
        ([8], None, 0),
        ([30, 31, 32, 1], 8, 1),
    ]
    one, many = CacheMap(initial_slots=4), CacheMap(initial_slots=4)
    for m in (one, many):
        for i in range(6):  # 30 and 31 held by more instances than fit inline
            m.store(f"x{i}", Tier.GPU, [30, 31, 40])
        m.store("a", Tier.CPU, [2, 40])
    added = sum(one.store("a", Tier.GPU, h, p, d) for h, p, d in runs)
    assert many.store_chains("a", Tier.GPU, runs) == added == 10
    for m in (one, many):
        m.check_integrity()
    for block in (1, 2, 3, 4, 5, 6, 8, 30, 31, 32, 40, 77):
        assert one.node(block) == many.node(block) and one.holders(block) == many.holders(block)
    assert many.node(5) == (4, 4) and many.node(6) == (5, 8) and many.node(30) == (None, 0)
    assert many.node(32) == (31, 3)
    for tier in Tier:
        assert one.counts(tier) == many.counts(tier)
    for q in ([1, 2, 3, 4, 5, 6], [30, 31, 32, 1], [8]):
        assert one.match(q) == many.match(q)
    assert many.store_chains("a", Tier.GPU, []) == 0


def test_match_counts_cpu_run_after_gpu_run() -> None:
    m = CacheMap()
    m.store("a", Tier.GPU, [1, 2])
    m.store("a", Tier.CPU, [3, 4])
    m.store("a", Tier.GPU, [5])  # after a gap in nothing: still counts, 1..5 all resident
    got = m.match([1, 2, 3, 4, 5, 6])
    assert got == {"a": Match(gpu_blocks=2, total_blocks=5)}
    assert got["a"].cpu_blocks == 3
    m.remove("a", Tier.CPU, [3])
    assert m.match([1, 2, 3, 4, 5]) == {"a": Match(2, 2)}


def test_dropped_instance_bit_is_reused_cleanly() -> None:
    m = CacheMap()
    m.store("old", Tier.GPU, [1, 2, 3])
    m.drop_instance("old")
    m.store("new", Tier.GPU, [1])
    assert m.match([1, 2, 3]) == {"new": Match(1, 1)}
    assert len(m) == 1
    m.check_integrity()


def test_a_store_that_outgrows_the_slots_and_repeats_hashes() -> None:
    m = CacheMap(initial_slots=16)
    m.store("a", Tier.GPU, [1, 2])
    chain = [*range(1, 100), 5, 7]  # grows the columns mid-call; 5 and 7 repeat
    assert m.store("b", Tier.GPU, chain) == 99
    assert m.store("a", Tier.GPU, chain) == 97
    m.check_integrity()
    assert m.match(chain) == {"a": Match(101, 101), "b": Match(101, 101)}
    assert m.node(5) == (4, 4)
    assert m.remove("a", Tier.GPU, [1, 1, 2, 500]) == 2
    assert m.remove("b", Tier.GPU, chain) == 99
    m.check_integrity()
    assert m.match([1]) == {} and m.count("a", Tier.GPU) == 97 and 1 not in m
    got = m.match([3, 4])
    assert "a" in got and "b" not in got and got.get("b", None) is None
    assert got["a"] == Match(2, 2) and list(got) == ["a"]
    with pytest.raises(KeyError):
        got["b"]


def test_only_widely_shared_blocks_pay_for_a_row_at_a_thousand_instances() -> None:
    """A private block costs its inline holders whatever the cluster size; a block held by more
    instances than fit inline moves to a row, and matches are the same either way."""
    m = CacheMap()
    shared = [1, 2, 3]
    for i in range(1024):
        m.store(f"e{i}", Tier.GPU if i % 2 else Tier.CPU, [*shared, 1000 + i])
    assert m.stats().mask_words == 16
    assert m.stats().wide_blocks == 3  # the shared prefix; the 1,024 private tails stay inline
    got = m.match([*shared, 1005])
    assert len(got) == 1024
    assert got["e5"] == Match(4, 4) and got["e4"] == Match(0, 3) and got["e7"] == Match(3, 3)
    assert list(got)[:3] == ["e0", "e1", "e2"]
    assert list(got.items()) == [(k, got[k]) for k in got]  # the pairs straight from the runs
    bit_of, by_bit = m.counts_by_bit(Tier.GPU)
    assert {k: int(by_bit[b]) for k, b in bit_of.items()} == m.counts(Tier.GPU)
    for i in range(4):  # a tail shared by a few: still inline, followed one by one
        m.store(f"e{i}", Tier.GPU, [*shared, 1000 + i, 7, 8])
    assert m.stats().wide_blocks == 3
    assert m.match([1000, 7, 8]) == {"e0": Match(3, 3)}
    assert m.match([*shared, 1003, 7, 8])["e3"] == Match(6, 6)
    m.store("e11", Tier.CPU, [7])  # a fifth holder of 7 does not fit inline
    assert m.stats().wide_blocks == 4
    assert m.match([7, 8]) == {
        "e0": Match(2, 2),
        "e1": Match(2, 2),
        "e2": Match(2, 2),
        "e3": Match(2, 2),
        "e11": Match(0, 1),
    }
    m.check_integrity()
    for i in range(1024):
        m.drop_instance(f"e{i}")
    assert len(m) == 0 and m.stats().wide_blocks == 0
    m.check_integrity()
