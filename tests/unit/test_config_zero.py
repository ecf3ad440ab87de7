"""The zero section promises only what the engine runs: stages 1 to 3, and the stage-3 persistence threshold."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierzero.cli.config import parse_overrides
from tierzero.config import ConfigError, ZeroConfig, config_markdown, load_config
from tierzero.config.markdown import field_docs
from tierzero.stages import STAGES


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _accepts(stage: Any) -> bool:
    try:
        load_config({"zero": {"stage": stage}})
    except ConfigError:
        return False
    return True


def test_the_accepted_stages_are_the_ones_the_engine_runs() -> None:
    assert {stage for stage in range(-2, 8) if _accepts(stage)} == set(STAGES) == {1, 2, 3}


@pytest.mark.parametrize(("stage", "shown"), [(0, "0"), (4, "4"), (-1, "-1"), (2.5, "2.5"), ("3", "'3'"), (None, "null")])
def test_any_other_stage_is_one_line_with_the_fix(stage: Any, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"zero": {"stage": stage}})
    assert str(info.value) == f"zero.stage is {shown}, this engine runs stages 1, 2 and 3: set zero.stage to 1, 2 or 3"
    assert info.value.key == "zero.stage"


def test_stage_zero_is_refused_from_overrides_and_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^zero.stage is 0, "):
        load_config({}, overrides=parse_overrides(["zero.stage=0"]))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"zero": {"stage": 0}}))
    with pytest.raises(ConfigError, match="^zero.stage is 0, "):
        load_config(path)
    assert "int 1..3" in next(line for line in config_markdown().splitlines() if line.startswith("| `zero.stage`"))


def test_optimizer_offload_works_at_every_stage() -> None:
    for stage in STAGES:
        assert load_config({"zero": {"stage": stage}, "offload": {"optimizer": "cpu"}}).zero.stage == stage


def test_param_persistence_threshold_is_kept() -> None:
    assert ZeroConfig().param_persistence_threshold == 0
    assert load_config({"zero": {"param_persistence_threshold": 100_000}}).zero.param_persistence_threshold == 100_000
    assert load_config({"zero": {"param_persistence_threshold": 1e5}}).zero.param_persistence_threshold == 100_000
    with pytest.raises(ConfigError, match=r"^zero\.param_persistence_threshold: expected a non-negative integer, got -1$"):
        load_config({"zero": {"param_persistence_threshold": -1}})


def test_param_persistence_threshold_says_what_stage3_does_with_it() -> None:
    doc = field_docs(ZeroConfig)["param_persistence_threshold"]
    assert doc.startswith("Stage 3: units whose parameter count is below this threshold stay gathered on the device "
                          "between forward and backward")


def test_deepspeed_persistence_threshold_maps_to_it() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 4096}})
    assert cfg.zero.param_persistence_threshold == 4096
    assert "| `zero_optimization.stage3_param_persistence_threshold` | `zero.param_persistence_threshold` |" in config_markdown()
