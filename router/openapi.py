"""The OpenAPI document's parts that FastAPI cannot infer: the request bodies of endpoints that
read their body themselves, the OpenAI-shaped error responses, the completion responses, and
the bearer scheme."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def json_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``openapi_extra`` of an endpoint that reads its body itself (bounded,
    4xx-shaped): the model's JSON schema as the request body, with pydantic's ``$defs`` inlined
    (OpenAPI resolves a ``$ref`` from the document's root)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    refused = getattr(model, "refused_fields", None)
    for name, accepted, why in refused() if refused is not None else ():
        schema["properties"][name] = {"enum": list(accepted), "description": why}

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        },
    },
}


def error_responses(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses: each status of ``described`` with its description and the
    OpenAI-shaped error body."""
    error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    return {status: {"description": why, **error} for status, why in described.items()}


# the errors of every endpoint that reads a JSON body (``router.http_checks.read_json_body``)
BODY_ERRORS = {
    400: "Malformed body, or a field not valid",
    413: "Body over the limit",
    415: "Content type not application/json",
}
# the errors of an endpoint behind the admin key
ADMIN_ERRORS = {
    401: "Missing or invalid admin key",
    403: "Off: no admin key is configured",
}


def openapi_responses(chat: bool) -> dict[int | str, dict[str, Any]]:
    """The documented responses of a completion endpoint: the body (or an SSE stream with
    ``stream: true``) and the OpenAI-shaped errors."""
    choice: dict[str, Any] = {
        "type": "object",
        "required": ["index", "finish_reason", "logprobs"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "finish_reason": {"type": ["string", "null"]},
            "logprobs": {"type": ["object", "null"]},
            "stop_reason": {"type": ["integer", "string", "null"]},
            **(
                {
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                        },
                    }
                }
                if chat
                else {"text": {"type": "string"}}
            ),
        },
    }
    body = {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion" if chat else "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE_SCHEMA,
        },
    }
    error = {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    return {
        200: {
            "description": "The completion; with stream: true, server-sent events of chunks",
            "content": {
                "application/json": {"schema": body},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        },
        400: {"description": "Malformed body, field, or a parameter not supported", **error},
        401: {"description": "Missing or invalid API key", **error},
        404: {"description": "Unknown model", **error},
        413: {"description": "Body over the limit", **error},
        415: {"description": "Content type not application/json", **error},
        429: {"description": "Overloaded (admission); see Retry-After", **error},
        500: {"description": "Internal error", **error},
        503: {"description": "No engine could serve the request; see Retry-After", **error},
    }


def with_bearer_scheme(
    doc: dict[str, Any], api_keys: bool, metrics_admin: bool, metrics_keyed: bool = False
) -> dict[str, Any]:
    """``doc`` (FastAPI's document, changed in place) with the bearer scheme declared (always)
    and required by the operations that check a key: /v1/* with ``api_keys`` configured, the KV
    control API (the admin key), /metrics when it is the admins' (``metrics_admin``) or needs
    a client's key (``metrics_keyed``)."""
    doc.setdefault("components", {})["securitySchemes"] = {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "an API key (/v1/*), or an admin key (/v1/kv/*)",
        }
    }
    for path, ops in doc["paths"].items():
        admin = path.startswith("/v1/kv/") or (path == "/metrics" and metrics_admin)
        keyed = (path.startswith("/v1/") and api_keys) or (path == "/metrics" and metrics_keyed)
        if admin or keyed:
            for op in ops.values():
                op["security"] = [{"bearer": []}]
    return doc
