"""Every shipped serve YAML validates; bad settings name their field."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.config import ServeConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("serve-*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    cfg = ServeConfig.from_yaml(path)
    assert cfg.engines.instances >= 1


def test_defaults_are_two_sim_engines_on_localhost() -> None:
    cfg = ServeConfig()
    assert (cfg.host, cfg.port, cfg.engines.instances) == ("127.0.0.1", 8000, 2)
    assert cfg.engines.engine.kind == "sim" and cfg.router.scorer == "kv_ttft"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"port": 0}, "port"),
        ({"router": {"scorer": "nope"}}, "router.scorer"),
        ({"engines": {"instances": 0}}, "engines.instances"),
        ({"engines": {"engine": {"kind": "vllm", "block_size": 16}}}, "engines.engine"),
        ({"surprise": 1}, "surprise"),
        ({"router": {"scorer_options": {"nope": 1}}}, "scorer_options"),
        ({"router": {"scorer_options": {"kv_veto": 2}}}, "scorer_options"),
        ({"engines": {"engine": {"kind": "vllm", "cpu_bind": ["0", "x"]}}}, r"cpu_bind\[1\]"),
        ({"engines": {"engine": {"kind": "vllm", "cpu_bind": []}}}, "cpu_bind"),
        ({"engines": {"engine": {"long_prefill_token_threshold": 0}}}, "long_prefill_token"),
        ({"engines": {"engine": {"long_prefill_token_threshold": 8192}}}, "long_prefill_token"),
    ],
)
def test_bad_settings_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ServeConfig.validated(data)


def test_yaml_errors_are_value_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        ServeConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="no such file"):
        ServeConfig.from_yaml(tmp_path / "missing.yaml")
