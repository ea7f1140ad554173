"""The routing suite's workloads (``benchmarks/routing_suite.py``): the suite's names
(``WORKLOADS``), any trace file ``kvroute simulate --trace`` reads named by its path, and a run's
plan of one of them (``make_plan``).

A trace is loaded once per process (and per prefix model seed for a CSV trace, whose prefixes
are drawn), into the cache both ``make_plan`` and the ``--workloads`` check (``parse_workloads``)
read.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import TRACES
from loadgen.synthetic import SYNTH_BLOCK_SIZE, SynthParams, generate_count
from loadgen.traces import PrefixModel, TraceRequest, load_trace
from loadgen.workloads import Planned, build_schedule

WORKLOADS: dict[str, str] = {
    # name: a trace file under TRACES, or a ``loadgen.synthetic`` workload
    "conversation": "mooncake_conversation.jsonl",
    "to-b": "to-b",
    "mix": "mix",
    "agentic": "agentic",
    "rag": "rag",
    "azure-conv": "azure_llm_2023_conv.csv",
}
# a workload that names a file with one of these is a trace (``loadgen.traces.load_trace``)
TRACE_SUFFIXES = (".jsonl", ".csv")
SYNTH_BASE_RATE = SynthParams().rate  # req/s of a synthetic workload at rate scale 1

# loaded traces (and their block size) by (file, prefix model seed)
_traces: dict[tuple[str, int], tuple[list[TraceRequest], int]] = {}


def _trace(path: Path, seed: int) -> tuple[list[TraceRequest], int]:
    """A trace's requests and block size, loaded once per process (a CSV's prefixes drawn with
    ``seed``; a JSONL trace carries its own)."""
    key = (str(path), seed if path.suffix == ".csv" else 0)
    if key not in _traces:
        trace = load_trace(path, prefix_model=PrefixModel(seed=seed))
        _traces[key] = (trace.requests, trace.block_size)
    return _traces[key]


def make_plan(
    workload: str,
    scale: float,
    seed: int,
    requests: int,
    traces: Path = TRACES,
) -> tuple[list[Planned], int]:
    """The first ``requests`` requests of ``workload`` at rate scale ``scale``, seeded:
    ``(plan, block size of its hash ids)``."""
    source = WORKLOADS.get(workload, workload)  # else a trace file's path (``parse_workloads``)
    if source.endswith(TRACE_SUFFIXES):
        reqs, block = _trace(traces / source, seed)
        return build_schedule(reqs, time_scale=1.0 / scale, max_requests=requests), block
    reqs = generate_count(source, requests, SYNTH_BASE_RATE * scale, seed)
    return build_schedule(reqs), SYNTH_BLOCK_SIZE


def parse_workloads(raw: str) -> list[str]:
    """``--workloads``: suite names, or trace files by path (resolved, and loaded here, into
    the cache ``make_plan`` reads, so that a bad file is named before any run)."""
    out = []
    for x in (x.strip() for x in raw.split(",")):
        if not x:
            continue
        if x in WORKLOADS:
            out.append(x)
            continue
        if not x.endswith(TRACE_SUFFIXES):
            valid = ", ".join([*WORKLOADS, "a trace file (.jsonl, .csv)"])
            raise ValueError(f"--workloads: unknown {x}; valid: {valid}")
        path = Path(x).resolve()
        if not path.is_file():
            raise ValueError(f"--workloads: no trace file {x!r}")
        try:
            if not _trace(path, 0)[0]:
                raise ValueError("no requests in it")
        except (OSError, ValueError) as e:
            raise ValueError(f"--workloads: cannot read trace {x!r}: {e}") from None
        out.append(str(path))
    if not out:
        raise ValueError("--workloads: none given")
    return out
