"""The two contenders the benches and the GPU checks set side by side, and where tierzero puts its state.

`PlainTraining` is a built-in GPT trained by plain PyTorch (`torch.optim.AdamW(fused=True)`,
everything in memory on one device); `EngineTraining` is the same model, seed and batches
trained by tierzero with a ZeRO stage and a `Placement` of its state. `run_parity` trains
both for a few steps and compares them, as the CPU parity tests in tests/distributed do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierzero.api import initialize
from tierzero.common.slices import Tier
from tierzero.models.builtin import GPT, PRESETS

__all__ = [
    "MATRIX",
    "PLACEMENTS",
    "EngineSteps",
    "EngineTraining",
    "ParityResult",
    "Placement",
    "PlainTraining",
    "difference_to_autocast",
    "engine_config",
    "gpt",
    "max_param_difference",
    "placement_matrix",
    "run_parity",
    "token_batch",
]

LR = 1e-3
PARITY_WEIGHT_DECAY = 0.01


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """The home tier of each kind of state (the config's `offload` section)."""

    name: str
    params: Tier = Tier.DEVICE
    gradients: Tier = Tier.DEVICE
    optimizer: Tier = Tier.DEVICE

    def for_stage(self, stage: int) -> Placement:
        """What `stage` allows of it: parameters leave the device at stage 3 only, gradients at 2 and 3."""
        return Placement(
            name=self.name,
            params=self.params if stage >= 3 else Tier.DEVICE,
            gradients=self.gradients if stage >= 2 else Tier.DEVICE,
            optimizer=self.optimizer,
        )

    def homes(self) -> tuple[Tier, Tier, Tier]:
        return self.params, self.gradients, self.optimizer

    def offload(self) -> dict[str, str]:
        return {"params": self.params.value, "gradients": self.gradients.value, "optimizer": self.optimizer.value}


_D, _C, _N = Tier.DEVICE, Tier.CPU, Tier.NVME
PLACEMENTS: dict[str, Placement] = {
    p.name: p
    for p in (
        Placement(name="device"),
        Placement(name="cpu", params=_C, gradients=_C, optimizer=_C),
        Placement(name="nvme", params=_N, gradients=_N, optimizer=_N),
        Placement(name="mixed", params=_N, gradients=_C, optimizer=_D),
        Placement(name="params-cpu", params=_C),
        Placement(name="params-nvme", params=_N),
        Placement(name="params-optimizer-nvme", params=_N, optimizer=_N),
    )
}
"""Named placements; `params-optimizer-nvme` is what `tierzero bench train` offloads."""

MATRIX = ("device", "cpu", "nvme", "mixed")
"""The placements the GPU parity tests run at every stage."""


def placement_matrix(stages: tuple[int, ...] = (1, 2, 3), names: tuple[str, ...] = MATRIX) -> list[tuple[int, Placement]]:
    """(stage, placement) pairs, each placement cut to what its stage allows, without repeats."""
    out: list[tuple[int, Placement]] = []
    for stage in stages:
        seen: set[tuple[Tier, Tier, Tier]] = set()
        for name in names:
            placement = PLACEMENTS[name].for_stage(stage)
            if placement.homes() not in seen:
                seen.add(placement.homes())
                out.append((stage, placement))
    return out


def engine_config(
    *,
    stage: int,
    placement: Placement,
    nvme_path: str | Path,
    clip: float = 0.0,
    dtype: str = "fp32",
    weight_decay: float = 0.0,
    autocast: bool = False,
) -> dict[str, Any]:
    """tierzero's side of the comparison: AdamW as the plain contender's, every parameter decayed alike;
    `autocast`: `precision.autocast`, the numerics of the plain contender under autocast."""
    optimizer = {"type": "adamw", "lr": LR, "weight_decay": weight_decay, "no_decay": [], "no_decay_modules": []}
    return {
        "zero": {"stage": stage},
        "precision": {"param_dtype": dtype, "autocast": autocast},
        "gradient_clipping": clip,
        "optimizer": optimizer,
        "offload": placement.for_stage(stage).offload(),
        "tiers": {"nvme": {"path": str(nvme_path)}},
    }


def gpt(preset: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(PRESETS[preset])


def token_batch(step: int, *, batch: int, seq: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for both contenders: `step` seeds it."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


class PlainTraining:
    """Plain PyTorch on `device`: the model, torch's fused AdamW, clip_grad_norm_, autocast for bf16."""

    def __init__(
        self,
        preset: str,
        *,
        clip: float = 0.0,
        dtype: str = "fp32",
        device: torch.device | str = "cpu",
        weight_decay: float = 0.0,
    ) -> None:
        self.device = torch.device(device)
        self.model = gpt(preset).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=weight_decay, fused=True)
        self.clip, self.autocast = clip, dtype == "bf16"

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step; the loss stays a tensor on the device (reading it would synchronise)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(tokens, targets)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close(self) -> None:
        pass


class EngineSteps:
    """A contender whose `engine` trains by three calls a step, `engine(x, y)`, `backward`, `step`:
    tierzero's, and DeepSpeed's (bench train --against deepspeed)."""

    engine: Any

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step; the loss stays a tensor on the device (reading it would synchronise)."""
        _, loss = self.engine(tokens, targets)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


class EngineTraining(EngineSteps):
    """tierzero on the same model."""

    def __init__(self, preset: str, config: dict[str, Any]) -> None:
        self.engine = initialize(gpt(preset), config)

    def close(self) -> None:
        self.engine.close()


def max_param_difference(engine: Any, model: torch.nn.Module) -> float:
    """The largest per-tensor norm-relative difference between the engine's parameters and `model`'s."""
    state = engine.full_state_dict()
    assert state is not None, "full_state_dict() is rank 0's"
    return _max_difference(state, model)


def _max_difference(state: dict[str, torch.Tensor], model: torch.nn.Module) -> float:
    return max(
        float((state[name].float() - p.detach().cpu()).norm() / p.detach().cpu().norm())
        for name, p in model.named_parameters()
    )


def difference_to_autocast(
    preset: str, config: dict[str, Any], *, steps: int, batch: int, seq: int, clip: float = 0.0
) -> tuple[float, float]:
    """After `steps` steps on the same batches, the largest per-tensor difference to plain PyTorch
    under autocast(bf16): of tierzero's bf16 with `config`, and of plain fp32 PyTorch. autocast
    rounds each product's inputs to bf16 and keeps fp32 elsewhere, so any other precision, fp32
    included, drifts from it: the second is how far exact arithmetic does."""
    reference, fp32 = PlainTraining(preset, clip=clip, dtype="bf16"), PlainTraining(preset, clip=clip)
    tz = EngineTraining(preset, config)
    try:
        for step in range(steps):
            tokens, targets = token_batch(step, batch=batch, seq=seq)
            for runner in (reference, fp32, tz):
                runner.step(tokens, targets)
        exact = {name: p.detach().cpu() for name, p in fp32.model.named_parameters()}
        return max_param_difference(tz.engine, reference.model), _max_difference(exact, reference.model)
    finally:
        tz.close()


@dataclass(frozen=True, slots=True, kw_only=True)
class ParityResult:
    stage: int
    placement: Placement
    plain_losses: tuple[float, ...]
    engine_losses: tuple[float, ...]
    max_param_difference: float
    memory: dict[str, Any]
    """The engine's `memory_report()` after the last step."""

    @property
    def max_loss_difference(self) -> float:
        return max(abs(a - b) for a, b in zip(self.plain_losses, self.engine_losses, strict=True))


def run_parity(
    *,
    stage: int,
    placement: Placement,
    nvme_path: str | Path,
    device: torch.device | str,
    steps: int = 4,
    preset: str = "tiny",
    seq: int = 32,
    batch: int = 2,
    dtype: str = "fp32",
) -> ParityResult:
    """Train both contenders `steps` steps on the same batches, with weight decay; their losses and final
    parameters. bf16: plain PyTorch under autocast beside the engine's `precision.autocast`."""
    plain = PlainTraining(preset, device=device, weight_decay=PARITY_WEIGHT_DECAY, dtype=dtype)
    config = engine_config(
        stage=stage, placement=placement, nvme_path=nvme_path, weight_decay=PARITY_WEIGHT_DECAY, dtype=dtype,
        autocast=dtype != "fp32",
    )  # fmt: skip
    tz = EngineTraining(preset, config)
    plain_losses, engine_losses = [], []
    try:
        for step in range(steps):
            tokens, targets = token_batch(step, batch=batch, seq=seq, device=device)
            plain_losses.append(float(plain.step(tokens, targets)))
            engine_losses.append(float(tz.step(tokens, targets)))
        difference = max_param_difference(tz.engine, plain.model)
        memory = tz.engine.memory_report()
    finally:
        tz.close()
    return ParityResult(
        stage=stage,
        placement=placement.for_stage(stage),
        plain_losses=tuple(plain_losses),
        engine_losses=tuple(engine_losses),
        max_param_difference=difference,
        memory=memory,
    )
