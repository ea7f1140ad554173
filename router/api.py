"""OpenAI-compatible request bodies (pydantic) and OpenAI-shaped errors.

Only what kvroute serves is modelled strictly; unknown fields are accepted and ignored, as
OpenAI-compatible servers commonly do, so clients sending newer fields keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class APIError(Exception):
    """A client-visible error: rendered as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)
    cache_salt: str | None = None
    # kvroute extension: request type for the CPU-tier policy (text/search/image/file).
    kvroute_category: str | None = None
    # kvroute extension: the client's probability that this conversation sends another turn,
    # for the CPU-tier policy (also header x-kvroute-continuation; this field wins)
    kvroute_continuation: float | None = Field(default=None, ge=0, le=1)
    # vLLM's field: a KV connector's per-request parameters, passed on to the engine unchanged
    # (kvroute's policy hints are merged in under "kvroute")
    kv_transfer_params: dict[str, Any] | None = None

    def output_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)

    @model_validator(mode="after")
    def _text_only(self) -> ChatCompletionRequest:
        for m in self.messages:
            m.text()
        return self


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and min(v) < 0:  # type: ignore[type-var]
            raise ValueError("token ids must be non-negative")
        return v  # type: ignore[no-any-return]
