"""``benchmarks/dynamo_replay.py``'s kvroute side (Dynamo itself runs in its own venv, which CI
does not build): a synthetic ``--workload`` is written in the layout Dynamo's replay reads,
its engines hold as many KV tokens as the trace's, and kvroute's simulator runs the same
requests."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import load_benchmark


@pytest.fixture(scope="module")
def replay() -> ModuleType:
    return load_benchmark("dynamo_replay")


def test_a_synthetic_workload_is_lined_up_on_16_token_blocks(replay, tmp_path: Path) -> None:
    args = replay.parse_args(["--workload", "mix", "--workload-requests", "120", "--kvroute", ""])
    assert args.block_size == 16 and len(args.synthetic) == 120
    # the same KV tokens per engine as the trace's 859 blocks of 512
    assert args.num_gpu_blocks * 16 == replay.DEFAULT_GPU_BLOCKS * replay.TRACE_BLOCK
    path = tmp_path / "mix.jsonl"
    replay.write_synthetic(args.synthetic, path)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 120
    first, req = lines[0], args.synthetic[0]
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert first["timestamp"] == pytest.approx(req.timestamp_s * 1e3, abs=5e-4)  # to the µs
    assert first["hash_ids"] == list(req.hash_ids)
    assert all(len(x["hash_ids"]) == -(-x["input_length"] // 16) for x in lines)
    ours = replay.kvroute_runs(["round_robin"], args)["round_robin"]["median"]
    assert ours["requests"] == ours["completed"] == 120


def test_a_bad_workload_is_refused(replay, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        replay.parse_args(["--workload", "nope", "--kvroute", ""])
    assert "--workload" in capsys.readouterr().err
