"""The prompts a router sent that no KV event shows yet (``router.inflight``)."""

from __future__ import annotations

from cachemap import Match
from router.core import RouterCore
from router.inflight import InFlightPrompts
from router.placement import InstanceView, Placement, PlacementRequest
from router.settings import RouterSettings
from tests.unit.test_placement import BS, Linear


def test_a_sent_prompt_counts_where_it_went_until_its_first_token() -> None:
    f = InFlightPrompts()
    f.sent("r1", "a", [1, 2, 3, 4])
    f.sent("r2", "a", [1, 2, 9])  # shares two blocks with r1
    f.sent("r3", "b", [1, 2])
    got = f.extend([1, 2, 3, 4, 5], {"c": Match(5, 5), "b": Match(1, 3)})
    assert got == {"a": Match(4, 4), "b": Match(2, 3), "c": Match(5, 5)}
    f.done("r1")  # r2 still holds blocks 1 and 2 on a
    assert f.extend([1, 2, 3, 4], {}) == {"a": Match(2, 2), "b": Match(2, 2)}
    f.drop_instance("b")
    f.done("r2")
    f.done("nope")
    assert len(f) == 0
    m = {"x": Match(1, 1)}
    assert f.extend([1, 2], m) is m


def test_the_core_sends_a_shared_prompt_after_its_first_copy() -> None:
    """Two requests with one new prompt, the second before any KV event, while the other
    engines have some prefill queued: with ``inflight_prompts`` it goes where the first went,
    its blocks counted as cached there (waiting for the first is quicker than recomputing them
    behind another queue); without, every engine looks cold and the first one's queue is the
    longest. At the first token the map speaks again."""

    def placed(inflight: bool, step: int = BS) -> tuple[str, str, int, int]:
        model = Linear(max_num_batched_tokens=step)
        core = RouterCore(RouterSettings(block_size=BS, inflight_prompts=inflight), model)
        for iid in ("a", "b", "c"):
            core.add_instance(iid)
        first = PlacementRequest("r1", 64 * BS, list(range(1, 65)))
        p1 = core.place(first, 0.0)
        core.assigned(first, p1, 0.0)
        for k, iid in enumerate(i for i in ("a", "b", "c") if i != p1.instance_id):
            other = PlacementRequest(f"x{k}", 32 * BS, [1000 * (k + 1) + j for j in range(32)])
            core.assigned(other, Placement(iid), 0.0)
        second = PlacementRequest("r2", 66 * BS, list(range(1, 67)))
        p2 = core.place(second, 0.001)
        core.first_token("r1", 0.2)
        p3 = core.place(PlacementRequest("r3", 66 * BS, list(range(1, 67))), 0.2)
        return p1.instance_id, p2.instance_id, p2.cached_blocks, p3.cached_blocks

    one, two, cached, after = placed(True)
    assert (two, cached) == (one, 64)
    assert after == 0  # no KV event came: after the first token nothing counts as cached
    one, two, cached, _ = placed(False)
    assert two != one and cached == 0
    # the first copy's 64 blocks fit one engine step: the second would be admitted beside it
    # and compute them again, so they count for nothing there
    one, two, cached, _ = placed(True, step=64 * BS)
    assert two != one and cached == 0
    one, two, cached, _ = placed(True, step=64 * BS - 1)  # one token more than a step
    assert (two, cached) == (one, 64)


def test_in_flight_prompts_count_only_behind_more_than_a_step_of_prefill() -> None:
    f = InFlightPrompts()
    f.sent("r1", "a", [1, 2, 3])
    f.sent("r2", "b", [1, 2])
    views = [
        InstanceView("a", BS, Linear(max_num_batched_tokens=100), pending_prefill_tokens=101),
        InstanceView("b", BS, Linear(max_num_batched_tokens=100), pending_prefill_tokens=100),
    ]
    got = f.extend([1, 2, 3], {"b": Match(1, 1)}, {v.instance_id: v for v in views}.get)
    assert got == {"a": Match(3, 3), "b": Match(1, 1)}  # b's 2 in-flight blocks: not counted
    # an instance the lookup has no view of is not lengthened
    assert f.extend([1, 2, 3], {"b": Match(1, 1)}, {"b": views[1]}.get) == {"b": Match(1, 1)}
    assert f.extend([1, 2, 3], {"b": Match(1, 1)}) == {"a": Match(3, 3), "b": Match(2, 2)}
