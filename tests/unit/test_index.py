"""HashIndex against a dict: random insert/delete/get batches, including colliding keys."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from cachemap.index import HashIndex

# Keys from a tiny range collide on their home positions; big ones exercise the full width.
keys = st.one_of(st.integers(0, 64), st.integers(2**63, 2**64 - 1))
ops = st.lists(
    st.tuples(st.sampled_from(["insert", "delete", "get"]), st.lists(keys, max_size=40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_matches_a_dict(ops: list[tuple[str, list[int]]]) -> None:
    idx = HashIndex(capacity=4)
    ref: dict[int, int] = {}
    counter = 0
    for op, batch in ops:
        arr = np.asarray(batch, np.uint64)
        if op == "insert":
            fresh = list(dict.fromkeys(k for k in batch if k not in ref))
            vals = np.arange(counter, counter + len(fresh))
            counter += len(fresh)
            idx.insert(np.asarray(fresh, np.uint64), vals)
            ref.update(zip(fresh, vals.tolist(), strict=True))
        elif op == "delete":
            present = {k for k in batch if k in ref}
            assert idx.delete(arr) == len(present)
            for k in present:
                del ref[k]
        got = idx.get(arr).tolist()
        assert got == [ref.get(k, -1) for k in batch]
        assert len(idx) == len(ref)
    k, v = idx.items()
    assert dict(zip(k.tolist(), v.tolist(), strict=True)) == ref


def test_many_keys_survive_growth_and_tombstone_churn() -> None:
    rng = np.random.default_rng(0)
    idx = HashIndex(capacity=16)
    live: dict[int, int] = {}
    for round_ in range(30):
        new = np.unique(rng.integers(0, 2**63, 5000, dtype=np.uint64))
        new = np.asarray([k for k in new.tolist() if k not in live], np.uint64)
        idx.insert(new, np.arange(len(new)) + round_ * 10_000)
        live.update(
            zip(new.tolist(), (np.arange(len(new)) + round_ * 10_000).tolist(), strict=True)
        )
        gone = rng.choice(np.fromiter(live, np.uint64), 3000, replace=False)
        idx.delete(gone)
        for g in gone.tolist():
            del live[g]
    probe = np.fromiter(live, np.uint64)
    assert idx.get(probe).tolist() == list(live.values())
    assert len(idx) == len(live)
