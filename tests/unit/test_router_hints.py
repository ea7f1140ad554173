"""The router's hints to the CPU-tier policy: one record, one encoder, read back by the one
parser the engines use, and conversation ids that chain a chat's turns."""

from __future__ import annotations

import pytest

from policies.base import RequestInfo
from policies.lpc import HistoryPredictor
from router.hints import HINTS_KEY, PolicyHints, conversation_ids, parse_continuation


def test_hints_round_trip_through_the_engines_parser() -> None:
    hints = PolicyHints("search_2", 2, session_id=11, parent_id=7, continuation=0.8)
    info = RequestInfo.from_hints({HINTS_KEY: hints.encode()})
    assert info == RequestInfo(
        category="search_2", turn=2, session_id=11, parent_id=7, continuation_p=0.8
    )
    bare = PolicyHints("text_1").encode()
    assert bare == {"category": "text_1", "turn": 1}  # unset fields are left out
    assert RequestInfo.from_hints({HINTS_KEY: bare}) == RequestInfo(category="text_1", turn=1)


def test_hints_merge_into_what_a_connector_put_there() -> None:
    connector = {"remote_engine_id": "p-0", "remote_block_ids": [1, 2], HINTS_KEY: {"x": 1}}
    merged = PolicyHints("text_1").merged_into(connector)
    assert merged["remote_engine_id"] == "p-0" and merged["remote_block_ids"] == [1, 2]
    assert merged[HINTS_KEY] == {"category": "text_1", "turn": 1}
    assert connector[HINTS_KEY] == {"x": 1}  # the caller's dict is not changed


def chat(*turns: str, system: str = "be brief") -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        if i:
            msgs.append({"role": "assistant", "content": f"reply {i}"})
        msgs.append({"role": "user", "content": text})
    return msgs


def test_a_turn_names_the_previous_turn_as_its_parent() -> None:
    first, none = conversation_ids(chat("hi"))
    assert first is not None and none is None
    second, parent = conversation_ids(chat("hi", "and then?"))
    assert parent == first and second not in (None, first)
    third, parent3 = conversation_ids(chat("hi", "and then?", "thanks"))
    assert parent3 == second and third not in (first, second)
    # another user's identical conversation, or another system prompt: other ids
    assert conversation_ids(chat("hi"), session="alice")[0] not in (None, first)
    assert conversation_ids(chat("hi", system="be long"))[0] != first
    assert conversation_ids([{"role": "system", "content": "x"}]) == (None, None)
    assert 0 <= first < 2**63


def test_history_predictor_learns_from_ingress_ids() -> None:
    """LPC's predictor, fed what the ingress derives: 'text_1' chats that always get a second
    turn move its estimate off the prior; without the ids it answers the prior."""
    learned, blind = HistoryPredictor(prior=0.5), HistoryPredictor(prior=0.5)
    for k in range(30):
        for turns in ((f"q{k}",), (f"q{k}", "more")):
            node, parent = conversation_ids(chat(*turns))
            cat = f"text_{len(turns)}"
            learned.observe(RequestInfo(category=cat, session_id=node, parent_id=parent))
            blind.observe(RequestInfo(category=cat))
    assert learned.predict(RequestInfo(category="text_1")) > 0.8
    assert blind.predict(RequestInfo(category="text_1")) == 0.5


@pytest.mark.parametrize("raw", ["1.5", "-0.1", "nan", "often"])
def test_bad_continuation_names_the_field(raw: str) -> None:
    with pytest.raises(ValueError, match="x-kvroute-continuation"):
        parse_continuation(raw, "x-kvroute-continuation")


def test_continuation_parses() -> None:
    assert parse_continuation("0.25", "h") == 0.25
    assert parse_continuation(None, "h") is None and parse_continuation("", "h") is None
