"""The built-in random models: presets by name, one build per preset, bad names refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.tiny_model import MODEL_PRESETS, build_tiny_model, resolve_model


def test_small_preset_builds_its_own_sizes(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "small", preset="small")
    config = json.loads((path / "config.json").read_text())
    for key, value in MODEL_PRESETS["small"].items():
        assert config[key] == value
    assert (path / "tokenizer.json").is_file()
    assert build_tiny_model(tmp_path / "small", preset="small") == path  # cached


def test_unknown_preset_and_plain_paths() -> None:
    with pytest.raises(ValueError, match="preset must be one of tiny, small"):
        build_tiny_model(preset="huge")
    assert resolve_model("/models/llama") == "/models/llama"
