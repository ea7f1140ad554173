"""What the load generator sends that kvroute's ingress turns into CPU-tier policy hints: the
request type as ``kvroute_category`` (opt-in), and, in live chat sessions, a resent history
whose conversation ids (``router.hints.conversation_ids``) chain turn to parent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import loadgen.runner as runner_mod
from loadgen.prompts import PromptSynth
from loadgen.records import RequestRecord
from loadgen.runner import RunConfig, Runner
from loadgen.traces import TraceRequest
from loadgen.workloads import build_schedule
from router.hints import conversation_ids


def _trace() -> list[TraceRequest]:
    return [
        TraceRequest(0.0, 40, 5, (1, 2, 3), chat_id=10, parent_chat_id=None, type="text", turn=1),
        TraceRequest(0.0, 20, 3, (8, 9), chat_id=11, parent_chat_id=None, type="api", turn=1),
        TraceRequest(0.01, 60, 5, (1, 2, 4, 5), chat_id=12, parent_chat_id=10, type="text", turn=2),
        TraceRequest(0.02, 90, 5, (1, 2, 4, 5, 6, 7), chat_id=13, parent_chat_id=12, turn=3),
    ]


def _cfg(**kw: Any) -> RunConfig:
    return RunConfig("http://127.0.0.1:1", "m", PromptSynth(16, seed=1), api="chat", **kw)


def _bodies(config: RunConfig) -> list[dict[str, Any]]:
    plan = build_schedule(_trace())
    runner = Runner(config, plan)
    return [json.loads(runner._body(p)[0]) for p in plan]


def test_category_is_sent_only_when_asked_and_known() -> None:
    assert all("kvroute_category" not in b for b in _bodies(_cfg()))
    sent = [b.get("kvroute_category") for b in _bodies(_cfg(send_category=True))]
    assert sent == ["text", "api", "text", None]  # the last request has no type


def test_extra_body_still_wins_over_the_category() -> None:
    bodies = _bodies(_cfg(send_category=True, extra_body={"kvroute_category": "search"}))
    assert {b["kvroute_category"] for b in bodies} == {"search"}


def test_live_session_histories_chain_under_the_ingress_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[int, list[dict[str, str]]] = {}

    async def fake_send(
        _session: Any, _url: Any, data: bytes, rec: RequestRecord, _t0: float, **kw: Any
    ) -> None:
        body = json.loads(data)
        seen[rec.chat_id] = body["messages"]  # type: ignore[index]
        rec.sent_s = rec.first_token_s = rec.done_s = 0.0
        rec.status = 200
        if kw.get("keep_reply"):
            rec.reply = f" reply of {rec.chat_id}"

    monkeypatch.setattr(runner_mod, "send", fake_send)
    result = asyncio.run(Runner(_cfg(sessions="live"), build_schedule(_trace())).run())
    assert all(r.ok for r in result.records)
    ids = {chat: conversation_ids(messages, "s") for chat, messages in seen.items()}
    # first turns: no parent; each later turn names the id its parent's request hashed to
    assert ids[10][1] is None and ids[11][1] is None
    assert ids[12][1] == ids[10][0] and ids[13][1] == ids[12][0]
    assert len({node for node, _ in ids.values()}) == 4
    assert seen[12][1] == {"role": "assistant", "content": " reply of 10"}
