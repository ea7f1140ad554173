"""The router's hints to the CPU-tier policy: one record (``policies.hints.PolicyHints``, the
``kv_transfer_params["kvroute"]`` entry) with one encoder and the one parser the engines use,
and conversation ids that chain a chat's turns."""

from __future__ import annotations

import msgspec
import pytest

from policies.base import RequestInfo
from policies.hints import HINTS_KEY, PolicyHints, TransferReport
from policies.lpc import HistoryPredictor
from router.hints import conversation_ids, parse_continuation


def test_hints_round_trip_through_the_engines_parser() -> None:
    hints = PolicyHints("search_2", 2, session_id=11, parent_id=7, continuation=0.8)
    info = RequestInfo.from_hints(hints.merged_into(None))
    assert info == RequestInfo(
        category="search_2", turn=2, session_id=11, parent_id=7, continuation=0.8
    )
    bare = PolicyHints("text_1").encode()
    assert bare == {"category": "text_1"}  # fields at their default are left out
    assert RequestInfo.from_hints({HINTS_KEY: bare}) == RequestInfo(category="text_1", turn=1)
    pin = PolicyHints("sys_1", pin=False)
    assert PolicyHints.from_params(pin.merged_into(None)) == pin


def test_hints_merge_into_what_a_connector_put_there() -> None:
    connector = {"remote_engine_id": "p-0", "remote_block_ids": [1, 2], HINTS_KEY: {"x": 1}}
    merged = PolicyHints("text_1").merged_into(connector)
    assert merged["remote_engine_id"] == "p-0" and merged["remote_block_ids"] == [1, 2]
    assert merged[HINTS_KEY] == {"category": "text_1"}
    assert connector[HINTS_KEY] == {"x": 1}  # the caller's dict is not changed


def test_the_parser_is_lenient_where_it_was_and_names_a_bad_field() -> None:
    """No entry, or one that is not an object: no hints. Missing fields take their defaults,
    unknown ones (a newer router's) are ignored, numbers written as strings are read; a field
    of the wrong kind is a ValueError naming it."""
    assert PolicyHints.from_params(None) is None and PolicyHints.from_params({"other": 1}) is None
    assert PolicyHints.from_params({HINTS_KEY: "text_1"}) is None
    assert PolicyHints.from_params({HINTS_KEY: {"now_s": 1}}) == PolicyHints(now_s=1.0)
    loose = {HINTS_KEY: {"category": "a_1", "turn": "3", "continuation": 1, "future": [1]}}
    assert PolicyHints.from_params(loose) == PolicyHints("a_1", 3, continuation=1.0)
    for field, bad in (("turn", "often"), ("continuation", 1.5), ("session_id", [1])):
        with pytest.raises(ValueError, match=rf"kvroute.*\$\.{field}"):
            RequestInfo.from_hints({HINTS_KEY: {"category": "a_1", field: bad}})


def test_now_s_and_the_transfer_report_ride_in_the_same_entry() -> None:
    """``now_s`` (the sender's clock, for the vLLM adapter) is a field of the record, and a decode
    engine's transfer report is added to the router's hints without losing them."""
    hints = PolicyHints("text_2", 2, session_id=3, now_s=12.5)
    report = TransferReport(ok=True, blocks=3, bytes=96, seconds=0.01, prompt_tokens_computed=1)
    out = msgspec.structs.replace(hints, transfer=report).merged_into(None)
    assert out[HINTS_KEY]["now_s"] == 12.5
    assert out[HINTS_KEY]["transfer"] == {
        "ok": True,
        "blocks": 3,
        "bytes": 96,
        "seconds": 0.01,
        "prompt_tokens_computed": 1,
    }
    back = PolicyHints.from_params(out)
    assert back is not None and back.transfer == report and back.request_info().session_id == 3
    failed = {HINTS_KEY: {"transfer": {"ok": False, "error": "no answer"}}}
    assert PolicyHints.from_params(failed) == PolicyHints(
        transfer=TransferReport(ok=False, error="no answer")
    )


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
