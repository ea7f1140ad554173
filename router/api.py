"""The OpenAI-compatible request bodies (pydantic) and what the served engines support.

The request models list exactly the fields vLLM's own OpenAI server accepts for chat and text
completions (``vllm.entrypoints.openai.*.protocol``), with the same meanings, plus kvroute's
extensions (``kvroute_category``, ``kvroute_continuation``); any other field is a 400 naming it.
Clients are untrusted (docs/architecture.md, "Trust boundaries"): ``kv_transfer_params`` is
accepted only empty (every key is a 400 naming ``kv_transfer_params.<key>``: the router's PD legs
and admin commands alone set transfer parameters), and ``vllm_xargs`` may not set the
``extra_args`` keys vLLM itself reads (``RESERVED_XARGS``).
Nothing is dropped silently: a field kvroute cannot honour (tools, beam search, prompt
logprobs ...) is accepted only at its default value and is a 400 naming it otherwise, and on sim
engines so is every field whose effect a client could check but a model-free engine cannot
produce (logprobs, structured outputs, logit_bias ...; see ``SIM_UNSUPPORTED``).
The bodies' parts are in ``router.api_fields``, their errors in ``router.api_errors``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, WithJsonSchema, field_validator

from cachemap.hashing import as_u32
from engines.base import SamplingParams
from router.api_errors import APIError, unsupported
from router.api_fields import (
    CATEGORY_PATTERN,
    INT64_MAX,
    INT64_MIN,
    MAX_PROMPTS,
    MAX_STOP_STRINGS,
    RESERVED_XARGS,
    CacheSalt,
    ChatMessage,
    EngineKind,
    NonEmpty,
    ResponseFormat,
    RouterOnlyParams,
    StreamOptions,
    StrictBody,
    StructuredOutputs,
    TokenId,
)

_RENDER_ONLY = "only for vLLM's render endpoints, which this server does not serve"


def _fits_u32(ids: list[int]) -> bool:
    """Every id in ``[0, 2**32)`` (``as_u32``'s C-speed check; ``min`` takes twice as long)."""
    try:
        as_u32(ids)
    except ValueError:
        return False
    return True


def checked_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """A token-id prompt, each id inside the served model's vocabulary (else a 400 naming
    ``param``)."""
    out = list(ids)
    if not out:
        return out
    # NOTE: as_u32's C array converts and range-checks 1k ids in ~8 us, max() over the list
    # takes ~15; an id past 32 bits (as_u32 refuses it) is named by max()
    try:
        top = int(as_u32(out).max())
    except ValueError:
        top = max(out)
    if top >= vocab_size:
        raise APIError(
            400, f"token id {top} is outside the vocabulary (size {vocab_size})", param=param
        )
    return out


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

_TOKEN_IDS: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0},
}


class _Common(StrictBody):
    """The fields chat and text completions share (vLLM's names, types and meanings)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: Annotated[
        str | list[str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "maxItems": MAX_STOP_STRINGS,
                        "items": {"type": "string", "minLength": 1},
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[NonEmpty] | None = None
    logprob_token_ids: list[TokenId] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    stream_interval: int | None = Field(default=None, ge=1)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # the id of the response, prefixed "chatcmpl-" / "cmpl-"; default: the engine request's,
    # which is always a random one
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # vLLM: a stable id of the conversation; kvroute: the session key when no x-session-id
    session_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: CacheSalt | None = None
    # vLLM's field: a KV connector's per-request parameters. Set by the router's own PD legs and
    # admin commands only (docs/architecture.md, "Trust boundaries"): a client may send it empty
    # or null, and every key is a 400 naming it (``kv_transfer_params.<key>``)
    kv_transfer_params: RouterOnlyParams | None = None
    # kvroute extension: request type for the CPU-tier policy (text/search/image/file); also
    # header x-kvroute-category (the header wins). A short name (``CATEGORY_PATTERN``)
    kvroute_category: str | None = Field(default=None, pattern=CATEGORY_PATTERN)
    # kvroute extension: the client's probability that this conversation sends another turn,
    # for the CPU-tier policy (also header x-kvroute-continuation; this field wins)
    kvroute_continuation: float | None = Field(default=None, ge=0, le=1)

    # Accepted by vLLM, not honoured by kvroute: a 400 unless at the default (``refusals``).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    watermarking: bool | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    routed_experts_prompt_start: int = 0

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only with stream=true")
        return v

    # -- what the request asks for ---------------------------------------------------------------

    def output_limit(self, default: int) -> int:
        return self.max_tokens or default

    def top_candidates(self) -> int | None:
        """Candidates per output token besides the sampled one (vLLM's ``logprobs``); None: the
        request wants no logprobs."""
        raise NotImplementedError

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def wants_logprobs(self) -> bool:
        return self.top_candidates() is not None or bool(self.logprob_token_ids)

    def structured(self) -> dict[str, Any] | None:
        """vLLM's ``StructuredOutputsParams`` keyword arguments: ``structured_outputs`` with
        ``response_format`` applied over it (vLLM's rule); None: unconstrained."""
        params = self.structured_outputs.params() if self.structured_outputs else {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            params["json_object"] = True
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            params["json"] = rf.json_schema.json_schema
        if not params:
            return None
        given = [k for k in _CONSTRAINTS if params.get(k) is not None]
        if len(given) != 1:
            raise APIError(
                400,
                "structured outputs need exactly one constraint "
                f"({', '.join(_CONSTRAINTS)}); got {', '.join(given) or 'none'}",
                param="structured_outputs" if self.structured_outputs else "response_format",
            )
        return params

    def refusals(self, engine_kind: EngineKind) -> None:
        """Raise the 400 naming the first field set to something kvroute cannot honour, or (for
        ``engine_kind="sim"``) the sim engine cannot."""
        for name, accepted, why in self.refused_fields():
            if getattr(self, name) not in accepted:
                raise unsupported(name, why)
        if self.n > 1 and self.temperature == 0:
            raise APIError(400, "n must be 1 with greedy sampling (temperature 0)", param="n")
        if self.logprob_token_ids and self.top_candidates() is None:
            raise APIError(400, "logprob_token_ids: needs logprobs", param="logprob_token_ids")
        for key in RESERVED_XARGS:
            if key in (self.vllm_xargs or {}):
                raise APIError(
                    400,
                    f"vllm_xargs.{key}: reserved for the router (vLLM reads it from extra_args)",
                    param=f"vllm_xargs.{key}",
                )
        if engine_kind == "sim":
            for name, why in SIM_UNSUPPORTED.items():
                if self._is_set(name):
                    raise unsupported(name, why)

    @classmethod
    def refused_fields(cls) -> list[tuple[str, tuple[Any, ...], str]]:
        """``(field, the values accepted, why)`` of the fields vLLM accepts and kvroute does not
        honour (the OpenAPI schema documents the accepted values)."""
        return _REFUSED + cls._refused_here()

    def _is_set(self, name: str) -> bool:
        """``name`` asks for something (not its default or an empty value)."""
        value = getattr(self, name)
        if name == "logprobs":
            return self.top_candidates() is not None
        if name == "response_format":
            return value is not None and value.type != "text"
        if name in ("skip_special_tokens", "spaces_between_special_tokens"):
            return value is False
        return value not in (None, [], {})

    @classmethod
    def _refused_here(cls) -> list[tuple[str, tuple[Any, ...], str]]:
        return []

    def sampling(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """The engine's ``SamplingParams`` of this body (vLLM's ``to_sampling_params``: same
        fields, same meanings), ``max_tokens`` already resolved against the context. Token ids
        are checked against the vocabulary (vLLM refuses ids outside it)."""
        for param, ids in (
            ("stop_token_ids", self.stop_token_ids or []),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logprob_token_ids", self.logprob_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                    param=param,
                )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise APIError(400, "allowed_token_ids must not be empty", param="allowed_token_ids")
        bias: dict[int, float] | None = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise APIError(
                        400, f"logit_bias key {key!r} is not a token id", param="logit_bias"
                    ) from None
                if not 0 <= token < vocab_size:
                    raise APIError(
                        400,
                        f"logit_bias token id {token} is outside the vocabulary "
                        f"(size {vocab_size})",
                        param="logit_bias",
                    )
                bias[token] = min(100.0, max(-100.0, value))  # vLLM clamps
        if self.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens {self.min_tokens} exceeds max_tokens {max_tokens}",
                param="min_tokens",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=self.stops(),
            stop_token_ids=list(dict.fromkeys(self.stop_token_ids or [])),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=None if self.logprob_token_ids else self.top_candidates(),
            logprob_token_ids=list(self.logprob_token_ids) if self.logprob_token_ids else None,
            logit_bias=bias,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids else None,
            bad_words=list(dict.fromkeys(self.bad_words or [])),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self.structured(),
            stream_interval=self.stream_interval,
            extra_args=dict(self.vllm_xargs) if self.vllm_xargs else None,
        )


# (field, the values accepted, why) for fields vLLM accepts and kvroute does not honour
_REFUSED: list[tuple[str, tuple[Any, ...], str]] = [
    ("use_beam_search", (False,), "beam search is not supported by this server"),
    ("length_penalty", (1.0,), "applies to beam search only, which this server does not support"),
    ("watermarking", (None, False), "not supported by this server"),
    ("prompt_logprobs", (None,), "not supported by this server"),
    ("priority", (0,), "the engines do not schedule by priority"),
    ("thinking_token_budget", (None, -1), "no reasoning parser is configured"),
    ("repetition_detection", (None,), "not supported by this server"),
    ("ec_transfer_params", (None,), "no encoder-cache transfer is configured"),
    ("return_token_offsets", (None, False), _RENDER_ONLY),
    ("mm_payload", ("tensors",), _RENDER_ONLY),
    ("return_mm_kwargs", (None,), _RENDER_ONLY),
    ("routed_experts_prompt_start", (0,), "routed-expert data is not returned by this server"),
]

# What a model-free sim engine cannot produce, though vLLM can (a 400 on sim deployments): it
# has no token distribution (logprobs, biases, constraints) and no detokenizer of its own (the
# ingress detokenizes with special tokens skipped).
SIM_UNSUPPORTED: dict[str, str] = {
    "logprobs": "the sim engine has no token distribution to report",
    "logprob_token_ids": "the sim engine has no token distribution to report",
    "logit_bias": "the sim engine has no token distribution to bias",
    "allowed_token_ids": "the sim engine's tokens cannot be constrained",
    "bad_words": "the sim engine's tokens cannot be constrained",
    "response_format": "the sim engine's tokens cannot be constrained (structured outputs)",
    "structured_outputs": "the sim engine's tokens cannot be constrained",
    "vllm_xargs": "the sim engine runs no vLLM extensions",
    "stream_interval": "not supported by the sim engine",
    "skip_special_tokens": "the sim engine's text always skips special tokens",
    "spaces_between_special_tokens": "the sim engine's text always skips special tokens",
}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True  # no effect without tools (as in vLLM)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs=true")
        return v

    def output_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def top_candidates(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @classmethod
    def _refused_here(cls) -> list[tuple[str, tuple[Any, ...], str]]:
        tools = "tool calling is not supported by this server"
        return [
            ("tools", (None,), tools),
            ("tool_choice", (None, "none"), tools),
            ("reasoning_effort", (None,), "no reasoning parser or template options are configured"),
            ("include_reasoning", (True,), "no reasoning parser is configured"),
            ("echo", (False,), "not supported by this server"),
            ("add_generation_prompt", (True,), "the ingress always adds the generation prompt"),
            ("continue_final_message", (False,), "not supported by this server"),
            ("add_special_tokens", (None, False), "the chat template alone adds special tokens"),
            ("documents", (None,), "not supported by this server"),
            ("chat_template", (None,), "request chat templates are not trusted by this server"),
            ("chat_template_kwargs", (None, {}), "not supported by this server"),
            ("media_io_kwargs", (None, {}), "only text content is supported"),
            ("mm_processor_kwargs", (None, {}), "only text content is supported"),
            ("return_prompt_text", (None, False), "not supported by this server"),
        ]


class CompletionRequest(_Common):
    # a prompt (text or token ids) or, as vLLM takes them, a list of prompts (texts, or token-id
    # lists): each prompt gets its own ``n`` choices, indexed ``prompt * n + choice``
    prompt: Annotated[
        str | list[int] | list[str] | list[list[int]],
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    _TOKEN_IDS,
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_PROMPTS,
                        "items": {"type": "string", "minLength": 1},
                    },
                    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": _TOKEN_IDS},
                ]
            }
        ),
    ]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0)
    suffix: str | None = None
    prompt_embeds: bytes | list[bytes] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        batch = v if isinstance(v, list) and v and isinstance(v[0], str | list) else [v]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        for p in batch:
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p, list) and not _fits_u32(p) and min(p) < 0:
                raise ValueError("token ids must be non-negative")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the list it gives (vLLM's batch of prompts)."""
        v = self.prompt
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            return list(v)
        return [v]  # type: ignore[list-item]

    def top_candidates(self) -> int | None:
        return self.logprobs

    @classmethod
    def _refused_here(cls) -> list[tuple[str, tuple[Any, ...], str]]:
        return [
            ("echo", (None, False), "not supported by this server"),
            ("suffix", (None,), "not supported by this server"),
            ("prompt_embeds", (None,), "only text or token-id prompts are supported"),
        ]
