"""What `tierzero train` says: the header before the first step, the learning rate of each step, a
config that names nothing to train refused, DeepSpeed's dropped keys and "auto" values, a resume of
a finished run, and bf16 on a CPU without bf16 instructions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import tierzero.cli.train as T
from tierzero.cli.main import main
from tierzero.config import TierZeroConfigWarning, load_config, read_config
from tierzero.config.deepspeed.translate import auto_keys, tierzero_keys
from tierzero.config.precision import cpu_flags, slow_bf16_note

TINY = {
    "zero": {"stage": 3},
    "optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.0},
    "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32},
    "data": {"max_bytes": "256KiB"},
    "train": {"steps": 4, "micro_batch_size": 2, "seq_len": 32, "log_every": 1},
}
"""A 26,368-parameter GPT (the tiny test model of test_checkpoint_train.py)."""
NO_WORKLOAD = (
    "names no model and no data, so it would train the built-in 124,672-parameter byte-level demo GPT on Python's "
    "own sources: set model.pretrained to a transformers model directory and data.path to your text (or "
    "model.type: gpt to train the demo model)"
)
DEEPSPEED = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "sub_group_size": 1e9},
    "steps_per_print": 10,
}


def _write(tmp_path: Path, raw: dict[str, Any], name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw) if name.endswith(".json") else yaml.safe_dump(raw))
    return path


def _train(capsys: pytest.CaptureFixture[str], config: Path, *args: str) -> tuple[int, str, str]:
    rc = main(["train", "--config", str(config), "--no-progress", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# ---------------------------------------------------------------- the header and the learning rate


def test_the_header_says_model_tokens_placement_and_schedule_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = TINY | {"offload": {"optimizer": "cpu"}, "scheduler": {"type": "cosine", "warmup_steps": 2}, "gradient_accumulation_steps": 2}
    rc, out, _ = _train(capsys, _write(tmp_path, raw), "--steps", "1")
    lines = out.splitlines()
    # fp32 parameters live where they compute, as do the gradients; the Adam states in host memory.
    assert rc == 0 and lines[:6] == [
        "tierzero train",
        "  model            gpt (built-in: 2 layers, d_model 32), fresh weights, 26,368 parameters",
        "  tokens per step  128 (micro batch 2 x seq_len 32 x accumulation 2 x 1 rank)",
        "  placement        device: param 120.0 KiB, grad 120.0 KiB; cpu: exp_avg 120.0 KiB, exp_avg_sq 120.0 KiB; "
        "nvme: nothing (per rank)",
        "  schedule         1 step, adamw lr 0.01, cosine decay over 1 step to 0, linear warm-up over 2 steps",
        "  precision        fp32",
    ]
    assert lines[6].startswith("step 1/1 loss=") and " lr=0 " in lines[6]


def test_each_log_line_and_the_summary_json_carry_the_step_s_learning_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A linear warm-up over 4 steps in transformers' convention: step k runs at k/4 of optimizer.lr.
    raw = TINY | {"scheduler": {"type": "constant", "warmup_steps": 4}}
    summary = tmp_path / "summary.json"
    rc, out, _ = _train(capsys, _write(tmp_path, raw), "--summary-json", str(summary))
    assert rc == 0
    assert re.findall(r"^step \d/4 loss=[0-9.]+ lr=(\S+) tok/s=", out, flags=re.M) == ["0", "0.0025", "0.005", "0.0075"]
    assert json.loads(summary.read_text())["lrs"] == [0.0, 0.0025, 0.005, 0.0075]


# ---------------------------------------------------------------- resume


def test_resuming_a_finished_run_says_so_in_one_line_and_writes_no_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ck"
    config = _write(tmp_path, TINY | {"train": TINY["train"] | {"steps": 2}, "checkpoint": {"dir": str(root)}})
    summary = tmp_path / "summary.json"
    assert _train(capsys, config, "--summary-json", str(summary))[0] == 0
    finished = summary.read_text()
    rc, out, err = _train(capsys, config, "--resume", "--summary-json", str(summary))
    assert (rc, err) == (0, "")
    assert out == (
        f"resumed from {root / '2'} at step 2\n"
        "the run is already complete at step 2 (train.steps 2): nothing to train; raise train.steps (or --steps) "
        "to train further\n"
    )
    assert summary.read_text() == finished  # the summary of the run that finished it stays


def test_a_resume_from_a_directory_that_does_not_exist_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs" / "ck"
    config = _write(tmp_path, TINY | {"checkpoint": {"dir": str(root)}})
    rc, out, err = _train(capsys, config, "--resume")
    assert (rc, out) == (2, "")
    assert err == f"tierzero: error: --resume found no complete checkpoint under {root}: run without --resume to start from step 0\n"
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- no silent toy


def test_a_config_naming_no_model_and_no_data_is_refused_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(T, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    config = _write(tmp_path, {"train": {"steps": 1}, "zero": {"stage": 2}})
    assert _train(capsys, config) == (2, "", f"tierzero: error: {config} {NO_WORKLOAD}\n")
    # An empty model section says nothing either; a null data.path is the built-in fallback.
    config = _write(tmp_path, {"model": {}, "data": {"path": None}})
    assert _train(capsys, config) == (2, "", f"tierzero: error: {config} {NO_WORKLOAD}\n")


@pytest.mark.parametrize(
    "said", [["--set", "model.type=gpt"], ["--set", "model.n_layer=1"], ["--set", "data.path=TEXT"]]
)
def test_any_model_key_or_a_data_path_says_what_to_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], said: list[str]
) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    config = _write(tmp_path, {"train": {"steps": 1, "micro_batch_size": 2, "seq_len": 32}})
    rc, out, _ = _train(capsys, config, *(arg.replace("TEXT", str(text)) for arg in said))
    assert rc == 0 and "steps                1 of 1\n" in out


def test_a_deepspeed_json_alone_is_refused_and_its_dropped_keys_are_one_clean_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path, DEEPSPEED, "ds.json")
    rc, out, err = _train(capsys, config)
    assert (rc, out) == (2, "")
    assert err.splitlines() == [
        "tierzero: warning: DeepSpeed key zero_optimization.sub_group_size has no tierzero equivalent; ignored",
        "tierzero: warning: DeepSpeed key steps_per_print has no tierzero equivalent; ignored",
        f"tierzero: error: {config} {NO_WORKLOAD}",
    ]


def test_deepspeed_auto_values_say_what_they_resolved_to_in_the_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = _write(tmp_path, DEEPSPEED, "ds.json")
    rc, out, _ = _train(capsys, config, "--set", "model.type=gpt", "--set", "optimizer.lr=0.002", "--steps", "1",
                        "--set", "train.seq_len=32")  # fmt: skip
    autos = [line for line in out.splitlines() if line.startswith("  auto ")]
    assert rc == 0 and autos == [
        "  auto             train_batch_size -> train.micro_batch_size 1, gradient_accumulation_steps 1",
        "  auto             train_micro_batch_size_per_gpu -> train.micro_batch_size 1",
        "  auto             gradient_accumulation_steps -> gradient_accumulation_steps 1",
        # optimizer.params.lr is gone: the override set it
        "  auto             optimizer.params.weight_decay -> optimizer.weight_decay 0.01",
        "  auto             bf16.enabled -> precision.param_dtype fp32",
        "  auto             zero_optimization.reduce_bucket_size -> zero.reduce_bucket_size 25MiB",
    ]


def test_deepspeed_keys_map_to_the_tierzero_keys_of_the_mapping_table() -> None:
    assert auto_keys({"a": "auto", "b": {"c": "auto", "d": 1}, "e": ["auto"]}) == ["a", "b.c"]
    assert tierzero_keys("zero_optimization.offload_optimizer.device") == ("offload.optimizer", "offload.gradients")
    assert tierzero_keys("zero_optimization.offload_param.nvme_path") == ("tiers.nvme.path",)
    assert tierzero_keys("aio.thread_count") == ("tiers.nvme.threads",)
    assert tierzero_keys("optimizer.params.betas") == ("optimizer.betas",)
    assert tierzero_keys("bfloat16.enabled") == ("precision.param_dtype",)
    assert tierzero_keys("scheduler.params.warmup_min_lr") == ("scheduler.warmup_start_ratio",)
    assert tierzero_keys("zero_optimization.sub_group_size") == ()
    with pytest.warns(TierZeroConfigWarning, match="^DeepSpeed key steps_per_print has no tierzero equivalent; ignored$"):
        loaded = read_config({**DEEPSPEED, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}})
    assert loaded.autos[-1] == "zero_optimization.stage3_prefetch_bucket_size -> prefetch.bytes 64MiB"
    assert not loaded.names_workload and read_config({"model": {"type": "llama"}}).names_workload


def test_the_demo_config_and_the_presets_name_their_model(tmp_path: Path) -> None:
    for preset in sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")):
        assert read_config(preset, overrides={"tiers.nvme.path": str(tmp_path)}).names_workload, preset


# ---------------------------------------------------------------- bf16 on a CPU without it

SLOW_BF16 = (
    "precision.param_dtype is bf16, but this CPU has no bf16 instructions (avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
    "PyTorch emulates them, several times slower than fp32 (13x in one run); set precision.param_dtype: fp32 on this machine"
)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == frozenset({"fpu", "sse", "avx2", "avx512f"})
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(info) == frozenset({"fp", "asimd", "bf16"})
    info.write_text("processor\t: 0\n")
    assert cpu_flags(info) is None and cpu_flags(tmp_path / "missing") is None


def test_bf16_without_cpu_support_is_one_note() -> None:
    bf16, fp32 = load_config({"precision": {"param_dtype": "bf16"}}).precision, load_config({}).precision
    assert slow_bf16_note(bf16, flags=frozenset({"avx2", "avx512f"})) == SLOW_BF16
    assert slow_bf16_note(bf16, flags=frozenset({"avx512_bf16"})) is None
    assert slow_bf16_note(bf16, flags=frozenset({"amx_bf16"})) is None
    assert slow_bf16_note(bf16, flags=None) is None  # unknown: nothing said
    assert slow_bf16_note(fp32, flags=frozenset()) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compute is not the CPU's")
@pytest.mark.parametrize(("flags", "said"), [({"avx2"}, [f"tierzero: warning: {SLOW_BF16}"]), ({"avx2", "amx_bf16"}, [])])
def test_train_warns_once_of_bf16_on_a_cpu_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: set[str], said: list[str]
) -> None:
    monkeypatch.setattr(T, "cpu_flags", lambda: frozenset(flags))
    config = _write(tmp_path, TINY | {"precision": {"param_dtype": "bf16"}})
    rc, _, err = _train(capsys, config, "--steps", "2")
    assert rc == 0 and err.splitlines() == said
