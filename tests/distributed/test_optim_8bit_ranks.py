"""int8 Adam moments at two gloo ranks: NVMe gives the device's bits, and a checkpoint reshards block for block.

Each rank keeps its shard's codes and absmax ([Note: compact moments]); with states on NVMe
the run must give the bits of the states on the device, stage 2 and 3. The checkpoint the
NVMe run writes at 2 ranks is loaded at 1: its codes and absmax are the two ranks' end to
end, bit for bit ([Note: int8 moments in a checkpoint]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, run_ranks

import tierzero
from tierzero.checkpoint import load_checkpoint, save_checkpoint
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.optim.moments import MomentFormat, StateDtype

CASES = {
    "stage3": Case(stage=3, optimizer="adamw", steps=3, accumulation=1),
    "stage2": Case(stage=2, optimizer="adamw", steps=3, accumulation=1, dtype="bf16"),
}
PLACEMENTS = {"device": {}, "nvme": {"optimizer": "nvme"}}
INT8 = MomentFormat(StateDtype.INT8)


def _config(case: Case, offload: dict[str, str], swap: str) -> dict[str, Any]:
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": swap}}}
    config["optimizer"] = config["optimizer"] | {"state_dtype": "int8"}
    return config


def _moments(engine: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each unit's moments on this rank as (codes, absmax)."""
    out = {}
    for unit in engine.units:
        for kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ):
            key = SliceKey(unit.name, kind)
            stored = engine.store.fetch(key, to=Tier.CPU).wait().clone()
            engine.store.release(key)
            absmax, codes = INT8.split(stored, unit.shard_numel)
            out[str(key)] = (codes.clone(), absmax.clone())
    return out


def _job(rank: int, world_size: int, payload: tuple[str, str]) -> dict[str, Any]:
    swap, root = payload
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        for where, offload in PLACEMENTS.items():
            with tierzero.initialize(case.model(), _config(case, offload, swap)) as engine:
                losses = []
                for step in range(case.steps):
                    loss = case.loss(engine, *case.micro_batch(step, micro=0, rank=rank, world_size=world_size))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                if where == "nvme":
                    save_checkpoint(engine, Path(root) / name)
                out[f"{name}-{where}"] = {"losses": losses, "params": engine.full_state_dict(), "moments": _moments(engine)}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    swap, root = tmp_path_factory.mktemp("swap"), tmp_path_factory.mktemp("ckpt")
    return run_ranks(_job, world_size=2, payload=(str(swap), str(root))), root


@pytest.mark.parametrize("name", list(CASES))
def test_nvme_moments_give_the_device_bits_at_two_ranks(ranks: tuple[list[dict[str, Any]], Path], name: str) -> None:
    for rank in ranks[0]:
        nvme, device = rank[f"{name}-nvme"], rank[f"{name}-device"]
        assert nvme["losses"] == device["losses"]
        if device["params"] is not None:  # rank 0 gathers the weights
            assert all(torch.equal(nvme["params"][n], t) for n, t in device["params"].items())
        for key, (codes, absmax) in device["moments"].items():
            assert torch.equal(nvme["moments"][key][0], codes) and torch.equal(nvme["moments"][key][1], absmax)
    assert ranks[0][0][f"{name}-device"]["params"] is not None


@pytest.mark.parametrize("name", list(CASES))
def test_the_two_rank_checkpoint_loads_at_one_rank_block_for_block(ranks: tuple[list[dict[str, Any]], Path], name: str) -> None:
    results, root = ranks
    case = CASES[name]
    with tierzero.initialize(case.model(), _config(case, {}, str(root))) as engine:
        load_checkpoint(engine, root / name)
        loaded = _moments(engine)
        numels = {unit.name: unit.numel for unit in engine.units}
    for key, (codes, absmax) in loaded.items():
        unit = key.split("/")[0]
        written = [rank[f"{name}-nvme"]["moments"][key] for rank in results]
        assert torch.equal(codes[: numels[unit]], torch.cat([c for c, _ in written])[: numels[unit]])
        blocks = -(-numels[unit] // 2048)
        assert torch.equal(absmax[:blocks], torch.cat([a for _, a in written])[:blocks])
        assert bool(absmax[: blocks].gt(0).any())
