"""``benchmarks/fcfs_reference.py``'s queueing model: the references it measures placement by."""

from __future__ import annotations

from benchmarks.fcfs_reference import Caches, greedy, hold, reorder
from engines.profile import LatencyProfile
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned


def planned(index: int, at: float, tokens: int, ids: tuple[int, ...] = ()) -> Planned:
    return Planned(index, at, TraceRequest(0.0, tokens, 1, ids))


def by_size(_engine: int, p: Planned) -> float:
    return float(p.req.input_length)


def test_greedy_sends_each_request_where_it_finishes_first() -> None:
    plan = [planned(0, 0.0, 4), planned(1, 0.0, 1), planned(2, 0.5, 1)]
    sent: list[tuple[int, int]] = []
    finish = greedy(plan, 2, by_size, lambda k, p: sent.append((k, p.index)))
    assert finish == {0: 4.0, 1: 1.0, 2: 2.0}  # the third queues behind the short one
    assert sent == [(0, 0), (1, 1), (1, 2)]


def test_held_requests_go_shortest_first_unless_their_wait_outweighs_it() -> None:
    # one engine busy until 5 s with the first; three more wait for it
    plan = [planned(0, 0.0, 5), planned(1, 1.0, 3), planned(2, 2.0, 2), planned(3, 3.0, 1)]
    sjf = hold(plan, 1, by_size, lambda k, p: None, age=0.0)
    assert sjf == {0: 5.0, 3: 6.0, 2: 8.0, 1: 11.0}
    aged = hold(plan, 1, by_size, lambda k, p: None, age=10.0)  # waiting dominates: FCFS
    assert aged == {0: 5.0, 1: 8.0, 2: 10.0, 3: 11.0}


def test_each_engine_serves_its_queue_shortest_first_until_a_wait_reaches_the_cap() -> None:
    # one engine busy until 5 s with the first; three more queue on it
    plan = [planned(0, 0.0, 5), planned(1, 1.0, 3), planned(2, 2.0, 2), planned(3, 3.0, 1)]
    sent: list[tuple[int, int]] = []
    sjf = reorder(plan, 1, by_size, lambda k, p: sent.append((k, p.index)), cap=1e9)
    assert sjf == {0: 5.0, 3: 6.0, 2: 8.0, 1: 11.0}
    assert sent == [(0, 0), (0, 1), (0, 2), (0, 3)]  # placed as greedy places them
    # at 5 s request 1 has waited 4 s: under a 4.5 s cap the shortest goes first, and at 6 s
    # request 1 (5 s waited) passes request 2 (4 s)
    assert reorder(plan, 1, by_size, lambda k, p: None, cap=4.5) == {
        0: 5.0,
        3: 6.0,
        1: 9.0,
        2: 11.0,
    }
    # under a 3.5 s cap requests 1 and 2 have both waited past it at 5 s: oldest first
    assert reorder(plan, 1, by_size, lambda k, p: None, cap=3.5) == {
        0: 5.0,
        1: 8.0,
        2: 10.0,
        3: 11.0,
    }
    # two engines, placed as greedy places them (0, 2, 4 on the first; 1, 3 on the second):
    # at 6 s the first serves 4 (1 s) before 2 (3 s); the second's queue keeps its order
    two = [planned(0, 0.0, 6), planned(1, 0.0, 6), planned(2, 1.0, 3)]
    two += [planned(3, 2.0, 3), planned(4, 3.0, 1)]
    assert greedy(two, 2, by_size, lambda k, p: None) == {0: 6.0, 1: 6.0, 2: 9.0, 3: 9.0, 4: 10.0}
    assert reorder(two, 2, by_size, lambda k, p: None, cap=1e9) == {
        0: 6.0,
        1: 6.0,
        4: 7.0,
        2: 10.0,
        3: 9.0,
    }


def test_an_engine_serves_a_prefix_it_was_sent_as_a_hit() -> None:
    prof = LatencyProfile.load("h100-llama3.1-8b")
    caches = Caches(prof, [1.0, 2.0], block=16)
    first = planned(0, 0.0, 4096, tuple(range(256)))
    again = planned(1, 0.0, 4096, tuple(range(256)))
    cold = caches.service(0, again)
    caches.send(0, first)
    assert caches.service(0, again) < cold / 10  # all but the last token cached
    assert caches.service(1, again) == 2.0 * cold  # the other engine: cold, and half as fast
