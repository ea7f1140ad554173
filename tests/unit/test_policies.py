"""The policy contract, run over every registered policy, and the registry."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import (
    EvictionPolicy,
    OfflinePolicy,
    RequestInfo,
    create_policy,
    get_policy_class,
    policy_names,
)
from policies.lru import LRUPolicy

ALL = policy_names()


def test_registry_lists_every_required_policy() -> None:
    required = {"lru", "fifo", "lfu", "arc", "s3-fifo", "gdsf", "aging-lfu", "wa", "lpc", "belady"}
    assert required <= set(ALL)
    for name in ALL:
        cls = get_policy_class(name)
        assert issubclass(cls, EvictionPolicy) and cls.name == name


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown name 'nope'") as err:
        get_policy_class("nope")
    for name in ALL:
        assert name in str(err.value)


def test_module_path_fallback_and_case() -> None:
    assert get_policy_class("LRUPolicy", "policies.lru") is LRUPolicy
    assert get_policy_class(" LRU ") is LRUPolicy
    with pytest.raises(ValueError, match="not an EvictionPolicy"):
        get_policy_class("RequestInfo", "policies.base")


@pytest.mark.parametrize("name", ALL)
def test_bad_capacity_is_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        create_policy(name, 0)


def _fresh(name: str, capacity: int, universe: int) -> EvictionPolicy:
    policy = create_policy(name, capacity)
    if isinstance(policy, OfflinePolicy):
        # A future where every key is used once more in a later request.
        policy.load_future([list(range(universe)), list(range(universe))[::-1]])
    policy.begin_request(RequestInfo(category="text_1", index=0, session_id=1), 0.0)
    return policy


# (op, a, b): a picks a key or a count, b picks a protected mask.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "remove", "evict", "end", "begin"]),
        st.integers(0, 40),
        st.integers(0, 2**12),
    ),
    max_size=120,
)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.integers(1, 12))
def test_contract_against_a_reference_set(
    name: str, ops: list[tuple[str, int, int]], capacity: int
) -> None:
    """Random operation sequences; after every step the policy tracks exactly the resident
    keys, and evict is atomic and never returns a protected key."""
    universe = 41
    policy = _fresh(name, capacity, universe)
    resident: list[int] = []
    now = 0.0
    for op, a, mask in ops:
        now += 0.5
        if op == "insert" and a not in resident:
            parent = resident[-1] if resident else None
            policy.insert(a, now, parent, len(resident) % 5)
            resident.append(a)
        elif op == "touch" and resident:
            policy.touch(resident[a % len(resident)], now)
        elif op == "remove" and resident:
            policy.remove(resident.pop(a % len(resident)))
        elif op == "end" and resident:
            keys = resident[: 1 + a % len(resident)]
            policy.end_request(RequestInfo(index=0, num_blocks=len(keys)), keys, keys[::2], now)
        elif op == "begin":
            policy.begin_request(
                RequestInfo(category=f"text_{1 + a % 3}", turn=1 + a % 3, index=0), now
            )
        elif op == "evict":
            protected = {k for i, k in enumerate(resident) if mask >> (i % 12) & 1}
            n = a % (len(resident) + 2)
            free = len(resident) - len(protected)
            victims = policy.evict(n, protected)
            if n > free:
                assert victims is None
            else:
                assert victims is not None and len(victims) == n
                assert len(set(victims)) == n
                assert not set(victims) & protected
                assert set(victims) <= set(resident)
                resident = [k for k in resident if k not in set(victims)]
        assert len(policy) == len(resident)
        assert all(k in policy for k in resident)
        assert all(k not in policy for k in range(universe) if k not in resident)
    policy.clear()
    assert len(policy) == 0


@pytest.mark.parametrize("name", ALL)
def test_evict_zero_and_empty(name: str) -> None:
    policy = _fresh(name, 4, 4)
    assert policy.evict(0) == []
    assert policy.evict(1) is None
    policy.insert(1, 0.0)
    assert policy.evict(1, {1}) is None
    assert 1 in policy
    assert policy.evict(1) == [1]
    assert len(policy) == 0


@pytest.mark.parametrize("name", ALL)
def test_bytes_keys_work(name: str) -> None:
    """vLLM's OffloadKeys are bytes; nothing may assume int keys."""
    policy = _fresh(name, 3, 0)
    keys = [bytes([i]) * 8 for i in range(5)]
    for i, key in enumerate(keys):
        policy.insert(key, float(i), keys[i - 1] if i else None, i)
    policy.end_request(RequestInfo(index=0), keys, keys[:2], 5.0)
    victims = policy.evict(3, {keys[0]})
    assert victims is not None and len(victims) == 3 and keys[0] not in victims
