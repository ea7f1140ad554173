"""Where placements are recorded: every placement as one JSON-able entry (``placement_record``)
handed to a ``PlacementRecorder`` (a JSON-lines file in production, memory in tests and
simulations). The entry to read when routing looks wrong."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TextIO

from cachemap import Match
from router.placement import InstanceView, Placement, PlacementRequest

log = logging.getLogger(__name__)


class PlacementRecorder(Protocol):
    """Receives every placement as a ``placement_record`` entry: the record to read when routing
    looks wrong. Called outside the router's lock; must not raise."""

    def record(self, entry: dict[str, Any]) -> None: ...


def placement_record(
    now: float,
    request: PlacementRequest,
    views: Sequence[InstanceView],
    match: Mapping[str, Match],
    placement: Placement,
) -> dict[str, Any]:
    """One placement as a JSON-able dict: the request, every candidate's load view and cached
    blocks, the choice and its estimate."""
    return {
        "ts": now,
        "request": request.request_id,
        "prompt_tokens": request.prompt_tokens,
        "blocks": len(request.block_hashes),
        "chosen": placement.instance_id,
        "estimated_ttft_s": placement.estimated_ttft_s,
        "cached_blocks": placement.cached_blocks,
        "candidates": {
            v.instance_id: {
                "pending_prefill_tokens": v.pending_prefill_tokens,
                "waiting": v.waiting,
                "running": v.running,
                "gpu_kv_usage": round(v.gpu_kv_usage, 4),
                "cached_blocks": match[v.instance_id].total_blocks if v.instance_id in match else 0,
            }
            for v in views
        },
    }


class JsonlRecorder:
    """Appends one ``placement_record`` JSON line per placement to ``path`` (opened on the first
    placement, line-buffered). A write error is logged once; it never fails a request."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        self.errors = 0

    def record(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry) + "\n"
        with self._lock:
            try:
                if self._file is None:
                    self._file = open(self.path, "a", buffering=1)  # noqa: SIM115
                self._file.write(line)
            except OSError as e:
                if not self.errors:
                    log.warning("placement log %s: %s", self.path, e)
                self.errors += 1

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class MemoryRecorder:
    """Keeps every ``placement_record`` entry in ``records`` (tests, simulated runs)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def record(self, entry: dict[str, Any]) -> None:
        self.records.append(entry)
