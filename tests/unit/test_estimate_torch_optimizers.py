"""`tierzero estimate`, `offload: auto` and `engine.memory_report()` count a torch.optim class's states as the class keeps them.

The reference is always a real instance after one step: the bytes of the tensors in its `state`,
summed. Lion holds 4 B an element, SGD 4 B with momentum and none without, RAdam 8 B and a 4-byte
`step` per tensor, Adafactor a row and a column per matrix: a count that took every class for the
fused AdamW (8 B an element) fails each of these.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero import api
from tierzero.cli.estimate import format_estimate
from tierzero.common.slices import Tier
from tierzero.config import load_config
from tierzero.engine.micro_step import micro_step
from tierzero.estimate.estimator import Bandwidth, estimate
from tierzero.models.builtin import build_model
from tierzero.optim.flat import make_optimizer
from tierzero.optim.groups import GroupRules
from tierzero.optim.torch_opt import TorchOptimizer, unit_pieces
from tierzero.optim.unit_states import unit_state_bytes
from tierzero.placement import MachineBudgets, TierBudget
from tierzero.placement.planner import RankBudgets, plan_placement
from tierzero.placement.prediction import measure_step_rate
from tierzero.stages.plan import Homes
from tierzero.units.unit import plan_units

TYPES: dict[str, tuple[str, dict[str, Any]]] = {
    "lion": ("lion", {}),
    "adafactor": ("adafactor", {}),
    "sgd": ("torch:torch.optim.SGD", {}),
    "sgd-momentum": ("torch:torch.optim.SGD", {"momentum": 0.9}),
    "radam": ("torch:torch.optim.RAdam", {}),
}
DISK = Bandwidth(read=2.0e9, write=3.0e9, source="test")
FLOPS = Bandwidth(read=1.0e11, write=1.0e11, source="test")


@pytest.fixture(scope="module")
def swap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("swap")


def _raw(name: str, swap: Path, *, offload: Any, param_dtype: str = "fp32") -> dict[str, Any]:
    kind, kwargs = TYPES.get(name, (name, {}))
    return {
        "zero": {"stage": 3, "unit_classes": ["Linear"]},
        "precision": {"param_dtype": param_dtype},
        "optimizer": {"type": kind, "lr": 1e-3, "weight_decay": 0.01, **({"kwargs": kwargs} if kwargs else {})},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "max_seq_len": 32},
        "train": {"steps": 1, "micro_batch_size": 2, "seq_len": 32},
        "offload": offload,
        "tiers": {"nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}, "cpu": {"keep_freed": 0}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
    }


def _held(instance: torch.optim.Optimizer | None) -> int:
    """The reference: bytes of the tensors in a real instance's state."""
    if instance is None:
        return 0
    return sum(t.nbytes for state in instance.state.values() for t in state.values() if isinstance(t, torch.Tensor))


def _budgets(cpu: int) -> MachineBudgets:
    return MachineBudgets(
        device=TierBudget(tier=Tier.DEVICE, nbytes=None, source="test"),
        cpu=TierBudget(tier=Tier.CPU, nbytes=cpu, source="test"),
        nvme=TierBudget(tier=Tier.NVME, nbytes=1 << 40, source="test"),
    )


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", sorted(TYPES))
def test_the_count_is_the_bytes_a_stepped_instance_holds(name: str, world_size: int, swap: Path) -> None:
    """Each rank's pieces: whole tensors, and at two ranks flat pieces of the tensors a shard cuts (rank 1
    holds the position embedding whole, a matrix, and the rest of the cut token embedding, flat)."""
    cfg = load_config(_raw(name, swap, offload="auto"))
    rules = GroupRules.from_config(cfg.optimizer)
    units = plan_units(build_model(cfg.model, device="meta", seed=0), world_size=world_size, unit_classes=["Linear"],
                       group_of=rules.group_of)  # fmt: skip
    trained = [unit for unit in units if unit.trainable]
    for rank in range(world_size):
        optimizer = make_optimizer(cfg.optimizer, rules.groups)
        assert isinstance(optimizer, TorchOptimizer)
        counted = unit_state_bytes(optimizer, units, rank=rank)
        for unit in trained:
            master, grad = torch.randn(unit.shard_numel), torch.randn(unit.shard_numel)
            optimizer.for_unit(unit, rank=rank, master=master).step(
                param=master, grad=grad, states={}, step=1, lr=optimizer.group_lrs(1.0)
            )
        held = {unit.name: _held(optimizer.units[unit.name].optimizer) for unit in trained}
        assert counted == held
        pieces = [piece.shape for unit in trained for piece in unit_pieces(unit, rank=rank)]
        assert sum(held.values()) == sum(_class_bytes(name, shape) for shape in pieces)


def _class_bytes(name: str, shape: tuple[int, ...]) -> int:
    """What each class keeps for one parameter, as its source reads: Lion and SGD's momentum one fp32
    buffer, RAdam two and a 4-byte `step`, Adafactor a `step` and a row and a column of a matrix (over
    its leading dimensions) or a full second moment of a 1-D tensor (a piece a shard cuts is one)."""
    numel = math.prod(shape)
    if name == "adafactor":
        return 4 + 4 * (math.prod(shape[:-2]) * (shape[-2] + shape[-1]) if len(shape) >= 2 else numel)
    return {"lion": 4 * numel, "sgd": 0, "sgd-momentum": 4 * numel, "radam": 8 * numel + 4}[name]


@pytest.mark.parametrize("name", sorted(TYPES))
def test_estimate_report_and_a_real_step_agree(name: str, swap: Path) -> None:
    offload = {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}
    cfg = load_config(_raw(name, swap, offload=offload))
    result = estimate(cfg, suggest=False)
    with tierzero.initialize(build_model(cfg.model, device="meta", seed=0), cfg) as engine:
        x = torch.randint(0, cfg.model.vocab_size, (2, 32))
        micro_step(engine, x, x, is_hf=False)
        optimizer = engine.stage.optimizer
        held = sum(_held(unit.optimizer) for unit in optimizer.units.values())
        assert engine.memory_report()["optimizer_states"] == {"cpu": held}
    cpu = result.tiers[Tier.CPU]
    assert cpu.optimizer_states == held and result.tiers[Tier.DEVICE].optimizer_states == 0
    assert cpu.home_total == sum(cpu.homes.values()) + held
    assert result.tiers[Tier.NVME].home_total == 0
    if held:  # shown in the table, and counted in the peak
        assert cpu.working["optimizer_states"] == held and " optimizer_states " in format_estimate(result)


def test_states_on_nvme_are_refused_by_the_estimate_too(swap: Path) -> None:
    cfg = load_config(_raw("lion", swap, offload="auto"))
    with pytest.raises(ValueError, match=r"^offload.optimizer places .*'s optimizer states on nvme, but Lion"):
        estimate(cfg, suggest=False, homes=Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.NVME))


def _tight_budget(name: str, swap: Path) -> int:
    """The host memory `name` needs with parameters and gradients on NVMe and its optimizer's in memory,
    and 64 KiB: where AdamW's 8 B an element do not fit beside the rest."""
    cfg = load_config(_raw(name, swap, offload="auto", param_dtype="bf16"))
    result = estimate(cfg, suggest=False, homes=Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.CPU))
    device, cpu = RankBudgets.of(_budgets(cpu=1), cfg).host_needs(result)
    return device + cpu + (64 << 10)


def _plan(cfg: Any, budget: int) -> Any:
    step_rate = measure_step_rate(cfg, numel=1 << 12)  # the class's own step, timed
    return plan_placement(cfg, budgets=_budgets(cpu=budget), disk=DISK, flops=FLOPS, copy_rate=5e9, step_rate=step_rate)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tight budget is the host's, which holds the device tier without a GPU")
@pytest.mark.parametrize("name", sorted(TYPES))
def test_auto_under_a_tight_budget_keeps_the_states_in_memory_and_trains(
    name: str, swap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, so the optimizer's home holds the fp32 master too: AdamW, under the same budget, has some of
    its optimizer states on NVMe (but RAdam, as big as AdamW's, gets a budget AdamW fits in)."""
    budget = _tight_budget(name, swap)
    if name != "radam":
        adamw = _plan(load_config(_raw("adamw", swap, offload="auto", param_dtype="bf16")), budget)
        assert Tier.NVME in adamw.homes.tiers("optimizer")
    plans: list[Any] = []
    monkeypatch.setattr(api, "plan_placement", lambda cfg, **_: plans.append(_plan(cfg, budget)) or plans[-1])
    cfg = load_config(_raw(name, swap, offload="auto", param_dtype="bf16"))
    with tierzero.initialize(build_model(cfg.model, device="meta", seed=0), cfg) as engine:
        (plan,) = plans
        assert Tier.NVME not in plan.homes.tiers("optimizer")
        assert not plan.budgets.shortfalls(plan.estimate)
        x = torch.randint(0, cfg.model.vocab_size, (2, 32))
        micro_step(engine, x, x, is_hf=False)
        assert engine.global_step == 1
        held = sum(_held(unit.optimizer) for unit in engine.stage.optimizer.units.values())
        report = engine.memory_report()["optimizer_states"]
    counted = {tier.value: e.optimizer_states for tier, e in plan.estimate.tiers.items() if e.optimizer_states}
    assert sum(report.values()) == held and {t: n for t, n in report.items() if n} == counted
