"""What `tierzero train` says before its first step: the model, the tokens of a step, where the state lives, the schedule, and what each "auto" became.

The run's own words for what it is about to do, so that a config that trains something other
than the user meant (a demo model, a batch half the size) shows before the first step, not in
the summary at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierzero.common.sizes import format_size
from tierzero.config import Config

__all__ = ["RunHeader"]

_TIERS = ("device", "cpu", "nvme")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunHeader:
    """What rank 0 prints once the engine is built; `lines()` is the text."""

    cfg: Config
    model_class: str
    """The class of the model built (e.g. GPT, LlamaForCausalLM)."""
    parameters: int
    trained: int
    """Parameters the optimizer steps: all of them, or a LoRA run's adapters."""
    placement: dict[str, dict[str, int]]
    """Bytes of each kind by home tier on this rank (`engine.memory_report()["placement"]`)."""
    planned: str | None = None
    """The planner's choice when an `offload` key is auto."""
    autos: tuple[str, ...] = ()
    """Each DeepSpeed "auto" value and what it resolved to (`LoadedConfig.autos`)."""

    @classmethod
    def of(cls, cfg: Config, engine: Any, *, model_class: str, parameters: int, trained: int, autos: tuple[str, ...]) -> RunHeader:
        """The header of a run of `engine`, built from `cfg`: where its state lives, and what the planner chose."""
        planned = None if engine.placement is None else engine.placement.label
        placement = engine.memory_report()["placement"]
        return cls(cfg=cfg, model_class=model_class, parameters=parameters, trained=trained, placement=placement, planned=planned, autos=autos)

    def lines(self, *, world_size: int) -> list[str]:
        rows = [
            ("model", self._model()),
            ("tokens per step", self._tokens(world_size)),
            ("placement", self._placement()),
            ("schedule", self._schedule()),
            ("precision", self._precision()),
        ]
        if self.planned is not None:
            rows.append(("auto", f"offload -> {self.planned} (the planner's choice, above)"))
        rows += [("auto", text) for text in self.autos]
        return ["tierzero train", *(f"  {k:<16} {v}" for k, v in rows)]

    def _model(self) -> str:
        model = self.cfg.model
        if model.pretrained is not None:
            what = f"pretrained {model.pretrained} ({self.model_class})"
        elif model.type == "transformers":
            what = f"transformers {model.transformers_class}, fresh weights"
        else:
            what = f"{model.type} (built-in: {model.n_layer} layers, d_model {model.d_model}), fresh weights"
        count = f"{self.parameters:,} parameters"
        if self.trained != self.parameters:
            count += f", {self.trained:,} trained (LoRA r {model.lora.r})" if model.lora.r else f", {self.trained:,} trained"
        return f"{what}, {count}"

    def _tokens(self, world_size: int) -> str:
        train, accumulation = self.cfg.train, self.cfg.gradient_accumulation_steps
        total = train.micro_batch_size * train.seq_len * accumulation * world_size
        ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
        return (
            f"{total:,} (micro batch {train.micro_batch_size} x seq_len {train.seq_len} x accumulation "
            f"{accumulation} x {ranks})"
        )

    def _placement(self) -> str:
        tiers = []
        for tier in _TIERS:
            kinds = self.placement.get(tier, {})
            held = ", ".join(f"{kind} {format_size(n)}" for kind, n in kinds.items()) or "nothing"
            tiers.append(f"{tier}: {held}")
        return "; ".join(tiers) + " (per rank)"

    def _schedule(self) -> str:
        cfg = self.cfg
        opt, sched = cfg.optimizer, cfg.scheduler
        text = f"{_steps(cfg.train.steps)}, {opt.type} lr {opt.lr:g}, {sched.type}"
        if sched.type != "constant":
            floor = f" to {sched.min_lr_ratio:g} x lr" if sched.min_lr_ratio else " to 0"
            text += f" decay over {_steps(sched.total_steps or cfg.train.steps)}{floor}"
        if sched.warmup_steps:
            text += f", {sched.warmup_type} warm-up over {_steps(sched.warmup_steps)}"
        if sched.convention == "deepspeed":
            text += ", stepped as DeepSpeed does"
        return text

    def _precision(self) -> str:
        precision = self.cfg.precision
        text = precision.param_dtype + (" under autocast" if precision.autocast else "")
        if precision.param_dtype == "fp16":
            text += f", loss scale {precision.loss_scale}"
        return text


def _steps(n: int) -> str:
    return "1 step" if n == 1 else f"{n:,} steps"
