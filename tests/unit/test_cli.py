"""The ``kvroute`` command line itself: its version, and ``serve`` refusing a model path that is
not there before it starts Ray (seconds, one line) rather than after (minutes of replica
tracebacks)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import cli

REPO = Path(__file__).resolve().parents[2]


def test_version_names_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvroute {importlib.metadata.version('kvroute')}"


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--engine", "vllm", "--model", "/nonexistent/model"],
        ["serve", "--model", "./no-such-dir"],
    ],
)
def test_serve_refuses_a_missing_model_path_before_starting_anything(argv: list[str]) -> None:
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "deploy.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("kvroute: ") or "error" in ln]
    assert len(lines) == 1 and "--model" in lines[0] and "not a directory" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "ray" not in r.stdout.lower()
    print(f"refused in {time.monotonic() - t0:.1f} s")


def test_serve_takes_presets_and_hub_ids_as_they_are(tmp_path: Path) -> None:
    from deploy.commands.serve import build_config, check_local_models

    parser = cli.build_parser()
    for model in ("tiny", "small", "meta-llama/Llama-3.1-8B-Instruct", str(tmp_path)):
        check_local_models(build_config(parser.parse_args(["serve", "--model", model])))
