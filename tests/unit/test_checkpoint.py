"""Checkpoints at one world size: exact resume, the files on disk, latest/keep, half-written saves."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from crc32c import crc32c
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

import tierzero
from tierzero.checkpoint import (
    CheckpointError,
    CheckpointFallbackWarning,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.store import SliceState

VOCAB, WIDTH = 24, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):
    """Embedding, two blocks, an LM head tied to the embedding (one slot, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def config(stage: int = 3, *, dtype: str = "fp32", offload: dict[str, str] | None = None, swap: Path | None = None, accumulation: int = 1) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "zero": {"stage": stage},
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        "precision": {"param_dtype": dtype},
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": accumulation,
        "offload": offload or {},
    }
    if swap is not None:
        cfg["tiers"] = {"nvme": {"path": str(swap)}}
    return cfg


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(engine: Any, first: int, last: int) -> None:
    accumulation = engine.cfg.gradient_accumulation_steps
    for step in range(first, last):
        tokens, targets = batch(step)
        for micro in range(accumulation):
            rows = slice(micro * 4 // accumulation, (micro + 1) * 4 // accumulation)
            engine.backward(engine(tokens[rows], targets[rows]))
            engine.step()


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


RUNS = [
    pytest.param(1, "fp32", {}, 1, id="stage1-fp32"),
    pytest.param(2, "bf16", {"optimizer": "cpu"}, 2, id="stage2-bf16-optimizer_cpu-accum2"),
    pytest.param(3, "bf16", {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}, 1, id="stage3-bf16-all_nvme"),
    pytest.param(3, "fp32", {"optimizer": "nvme"}, 2, id="stage3-fp32-optimizer_nvme-accum2"),
]


@pytest.mark.parametrize(("stage", "dtype", "offload", "accumulation"), RUNS)
def test_resumed_run_is_bitwise_the_uninterrupted_run(tmp_path: Path, stage: int, dtype: str, offload: dict[str, str], accumulation: int) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = config(stage, dtype=dtype, offload=offload, swap=swap, accumulation=accumulation)
    with tierzero.initialize(make_model(), cfg) as engine:
        train(engine, 0, 3)
        written = save_checkpoint(engine, tmp_path / "ckpt")
        train(engine, 3, 6)
        uninterrupted = engine.full_state_dict()
    # a fresh model with other initial weights: everything must come from the checkpoint
    torch.manual_seed(123)
    with tierzero.initialize(TinyLM(), cfg) as engine:
        assert load_checkpoint(engine, tmp_path / "ckpt") == written == tmp_path / "ckpt" / "3"
        assert engine.global_step == 3
        train(engine, 3, 6)
        assert_same_params(engine.full_state_dict(), uninterrupted)


def test_files_on_disk_hold_the_slices_the_layout_and_their_checksums(tmp_path: Path) -> None:
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        train(engine, 0, 2)
        path = save_checkpoint(engine, tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "latest"]
        assert (tmp_path / "latest").read_text() == "2\n"
        assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank-00000.json", "rank-00000.safetensors"]
        manifest = json.loads((path / "manifest.json").read_text())
        assert (manifest["step"], manifest["world_size"], manifest["stage"], manifest["param_dtype"]) == (2, 1, 3, "bfloat16")
        assert manifest["engine"]["global_step"] == 2 and manifest["engine"]["lr"] == 1e-2
        assert manifest["config"]["optimizer"]["type"] == "adamw"
        for name, record in manifest["files"].items():
            data = (path / name).read_bytes()
            assert record == {"bytes": len(data), "checksum": f"{crc32c(data):08x}"}
        units = {u["name"]: u for u in manifest["units"]}
        assert list(units) == [u.name for u in engine.units]
        for unit in engine.units:
            saved = units[unit.name]
            assert (saved["numel"], saved["padded_numel"], saved["world_size"]) == (unit.numel, unit.padded_numel, 1)
            assert saved["kinds"] == {"param": "bfloat16", "master": "float32", "exp_avg": "float32", "exp_avg_sq": "float32"}
            assert [(s["names"], s["shape"], s["offset"]) for s in saved["slots"]] == [
                ([b.name for b in slot.bindings], list(slot.shape), slot.offset) for slot in unit.slots
            ]
        assert units["root"]["slots"][0]["names"] == ["embed.weight", "head.weight"]
        with safe_open(str(path / "rank-00000.safetensors"), framework="pt") as f:
            assert len(list(f.keys())) == 4 * len(engine.units)
            for unit in engine.units:
                for kind in (Kind.PARAM, Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ):
                    stored = f.get_tensor(f"{unit.name}/{kind.value}")
                    assert torch.equal(stored, engine.store.home_tensor(SliceKey(unit.name, kind)))


def test_keep_prunes_to_the_newest_and_latest_follows(tmp_path: Path) -> None:
    with tierzero.initialize(make_model(), config(2)) as engine:
        for step in range(4):
            train(engine, step, step + 1)
            save_checkpoint(engine, tmp_path, keep=2)
        assert [p.name for p in list_checkpoints(tmp_path)] == ["3", "4"]
        assert (tmp_path / "latest").read_text() == "4\n"
        with pytest.raises(ValueError, match="checkpoint keep must be >= 1 \\(or None to keep all\\), got 0"):
            save_checkpoint(engine, tmp_path, keep=0)


def test_half_written_checkpoints_are_never_loaded_and_are_cleaned_up(tmp_path: Path) -> None:
    with tierzero.initialize(make_model(), config(3)) as engine:
        train(engine, 0, 1)
        good = save_checkpoint(engine, tmp_path)
        before = engine.full_state_dict()
        # a save killed before its rename (newer step, files but no manifest), and a
        # step directory without a manifest
        dead = tmp_path / ".tmp-7-deadbeef"
        dead.mkdir()
        (dead / "rank-00000.safetensors").write_bytes(b"\0" * 64)
        (tmp_path / "9").mkdir()
        fallback = r"loading .*/1, not the newer .*/9: it holds no manifest\.json"
        with pytest.warns(CheckpointFallbackWarning, match=fallback):
            assert find_checkpoint(tmp_path) == good
        with pytest.raises(CheckpointError, match=r"\.tmp-7-deadbeef is a half-written checkpoint"):
            find_checkpoint(dead)
        train(engine, 1, 2)
        with pytest.warns(CheckpointFallbackWarning, match=fallback):
            assert load_checkpoint(engine, tmp_path) == good
        assert engine.global_step == 1
        assert_same_params(engine.full_state_dict(), before)
        save_checkpoint(engine, tmp_path)  # step 1 again: replaces the old copy and clears the dead save
        assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "9", "latest"]
        assert load_checkpoint(engine, tmp_path / "1") == good


def test_no_checkpoint_is_a_file_not_found_error(tmp_path: Path) -> None:
    with tierzero.initialize(make_model(), config(3)) as engine:
        with pytest.raises(FileNotFoundError, match=f"no complete checkpoint under {tmp_path}"):
            load_checkpoint(engine, tmp_path)
        with pytest.raises(FileNotFoundError, match="no complete checkpoint under .*missing"):
            load_checkpoint(engine, tmp_path / "missing")


def test_rng_states_and_loss_scaler_are_restored(tmp_path: Path) -> None:
    cfg = config(3, dtype="fp16") | {"precision": {"param_dtype": "fp16", "initial_scale": 1024.0, "scale_window": 2}}
    with tierzero.initialize(make_model(), cfg) as engine:
        train(engine, 0, 3)
        scaler = engine.loss_scaler.state_dict()
        assert scaler != {"scale": 1024.0, "clean_steps": 0}  # it moved from where a fresh engine starts
        save_checkpoint(engine, tmp_path)
        expected = (torch.rand(3), np.random.rand(3), random.random())
        torch.manual_seed(5), np.random.seed(5), random.seed(5)
    with tierzero.initialize(make_model(), cfg) as engine:
        load_checkpoint(engine, tmp_path)
        assert engine.loss_scaler.state_dict() == scaler
        assert engine.global_step == 3
        drawn = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]


def test_nvme_slices_are_streamed_one_at_a_time_and_released(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    offload = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
    with tierzero.initialize(make_model(), config(3, dtype="bf16", offload=offload, swap=swap)) as engine:
        train(engine, 0, 1)
        # The step the next forward would take settles first (a save does so too), then the save streams.
        engine.stage.settle_step()
        engine.stage.last_step_report.wait()
        engine.store.reset_peaks()
        save_checkpoint(engine, tmp_path / "ckpt")
        cpu = engine.store.report().tiers[Tier.CPU]
        kinds = (Kind.PARAM, Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)
        assert all(engine.store.state(SliceKey(u.name, k)) is SliceState.HOME for u in engine.units for k in kinds)
        assert all(cpu.current_by_kind.get(k, 0) == 0 for k in kinds)
        # host copies came one slice at a time: each kind peaked at its largest slice, not the sum
        for kind in kinds:
            itemsize = 2 if kind is Kind.PARAM else 4
            largest, total = max(u.shard_numel for u in engine.units) * itemsize, sum(u.shard_numel for u in engine.units) * itemsize
            assert cpu.peak_by_kind[kind] == largest < total


def test_buffers_and_frozen_parameters_are_saved_and_restored(tmp_path: Path) -> None:
    def model(fill: float) -> TinyLM:
        m = make_model()
        m.register_buffer("seen", torch.full((3,), fill))
        m.blocks[0].up.bias.requires_grad_(False)
        with torch.no_grad():
            m.blocks[0].up.bias.fill_(fill)
        return m

    with tierzero.initialize(model(7.0), config(2)) as engine:
        train(engine, 0, 1)
        save_checkpoint(engine, tmp_path)
        # the frozen bias is its own unit's slice; the buffer stays the module's
        assert set(engine.module.state_dict()) == {"seen"}
        assert [u.name for u in engine.units if not u.trainable] == ["blocks.0:frozen"]
        expected = engine.full_state_dict()
        assert torch.equal(expected["blocks.0.up.bias"], torch.full_like(expected["blocks.0.up.bias"], 7.0))
    with tierzero.initialize(model(-1.0), config(2)) as engine:
        load_checkpoint(engine, tmp_path)
        assert torch.equal(engine.module.state_dict()["seen"], torch.full((3,), 7.0))
        assert_same_params(engine.full_state_dict(), expected)
    with tierzero.initialize(make_model(), config(2)) as engine, pytest.raises(
        CheckpointError, match="unit blocks.0 holds other parameters than this model's: load a checkpoint of the same model"
    ):
        # a model that trains what the checkpoint froze does not match it
        load_checkpoint(engine, tmp_path)


def test_engine_methods_default_to_the_configured_directory_and_keep(tmp_path: Path) -> None:
    cfg = config(2) | {"checkpoint": {"dir": str(tmp_path / "ckpt"), "keep": 1}}
    with tierzero.initialize(make_model(), cfg) as engine:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
            engine.load_checkpoint()
        for step in range(2):
            train(engine, step, step + 1)
            assert engine.save_checkpoint() == tmp_path / "ckpt" / str(step + 1)
        assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["2"]
        assert engine.save_checkpoint(tmp_path / "other", keep=3) == tmp_path / "other" / "2"
        assert engine.load_checkpoint() == tmp_path / "ckpt" / "2"
    with tierzero.initialize(make_model(), config(2)) as engine:
        with pytest.raises(ValueError, match="no checkpoint directory: pass one, or set checkpoint.dir in the config"):
            engine.save_checkpoint()
        assert engine.load_checkpoint(tmp_path / "other") == tmp_path / "other" / "2"
        assert engine.global_step == 2 and engine.micro_steps == 2


def test_saving_mid_accumulation_is_refused(tmp_path: Path) -> None:
    with tierzero.initialize(make_model(), config(2, accumulation=2)) as engine:
        tokens, targets = batch(0)
        engine.backward(engine(tokens[:2], targets[:2]))
        engine.step()
        with pytest.raises(ValueError, match=r"cannot save a checkpoint in the middle of gradient accumulation \(1 of 2 micro-steps done\)"):
            save_checkpoint(engine, tmp_path)
        assert not tmp_path.joinpath("latest").exists()
