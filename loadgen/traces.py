"""Production trace loaders: Mooncake (FAST'25) and Alibaba Qwen-Bailian (ATC'25) JSONL formats.

Both are one JSON object per line with ``timestamp``, ``input_length``, ``output_length`` and
``hash_ids`` (remapped prefix block ids; equal leading ids = shared prefix). They differ in units
and extras:

- Mooncake: ``timestamp`` in milliseconds, 512-token blocks.
- Bailian: ``timestamp`` in seconds, 16-token blocks, plus ``chat_id``, ``parent_chat_id``
  (-1 for a first turn), ``type`` (text/search/image/file) and ``turn``.

Every line is validated (types, ``len(hash_ids) == ceil(input_length / block_size)``,
non-decreasing time); a bad line raises ``TraceFormatError`` naming file, line and field, or is
counted and skipped with ``skip_invalid=True``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

TraceFormat = Literal["mooncake", "bailian"]
FORMATS: dict[str, tuple[float, int]] = {
    # name: (seconds per timestamp unit, tokens per hash id)
    "mooncake": (1e-3, 512),
    "bailian": (1.0, 16),
}
_BAILIAN_KEYS = frozenset({"chat_id", "parent_chat_id", "type", "turn"})


class TraceFormatError(ValueError):
    """A trace line that does not parse; names the file, 1-based line and field."""

    def __init__(self, path: str | Path, line: int, field: str, message: str) -> None:
        self.path, self.line, self.field = str(path), line, field
        super().__init__(f"{path}:{line}: field {field!r}: {message}")


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace, in normalised units (seconds, tokens)."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chat_id: int | None = None
    parent_chat_id: int | None = None
    type: str | None = None
    turn: int | None = None

    @property
    def category(self) -> str:
        """Request category for workload-aware policies: ``type_turn`` (e.g. ``text_2``)."""
        if self.type is None:
            return "all"
        return f"{self.type}_{self.turn if self.turn is not None else 1}"


@dataclass(slots=True)
class Trace:
    path: str
    format: TraceFormat
    block_size: int
    requests: list[TraceRequest] = field(default_factory=list)
    skipped: int = 0

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].timestamp_s - self.requests[0].timestamp_s


def detect_format(record: dict[str, Any]) -> TraceFormat:
    """Bailian lines carry session fields; anything else is read as Mooncake."""
    return "bailian" if _BAILIAN_KEYS & record.keys() else "mooncake"


def _int_field(rec: dict[str, Any], name: str, path: Path, lineno: int, minimum: int = 0) -> int:
    if name not in rec:
        raise TraceFormatError(path, lineno, name, "missing")
    v = rec[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceFormatError(path, lineno, name, f"expected an integer, got {v!r}")
    if v < minimum:
        raise TraceFormatError(path, lineno, name, f"must be >= {minimum}, got {v}")
    return v


def _parse(
    rec: Any, fmt: TraceFormat, path: Path, lineno: int, block_size: int, prev_ts: float
) -> TraceRequest:
    if not isinstance(rec, dict):
        raise TraceFormatError(path, lineno, "<line>", "expected a JSON object")
    unit_s, _ = FORMATS[fmt]
    if "timestamp" not in rec:
        raise TraceFormatError(path, lineno, "timestamp", "missing")
    ts = rec["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise TraceFormatError(path, lineno, "timestamp", f"expected a number, got {ts!r}")
    if ts < 0:
        raise TraceFormatError(path, lineno, "timestamp", f"must be >= 0, got {ts}")
    timestamp_s = ts * unit_s
    if timestamp_s < prev_ts:
        raise TraceFormatError(
            path, lineno, "timestamp", f"goes back in time ({ts} after {prev_ts / unit_s:g})"
        )
    input_length = _int_field(rec, "input_length", path, lineno, minimum=1)
    output_length = _int_field(rec, "output_length", path, lineno)
    hash_ids = rec.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceFormatError(path, lineno, "hash_ids", "expected a list of non-negative ints")
    want = math.ceil(input_length / block_size)
    if len(hash_ids) != want:
        raise TraceFormatError(
            path,
            lineno,
            "hash_ids",
            f"has {len(hash_ids)} ids, expected ceil({input_length} / {block_size}) = {want}",
        )
    if fmt == "mooncake":
        return TraceRequest(timestamp_s, input_length, output_length, tuple(hash_ids))
    chat_id = _int_field(rec, "chat_id", path, lineno)
    parent = rec.get("parent_chat_id", -1)
    if isinstance(parent, bool) or not isinstance(parent, int):
        raise TraceFormatError(path, lineno, "parent_chat_id", f"expected an int, got {parent!r}")
    rtype = rec.get("type", "text")
    if not isinstance(rtype, str) or not rtype:
        raise TraceFormatError(path, lineno, "type", f"expected a string, got {rtype!r}")
    turn = _int_field(rec, "turn", path, lineno, minimum=1) if "turn" in rec else 1
    return TraceRequest(
        timestamp_s,
        input_length,
        output_length,
        tuple(hash_ids),
        chat_id=chat_id,
        parent_chat_id=None if parent < 0 else parent,
        type=rtype,
        turn=turn,
    )


def iter_trace(
    path: str | Path, fmt: str = "auto", skip_invalid: bool = False
) -> Iterator[tuple[TraceFormat, TraceRequest | None]]:
    """Yield ``(format, request)`` per line; ``request`` is None for a skipped invalid line."""
    path = Path(path)
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"format must be one of auto, {', '.join(FORMATS)}; got {fmt!r}")
    resolved: TraceFormat | None = None if fmt == "auto" else fmt  # type: ignore[assignment]
    prev_ts = 0.0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    rec = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise TraceFormatError(path, lineno, "<line>", f"invalid JSON: {e}") from None
                if resolved is None:
                    if not isinstance(rec, dict):
                        raise TraceFormatError(path, lineno, "<line>", "expected a JSON object")
                    resolved = detect_format(rec)
                req = _parse(rec, resolved, path, lineno, FORMATS[resolved][1], prev_ts)
            except TraceFormatError:
                if not skip_invalid:
                    raise
                yield (resolved or "mooncake"), None
                continue
            prev_ts = req.timestamp_s
            yield resolved, req


def load_trace(path: str | Path, fmt: str = "auto", skip_invalid: bool = False) -> Trace:
    """Read a whole trace into memory (the shared Mooncake trace is 12k lines, ~5 MB)."""
    requests: list[TraceRequest] = []
    skipped = 0
    resolved: TraceFormat = "mooncake" if fmt == "auto" else fmt  # type: ignore[assignment]
    for resolved, req in iter_trace(path, fmt, skip_invalid):  # noqa: B007
        if req is None:
            skipped += 1
        else:
            requests.append(req)
    return Trace(str(path), resolved, FORMATS[resolved][1], requests, skipped)
