"""Checkpoints see an engine only through `Checkpointable`: the real Engine has every member, and
an object that is no Engine but has them saves and loads."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tierzero
from tierzero.checkpoint import Checkpointable, load_checkpoint, save_checkpoint
from tierzero.checkpoint.protocol import CheckpointStage, CheckpointStore, RunConfig
from tierzero.comm.collectives import CommCounter, CommGroup
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.stages.plan import SliceSpec
from tierzero.units.precision import LossScaler, StaticLossScaler
from tierzero.units.unit import Unit, plan_units


@dataclass
class _Done:
    value: Any = None

    def wait(self) -> Any:
        return self.value


@dataclass
class DictStore:
    """Every slice a host tensor in a dict: no tiers, nothing in flight."""

    slices: dict[SliceKey, torch.Tensor] = field(default_factory=dict)

    def home_tensor(self, key: SliceKey) -> torch.Tensor:
        return self.slices[key]

    def fetch(self, key: SliceKey, *, to: Tier) -> _Done:
        return _Done(self.slices[key].clone())

    def release(self, key: SliceKey) -> None:
        pass

    def write_back(self, key: SliceKey, src: torch.Tensor | None = None) -> _Done:
        assert src is not None
        self.slices[key].copy_(src)
        return _Done()


@dataclass
class ParamsOnlyStage:
    """One fp32 PARAM slice per unit, homed in host memory."""

    number: int = 3
    param_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def slice_specs(self, unit: Unit) -> list[SliceSpec]:
        return [SliceSpec(Kind.PARAM, unit.shard_numel, torch.float32, Tier.CPU)]

    def finish(self) -> None:
        pass


@dataclass
class PlainConfig:
    gradient_accumulation_steps: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"gradient_accumulation_steps": self.gradient_accumulation_steps}


@dataclass
class FakeEngine:
    """Just the members of `Checkpointable`, as plain attributes."""

    module: nn.Module
    units: list[Unit]
    store: DictStore
    cfg: PlainConfig = field(default_factory=PlainConfig)
    stage: ParamsOnlyStage = field(default_factory=ParamsOnlyStage)
    comm: CommGroup = field(default_factory=lambda: CommGroup(rank=0, world_size=1, counter=CommCounter()))
    loss_scaler: LossScaler = field(default_factory=StaticLossScaler)
    global_step: int = 0
    micro_steps: int = 0
    lr: float = 0.1
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))


def fake_engine() -> FakeEngine:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    units = plan_units(module, world_size=1)
    # Past the unit's numel a slice holds padding, which is zero in any engine (and after a load).
    store = DictStore({SliceKey(u.name, Kind.PARAM): torch.zeros(u.shard_numel) for u in units})
    for unit in units:
        store.slices[SliceKey(unit.name, Kind.PARAM)][: unit.numel] = torch.randn(unit.numel)
    return FakeEngine(module=module, units=units, store=store)


def test_an_object_that_is_no_engine_satisfies_the_protocol() -> None:
    engine = fake_engine()
    assert isinstance(engine, Checkpointable)
    assert isinstance(engine.stage, CheckpointStage)
    assert isinstance(engine.store, CheckpointStore)
    assert isinstance(engine.cfg, RunConfig)


def test_an_object_missing_a_member_does_not() -> None:
    @dataclass
    class NoLearningRate:
        inner: FakeEngine

        def __getattr__(self, name: str) -> Any:
            if name == "lr":
                raise AttributeError(name)
            return getattr(self.inner, name)

    assert not isinstance(NoLearningRate(fake_engine()), Checkpointable)


def test_the_protocol_alone_is_enough_to_save_and_load(tmp_path: Path) -> None:
    engine = fake_engine()
    engine.global_step, engine.micro_steps, engine.lr = 7, 7, 0.05
    saved = {key: t.clone() for key, t in engine.store.slices.items()}
    buffers = {name: t.clone() for name, t in engine.module.state_dict().items()}
    assert save_checkpoint(engine, tmp_path) == tmp_path / "7"

    other = fake_engine()
    for tensor in other.store.slices.values():
        tensor.fill_(-1.0)
    assert load_checkpoint(other, tmp_path) == tmp_path / "7"
    assert (other.global_step, other.micro_steps, other.lr, other.run_id) == (7, 7, 0.05, engine.run_id)
    for key, tensor in saved.items():
        assert torch.equal(other.store.slices[key], tensor), key
    for name, tensor in other.module.state_dict().items():
        assert torch.equal(tensor, buffers[name]), name


def test_the_real_engine_satisfies_the_protocol() -> None:
    """Fails when the protocol asks for a member the engine lacks."""
    cfg = {"zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": 1e-2}}
    with tierzero.initialize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), cfg) as engine:
        assert isinstance(engine, Checkpointable)
        assert isinstance(engine.stage, CheckpointStage)
        assert isinstance(engine.store, CheckpointStore)
        assert isinstance(engine.cfg, RunConfig)
        assert isinstance(engine.loss_scaler, LossScaler)
        engine.micro_steps = 0  # a load sets it: it must stay settable
