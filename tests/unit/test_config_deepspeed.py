"""DeepSpeed configs, as the HF Trainer and DeepSpeed users write them, translated to tierzero."""

from __future__ import annotations

import copy
import io
import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tierzero.cli.config import run_check
from tierzero.common.slices import Tier
from tierzero.config import ConfigError, TierZeroConfigWarning, load_config

DATA = Path(__file__).resolve().parents[1] / "data"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _ds(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def _load(source: Any, **kwargs: Any) -> tuple[Any, Counter[str]]:
    """The config and how many times each TierZeroConfigWarning message was raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(source, **kwargs)
    assert all(issubclass(w.category, TierZeroConfigWarning) for w in caught), [str(w.message) for w in caught]
    return cfg, Counter(str(w.message) for w in caught)


def _ignored(*keys: str) -> Counter[str]:
    return Counter(f"DeepSpeed key {key} has no tierzero equivalent; ignored" for key in keys)


def _round_up(n: int, alignment: int = 4096) -> int:
    return (n + alignment - 1) // alignment * alignment


def test_hf_zero3_nvme_config(tmp_path: Path) -> None:
    cfg, warned = _load(DATA / "ds_zero3_nvme.json", overrides={"tiers.nvme.path": str(tmp_path)})
    assert cfg.zero.stage == 3
    assert (cfg.offload.params, cfg.offload.gradients, cfg.offload.optimizer) == (Tier.NVME,) * 3
    assert cfg.tiers.nvme.path == str(tmp_path) and cfg.tiers.cpu.pin_memory is True
    # fp16/bf16 "auto" resolve to fp32, so DeepSpeed's element counts are 4 bytes each.
    assert cfg.precision.param_dtype == "fp32"
    assert cfg.swapper.buffer_count == max(4, 5)
    assert cfg.swapper.buffer_size == _round_up(100_000_000 * 4)
    assert cfg.prefetch.max_live_bytes == 1_000_000_000 * 4
    assert (cfg.tiers.nvme.block_size, cfg.tiers.nvme.queue_depth, cfg.tiers.nvme.threads) == (262144, 32, 1)
    # "auto" everywhere else: tierzero's defaults.
    defaults = load_config({})
    assert cfg.optimizer == defaults.optimizer
    assert (cfg.zero.reduce_bucket_size, cfg.prefetch.bytes, cfg.zero.param_persistence_threshold) == (
        defaults.zero.reduce_bucket_size, defaults.prefetch.bytes, defaults.zero.param_persistence_threshold,
    )
    assert (cfg.gradient_clipping, cfg.gradient_accumulation_steps, cfg.train.micro_batch_size) == (0.0, 1, 1)
    assert (cfg.precision.loss_scale, cfg.precision.initial_scale, cfg.precision.scale_window, cfg.precision.min_scale) == (
        "dynamic", 2.0**16, 1000, 1.0,
    )
    # WarmupLR with every param "auto": the optimizer's lr from the first step (no warm-up steps).
    s = cfg.scheduler
    assert (s.type, s.convention, s.warmup_steps, s.warmup_start_ratio) == ("constant", "deepspeed", 0, 0.0)
    assert s.warmup_type == "log"  # left out: DeepSpeed's default
    assert warned == _ignored(
        "fp16.hysteresis",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "aio.single_submit",
        "aio.overlap_events",
        "steps_per_print",
        "wall_clock_breakdown",
    )


def test_hf_zero2_cpu_config() -> None:
    cfg, warned = _load(DATA / "ds_zero2_cpu.json")
    assert cfg.zero.stage == 2
    assert (cfg.offload.params, cfg.offload.gradients, cfg.offload.optimizer) == (Tier.DEVICE, Tier.CPU, Tier.CPU)
    assert cfg.zero.reduce_bucket_size == 200_000_000 * 4 and cfg.zero.overlap_comm is True
    assert not cfg.uses_nvme and cfg.tiers.nvme.path is None
    # WarmupDecayLR, total_num_steps "auto": decays to 0 over train.steps
    s = cfg.scheduler
    assert (s.type, s.convention, s.warmup_steps, s.min_lr_ratio, s.total_steps) == ("linear", "deepspeed", 0, 0.0, None)
    assert warned == _ignored(
        "fp16.hysteresis",
        "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.reduce_scatter",
        "zero_optimization.contiguous_gradients",
        "steps_per_print",
        "wall_clock_breakdown",
    )


def test_explicit_fp16_config_converts_elements_with_two_bytes() -> None:
    cfg, warned = _load(_ds("ds_zero3_fp16_explicit"))
    assert warned == Counter()
    assert cfg.precision.param_dtype == "fp16"
    assert (cfg.precision.loss_scale, cfg.precision.initial_scale, cfg.precision.scale_window, cfg.precision.min_scale) == (
        "dynamic", 2.0**12, 500, 2.0,
    )
    assert cfg.swapper.buffer_size == _round_up(50_000_000 * 2) and cfg.swapper.buffer_count == 6
    assert cfg.zero.reduce_bucket_size == 50_000_000 * 2 and cfg.zero.overlap_comm is False
    assert cfg.prefetch.bytes == 45_000_000 * 2 and cfg.prefetch.max_live_bytes == 300_000_000 * 2
    assert cfg.zero.param_persistence_threshold == 100_000
    assert (cfg.offload.params, cfg.offload.gradients, cfg.offload.optimizer) == (Tier.CPU,) * 3
    assert cfg.tiers.cpu.pin_memory is True  # offload_param asks for it, offload_optimizer does not
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    o = cfg.optimizer
    assert (o.type, o.lr, o.betas, o.eps, o.weight_decay) == ("adamw", 2e-5, (0.9, 0.95), 1e-6, 0.1)
    assert cfg.gradient_clipping == 1.0
    # train_batch_size 64 = micro x 4 accumulation x world size 1
    assert (cfg.train.micro_batch_size, cfg.gradient_accumulation_steps) == (16, 4)


def test_batch_size_is_derived_with_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg, _ = _load(_ds("ds_zero3_fp16_explicit"))
    assert (cfg.train.micro_batch_size, cfg.gradient_accumulation_steps) == (8, 4)
    ds = _ds("ds_zero3_fp16_explicit")
    ds["gradient_accumulation_steps"] = "auto"
    ds["train_micro_batch_size_per_gpu"] = 4
    cfg, _ = _load(ds)
    assert (cfg.train.micro_batch_size, cfg.gradient_accumulation_steps) == (4, 64 // (4 * 2))


def test_adam_without_w_mode_is_adam() -> None:
    ds = _ds("ds_zero3_fp16_explicit")
    ds["optimizer"]["params"]["adam_w_mode"] = False
    assert _load(ds)[0].optimizer.type == "adam"
    ds["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    cfg, _ = _load(ds)
    assert (cfg.optimizer.type, cfg.optimizer.lr, cfg.optimizer.momentum) == ("sgd", 0.1, 0.9)


def test_minimal_configs() -> None:
    # No stage means DeepSpeed's 0 (plain data parallel), which the engine does not run.
    assert _error({"zero_optimization": {}, "bfloat16": {"enabled": True}}) == (
        "zero_optimization.stage (zero.stage in tierzero; not set, so DeepSpeed's default) is 0, this engine runs "
        "stages 1, 2 and 3: set zero.stage to 1, 2 or 3"
    )
    assert _load({"zero_optimization": {}}, overrides={"zero.stage": 2})[0].zero.stage == 2
    cfg, warned = _load({"zero_optimization": {"stage": 1}, "bfloat16": {"enabled": True}})
    assert cfg.zero.stage == 1 and cfg.precision.param_dtype == "bf16" and warned == Counter()
    cfg, _ = _load({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    # gradients stay on the device below stage 2
    assert (cfg.offload.optimizer, cfg.offload.gradients) == (Tier.CPU, Tier.DEVICE)
    cfg, _ = _load({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}})
    assert cfg.offload.params is Tier.DEVICE


def test_unknown_keys_warn_once_each() -> None:
    ds = {"zero_optimization": {"stage": 2, "made_up": 1}, "flux_capacitor": {"on": True}, "optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}
    cfg, warned = _load(ds)
    assert cfg.zero.stage == 2
    assert warned == _ignored("zero_optimization.made_up", "flux_capacitor", "optimizer.params.amsgrad")


def test_overrides_apply_after_translation(tmp_path: Path) -> None:
    ds = _ds("ds_zero3_nvme")
    cfg, _ = _load(ds, overrides={"tiers.nvme.path": str(tmp_path), "swapper.buffer_count": 2, "offload.gradients": "cpu"})
    assert (cfg.swapper.buffer_count, cfg.offload.gradients) == (2, Tier.CPU)


def _error(ds: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as info:
        _load(ds)
    assert isinstance(info.value, ConfigError) and "\n" not in str(info.value)
    return str(info.value)


def test_bad_deepspeed_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _ds("ds_zero3_fp16_explicit")

    def variant(**changes: Any) -> dict[str, Any]:
        ds = copy.deepcopy(base)
        for dotted, value in changes.items():
            *parents, leaf = dotted.split("__")
            node = ds
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = value
        return ds

    assert _error(variant(optimizer__type="Lamb")) == (
        "DeepSpeed optimizer.type: expected AdamW, Adam or SGD, got 'Lamb'; tierzero has no other optimizer"
    )
    assert _error(variant(bf16={"enabled": True})) == "DeepSpeed fp16.enabled and bf16.enabled are both true: enable at most one"
    assert _error(variant(zero_optimization__offload_param__device="gpu")) == (
        "DeepSpeed zero_optimization.offload_param.device: expected one of none, cpu, nvme, got 'gpu'"
    )
    assert _error(variant(train_micro_batch_size_per_gpu=8)) == (
        "DeepSpeed train_batch_size 64 != train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 4 x "
        'world size 1: fix one of them or set train_batch_size to "auto"'
    )
    assert _error(variant(zero_optimization__reduce_bucket_size="big")) == (
        "DeepSpeed zero_optimization.reduce_bucket_size: expected a number of elements such as 5e8, got 'big'"
    )
    assert _error(variant(aio={"block_size": 1000})) == (
        "aio.block_size (tiers.nvme.block_size in tierzero): expected a positive size that is a multiple of 4096 "
        "bytes such as 4096, '512MB' or '8GiB', got 1000"
    )
    assert _error(variant(fp16__loss_scale=-2)) == (
        "fp16.loss_scale (precision.loss_scale in tierzero): expected 'dynamic' or a positive number, got -2"
    )
    assert _error(variant(zero_optimization__stage=2)) == (
        "zero_optimization.offload_param.device (offload.params in tierzero) is cpu but zero_optimization.stage "
        "(zero.stage in tierzero) is 2: parameter offload needs zero.stage 3; set zero.stage: 3 or offload.params: device"
    )
    a, b = tmp_path / "a", tmp_path / "b"
    assert _error(variant(
        zero_optimization__offload_param__nvme_path=str(a), zero_optimization__offload_optimizer__nvme_path=str(b),
    )) == (
        f"DeepSpeed zero_optimization.offload_optimizer.nvme_path {b} differs from "
        f"zero_optimization.offload_param.nvme_path {a}: tierzero keeps all swap files in one directory; "
        "use the same path in both"
    )
    missing = tmp_path / "missing"
    assert _error(variant(
        zero_optimization__offload_param__device="nvme", zero_optimization__offload_param__nvme_path=str(missing),
    )) == (
        f"zero_optimization.offload_param.nvme_path (tiers.nvme.path in tierzero) {missing} does not exist: "
        f"create it (mkdir -p {missing}) or pick another directory"
    )
    monkeypatch.setenv("WORLD_SIZE", "zero")
    assert _error(base) == "WORLD_SIZE: expected a positive integer, got 'zero'; unset it or fix the launcher"


def test_config_check_prints_deepspeed_warnings(tmp_path: Path) -> None:
    class Args:
        file = str(DATA / "ds_zero2_cpu.json")
        overrides = ["zero.overlap_comm=false"]
        nvme_path = None

    out, err = io.StringIO(), io.StringIO()
    assert run_check(Args(), out=out, err=err) == 0  # type: ignore[arg-type]
    lines = err.getvalue().splitlines()
    assert "tierzero: warning: DeepSpeed key zero_optimization.reduce_scatter has no tierzero equivalent; ignored" in lines
    assert len(lines) == 7 and all(line.startswith("tierzero: warning: DeepSpeed key ") for line in lines)
    assert "overlap_comm: false" in out.getvalue() and "optimizer: cpu" in out.getvalue()


SIZE_HINT = "such as 4096, '512MB' or '8GiB'"
STAGE_FIX = "this engine runs stages 1, 2 and 3: set zero.stage to 1, 2 or 3"
DEEPSPEED_ERRORS = [
    ({"offload_param": {"device": "nvme", "nvme_path": 5}},
     "zero_optimization.offload_param.nvme_path",
     "zero_optimization.offload_param.nvme_path (tiers.nvme.path in tierzero): expected a directory path (or null), got 5"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": ["/a"]}},
     "zero_optimization.offload_optimizer.nvme_path",
     "zero_optimization.offload_optimizer.nvme_path (tiers.nvme.path in tierzero): expected a directory path (or null), "
     "got ['/a']"),
    ({"stage": 4}, "zero_optimization.stage", f"zero_optimization.stage (zero.stage in tierzero) is 4, {STAGE_FIX}"),
    ({"stage": 0}, "zero_optimization.stage", f"zero_optimization.stage (zero.stage in tierzero) is 0, {STAGE_FIX}"),
    ({"stage": "three"}, "zero_optimization.stage",
     f"zero_optimization.stage (zero.stage in tierzero) is 'three', {STAGE_FIX}"),
    ({"offload_param": {"device": "cpu", "buffer_size": 0}},
     "zero_optimization.offload_param.buffer_size",
     "zero_optimization.offload_param.buffer_size (swapper.buffer_size in tierzero): expected a positive size that is "
     f"a multiple of 4096 bytes {SIZE_HINT}, got 0"),
    ({"offload_param": {"device": "cpu", "buffer_count": -1}},
     "zero_optimization.offload_param.buffer_count",
     "DeepSpeed zero_optimization.offload_param.buffer_count: expected a positive integer such as 4, got -1"),
    ({"reduce_bucket_size": -1}, "zero_optimization.reduce_bucket_size",
     "DeepSpeed zero_optimization.reduce_bucket_size: expected a number of elements such as 5e8, got -1"),
    ({"reduce_bucket_size": 0}, "zero_optimization.reduce_bucket_size",
     f"zero_optimization.reduce_bucket_size (zero.reduce_bucket_size in tierzero): expected a positive size {SIZE_HINT}, got 0"),
    ({"overlap_comm": "yes"}, "zero_optimization.overlap_comm",
     "zero_optimization.overlap_comm (zero.overlap_comm in tierzero): expected true or false, got 'yes'"),
    # the key at fault (prefetch.bytes) is tierzero's default; the one it is compared with came from DeepSpeed
    ({"stage3_max_live_parameters": 1e6}, "zero_optimization.stage3_max_live_parameters",
     "zero_optimization.stage3_prefetch_bucket_size (prefetch.bytes in tierzero) 64.0 MiB is above "
     "zero_optimization.stage3_max_live_parameters (prefetch.max_live_bytes in tierzero) 3.8 MiB: "
     "lower prefetch.bytes or raise prefetch.max_live_bytes"),
    # a key DeepSpeed left out is named by the DeepSpeed key that would set it
    ({"offload_param": {"device": "nvme"}}, "zero_optimization.offload_*.nvme_path",
     "zero_optimization.offload_param.device (offload.params in tierzero) is nvme but "
     "zero_optimization.offload_*.nvme_path (tiers.nvme.path in tierzero) is not set: set tiers.nvme.path to a "
     "directory on a local NVMe disk (or pass --nvme-path)"),
]


@pytest.mark.parametrize(("zero", "deepspeed_key", "message"), DEEPSPEED_ERRORS, ids=[k for _, k, _ in DEEPSPEED_ERRORS])
def test_errors_name_the_deepspeed_key(zero: dict[str, Any], deepspeed_key: str, message: str) -> None:
    error = _error({"zero_optimization": {"stage": 3} | zero})
    assert deepspeed_key in error
    assert error == message


def test_errors_name_deepspeed_keys_outside_zero_optimization() -> None:
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"momentum": 2}}}
    assert _error(ds) == "optimizer.params.momentum (optimizer.momentum in tierzero): expected a number in [0, 1), got 2"
    ds = {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 32}}
    assert _error(ds) == (
        "fp16.min_loss_scale (precision.min_scale in tierzero) 32 is above fp16.initial_scale_power "
        "(precision.initial_scale in tierzero) 16: lower min_scale or raise initial_scale"
    )


def test_overridden_keys_speak_tierzero(tmp_path: Path) -> None:
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    missing = tmp_path / "missing"
    expected = f"tiers.nvme.path {missing} does not exist: create it (mkdir -p {missing}) or pick another directory"
    for overrides in ({"tiers.nvme.path": str(missing)}, {"tiers.nvme": {"path": str(missing)}}):
        with pytest.raises(ConfigError) as info:
            _load(ds, overrides=overrides)
        assert str(info.value) == expected
    # a tierzero config's errors never mention DeepSpeed
    with pytest.raises(ConfigError) as info:
        load_config({"zero": {"stage": 0}})
    assert str(info.value) == f"zero.stage is 0, {STAGE_FIX}"


def test_communication_data_type_is_the_reduce_dtype(tmp_path) -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**config, "communication_data_type": "fp32"}))
    cfg = load_config(path)
    assert (cfg.precision.param_dtype, cfg.precision.reduce_dtype) == ("bf16", "fp32")
    path.write_text(json.dumps({**config, "communication_data_type": "int4"}))
    with pytest.raises(ConfigError, match=r"^communication_data_type \(precision\.reduce_dtype in tierzero\): expected one of"):
        load_config(path)


def test_torch_autocast_is_precision_autocast() -> None:
    base = {"zero_optimization": {"stage": 3}}
    cfg, warned = _load(base | {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert (cfg.precision.autocast, cfg.precision.param_dtype) == (True, "bf16") and warned == Counter()
    safe = {"lower_precision_safe_modules": ["torch.nn.Linear"]}
    cfg, warned = _load(base | {"torch_autocast": {"enabled": True, "dtype": "float16", **safe}})
    assert (cfg.precision.autocast, cfg.precision.param_dtype) == (True, "fp16")
    assert warned == _ignored("torch_autocast.lower_precision_safe_modules")
    cfg, _ = _load(base | {"torch_autocast": {"enabled": False, "dtype": "bfloat16"}})
    assert (cfg.precision.autocast, cfg.precision.param_dtype) == (False, "fp32")
    assert _error(base | {"torch_autocast": {"enabled": True}}) == (
        "DeepSpeed torch_autocast.dtype: expected bfloat16 or float16, got null; tierzero keeps the lowered "
        "layers' weights in it, so it must be named"
    )
    assert _error(base | {"torch_autocast": {"enabled": True, "dtype": "bf16"}, "bf16": {"enabled": True}}) == (
        "DeepSpeed torch_autocast.enabled and bf16.enabled are both true: torch_autocast keeps fp32 parameters and "
        "lowers each op, bf16 lowers every parameter; enable one of them"
    )
