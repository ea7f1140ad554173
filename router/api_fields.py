"""The parts of the OpenAI request bodies (``router.api``): strict bodies, bounded field types
(token ids, cache salts, request categories, free-form JSON bound for the engine, transfer
parameters only the router sets), and the nested models (stream options, response formats,
structured outputs, chat messages)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM's VLLM_MAX_STOP_STRINGS default (and OpenAI's limit)
MAX_STOP_STRINGS = 4
# prompts in one /v1/completions request (each is ``n`` engine requests of its own)
MAX_PROMPTS = 64

EngineKind = Literal["sim", "vllm"]
# a request category (``kvroute_category``, x-kvroute-category): the CPU-tier policies keep
# state per category, so it is a short name, and an ingress takes a bounded number of them
CATEGORY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$"
# the categories every ingress knows from its start (docs/api.md): a client's new names never
# crowd them out; a new name past the ingress's bound is carried as ``OVERFLOW_CATEGORY``
DOCUMENTED_CATEGORIES = ("text", "search", "image", "file")
OVERFLOW_CATEGORY = "other"
# the engines get a category per type and turn (``text_2``); turns past this share one label
# (``text_64``), so a client's chats of ever more messages cannot grow the policies' state
# (LPC learns per label); the hints' ``turn`` itself stays exact
MAX_CATEGORY_TURN = 64
NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
# vLLM's rule for a cache salt: 1-128 characters, none of '@', '/', '\\', NUL
CacheSalt = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^@/\\\x00]+$")]
# Free-form JSON that goes on to the engine (a structured-output schema) is
# pickled on the way by Ray, and pickle gives up a few hundred levels down: nested deeper than
# this it is a 400 naming the field (a request carrying one 500 levels deep was a 500).
MAX_JSON_DEPTH = 64


def bounded_nesting(value: Any) -> Any:
    """``value`` unchanged, unless its dicts and lists nest deeper than ``MAX_JSON_DEPTH``
    (``ValueError``; the top level is level 1). Only containers are walked: a string (a JSON
    schema given as text) is not read."""
    if not isinstance(value, dict | list):
        return value
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return value


# A free-form JSON object bound for the engine, nested at most ``MAX_JSON_DEPTH`` levels
EngineJson = Annotated[dict[str, Any], AfterValidator(bounded_nesting)]


def _router_only(value: Any) -> Any:
    raise PydanticCustomError(
        "router_only",
        "transfer parameters are set by the router only (its PD legs and admin commands); "
        "a client may not send any",
    )


# ``kv_transfer_params`` as clients may send it: empty. The dict is opaque (its keys change
# between vLLM versions) and every key of it steers a KV connector (do_remote_*: where the
# engine pulls KV from and what it stores it under; "kvroute": the CPU-tier policy), so the
# allowlist is empty: each key is an error located at ``kv_transfer_params.<key>``.
RouterOnlyParams = Annotated[
    dict[str, Annotated[Any, AfterValidator(_router_only)]],
    WithJsonSchema(
        {
            "type": "object",
            "maxProperties": 0,
            "description": "set by the router only: a client may send it empty, no key",
        }
    ),
]
# vLLM's own keys of ``SamplingParams.extra_args`` (``vllm.v1.request.Request``): the KV and
# encoder-cache connectors' parameters, and ``kv_cache_report_mode`` ("full" makes the engine
# re-publish a BlockStored event for every cached block a request reuses: an event storm on the
# cache-map bus). A client's ``vllm_xargs`` may not set them.
RESERVED_XARGS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")


class StrictBody(BaseModel):
    """A request body: unknown fields are errors; NaN and infinities are not numbers (vLLM
    refuses them). ``validation_error`` turns its ``ValidationError`` into the 400."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictBody):
    include_usage: bool | None = False
    # vLLM's extension: every chunk carries the usage so far
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(StrictBody):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: EngineJson | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    """OpenAI's ``response_format``; json_object / json_schema go to vLLM's structured outputs
    (vLLM's ``structural_tag`` type is not supported)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs the 'json_schema' field")
        return self


class StructuredOutputs(StrictBody):
    """vLLM's ``structured_outputs`` (``StructuredOutputsParams``): exactly one constraint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_: str | EngineJson | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: Literal[True] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = Field(default=None, min_length=1)

    def params(self) -> dict[str, Any]:
        """Keyword arguments of vLLM's ``StructuredOutputsParams`` (set fields only)."""
        return self.model_dump(by_alias=True, exclude_unset=True, exclude_none=True)


_TEXT_PARTS: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    },
}


class ChatMessage(StrictBody):
    """One chat message: the fields vLLM passes to the chat template (text content only)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[dict[str, Any]], WithJsonSchema(_TEXT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]] | None) -> Any:
        for part in v if isinstance(v, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
        return v

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content)  # text parts (``_text_only``)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: role and text content, and name,
        tool_calls and tool_call_id where given (the template decides what it renders)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out
