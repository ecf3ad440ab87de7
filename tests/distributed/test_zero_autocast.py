"""precision.autocast: the steps of plain PyTorch under torch.autocast(bf16), bit for bit.

Plain PyTorch keeps fp32 parameters and an fp32 AdamW; the engine keeps the linear layers'
weights in bf16 and the embeddings and norms in fp32 units ([Note: autocast's fp32
parameters] in tierzero/units/precision.py). At two ranks the reference sums the two halves'
gradients in rank order, as the engine's reduce-scatter does, and halves the sum; there
the engine's sharded AdamW rounds a few elements one ulp apart from torch's (so does fp32
without autocast), so the stages must agree bit for bit and the reference to rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, decay_groups, run_ranks
from torch import nn

import tierzero
import tierzero.units.unit as units_module
from tierzero.cli.bench.contenders import LR, PLACEMENTS, EngineTraining, engine_config, gpt, token_batch

STEPS = 4
BATCH, SEQ = 4, 16
#: (stage, placement) at one rank: the issue's placement at stage 3, the others in memory.
ONE_RANK = [(3, "params-optimizer-nvme"), (3, "device"), (2, "cpu"), (1, "device")]


@pytest.fixture(params=["merged", "companions"])
def fp32_units(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tiny GPT's norms join root:fp32 (merged, the default: a few KiB a block), or, with
    no size below which they merge, form a `blocks.<i>:fp32` unit beside each block."""
    if request.param == "companions":
        monkeypatch.setattr(units_module, "SMALL_FP32_BYTES", 0)
    return str(request.param)


def _config(stage: int, placement: str, nvme_path: Path | str, **precision: Any) -> dict[str, Any]:
    cfg = engine_config(stage=stage, placement=PLACEMENTS[placement], nvme_path=nvme_path, dtype="bf16")
    cfg["precision"].update(autocast=True, **precision)
    return cfg


def _plain(world_size: int) -> dict[str, torch.Tensor]:
    """fp32 parameters and AdamW, each rank's half of the batch under autocast, gradients summed in rank order."""
    model = gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    for step in range(STEPS):
        tokens, targets = token_batch(step, batch=BATCH, seq=SEQ)
        summed: list[torch.Tensor] | None = None
        for part_tokens, part_targets in zip(tokens.chunk(world_size), targets.chunk(world_size), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(part_tokens, part_targets)
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            summed = grads if summed is None else [a + b for a, b in zip(summed, grads, strict=True)]
            model.zero_grad(set_to_none=True)
        assert summed is not None
        for p, g in zip(model.parameters(), summed, strict=True):
            p.grad = g / world_size
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _train(cfg: dict[str, Any], *, rank: int, world_size: int) -> tuple[dict[str, torch.Tensor] | None, Any]:
    run = EngineTraining("tiny", cfg)
    try:
        for step in range(STEPS):
            tokens, targets = token_batch(step, batch=BATCH, seq=SEQ)
            run.step(tokens.chunk(world_size)[rank], targets.chunk(world_size)[rank])
        units = [(u.name, u.dtype) for u in run.engine.units]
        plan = run.engine.plan
        kinds = {unit.name: {spec.kind.value: spec.dtype for spec in plan.of(unit)} for unit in run.engine.units}
        return run.engine.full_state_dict(), (units, kinds)
    finally:
        run.close()


def _differing(state: dict[str, torch.Tensor] | None, reference: dict[str, torch.Tensor]) -> list[str]:
    assert state is not None
    return [name for name, p in reference.items() if not torch.equal(state[name], p)]


@pytest.mark.parametrize(("stage", "placement"), ONE_RANK, ids=[f"stage{s}-{p}" for s, p in ONE_RANK])
def test_one_rank_steps_as_plain_autocast(tmp_path: Path, stage: int, placement: str, fp32_units: str) -> None:
    state, (units, kinds) = _train(_config(stage, placement, tmp_path), rank=0, world_size=1)
    assert _differing(state, _plain(1)) == []
    # The embeddings (with the LM head tied to them) and the norms stay fp32, their own master.
    fp32 = [name for name, dtype in units if dtype is not None]
    assert fp32 == (["root:fp32"] if fp32_units == "merged" else ["blocks.0:fp32", "blocks.1:fp32", "root:fp32"])
    assert kinds["blocks.0"] == {"param": torch.bfloat16, "grad": torch.bfloat16, "master": torch.float32,
                                 "exp_avg": torch.float32, "exp_avg_sq": torch.float32}  # fmt: skip
    assert kinds[fp32[0]] == {"param": torch.float32, "grad": torch.float32,
                              "exp_avg": torch.float32, "exp_avg_sq": torch.float32}  # fmt: skip


def test_bf16_alone_is_not_autocast(tmp_path: Path) -> None:
    """Without precision.autocast the embeddings and norms compute in bf16: other bits."""
    cfg = _config(3, "device", tmp_path)
    cfg["precision"]["autocast"] = False
    state, (units, _) = _train(cfg, rank=0, world_size=1)
    assert all(dtype is None for _, dtype in units)
    assert len(_differing(state, _plain(1))) > 0


def _two_ranks(rank: int, world_size: int, nvme_root: str) -> list[dict[str, torch.Tensor] | None]:
    out = []
    for stage, placement in ((1, "device"), (2, "cpu"), (3, "params-optimizer-nvme")):
        nvme_path = Path(nvme_root) / f"{stage}-{rank}"
        nvme_path.mkdir()
        cfg = _config(stage, placement, nvme_path, reduce_dtype="fp32")
        out.append(_train(cfg, rank=rank, world_size=world_size)[0])
    return out


def test_two_ranks_step_as_plain_autocast_with_fp32_reduction(tmp_path: Path, fp32_units: str) -> None:
    """Each bucket's collective moves bf16 and fp32 units apart (comm.py splits them by dtype)."""
    states = run_ranks(_two_ranks, world_size=2, payload=str(tmp_path))[0]
    first = states[0]
    assert first is not None
    for stage, state in zip((2, 3), states[1:], strict=True):
        assert _differing(state, first) == [], stage
    reference = _plain(2)
    # bf16 without autocast lands about 1e-2 away; one ulp here and there is 1e-7.
    gaps = {name: float((first[name] - p).norm() / p.norm()) for name, p in reference.items()}
    assert max(gaps.values()) < 1e-6, gaps


def _plain_case(case: Case) -> nn.Module:
    """`case`'s model trained by plain PyTorch under autocast, fused AdamW on the engine's default groups."""
    model = case.model()
    opt = torch.optim.AdamW(decay_groups(model, 0.01), lr=3e-3, fused=True)
    for step in range(case.steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = case.loss(model, *case.batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _autocast_engine(case: Case, nvme_path: Path) -> Any:
    config = case.config()
    config["precision"] = {"param_dtype": "bf16", "autocast": True}
    config |= {"offload": {"params": "nvme", "optimizer": "nvme"}, "tiers": {"nvme": {"path": str(nvme_path)}}}
    return tierzero.initialize(case.model(), config)


def _steps(engine: Any, case: Case, steps: range) -> None:
    for step in steps:
        engine.backward(case.loss(engine, *case.batch(step)))
        engine.step()


def _case(model_name: str, *, lora: bool = False) -> Case:
    return Case(
        stage=3, optimizer="adamw", steps=STEPS, clip=0.0, accumulation=1, global_batch=4,
        model_name=model_name, lora=lora,
    )  # fmt: skip


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_transformers_models_step_as_plain_autocast(tmp_path: Path, model_name: str) -> None:
    """GPT-2's Conv1D layers (an addmm autocast lowers) move in bf16, its tied embeddings and
    norms stay fp32; Llama's RMSNorm weights too. The engine's default groups leave biases and
    norms undecayed: so does the reference."""
    case = _case(model_name)
    model = _plain_case(case)
    with _autocast_engine(case, tmp_path) as engine:
        _steps(engine, case, range(case.steps))
        lowered = sum(u.numel for u in engine.units if u.dtype is None)
        state = engine.full_state_dict()
    assert lowered > 0.5 * sum(p.numel() for p in model.parameters())  # most of the model moves in bf16
    assert _differing(state, {name: p.detach() for name, p in model.named_parameters()}) == []


def test_lora_adapters_step_as_plain_autocast(tmp_path: Path) -> None:
    """A frozen base keeps its lowered weights in bf16 only (what autocast computes with) and its
    norms in fp32: the adapters train bit for bit as plain autocast's."""
    case = _case("gpt2", lora=True)
    model = _plain_case(case)
    with _autocast_engine(case, tmp_path) as engine:
        assert {u.name for u in engine.units if u.dtype is not None} == {"root:fp32:frozen"}
        _steps(engine, case, range(case.steps))
        state = engine.full_state_dict()
    trained = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 4 and _differing(state, trained) == []
    frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    assert state is not None
    for name, p in frozen.items():
        kept = any(part in name for part in ("wte", "wpe", "ln_"))  # embeddings and norms: fp32
        assert torch.equal(state[name], p if kept else p.bfloat16().float()), name


def test_a_resumed_run_continues_bit_for_bit(tmp_path: Path) -> None:
    case = _case("gpt2")
    with _autocast_engine(case, tmp_path) as engine:
        _steps(engine, case, range(case.steps))
        straight = engine.full_state_dict()
    with _autocast_engine(case, tmp_path) as engine:
        _steps(engine, case, range(2))
        engine.save_checkpoint(tmp_path / "ckpt")
    with _autocast_engine(case, tmp_path) as engine:
        engine.load_checkpoint(tmp_path / "ckpt")
        _steps(engine, case, range(2, case.steps))
        resumed = engine.full_state_dict()
    assert straight is not None and _differing(resumed, straight) == []
