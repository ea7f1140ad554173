"""OpenAI response shapes for chat and text completions, streamed or whole, with ``n`` choices,
logprobs, and stop strings for engines that return no text.

An engine that detokenizes (vLLM) applies stop strings itself and sends its text; for one that
sends token ids only (the sim engine) the builder detokenizes and applies the request's stop
strings exactly as vLLM's detokenizer does (earliest match, ``min_tokens``, the stop token's
text left out, the held-back tail while streaming), and reports the choice done so that the
ingress aborts its engine request.

``router.lifecycle.choice_requests`` makes the engine requests of a request's choices (``n``,
each its own engine request, seeded as vLLM seeds its own ``n`` children);
``router.dispatch.ChoiceStreams`` runs them.
"""

from __future__ import annotations

import sys
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engines.base import EngineOutput, TopLogprob
from router.api import ChatCompletionRequest, CompletionRequest
from router.api_errors import APIError
from router.tokenizer import IncrementalDetokenizer, PromptTokenizer

if TYPE_CHECKING:
    from router.metrics import RequestTimer

_LOGPROB_FLOOR = -9999.0  # vLLM's (and OpenAI's) stand-in for -inf


def check_stop_strings(
    text: str, new_chars: int, stops: list[str], include: bool
) -> tuple[str, int] | None:
    """vLLM's ``check_stop_strings``: ``(stop string, length to cut the text to, -1: keep it
    whole)`` for the stop string completing earliest in the last ``new_chars`` characters (ties:
    list order), or None."""
    if not new_chars or not stops:
        return None
    best, best_index, best_end = None, 0, sys.maxsize
    for stop in stops:
        index = text.find(stop, 1 - new_chars - len(stop))
        if index != -1 and index + len(stop) < best_end:
            best, best_index, best_end = stop, index, index + len(stop)
    if best is None:
        return None
    if include:
        return best, -1 if best_end >= len(text) else best_end
    return best, best_index


@dataclass
class _Choice:
    index: int
    detok: IncrementalDetokenizer
    text: str = ""  # the output text so far (cut at a stop string)
    streamed: int = 0  # characters of ``text`` already sent
    token_ids: list[int] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)  # since the last chunk
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    done: bool = False
    sent_role: bool = False
    logged: int = 0  # logprobs entries already streamed
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat entries (final body)
    tokens: list[str] = field(default_factory=list)  # completions logprobs, whole body
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    next_offset: int = 0


class ResponseBuilder:
    """Accumulates one request's engine outputs (``n`` choices) into OpenAI chunks and the
    final body."""

    def __init__(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        chat: bool,
        tokenizer: PromptTokenizer,
        request_id: str,
        prompt_tokens: int,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.chat = chat
        self.model = req.model
        self.request_id = request_id
        self.created = int(time.time())
        self.arrived = time.monotonic()  # the request's latencies run from here
        # the request's clock (``RouterMetrics.admitted``): told of every output's new tokens
        self.timer: RequestTimer | None = None
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = self.include_usage and bool(opts and opts.continuous_usage_stats)
        self.prompt_tokens = prompt_tokens
        self.prompt_token_ids = prompt_token_ids if req.return_token_ids else None
        self.cached_tokens = 0
        self.instance_id: str | None = None
        self._tok = tokenizer
        self._stops = req.stops()
        self._include_stop = req.include_stop_str_in_output
        self._min_tokens = req.min_tokens
        self._hold = (
            max(len(s) for s in self._stops) - 1 if self._stops and not self._include_stop else 0
        )
        self._top = req.top_candidates()
        self._wants_logprobs = req.wants_logprobs()
        self._all_candidates = bool(req.logprob_token_ids) or self._top == -1
        self._as_ids = bool(req.return_tokens_as_token_ids)
        self._return_ids = bool(req.return_token_ids)
        self._usage_from: int | None = None  # the choice whose final usage was taken
        self.choices = [_Choice(i, IncrementalDetokenizer(tokenizer)) for i in range(req.n)]
        self._sent_prompt_ids = False

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def estimate_cached_tokens(self, estimate: int) -> None:
        """Report the router's estimate of the cached prefix when no engine reported its own
        (every choice was ended here, by a stop string, before its engine finished)."""
        if self._usage_from is None:
            self.cached_tokens = estimate

    # -- folding outputs in ------------------------------------------------------------------------

    def add(self, index: int, out: EngineOutput, instance_id: str) -> str:
        """Fold one output of choice ``index`` in; returns its text delta (what may be sent
        now). Raises ``APIError`` (400) if the engine refused the request as invalid."""
        c = self.choices[index]
        if c.done:
            return ""
        if out.error is not None:
            raise APIError(400, f"the engine refused the request: {out.error}")
        self.instance_id = instance_id
        hold = 0
        if out.text is not None:  # the engine detokenized, stop strings applied
            ids = list(out.token_ids)
            c.text += out.text
            self._add_logprobs(c, ids, out.logprobs)
        else:
            ids = self._detokenize(c, out)
            hold = self._hold
        c.token_ids.extend(ids)
        c.new_ids.extend(ids)
        if ids and self.timer is not None:
            self.timer.tokens(index, len(ids), instance_id, None, out.first_token_age_s)
        if out.finished and not c.done:
            c.done = True
            c.finish_reason = _openai_reason(out.finish_reason)
            c.stop_reason = out.stop_reason
        if out.usage is not None and (self._usage_from is None or index < self._usage_from):
            self._usage_from = index
            self.cached_tokens = out.usage.cached_tokens
            self.prompt_tokens = out.usage.prompt_tokens
        end = len(c.text) if c.done else max(len(c.text) - hold, c.streamed)
        delta = c.text[c.streamed : end]
        c.streamed = end
        return delta

    def _detokenize(self, c: _Choice, out: EngineOutput) -> list[int]:
        """Detokenize an output of an engine that sends token ids only and apply the stop
        strings (vLLM's detokenizer's rules); returns the token ids kept."""
        ids = list(out.token_ids)
        stop_terminated = out.finished and out.finish_reason == "stop"
        skipped = ids.pop() if ids and stop_terminated and not self._include_stop else None
        if not self._stops:
            c.text += c.detok.push(ids, final=out.finished)
            return ids if skipped is None else [*ids, skipped]
        before = len(c.token_ids)
        offsets = [len(c.text)]  # the text's length after each token (vLLM's token_offsets)
        for i, t in enumerate(ids):
            c.text += c.detok.push([t], final=out.finished and i == len(ids) - 1)
            offsets.append(len(c.text))
        if skipped is not None:
            ids.append(skipped)
            offsets.append(len(c.text))
        if before + len(ids) <= self._min_tokens:
            return ids
        check_from = offsets[max(self._min_tokens - before, 0)]
        hit = check_stop_strings(c.text, len(c.text) - check_from, self._stops, self._include_stop)
        if hit is None:
            return ids
        stop, cut = hit
        stop_end = len(c.text) if cut == -1 else cut
        if not self._include_stop:
            stop_end += len(stop)
        ids = ids[: bisect_left(offsets, stop_end, lo=1)]
        if cut != -1:
            c.text = c.text[:cut]
        c.done, c.finish_reason, c.stop_reason = True, "stop", stop
        return ids

    def _token(self, token_id: int, decoded: str | None) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self._tok.decode([token_id])

    def _add_logprobs(
        self, c: _Choice, ids: list[int], steps: list[list[TopLogprob]] | None
    ) -> None:
        """Render the logprobs of new tokens ``ids`` as vLLM's OpenAI server does."""
        if not self._wants_logprobs:
            return
        for i, token_id in enumerate(ids):
            step = steps[i] if steps is not None and i < len(steps) else None
            sampled = next((e for e in step if e.token_id == token_id), None) if step else None
            if self.chat:
                entry: dict[str, Any]
                if step is None or sampled is None:
                    token = self._token(token_id, None)
                    entry = {
                        "token": token,
                        "logprob": _LOGPROB_FLOOR,
                        "bytes": list(token.encode("utf-8", errors="replace")),
                        "top_logprobs": [],
                    }
                else:
                    k = len(step) if self._all_candidates else max(self._top or 0, 0)
                    entry = {
                        "token": self._token(token_id, sampled.token),
                        "logprob": max(sampled.logprob, _LOGPROB_FLOOR),
                        "bytes": None
                        if sampled.token is None
                        else list(sampled.token.encode("utf-8", errors="replace")),
                        "top_logprobs": [
                            {
                                "token": (tok := self._token(e.token_id, e.token)),
                                "logprob": max(e.logprob, _LOGPROB_FLOOR),
                                "bytes": list(tok.encode("utf-8", errors="replace")),
                            }
                            for e in step[:k]
                        ],
                    }
                c.logprobs.append(entry)
                continue
            if step is None or sampled is None:
                token = self._token(token_id, None)
                c.tokens.append(token)
                c.token_logprobs.append(None)
                c.top_logprobs.append(None)
            else:
                token = self._token(token_id, sampled.token)
                c.tokens.append(token)
                c.token_logprobs.append(max(sampled.logprob, _LOGPROB_FLOOR))
                # OpenAI's completions return the top `logprobs` + 1 (vLLM's rule)
                k = len(step) if self._all_candidates else (self._top or 0) + 1
                c.top_logprobs.append(
                    {
                        self._token(e.token_id, e.token): max(e.logprob, _LOGPROB_FLOOR)
                        for e in step[:k]
                    }
                )
            c.text_offset.append(c.next_offset)
            c.next_offset += len(token)

    # -- rendering ---------------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        completion = self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs_since(self, c: _Choice, start: int) -> dict[str, Any] | None:
        """The choice's logprobs of its tokens from ``start`` on (None: not asked for)."""
        if not self._wants_logprobs:
            return None
        c.logged = len(c.logprobs) if self.chat else len(c.tokens)
        if self.chat:
            return {"content": c.logprobs[start:]}
        return {
            "tokens": c.tokens[start:],
            "token_logprobs": c.token_logprobs[start:],
            "top_logprobs": c.top_logprobs[start:],
            "text_offset": c.text_offset[start:],
        }

    def chunks(self, index: int, out: EngineOutput, instance_id: str) -> list[dict[str, Any]]:
        """The SSE chunks for one engine output of choice ``index``."""
        c = self.choices[index]
        if c.done:
            return []
        delta = self.add(index, out, instance_id)
        reason = c.finish_reason if c.done else None
        if not delta and reason is None and c.sent_role:
            return []  # nothing to show yet: token ids and logprobs go with the next chunk
        body = self._envelope(chunk=True)
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            d: dict[str, Any] = {"content": delta}
            if not c.sent_role:
                d["role"] = "assistant"
                c.sent_role = True
            choice["delta"] = d
        else:
            choice["text"] = delta
        choice["logprobs"] = self._logprobs_since(c, c.logged)
        choice["finish_reason"] = reason
        if reason is not None:
            choice["stop_reason"] = c.stop_reason
        if self._return_ids:
            choice["token_ids"] = c.new_ids
            if not self._sent_prompt_ids:
                body["prompt_token_ids"] = self.prompt_token_ids
                self._sent_prompt_ids = True
        c.new_ids = []
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = self.usage() if self.continuous_usage else None
        return [body]

    def usage_chunk(self) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        body["choices"] = []
        body["usage"] = self.usage()
        return body

    def final(self) -> dict[str, Any]:
        body = self._envelope(chunk=False)
        choices = []
        for c in self.choices:
            choice: dict[str, Any] = {"index": c.index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choice["logprobs"] = self._logprobs_since(c, 0)
            choice["finish_reason"] = c.finish_reason
            choice["stop_reason"] = c.stop_reason
            if self._return_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body["choices"] = choices
        body["usage"] = self.usage()
        if self._return_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body


def _openai_reason(reason: str | None) -> str | None:
    if reason in (None, "stop", "length"):
        return reason
    return "stop" if reason == "abort" else reason
