"""The typed config: defaults, sources, overrides, round trips, errors, docs, presets, CLI."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tierzero.cli.config import add_config_commands, parse_overrides, run_check, run_docs
from tierzero.common.slices import Tier
from tierzero.config import Config, ConfigError, config_markdown, load_config

REPO = Path(__file__).resolve().parents[2]
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_defaults_are_the_documented_ones() -> None:
    cfg = load_config({})
    assert (cfg.zero.stage, cfg.zero.unit_classes, cfg.zero.reduce_bucket_size) == (3, [], 25 * MiB)
    assert (cfg.zero.overlap_comm, cfg.zero.param_persistence_threshold) == (True, 0)
    p = cfg.precision
    assert (p.param_dtype, p.loss_scale, p.initial_scale, p.scale_window, p.min_scale) == ("fp32", "dynamic", 65536.0, 1000, 1.0)
    o = cfg.optimizer
    assert (o.type, o.lr, o.betas, o.eps, o.weight_decay, o.momentum) == ("adamw", 1e-3, (0.9, 0.999), 1e-8, 0.01, 0.0)
    assert (cfg.gradient_clipping, cfg.gradient_accumulation_steps) == (0.0, 1)
    assert (cfg.train.micro_batch_size, cfg.train.seed) == (1, 0)
    assert (cfg.offload.params, cfg.offload.gradients, cfg.offload.optimizer) == (Tier.DEVICE,) * 3
    assert (cfg.tiers.device.capacity, cfg.tiers.cpu.capacity, cfg.tiers.cpu.pin_memory) == (None, None, True)
    n = cfg.tiers.nvme
    assert (n.path, n.capacity, n.block_size, n.queue_depth, n.threads, n.verify, n.backend) == (
        None, None, 8 * MiB, 16, 8, False, "pread",
    )
    assert (cfg.swapper.buffer_size, cfg.swapper.buffer_count) == (8 * MiB, 8)
    assert (cfg.prefetch.bytes, cfg.prefetch.max_live_bytes) == (64 * MiB, GiB)
    assert cfg == Config()
    assert not cfg.uses_nvme


RAW = {
    "zero": {"stage": 2, "reduce_bucket_size": "512MB", "unit_classes": ["GPT2Block"]},
    "precision": {"param_dtype": "BF16"},
    "optimizer": {"type": "SGD", "lr": "1e-2", "momentum": 0.9, "betas": [0.8, 0.9]},
    "offload": {"optimizer": "CPU", "gradients": "cpu"},
    "tiers": {"cpu": {"capacity": "8GiB", "pin_memory": False}, "device": {"capacity": 4096}},
    "swapper": {"buffer_size": "4MiB", "buffer_count": 2.0},
}


def test_values_are_parsed_to_their_types() -> None:
    cfg = load_config(RAW)
    assert cfg.zero.reduce_bucket_size == 512 * 1000**2
    assert cfg.precision.param_dtype == "bf16" and cfg.precision.dtype_bytes == 2
    assert cfg.optimizer.type == "sgd" and cfg.optimizer.lr == 0.01 and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.offload.optimizer is Tier.CPU and cfg.offload.gradients is Tier.CPU
    assert cfg.tiers.cpu.capacity == 8 * GiB and cfg.tiers.device.capacity == 4096
    assert cfg.swapper.buffer_size == 4 * MiB and cfg.swapper.buffer_count == 2
    assert isinstance(cfg.swapper.buffer_count, int)


def test_yaml_json_and_dict_sources_agree(tmp_path: Path) -> None:
    yaml_path, json_path = tmp_path / "c.yaml", tmp_path / "c.json"
    yaml_path.write_text(yaml.safe_dump(RAW))
    json_path.write_text(json.dumps(RAW))
    assert load_config(yaml_path) == load_config(str(json_path)) == load_config(RAW)


def test_yaml_float_without_dot_is_a_number(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("optimizer:\n  lr: 3e-4\n  eps: 1e-6\n")
    cfg = load_config(path)
    assert (cfg.optimizer.lr, cfg.optimizer.eps) == (3e-4, 1e-6)


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    cfg = load_config(
        {"zero": {"stage": 1}, "offload": {"params": "nvme"}},
        overrides={"zero.stage": 3, "tiers.nvme.path": str(tmp_path), "tiers.nvme": {"queue_depth": 2, "path": str(tmp_path)}},
    )
    assert cfg.zero.stage == 3 and cfg.tiers.nvme.path == str(tmp_path) and cfg.tiers.nvme.queue_depth == 2
    assert cfg.uses_nvme and cfg.placements()["offload.params"] is Tier.NVME
    with pytest.raises(ConfigError, match=r"^unknown key zero\.stag; did you mean zero\.stage\?$"):
        load_config({}, overrides={"zero.stag": 2})


def test_relative_nvme_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "swap").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_config({"tiers": {"nvme": {"path": "swap"}}}).tiers.nvme.path == str(tmp_path / "swap")


def test_round_trips(tmp_path: Path) -> None:
    cfg = load_config(RAW, overrides={"tiers.nvme.path": str(tmp_path), "offload.params": "nvme", "zero.stage": 3})
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(yaml.safe_load(str(cfg))) == cfg
    assert load_config(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert load_config(cfg) is cfg
    changed = load_config(cfg, overrides={"train.seed": 7})
    assert changed.train.seed == 7 and cfg.train.seed == 0
    assert "buffer_size: 4MiB" in str(cfg) and "reduce_bucket_size: 512000000" in str(cfg)


def test_config_is_frozen() -> None:
    cfg = load_config({})
    with pytest.raises(AttributeError):
        cfg.zero.stage = 2  # type: ignore[misc]


def test_sections_are_typed_and_checked_when_built_directly() -> None:
    from tierzero.config import ZeroConfig

    with pytest.raises(TypeError, match="^Config.zero takes a ZeroConfig, got dict; build configs from dicts with load_config$"):
        Config(zero={"stage": 2})  # type: ignore[arg-type]
    assert Config(zero=ZeroConfig(stage=2, reduce_bucket_size="1MiB")).zero.reduce_bucket_size == MiB
    with pytest.raises(ConfigError, match=r"^zero\.stage is -1, this engine runs stages 1, 2 and 3: set zero\.stage to 1, 2 or 3$"):
        ZeroConfig(stage=-1)


def test_a_loaded_config_is_revalidated(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = load_config({"offload": {"optimizer": "nvme"}, "tiers": {"nvme": {"path": str(swap)}}})
    swap.rmdir()
    with pytest.raises(ConfigError, match=f"^tiers.nvme.path {swap} does not exist"):
        load_config(cfg)


SIZE_HINT = "such as 4096, '512MB' or '8GiB'"
BAD_CONFIGS = [
    ({"offload": {"paramz": "cpu"}}, "unknown key offload.paramz; did you mean offload.params?"),
    ({"stage": 2}, "unknown key stage; did you mean zero.stage?"),
    ({"zero": {"xyzzy": 1}}, "unknown key zero.xyzzy; valid keys under zero: zero.stage, zero.unit_classes, "
     "zero.reduce_bucket_size, zero.overlap_comm, zero.overlap_step, zero.step_in_forward, zero.step_schedule, "
     "zero.gather_ahead, "
     "zero.param_persistence_threshold, zero.shard_group_size, zero.hpz_partition_size, zero.quantized_weights, "
     "zero.quantized_gradients, zero.quantization_block_size"),
    ({"zero": 3}, "zero: expected a mapping of keys, got 3"),
    ({"tiers": {"nvme": {"queue_depth": "eight"}}}, "tiers.nvme.queue_depth: expected a positive integer, got 'eight'"),
    ({"tiers": {"nvme": {"threads": 0}}}, "tiers.nvme.threads: expected a positive integer, got 0"),
    ({"zero": {"stage": 4}}, "zero.stage is 4, this engine runs stages 1, 2 and 3: set zero.stage to 1, 2 or 3"),
    ({"zero": {"stage": True}}, "zero.stage is true, this engine runs stages 1, 2 and 3: set zero.stage to 1, 2 or 3"),
    ({"train": {"micro_batch_size": 2.5}}, "train.micro_batch_size: expected a positive integer, got 2.5"),
    ({"offload": {"params": "gpu"}}, "offload.params: expected one of device, cpu, nvme, auto, got 'gpu'"),
    ({"zero": {"stage": 2}, "offload": {"params": "cpu"}},
     "offload.params is cpu but zero.stage is 2: parameter offload needs zero.stage 3; "
     "set zero.stage: 3 or offload.params: device"),
    ({"zero": {"stage": 1}, "offload": {"gradients": "cpu"}},
     "offload.gradients is cpu but zero.stage is 1: gradient offload needs zero.stage 2 or 3; "
     "set zero.stage: 2 or offload.gradients: device"),
    ({"zero": {"stage": 0}, "offload": {"optimizer": "cpu"}},
     "zero.stage is 0, this engine runs stages 1, 2 and 3: set zero.stage to 1, 2 or 3"),
    ({"offload": {"optimizer": "nvme"}},
     "offload.optimizer is nvme but tiers.nvme.path is not set: set tiers.nvme.path to a directory "
     "on a local NVMe disk (or pass --nvme-path)"),
    ({"offload": {"params": "nvme", "optimizer": "nvme"}},
     "offload.params and offload.optimizer are nvme but tiers.nvme.path is not set: set tiers.nvme.path "
     "to a directory on a local NVMe disk (or pass --nvme-path)"),
    ({"tiers": {"cpu": {"capacity": 0}}},
     f"tiers.cpu.capacity: expected a positive size {SIZE_HINT} (or null for no limit), got 0"),
    ({"tiers": {"device": {"capacity": "-1GiB"}}},
     f"tiers.device.capacity: expected a positive size {SIZE_HINT} (or null for no limit), got '-1GiB'"),
    ({"tiers": {"nvme": {"capacity": -4096}}},
     f"tiers.nvme.capacity: expected a positive size {SIZE_HINT} (or null for no limit), got -4096"),
    ({"zero": {"reduce_bucket_size": "lots"}}, f"zero.reduce_bucket_size: expected a positive size {SIZE_HINT}, got 'lots'"),
    ({"tiers": {"nvme": {"block_size": 5000}}},
     f"tiers.nvme.block_size: expected a positive size that is a multiple of 4096 bytes {SIZE_HINT}, got 5000"),
    ({"swapper": {"buffer_size": "1MB"}},
     f"swapper.buffer_size: expected a positive size that is a multiple of 4096 bytes {SIZE_HINT}, got '1MB'"),
    ({"precision": {"param_dtype": "fp16", "loss_scale": -1}},
     "precision.loss_scale: expected 'dynamic' or a positive number, got -1"),
    ({"precision": {"param_dtype": "fp16", "loss_scale": 0}},
     "precision.loss_scale: expected 'dynamic' or a positive number, got 0"),
    ({"precision": {"param_dtype": "fp8"}}, "precision.param_dtype: expected one of fp32, bf16, fp16, got 'fp8'"),
    ({"precision": {"min_scale": 131072}},
     "precision.min_scale 131072 is above precision.initial_scale 65536: lower min_scale or raise initial_scale"),
    ({"precision": {"autocast": True}},
     "precision.autocast needs a lower compute dtype than fp32: set precision.param_dtype to bf16 (or fp16), "
     "or drop precision.autocast"),
    ({"precision": {"param_dtype": "bf16", "autocast": "yes"}},
     "precision.autocast: expected true or false, got 'yes'"),
    ({"optimizer": {"type": "lamb"}}, "optimizer.type: expected one of adamw, adam, sgd, lion, adafactor, or torch:<module.Class> such as torch:torch.optim.RAdam, got 'lamb'"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected two numbers in [0, 1) such as [0.9, 0.999], got [0.9]"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas: expected two numbers in [0, 1) such as [0.9, 0.999], got [0.9, 1.0]"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr: expected a positive number, got 0"),
    ({"optimizer": {"momentum": 1.5}}, "optimizer.momentum: expected a number in [0, 1), got 1.5"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: expected a positive integer, got 0"),
    ({"gradient_clipping": -1.0}, "gradient_clipping: expected a number >= 0, got -1.0"),
    ({"tiers": {"cpu": {"pin_memory": "yes"}}}, "tiers.cpu.pin_memory: expected true or false, got 'yes'"),
    ({"tiers": {"nvme": {"backend": "io_uring"}}}, "tiers.nvme.backend: expected one of pread, aiofiles, got 'io_uring'"),
    ({"zero": {"unit_classes": "GPT2Block"}},
     "zero.unit_classes: expected a list of module class names such as [GPT2Block], got 'GPT2Block'"),
    ({"prefetch": {"bytes": "2GiB"}},
     "prefetch.bytes 2.0 GiB is above prefetch.max_live_bytes 1.0 GiB: lower prefetch.bytes or raise prefetch.max_live_bytes"),
]


@pytest.mark.parametrize(("raw", "message"), BAD_CONFIGS, ids=[m.split(":")[0].split(";")[0] for _, m in BAD_CONFIGS])
def test_bad_config_is_refused_with_one_line(raw: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(raw)
    assert isinstance(info.value, ConfigError)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_staging_must_fit_the_cpu_capacity(tmp_path: Path) -> None:
    raw = {"offload": {"optimizer": "nvme"}, "tiers": {"nvme": {"path": str(tmp_path)}, "cpu": {"capacity": "32MiB"}}}
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert str(info.value) == (
        "swapper staging needs swapper.buffer_count x swapper.buffer_size = 64.0 MiB of host memory but "
        "tiers.cpu.capacity is 32.0 MiB: lower the swapper settings or raise tiers.cpu.capacity"
    )
    assert load_config(raw, overrides={"swapper.buffer_count": 4}).tiers.cpu.capacity == 32 * MiB


def test_nvme_path_must_be_an_existing_writable_directory(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": {"nvme": {"path": str(missing)}}})
    assert str(info.value) == f"tiers.nvme.path {missing} does not exist: create it (mkdir -p {missing}) or pick another directory"
    a_file = tmp_path / "swapfile"
    a_file.write_bytes(b"x")
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": {"nvme": {"path": str(a_file)}}})
    assert str(info.value) == f"tiers.nvme.path {a_file} is not a directory: point tiers.nvme.path at a directory, not a file"
    assert load_config({"tiers": {"nvme": {"path": str(tmp_path)}}}).tiers.nvme.path == str(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["swapfile"]  # the write probe leaves nothing behind


def _unwritable_dir(tmp_path: Path) -> Path | None:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        return locked
    # root writes anywhere permissions say no, but not into sysfs
    sysfs = Path("/sys")
    try:
        fd = os.open(sysfs / ".tierzero-write-test", os.O_CREAT | os.O_WRONLY, 0o600)
    except OSError:
        return sysfs if sysfs.is_dir() else None
    os.close(fd)
    return None


def test_unwritable_nvme_path_is_refused(tmp_path: Path) -> None:
    locked = _unwritable_dir(tmp_path)
    if locked is None:
        pytest.skip("no directory here refuses writes to this user")
    with pytest.raises(ConfigError, match=rf"^tiers\.nvme\.path {locked} is not writable \(.+\): fix its permissions or pick another directory$"):
        load_config({"tiers": {"nvme": {"path": str(locked)}}})


def test_file_errors_are_one_line(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("zero:\n  stage: [3\n")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"zero": {"stage": 3,}}')
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    cases = [
        (tmp_path / "c.toml", f"config file {tmp_path / 'c.toml'}: expected a .yaml, .yml or .json file, got suffix '.toml'"),
        (tmp_path / "nope.yaml", f"config file {tmp_path / 'nope.yaml'} does not exist: pass the path of a config file"),
        (bad_json, f"config file {bad_json}: invalid JSON at line 1 column 22: Expecting property name enclosed in double quotes"),
        (listing, f"config file {listing}: expected a mapping of keys at the top level, got list"),
    ]
    for path, message in cases:
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value) == message
    with pytest.raises(ConfigError, match=rf"^config file {bad_yaml}: invalid YAML at line 3 column 1: .+$"):
        load_config(bad_yaml)
    with pytest.raises(ConfigError, match="^config source: expected a .yaml/.yml/.json path, a dict or a Config, got int$"):
        load_config(3)  # type: ignore[arg-type]


def test_docs_are_generated_from_the_field_docstrings() -> None:
    markdown = config_markdown()
    assert (REPO / "docs" / "config.md").read_text() == markdown, "run: tierzero config docs > docs/config.md"
    rows = [line for line in markdown.splitlines() if line.startswith("| `") and "|---" not in line]
    documented = {row.split("`")[1] for row in rows}
    cfg = load_config({})
    leaves = set()
    for section, values in cfg.to_dict().items():
        if isinstance(values, dict):
            for name, value in values.items():
                leaves.update(f"{section}.{name}.{k}" for k in value) if isinstance(value, dict) else leaves.add(f"{section}.{name}")
        else:
            leaves.add(section)
    assert leaves <= documented
    assert "| `tiers.nvme.block_size` | size | `8MiB` | Bytes per I/O request; a multiple of 4096 for direct I/O. |" in rows


@pytest.mark.parametrize("preset", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_presets_load(preset: Path, tmp_path: Path) -> None:
    cfg = load_config(preset, overrides={"tiers.nvme.path": str(tmp_path)})
    assert load_config(cfg.to_dict()) == cfg


def test_preset_settings(tmp_path: Path) -> None:
    configs = REPO / "configs"
    cpu = load_config(configs / "cpu-offload.yaml")
    assert (cpu.zero.stage, cpu.offload.optimizer, cpu.offload.params) == (2, Tier.CPU, Tier.DEVICE)
    nvme = load_config(configs / "single-gpu-nvme.yaml", overrides={"tiers.nvme.path": str(tmp_path)})
    assert (nvme.zero.stage, nvme.offload.params, nvme.offload.optimizer) == (3, Tier.NVME, Tier.NVME)
    assert yaml.safe_load((configs / "single-gpu-nvme.yaml").read_text())["tiers"]["nvme"]["path"] == "/tmp/tierzero-swap"
    multi = load_config(configs / "multi-gpu-zero3.yaml")
    assert (multi.zero.stage, multi.precision.param_dtype) == (3, "bf16")


# ---------------------------------------------------------------- CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierzero")
    add_config_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_parse_overrides() -> None:
    assert parse_overrides(["zero.stage=2", "tiers.nvme.path=/x", "tiers.nvme.verify=true", "optimizer.betas=[0.8, 0.9]"],
                           nvme_path="/y") == {
        "zero.stage": 2, "tiers.nvme.path": "/y", "tiers.nvme.verify": True, "optimizer.betas": [0.8, 0.9],
    }
    with pytest.raises(ConfigError, match=r"^--set expects KEY=VALUE such as zero.stage=2, got 'zero.stage'$"):
        parse_overrides(["zero.stage"])


def test_check_prints_the_resolved_config(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(RAW))
    args = _parse(["config", "check", str(path), "--set", "train.seed=5", "--nvme-path", str(tmp_path)])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    expected = load_config(RAW, overrides={"train.seed": 5, "tiers.nvme.path": str(tmp_path)})
    assert load_config(yaml.safe_load(out.getvalue())) == expected
    assert out.getvalue() == str(expected)
    assert args.func is run_check


def test_docs_command_prints_the_markdown() -> None:
    args = _parse(["config", "docs"])
    out = io.StringIO()
    assert args.func is run_docs and args.func(args, out=out) == 0
    assert out.getvalue() == config_markdown()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierzero.cli", *argv], capture_output=True, text=True, cwd=REPO, timeout=60,
    )


def test_cli_bad_config_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    pytest.importorskip("tierzero.cli.bench", reason="tierzero.cli needs tierzero.cli.bench")
    bad = tmp_path / "bad.yaml"
    bad.write_text("offload:\n  paramz: cpu\n")
    result = _cli("config", "check", str(bad))
    assert result.returncode == 2, result.stderr
    assert result.stderr == "tierzero: error: unknown key offload.paramz; did you mean offload.params?\n"
    assert result.stdout == ""
    good = _cli("config", "check", str(REPO / "configs" / "single-gpu-nvme.yaml"), "--nvme-path", str(tmp_path))
    assert good.returncode == 0, good.stderr
    assert load_config(yaml.safe_load(good.stdout)).tiers.nvme.path == str(tmp_path)
