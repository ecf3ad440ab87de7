"""Stage 3's step in backward reads ahead past the units whose states live in memory.

A unit whose optimizer states stay in host memory (the planner's split of a kind) has
nothing for the disk to do while its backward runs: the states of the NVMe-homed unit
after it are read meanwhile, within the step pipeline's bound, where such a unit's group
weighs only what the store copies for it (its gradient).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tierzero.comm import dist as D
from tierzero.common.slices import Kind, Tier, align_up
from tierzero.config import load_config
from tierzero.engine.engine import Engine
from tierzero.stages.plan import Homes
from tierzero.stages.step import group_sizes

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402

CASE = Case(stage=3, optimizer="adamw", steps=3, clip=0.0, accumulation=1, global_batch=4)
#: Parameters in host memory, gradients handed to the step in backward, states on NVMe but blocks.1's.
HOMES = Homes(params=Tier.CPU, grads=Tier.NVME, optimizer=Tier.NVME, units={("blocks.1", "optimizer"): Tier.CPU})


def _engine(swap: Path, homes: Homes) -> Engine:
    config = load_config(CASE.config() | {"tiers": {"nvme": {"path": str(swap)}}})
    return Engine(CASE.model(), config, ctx=D.setup(timeout_s=60), homes=homes)


def _train(engine: Engine, events: list[tuple[str, str]] | None = None) -> dict[str, torch.Tensor]:
    with engine:
        for step in range(CASE.steps):
            if events is not None and step == CASE.steps - 1:
                _record(engine, events)
            loss = engine(*CASE.batch(step))
            engine.backward(loss)
            engine.step()
        params = engine.full_state_dict()
    assert params is not None
    return params


def _record(engine: Engine, events: list[tuple[str, str]]) -> None:
    """Log each unit's backward start and each read of an exp_avg slice, in order."""
    stage, store = engine.stage, engine.store
    pre_backward, fetch = stage.pre_backward, store.fetch

    def backward(unit: Any) -> None:
        events.append(("backward", unit.name))
        pre_backward(unit)

    def fetched(key: Any, **kwargs: Any) -> Any:
        if key.kind is Kind.EXP_AVG:
            events.append(("read", key.unit))
        return fetch(key, **kwargs)

    stage.pre_backward = backward  # type: ignore[method-assign]
    store.fetch = fetched  # type: ignore[method-assign]


def test_a_unit_in_memory_weighs_only_its_gradient(tmp_path: Path) -> None:
    engine = _engine(tmp_path, HOMES)
    with engine:
        sizes = group_sizes(engine.stage)
        plan = engine.stage.plan

        def nbytes(unit: str, *kinds: Kind) -> int:
            return sum(align_up(spec.nbytes) for spec in plan.specs[unit] if spec.kind in kinds)

        assert sizes["blocks.1"] == nbytes("blocks.1", Kind.GRAD)  # params and states are the homes themselves
        assert sizes["blocks.0"] == nbytes("blocks.0", Kind.GRAD, Kind.EXP_AVG, Kind.EXP_AVG_SQ)
        assert sizes["blocks.0"] > 2 * sizes["blocks.1"]


def test_the_states_after_a_unit_in_memory_are_read_during_its_backward(tmp_path: Path) -> None:
    for swap in ("split", "nvme"):
        (tmp_path / swap).mkdir()
    events: list[tuple[str, str]] = []
    split = _train(_engine(tmp_path / "split", HOMES), events)
    # The backward takes blocks.2, blocks.1, blocks.0: blocks.0's states, on NVMe, come up while
    # blocks.1 (in memory) runs, before its backward starts, not after.
    assert events.index(("read", "blocks.0")) < events.index(("backward", "blocks.1"))
    assert events.index(("backward", "blocks.2")) < events.index(("read", "blocks.0"))
    whole = _train(_engine(tmp_path / "nvme", Homes(params=Tier.CPU, grads=Tier.NVME, optimizer=Tier.NVME)))
    assert [name for name in whole if not torch.equal(whole[name], split[name])] == []
