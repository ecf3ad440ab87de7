"""Hostile config files and values: each refused at load time with one line naming the file or key."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tierzero.cli.config import parse_overrides
from tierzero.config import Config, ConfigError, load_config
from tierzero.models.builtin import build_model, count_parameters

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
MAX_DEPTH = 64
"""tierzero.config.reading.MAX_DEPTH, as docs/config.md states it."""


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def alias_bomb(levels: int = 16, fan: int = 9) -> str:
    """A transformers_config whose aliases expand to fan ** levels strings, in about a kilobyte."""
    lines = ["model:", "  type: transformers", "  transformers_class: GPT2LMHeadModel", "  transformers_config:"]
    lines.append(f"    l0: &l0 [{', '.join(['x'] * fan)}]")
    for level in range(1, levels):
        lines.append(f"    l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * fan)}]")
    return "\n".join(lines) + "\n"


def _refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_alias_bomb_is_refused_at_once_and_small_aliases_load(tmp_path: Path) -> None:
    small = tmp_path / "anchors.yaml"
    small.write_text(alias_bomb(levels=3, fan=3) + "zero: &z {stage: 2}\nprecision: {param_dtype: bf16}\n")
    cfg = load_config(small)
    assert cfg.zero.stage == 2 and cfg.model.transformers_config["l2"] == [[["x"] * 3] * 3] * 3
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert bomb.stat().st_size < 1300
    start = time.perf_counter()
    message = _refusal(bomb)
    assert time.perf_counter() - start < 5
    assert message == (
        f"config file {bomb}: more than 100000 values once YAML aliases are expanded (at line 10): "
        "a config needs a few hundred; write out what the aliases repeat"
    )


def test_an_alias_inside_itself_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("model:\n  transformers_config:\n    x: &a [1, *a]\n")
    assert _refusal(path) == (
        f"config file {path}: the node at line 3 contains an alias of itself, which never ends: remove the alias"
    )


def test_nesting_past_the_limit_is_refused(tmp_path: Path) -> None:
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("model:\n  transformers_config:\n    x: " + "[" * 5000 + "]" * 5000 + "\n")
    assert _refusal(deep_yaml) == f"config file {deep_yaml}: nested more than 64 levels deep at line 3: flatten it"
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"model": {"transformers_config": {"x": ' + "[" * 5000 + "]" * 5000 + "}}}")
    assert _refusal(deep_json) == f"config file {deep_json}: nested more than 64 levels deep at line 1: flatten it"
    # Aliases that nest each other: each anchor is shallow, the expansion is not.
    chain = tmp_path / "chain.yaml"
    chain.write_text("a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 100)))
    assert _refusal(chain).startswith(f"config file {chain}: nested more than 64 levels deep at line ")
    nested: dict = {}
    node = nested
    for _ in range(5000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ConfigError, match=r"^the config: model\.transformers_config\.a\.a.* is nested more than 64 levels deep: flatten it$"):
        load_config({"model": {"transformers_config": nested}})
    with pytest.raises(ConfigError, match=r"^the override of model\.transformers_config: a\.a.* is nested more than 64 levels"):
        load_config({}, overrides={"model.transformers_config": nested})


def test_nesting_up_to_the_limit_loads(tmp_path: Path) -> None:
    # The top-level mapping is level 1, model 2, transformers_config 3: 61 nested lists fit below.
    inner = MAX_DEPTH - 3
    for name, text in (("ok.yaml", "model:\n  type: transformers\n  transformers_class: X\n  transformers_config:\n    x: "
                        + "[" * inner + "]" * inner + "\n"),
                       ("ok.json", json.dumps({"model": {"type": "transformers", "transformers_class": "X",
                                                         "transformers_config": {"x": json.loads("[" * inner + "]" * inner)}}}))):
        path = tmp_path / name
        path.write_text(text)
        assert isinstance(load_config(path), Config)
        path.write_text(text.replace("[", "[[", 1).replace("]", "]]", 1))
        assert "nested more than 64 levels deep" in _refusal(path)


def test_duplicate_keys_are_refused_with_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("zero:\n  stage: 1\n  overlap_comm: true\n  stage: 3\n")
    assert _refusal(path) == (
        f"config file {path}: duplicate key zero.stage at line 4 (first at line 2): YAML keeps only the last one; remove the other"
    )
    nested = tmp_path / "nested.yaml"
    nested.write_text("model:\n  transformers_config:\n    layers:\n      - {a: 1, a: 2}\n")
    assert "duplicate key model.transformers_config.layers[0].a at line 4 (first at line 4)" in _refusal(nested)
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text("zero:\n  &k stage: 1\n  *k : 3\n")
    assert "duplicate key zero.stage at line 2 (first at line 2)" in _refusal(aliased)
    as_json = tmp_path / "dup.json"
    as_json.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    assert _refusal(as_json) == (
        f"config file {as_json}: duplicate key zero_optimization.stage: JSON keeps only the last one; remove the other"
    )
    with pytest.raises(ConfigError, match=r"^--set model\.transformers_config: duplicate key a at line 1 \(first at line 1\)"):
        parse_overrides(["model.transformers_config={a: 1, a: 2}"])
    # A merge key may be overridden by the mapping's own key, as YAML says.
    merged = tmp_path / "merged.yaml"
    merged.write_text("zero: &z {stage: 2, overlap_comm: false}\nmodel:\n  type: transformers\n"
                      "  transformers_class: X\n  transformers_config: {<<: *z, stage: 3}\n")
    assert load_config(merged).model.transformers_config == {"stage": 3, "overlap_comm": False}


def test_unreadable_text_names_the_file(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model:\n  transformers_class: Caf\u00e9\n".encode("latin-1"))
    assert _refusal(latin1) == f"config file {latin1}: not UTF-8 text (byte 0xe9 at line 2): save it as UTF-8"
    control = tmp_path / "control.yaml"
    control.write_text("zero:\n  stage: 3\x00\n")
    assert _refusal(control) == f"config file {control}: invalid YAML: character #x0000 at line 2 is not allowed: remove it"
    huge = tmp_path / "huge.json"
    huge.write_text("{}" + " " * (1 << 20))
    assert _refusal(huge) == f"config file {huge} is larger than 1.0 MiB, far more than a config needs: pass the config file itself"
    date = tmp_path / "date.yaml"
    date.write_text("train:\n  seed: 2024-13-45\n")
    assert _refusal(date) == f"config file {date}: cannot read the value at line 2 (month must be in 1..12): fix or quote it"
    digits = tmp_path / "digits.yaml"
    digits.write_text("train:\n  seed: 0x" + "f" * 5000 + "\n")
    assert _refusal(digits) == f"config file {digits}: train.seed is an integer of 20000 bits, larger than any setting takes: fix it"


SIZE_LIMITED = [
    ({"tiers": {"nvme": {"block_size": "64GiB"}}},
     "tiers.nvme.block_size is '64GiB', above the limit of 1.0 GiB: set tiers.nvme.block_size to at most 1.0 GiB"),
    ({"tiers": {"nvme": {"capacity": "1MiB", "block_size": "2MiB"}}},
     "tiers.nvme.block_size 2.0 MiB is above tiers.nvme.capacity 1.0 MiB: lower tiers.nvme.block_size or raise tiers.nvme.capacity"),
    ({"tiers": {"nvme": {"queue_depth": 1024, "block_size": "1GiB"}}},
     "tiers.nvme.queue_depth x tiers.nvme.block_size = 1024 x 1.0 GiB = 1.0 TiB of host bounce blocks, above the limit "
     "of 64.0 GiB: lower tiers.nvme.queue_depth or tiers.nvme.block_size"),
    ({"tiers": {"nvme": {"queue_depth": 100_000}}},
     "tiers.nvme.queue_depth is 100000, above the limit of 1024: set tiers.nvme.queue_depth to at most 1024"),
    ({"tiers": {"nvme": {"threads": 10_000}}}, "tiers.nvme.threads is 10000, above the limit of 256: set tiers.nvme.threads to at most 256"),
    ({"swapper": {"buffer_count": 1024, "buffer_size": "1GiB"}},
     "swapper.buffer_count x swapper.buffer_size = 1024 x 1.0 GiB = 1.0 TiB of host staging buffers, above the limit "
     "of 64.0 GiB: lower swapper.buffer_count or swapper.buffer_size"),
    ({"prefetch": {"bytes": "2TiB", "max_live_bytes": "4TiB"}},
     "prefetch.bytes is '2TiB', above the limit of 1.0 TiB: set prefetch.bytes to at most 1.0 TiB"),
    ({"zero": {"reduce_bucket_size": 10**30}},
     "zero.reduce_bucket_size is 1000000000000000000000000000000, above the limit of 16.0 GiB: set zero.reduce_bucket_size to at most 16.0 GiB"),
    ({"model": {"n_layer": 1e7}}, "model.n_layer is 10000000.0, above the limit of 1024: set model.n_layer to at most 1024"),
    ({"model": {"n_layer": 1024, "d_model": 65536, "n_head": 64}},
     "model.n_layer 1024, d_model 65536, d_ff 256 and vocab_size 256 make a gpt of 1.76e+13 parameters, above the "
     "limit of 1e+13: lower model.n_layer, model.d_model or model.d_ff"),
    ({"precision": {"initial_scale": 2.0**128}},
     "precision.initial_scale is 3.402823669209385e+38, above the limit of 3.40282e+38: set precision.initial_scale to at most 3.40282e+38"),
    ({"train": {"seed": 2**64}},
     "train.seed is 18446744073709551616, above the limit of 9223372036854775807: set train.seed to at most 9223372036854775807"),
    ({"train": {"steps": 10**5000}}, "the config: train.steps is an integer of 16610 bits, larger than any setting takes: fix it"),
    ({"dist": {"timeout": 1e300}}, "dist.timeout is 1e+300, above the limit of 604800: set dist.timeout to at most 604800"),
    ({"model": {"type": "transformers", "transformers_class": "X", "transformers_config": {"a": float("nan")}}},
     "model.transformers_config: expected a mapping of keyword arguments such as {n_layer: 2}, holding strings, finite "
     "numbers, booleans, nulls, lists and mappings, got {'a': nan}"),
    ({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "initial_scale_power": 2000}},
     "DeepSpeed fp16.initial_scale_power: expected a number from -126 to 127 such as 16 (2 ** power must fit in float32), got 2000"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e300}},
     "zero_optimization.reduce_bucket_size (zero.reduce_bucket_size in tierzero) is an integer of 999 bits, above the "
     "limit of 16.0 GiB: set zero.reduce_bucket_size to at most 16.0 GiB"),
]


@pytest.mark.parametrize(("raw", "message"), SIZE_LIMITED, ids=[re.search(r"\w+\.[\w.]+", m).group(0) for _, m in SIZE_LIMITED])
def test_values_past_their_limits_are_refused_naming_the_key(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert str(info.value) == message


AT_LIMITS = {
    "tiers": {"nvme": {"block_size": "1GiB", "capacity": "1GiB", "queue_depth": 64, "threads": 256}},
    "swapper": {"buffer_count": 16, "buffer_size": "4GiB"},
    "precision": {"initial_scale": 2.0**127},
    "model": {"n_layer": 1024, "d_model": 4096, "n_head": 32, "d_ff": 16384},
    "train": {"seed": 2**63 - 1},
}
ONE_PAST = [
    ("tiers.nvme.block_size", 2 * GiB), ("tiers.nvme.capacity", GiB - 4096), ("tiers.nvme.queue_depth", 65),
    ("tiers.nvme.threads", 257), ("swapper.buffer_count", 17), ("precision.initial_scale", 2.0**128),
    ("model.n_layer", 1025), ("train.seed", 2**63),
]


def test_limits_are_inclusive() -> None:
    cfg = load_config(AT_LIMITS)
    assert cfg.tiers.nvme.block_size == GiB and cfg.precision.initial_scale == 2.0**127
    for key, past in ONE_PAST:
        with pytest.raises(ConfigError) as info:
            load_config(AT_LIMITS, overrides={key: past})
        assert "above" in str(info.value), (key, str(info.value))
    ds = {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "initial_scale_power": 127}}
    assert load_config(ds).precision.initial_scale == 2.0**127
    with pytest.raises(ConfigError, match=r"^DeepSpeed fp16\.initial_scale_power: expected a number from -126 to 127"):
        load_config({**ds, "fp16": {"enabled": True, "initial_scale_power": 128}})


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("shape", [
    {"n_layer": 2, "n_head": 2, "d_model": 64, "d_ff": 256, "vocab_size": 256, "max_seq_len": 128},
    {"n_layer": 3, "n_head": 4, "d_model": 96, "d_ff": 200, "vocab_size": 1000, "max_seq_len": 77},
])
def test_parameter_count_is_the_built_models(kind: str, shape: dict) -> None:
    cfg = load_config({"model": {"type": kind, **shape}, "train": {"seq_len": 64}})
    assert cfg.model.parameter_count() == count_parameters(build_model(cfg.model, device="meta"))


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tierzero.cli", *argv], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_train_refuses_a_bomb_and_a_huge_model_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("tierzero.cli.bench", reason="tierzero.cli needs tierzero.cli.bench")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    result = _cli("train", "--config", str(bomb), "--steps", "1")
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"tierzero: error: config file {bomb}: more than 100000 values once YAML aliases are expanded (at line 10): "
        "a config needs a few hundred; write out what the aliases repeat\n"
    )
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps({"model": {"n_layer": 1e7}}))
    result = _cli("train", "--config", str(layers), "--steps", "1")
    assert (result.returncode, result.stderr) == (
        2, "tierzero: error: model.n_layer is 10000000.0, above the limit of 1024: set model.n_layer to at most 1024\n"
    )


def test_yaml_dump_of_a_loaded_config_reads_back() -> None:
    cfg = load_config({"model": {"type": "transformers", "transformers_class": "X", "transformers_config": {"t": (1, 2)}}})
    assert cfg.model.transformers_config == {"t": [1, 2]}
    assert load_config(yaml.safe_load(str(cfg))) == cfg
