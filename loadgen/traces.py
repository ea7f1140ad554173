"""Production trace loaders: Mooncake (FAST'25) and Alibaba Qwen-Bailian (ATC'25) JSONL formats,
and the Azure LLM inference 2023 and BurstGPT CSV formats.

Both are one JSON object per line with ``timestamp``, ``input_length``, ``output_length`` and
``hash_ids`` (remapped prefix block ids; equal leading ids = shared prefix). They differ in units
and extras:

- Mooncake: ``timestamp`` in milliseconds, 512-token blocks.
- Bailian: ``timestamp`` in seconds, 16-token blocks, plus ``chat_id``, ``parent_chat_id``
  (-1 for a first turn), ``type`` (text/search/image/file) and ``turn``.

Every line is validated (types, ``len(hash_ids) == ceil(input_length / block_size)``,
non-decreasing time); a bad line raises ``TraceFormatError`` naming file, line and field, or is
counted and skipped with ``skip_invalid=True``.

The CSV formats (a header line names the columns; extra columns are ignored):

- Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA'24): ``TIMESTAMP`` (wall-clock,
  ``2023-11-16 18:15:46.6805900``), ``ContextTokens``, ``GeneratedTokens``.
- BurstGPT (Wang et al., 2024): ``Timestamp`` (seconds from the trace's start), ``Model``,
  ``Request tokens``, ``Response tokens``, ``Total tokens``, ``Log Type`` (``Conversation log``
  or ``API log``).

They carry arrival times and token counts but no prefixes. Both are kept as they are (times
relative to the first row); the prefixes are a *model*, drawn by ``PrefixModel`` with a seeded
generator from the Bailian statistics behind the synthetic workloads (``loadgen.synthetic``), in
16-token blocks, and come out Bailian-shaped (``chat_id``, ``parent_chat_id``, ``turn``).
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

TraceFormat = Literal["mooncake", "bailian", "azure", "burstgpt"]
FORMATS: dict[str, tuple[float, int]] = {
    # name: (seconds per timestamp unit, tokens per hash id)
    "mooncake": (1e-3, 512),
    "bailian": (1.0, 16),
    # CSV traces without prefixes: the block size of the ids ``PrefixModel`` gives them
    "azure": (1.0, 16),
    "burstgpt": (1.0, 16),
}
# the columns each CSV format needs: (timestamp, input tokens, output tokens[, log type])
CSV_COLUMNS: dict[str, tuple[str, ...]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens", "Log Type"),
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


@dataclass(frozen=True, slots=True)
class PrefixModel:
    """The prefix structure given to a trace that has none (the CSV formats), seeded.

    Requests are taken in time order. Each one, with probability ``continue_fraction``,
    continues an earlier conversation: a gap is drawn from an exponential of mean
    ``think_time_s``, and of the conversations whose latest turn (prompt plus reply) is shorter
    than this request's prompt, the one whose latest turn arrived nearest to ``now - gap`` is
    taken (the nearest of up to ``candidates`` looked at on either side of that time). The
    request then re-sends that turn's prompt: it shares the prompt's full blocks, and its
    other blocks (the reply and the new message) are new. A request that does not continue one
    (by the draw, or because none fits) starts a conversation: it begins with one of
    ``system_prompts`` system prompts, drawn by Zipf popularity (exponent ``zipf_s``; each
    prompt's length log-normal, median ``system_prompt_tokens``, sigma 0.5, cut to the
    request's prompt), then new blocks. Later turns carry their first turn's system prompt
    inside the prompt they re-send. An ``API log`` line of BurstGPT always starts afresh, and
    no later line continues it.

    The defaults are the synthetic workloads' (``SynthParams``; ``from_synth`` derives them):
    to-C for conversations (``turns_mean`` 3, so 1 - 1/3 of requests continue one; 80% of
    reuses within 10 minutes, a mean gap of 600/ln 5 = 373 s), to-B for system prompts (20
    programs, Zipf 1.1, median 600 tokens), after "KVCache Cache in the Wild" (ATC'25). The
    share that continues comes out lower than ``continue_fraction`` where few earlier turns
    are shorter than the prompt (the Azure conversation trace: 41% against 67%)."""

    continue_fraction: float = 1.0 - 1.0 / 3.0
    think_time_s: float = 600.0 / math.log(5.0)
    system_prompts: int = 20
    zipf_s: float = 1.1
    system_prompt_tokens: int = 600
    seed: int = 0
    candidates: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.continue_fraction <= 1:
            raise ValueError(f"continue_fraction must be in [0, 1], got {self.continue_fraction}")
        if self.think_time_s < 0 or self.zipf_s < 0:
            raise ValueError("think_time_s and zipf_s must be >= 0")
        if min(self.system_prompts, self.system_prompt_tokens, self.candidates) < 1:
            raise ValueError("system_prompts, system_prompt_tokens and candidates must be >= 1")

    @classmethod
    def from_synth(cls, p: Any, seed: int | None = None) -> PrefixModel:
        """The model a ``loadgen.synthetic.SynthParams`` describes (its to-C and to-B)."""
        return cls(
            continue_fraction=1.0 - 1.0 / p.turns_mean,
            think_time_s=p.think_time_s,
            system_prompts=p.programs,
            zipf_s=p.zipf_s,
            system_prompt_tokens=p.system_prompt_tokens,
            seed=p.seed if seed is None else seed,
        )


class _Prefixer:
    """``PrefixModel`` applied to one trace, one request at a time (see there)."""

    def __init__(self, model: PrefixModel, block_size: int) -> None:
        self.m, self.bs = model, block_size
        self.rng = np.random.default_rng(model.seed)
        self.next_hash = self.next_chat = 0
        self.sys_len = [
            int(max(1, round(model.system_prompt_tokens * math.exp(0.5 * z))))
            for z in self.rng.standard_normal(model.system_prompts)
        ]
        self.sys_blocks = [self._fresh(n // block_size) for n in self.sys_len]
        w = 1.0 / np.arange(1, model.system_prompts + 1) ** model.zipf_s
        self.cdf = np.cumsum(w / w.sum())
        # conversations: [latest turn's arrival, tokens of prompt + reply, shared blocks,
        # chat id, turn]; ``times``/``entries`` list each update in time order, stale ones
        # (the conversation moved on) skipped by their version
        self.convs: list[list[Any]] = []
        self.times: list[float] = []
        self.entries: list[tuple[int, int]] = []  # (conversation, version)
        self.version: list[int] = []

    def _fresh(self, n: int) -> list[int]:
        out = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        return out

    def _pick(self, target: float, length: int) -> int | None:
        i = bisect.bisect_right(self.times, target)
        lo, hi, looked, scanned = i - 1, i, 0, 0
        while (
            looked < self.m.candidates
            and scanned < 8 * self.m.candidates  # stale entries too, past many continuations
            and (lo >= 0 or hi < len(self.times))
        ):
            scanned += 1
            # the nearer of the two sides first
            left = lo >= 0 and (
                hi >= len(self.times) or target - self.times[lo] <= self.times[hi] - target
            )
            j = lo if left else hi
            if left:
                lo -= 1
            else:
                hi += 1
            conv, ver = self.entries[j]
            if self.version[conv] != ver:
                continue
            looked += 1
            if self.convs[conv][1] < length:
                return conv
        return None

    def __call__(
        self, ts: float, length: int, output: int, may_continue: bool, rtype: str
    ) -> TraceRequest:
        bs, m = self.bs, self.m
        n_blocks = math.ceil(length / bs)
        conv: int | None = None
        if may_continue and self.rng.random() < m.continue_fraction:
            conv = self._pick(ts - self.rng.exponential(m.think_time_s), length)
        chat, self.next_chat = self.next_chat, self.next_chat + 1
        if conv is not None:
            _, _, shared, parent, turn = self.convs[conv]
            parent_id: int | None = parent
            turn += 1
        else:
            prog = int(np.searchsorted(self.cdf, self.rng.random(), side="right"))
            shared = self.sys_blocks[min(prog, len(self.sys_blocks) - 1)][: length // bs]
            parent_id, turn = None, 1
            if may_continue:  # API lines start no conversation another line continues
                conv = len(self.convs)
                self.convs.append([])
                self.version.append(-1)
        hash_ids = [*shared, *self._fresh(n_blocks - len(shared))]
        req = TraceRequest(ts, length, output, tuple(hash_ids), chat, parent_id, rtype, turn)
        if conv is not None:
            self.convs[conv] = [ts, length + output, hash_ids[: length // bs], chat, turn]
            self.version[conv] += 1
            self.times.append(ts)
            self.entries.append((conv, self.version[conv]))
        return req


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


def _csv_format(header: list[str], path: Path, lineno: int, fmt: str) -> TraceFormat:
    names = set(header)
    if fmt != "auto":
        missing = [c for c in CSV_COLUMNS[fmt] if c not in names]
        if missing:
            raise TraceFormatError(path, lineno, missing[0], f"missing from the {fmt} CSV header")
        return fmt  # type: ignore[return-value]
    for name, cols in CSV_COLUMNS.items():
        if all(c in names for c in cols):
            return name  # type: ignore[return-value]
    raise TraceFormatError(
        path,
        lineno,
        "<header>",
        "neither a JSON object nor a known CSV header (azure: "
        f"{','.join(CSV_COLUMNS['azure'])}; burstgpt: {','.join(CSV_COLUMNS['burstgpt'])})",
    )


def _is_csv_header(line: bytes) -> bool:
    """A first line with commas that does not open a JSON value: a CSV header."""
    text = line.decode("utf-8-sig", "replace").strip()
    return "," in text and not text.startswith(("{", "["))


def _parse_wallclock(raw: str) -> tuple[int, float]:
    """``2023-11-16 18:15:46.6805900`` (any number of fractional digits, read as UTC) as whole
    POSIX seconds and the fraction apart (a float of the sum would keep only ~0.2 us)."""
    whole, _, frac = raw.strip().partition(".")
    if frac and not frac.isdigit():
        raise ValueError(raw)
    t = int(datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp())
    return t, (float("0." + frac) if frac else 0.0)


def _csv_int(row: dict[str, str], name: str, path: Path, lineno: int, minimum: int) -> int:
    raw = row.get(name)
    try:
        v = int((raw or "").strip())
    except ValueError:
        raise TraceFormatError(path, lineno, name, f"expected an integer, got {raw!r}") from None
    if v < minimum:
        raise TraceFormatError(path, lineno, name, f"must be >= {minimum}, got {v}")
    return v


def _iter_csv(
    f: IO[bytes],
    path: Path,
    fmt: str,
    header_line: bytes,
    header_no: int,
    skip_invalid: bool,
    model: PrefixModel,
) -> Iterator[tuple[TraceFormat, TraceRequest | None]]:
    header = [c.strip() for c in next(csv.reader([header_line.decode("utf-8-sig")]))]
    resolved = _csv_format(header, path, header_no, fmt)
    ts_col, in_col, out_col, *rest = CSV_COLUMNS[resolved]
    prefixer = _Prefixer(model, FORMATS[resolved][1])
    t0: tuple[int, float] | None = None
    prev = 0.0
    for lineno, raw in enumerate(f, start=header_no + 1):
        if not raw.strip():
            continue
        try:
            cells = next(csv.reader([raw.decode("utf-8", "replace")]))
            if len(cells) < len(header):
                raise TraceFormatError(
                    path, lineno, "<line>", f"has {len(cells)} columns, the header {len(header)}"
                )
            row = dict(zip(header, (c.strip() for c in cells), strict=False))
            try:
                t = (
                    _parse_wallclock(row[ts_col])
                    if resolved == "azure"
                    else (0, float(row[ts_col]))
                )
            except ValueError:
                raise TraceFormatError(
                    path, lineno, ts_col, f"expected a time, got {row[ts_col]!r}"
                ) from None
            if not math.isfinite(t[1]) or t[1] < 0:
                raise TraceFormatError(path, lineno, ts_col, f"must be a time >= 0, got {t[1]}")
            if t0 is None:
                t0 = t if resolved == "azure" else (0, 0.0)
            ts = (t[0] - t0[0]) + (t[1] - t0[1])
            if ts < prev:
                raise TraceFormatError(path, lineno, ts_col, "goes back in time")
            length = _csv_int(row, in_col, path, lineno, 1)
            output = _csv_int(row, out_col, path, lineno, 0)
            api = bool(rest) and row[rest[0]].lower().startswith("api")
        except TraceFormatError:
            if not skip_invalid:
                raise
            yield resolved, None
            continue
        prev = ts
        yield resolved, prefixer(ts, length, output, not api, "api" if api else "text")


def iter_trace(
    path: str | Path,
    fmt: str = "auto",
    skip_invalid: bool = False,
    prefix_model: PrefixModel | None = None,
) -> Iterator[tuple[TraceFormat, TraceRequest | None]]:
    """Yield ``(format, request)`` per line; ``request`` is None for a skipped invalid line.
    A CSV trace (a first line that is not a JSON object) gets its prefixes from
    ``prefix_model`` (default ``PrefixModel()``)."""
    path = Path(path)
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"format must be one of auto, {', '.join(FORMATS)}; got {fmt!r}")
    resolved: TraceFormat | None = None if fmt == "auto" else fmt  # type: ignore[assignment]
    prev_ts = 0.0
    first = True
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            # the first line decides: a CSV header, or JSON lines
            if first and (fmt in CSV_COLUMNS or (fmt == "auto" and _is_csv_header(raw))):
                model = prefix_model or PrefixModel()
                yield from _iter_csv(f, path, fmt, raw, lineno, skip_invalid, model)
                return
            first = False
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


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    skip_invalid: bool = False,
    prefix_model: PrefixModel | None = None,
) -> Trace:
    """Read a whole trace into memory (the shared Mooncake trace is 12k lines, ~5 MB)."""
    requests: list[TraceRequest] = []
    skipped = 0
    resolved: TraceFormat = "mooncake" if fmt == "auto" else fmt  # type: ignore[assignment]
    for resolved, req in iter_trace(path, fmt, skip_invalid, prefix_model):  # noqa: B007
        if req is None:
            skipped += 1
        else:
            requests.append(req)
    return Trace(str(path), resolved, FORMATS[resolved][1], requests, skipped)
