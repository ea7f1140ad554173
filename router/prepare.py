"""A validated OpenAI body made a ``RoutedRequest`` (what the dispatcher sends): checked against
the ingress's limits and the model's context, tokenized once, hashed, with its policy hints."""

from __future__ import annotations

import re
import uuid
from functools import partial
from typing import Any

from fastapi import Request

from cachemap import BlockHasher
from engines.base import EngineRequest, RoutedRequest
from policies.hints import PolicyHints
from router.api import ChatCompletionRequest, CompletionRequest, checked_token_ids
from router.api_errors import APIError
from router.api_fields import (
    CATEGORY_PATTERN,
    DOCUMENTED_CATEGORIES,
    MAX_CATEGORY_TURN,
    OVERFLOW_CATEGORY,
)
from router.hints import conversation_ids, parse_continuation
from router.ingress_config import IngressConfig
from router.keys import tenant_salt
from router.prepare_limits import COUNTED_ROLES, INLINE_CHARS, PrepareLanes, PromptBounds
from router.tokenizer import PromptTokenizer


class RequestPreparer:
    """Turns a validated OpenAI body into a ``RoutedRequest`` (what the dispatcher sends)."""

    def __init__(
        self, config: IngressConfig, tokenizer: PromptTokenizer, prompt_text: bool = True
    ) -> None:
        """``prompt_text``: give each request its prompt as text too (``RoutedRequest.prompt``,
        which only Ray's ``PrefixCacheAffinityRouter`` reads); without it the text is empty."""
        self.config, self.tokenizer, self.prompt_text = config, tokenizer, prompt_text
        self.hasher = BlockHasher(config.model, config.block_size)
        self.bounds = PromptBounds(
            config.max_model_len,
            tokenizer.longest_token_chars(),
            tokenizer.message_tokens(COUNTED_ROLES),
        )
        self.lanes = PrepareLanes()
        # those passed on (``max_categories``): the documented ones from the start
        self.categories: set[str] = {*DOCUMENTED_CATEGORIES, OVERFLOW_CATEGORY}
        self.category_overflow = 0  # requests whose new category was past the bound

    def category(self, request: Request, req: ChatCompletionRequest | CompletionRequest) -> str:
        """The request's type (header, else body, else "text"): a short name. The documented
        ones are always known; a new name is taken while fewer than ``max_categories`` are known
        (each is state in every engine's CPU-tier policy), and past that it is carried as
        ``OVERFLOW_CATEGORY`` (counted in ``category_overflow``), so no client can lock
        another's categories out, and no answer names what other clients sent."""
        config = self.config
        header = request.headers.get(config.category_header)
        kind = header or req.kvroute_category or "text"
        if header and not re.match(CATEGORY_PATTERN, header):
            param = config.category_header
            raise APIError(
                400, f"{param} must match {CATEGORY_PATTERN}, got {header[:64]!r}", param=param
            )
        if kind not in self.categories:
            if len(self.categories) >= config.max_categories:
                self.category_overflow += 1
                return OVERFLOW_CATEGORY
            self.categories.add(kind)
        return kind

    def precheck(self, body: dict[str, Any], chat: bool) -> None:
        """The cheap refusals of a raw body, before it is validated (``PromptBounds``)."""
        self.bounds.check(body, chat)

    async def __call__(
        self,
        request: Request,
        req: ChatCompletionRequest | CompletionRequest,
        prompt: str | list[int] | None = None,
        namespace: str | None = None,
    ) -> tuple[RoutedRequest, str]:
        """``prepared``, with the tokenizer and chat template run off the event loop unless the
        prompt is small (``PrepareLanes``)."""
        self._check_limits(req)
        chars = _prompt_chars(req, prompt)
        work = partial(self.prepared, request, req, prompt, namespace, checked=True)
        if chars <= INLINE_CHARS:
            return work()
        # what reads the request's headers or the category table runs here, on the loop
        category = self.category(request, req)
        return await self.lanes.run(chars, partial(work, category=category))

    def prepared(
        self,
        request: Request,
        req: ChatCompletionRequest | CompletionRequest,
        prompt: str | list[int] | None = None,
        namespace: str | None = None,
        *,
        checked: bool = False,
        category: str | None = None,
    ) -> tuple[RoutedRequest, str]:
        """The engine request and routing record of a validated body (tokenized once, chat
        template for chats; checked against the context, hashed, with its policy hints), and
        the response's id: the body's ``request_id`` prefixed as OpenAI's ids are, or else
        the engine request's (always a random one). ``prompt``: which of a completions body's
        prompts (default: its first). ``namespace``: the client key's cache namespace
        (``router.keys``): the request's KV and session are salted with it."""
        config = self.config
        chat = isinstance(req, ChatCompletionRequest)
        if not checked:
            self._check_limits(req)
        session = request.headers.get(config.session_header) or req.session_id or req.user
        if namespace is not None and session is not None:
            session = f"{namespace}/{session}"
        node = parent = None
        if isinstance(req, ChatCompletionRequest):
            messages = [m.for_template() for m in req.messages]
            ids = self.tokenizer.chat(messages)
            text = "".join(m["content"] for m in messages) if self.prompt_text else ""
            turn = sum(1 for m in req.messages if m.role == "user")
            node, parent = conversation_ids(messages, session)
        else:
            ids, text = self._prompt(req, req.prompts()[0] if prompt is None else prompt)
            turn = 1
        ids = self._truncated(req, ids)
        max_tokens = self._max_tokens(req, len(ids))
        category = f"{category or self.category(request, req)}_{min(turn, MAX_CATEGORY_TURN)}"
        continuation = self._continuation(request, req)
        hints = (
            PolicyHints(category, turn, node, parent, continuation)
            if config.session_hints
            else PolicyHints(category, turn)
        )
        try:
            sampling = req.sampling(max_tokens, self.tokenizer.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + uuid.uuid4().hex
        salt = tenant_salt(namespace, req.cache_salt)
        engine_req = EngineRequest(
            rid,
            ids,
            sampling,
            # a client's kv_transfer_params is empty (``RouterOnlyParams``): the hints alone
            kv_transfer_params=hints.merged_into(None),
            cache_salt=salt,
            # whole at the end unless someone reads it first: the client, or the ingress's
            # stop strings (an engine that detokenizes applies them itself)
            stream=bool(req.stream) or (bool(sampling.stop) and config.engine_kind == "sim"),
        )
        routed = RoutedRequest(
            engine_req,
            text,
            self.hasher(ids, cache_salt=salt),
            session_key=session,
            category=category,
        )
        return routed, prefix + req.request_id if req.request_id else rid

    def _check_limits(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """The 400 of a body that asks for what kvroute refuses, or for more choices or logprobs
        than this ingress serves."""
        config = self.config
        req.refusals(config.engine_kind)
        if req.n > config.max_n:
            raise APIError(400, f"n must be at most {config.max_n}, got {req.n}", param="n")
        top = req.top_candidates()
        if top is not None and top > config.max_logprobs:
            raise APIError(
                400,
                f"at most {config.max_logprobs} logprobs per token, got {top}",
                param="top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs",
            )

    def _prompt(self, req: CompletionRequest, prompt: str | list[int]) -> tuple[list[int], str]:
        """A completions prompt's token ids and its text (a token-id prompt's stand-in text)."""
        if isinstance(prompt, str):
            # vLLM's rule: a completions prompt gets the tokenizer's special tokens unless
            # the request says add_special_tokens: false
            special = req.add_special_tokens is not False
            return self.tokenizer.encode(prompt, special), prompt if self.prompt_text else ""
        ids = checked_token_ids(prompt, self.tokenizer.vocab_size, "prompt")
        return ids, " ".join(map(str, ids[:256])) if self.prompt_text else ""

    def _truncated(
        self, req: ChatCompletionRequest | CompletionRequest, ids: list[int]
    ) -> list[int]:
        """``ids`` cut to the body's ``truncate_prompt_tokens``, if any."""
        keep, context = req.truncate_prompt_tokens, self.config.max_model_len
        if keep is not None:  # vLLM's rule: -1 is the context less one; default side "left"
            if keep > context:
                raise APIError(
                    400,
                    f"truncate_prompt_tokens {keep} exceeds the context length {context}",
                    param="truncate_prompt_tokens",
                )
            keep = context - 1 if keep == -1 else keep
            if keep < len(ids):
                ids = ids[len(ids) - keep :] if req.truncation_side != "right" else ids[:keep]
        return ids

    def _max_tokens(self, req: ChatCompletionRequest | CompletionRequest, prompt: int) -> int:
        """The request's output limit: what it asks for, or the rest of the context; a 400 if
        the ``prompt`` tokens leave no room, or the limit does not fit beside them."""
        context = self.config.max_model_len
        chat = isinstance(req, ChatCompletionRequest)
        if not prompt:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        room = context - prompt
        if room < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {context} tokens; the prompt has {prompt}",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = req.output_limit(default=room)
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens {max_tokens} + prompt {prompt} tokens exceeds the "
                f"context length {context}",
                param="max_completion_tokens"
                if chat and req.max_completion_tokens  # type: ignore[union-attr]
                else "max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _continuation(
        self, request: Request, req: ChatCompletionRequest | CompletionRequest
    ) -> float | None:
        """The client's continuation hint: the body's field, else the header, else None (a
        malformed header is a 400 even where the hint goes unsent)."""
        header = self.config.continuation_header
        try:
            continuation = parse_continuation(request.headers.get(header), header)
        except ValueError as e:
            raise APIError(400, str(e), param=header) from None
        if req.kvroute_continuation is not None:
            continuation = req.kvroute_continuation
        return continuation


def _prompt_chars(
    req: ChatCompletionRequest | CompletionRequest, prompt: str | list[int] | None
) -> int:
    """What tokenizing the prompt costs, in characters (a token id counts as a few)."""
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) + 16 for m in req.messages)
    p = req.prompts()[0] if prompt is None else prompt
    return len(p) if isinstance(p, str) else 4 * len(p)
