"""OpenAI-shaped client errors: ``APIError`` (rendered as ``{"error": {message, type, param,
code}}``), and the 400 of a request body's ``ValidationError``, located by the client's field
path."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError


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


def unsupported(param: str, why: str = "not supported by this server") -> APIError:
    """The 400 for a parameter kvroute understands but does not honour."""
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def validation_error(e: ValidationError, model: type[BaseModel]) -> APIError:
    """The 400 of ``model``'s ``ValidationError`` ``e``: its first error, located by the client's
    field path (``param``), without pydantic's union-member tags (``stop``, not
    ``stop.list[str]``)."""
    err = e.errors(include_url=False)[0]
    param = ".".join(str(p) for p in field_path(model, err["loc"])) or None
    msg = str(err["msg"])
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def field_path(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` of a ``model`` validation error less its union-member tags. Pydantic puts the tag
    of the member that failed (``str``, ``list[str]``, a model's name ...) after the location of
    a union with several members; walking ``model``'s field types along ``loc`` tells the tags
    from field names, indices and dict keys (a key may look like a tag: ``vllm_xargs.Key``)."""
    path: list[int | str] = []
    tp: Any = model
    for part in loc:
        tp = _bare(tp)
        members = [_bare(m) for m in get_args(tp) if m is not type(None)] if _is_union(tp) else []
        if len(members) == 1:  # ``X | None``: no tag
            tp = members[0]
        elif members:  # ``part`` is the tag of the member that failed
            tp = next((m for m in members if _tag_names(m, part)), Any)
            continue
        path.append(part)
        origin = get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = next(
                (f for name, f in tp.model_fields.items() if part in (name, f.alias)), None
            )
            tp = field.annotation if field is not None else Any
        elif origin is list and get_args(tp):
            tp = get_args(tp)[0]
        elif origin is dict and get_args(tp):
            tp = get_args(tp)[1]
        else:
            tp = Any  # the rest of ``loc`` is inside a value of no known shape: kept whole
    return tuple(path)


def _bare(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, UnionType)


def _tag_names(member: Any, tag: int | str) -> bool:
    """``tag`` is pydantic's tag of union member ``member`` (``list[...]`` of a list ...)."""
    if not isinstance(tag, str):
        return False
    if isinstance(member, type) and issubclass(member, BaseModel):
        return tag == member.__name__
    origin = get_origin(member) or member
    name = getattr(origin, "__name__", None)
    return name is not None and (tag == name or tag.startswith(f"{name}["))
