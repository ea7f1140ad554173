"""OpenAI response shapes for chat and text completions, streamed or whole."""

from __future__ import annotations

import time
from typing import Any

from engines.base import EngineOutput
from router.api import ChatCompletionRequest, CompletionRequest
from router.tokenizer import IncrementalDetokenizer, PromptTokenizer


class ResponseBuilder:
    """Accumulates one request's engine outputs into OpenAI chunks and the final body."""

    def __init__(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        chat: bool,
        tokenizer: PromptTokenizer,
        request_id: str,
        prompt_tokens: int,
    ) -> None:
        self.chat = chat
        self.model = req.model
        self.request_id = request_id
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.instance_id: str | None = None
        self._detok = IncrementalDetokenizer(tokenizer)
        self._sent_role = False

    def _delta_text(self, out: EngineOutput) -> str:
        if out.text is not None:
            return out.text
        return self._detok.push(out.token_ids, final=out.finished)

    def add(self, out: EngineOutput, instance_id: str) -> str:
        """Fold one output in; returns its text delta."""
        self.instance_id = instance_id
        delta = self._delta_text(out)
        self.text.append(delta)
        self.completion_tokens += len(out.token_ids)
        if out.finished:
            self.finish_reason = _openai_reason(out.finish_reason)
            if out.usage is not None:
                self.completion_tokens = out.usage.completion_tokens
                self.cached_tokens = out.usage.cached_tokens
                self.prompt_tokens = out.usage.prompt_tokens
        return delta

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def chunks(self, out: EngineOutput, instance_id: str) -> list[dict[str, Any]]:
        """The SSE chunks for one engine output."""
        delta = self.add(out, instance_id)
        reason = self.finish_reason if out.finished else None
        if not delta and reason is None and self._sent_role:
            return []
        body = self._envelope(chunk=True)
        if self.chat:
            d: dict[str, Any] = {"content": delta}
            if not self._sent_role:
                d["role"] = "assistant"
                self._sent_role = True
            body["choices"] = [{"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}]
        else:
            body["choices"] = [
                {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}
            ]
        if self.include_usage:
            body["usage"] = None
        return [body]

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        body["choices"] = []
        body["usage"] = self.usage()
        return body

    def final(self) -> dict[str, Any]:
        body = self._envelope(chunk=False)
        text = "".join(self.text)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": self.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": self.finish_reason,
                "logprobs": None,
            }
        body["choices"] = [choice]
        body["usage"] = self.usage()
        return body


def _openai_reason(reason: str | None) -> str | None:
    if reason in (None, "stop", "length"):
        return reason
    return "stop" if reason == "abort" else reason
