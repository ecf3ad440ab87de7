"""The `optimizer` and `scheduler` sections: what steps the weights, and at which learning rate."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from tierzero.config.checks import BETAS, RATIO, Check, choice_check, float_check, int_check
from tierzero.config.errors import ConfigError
from tierzero.config.tree import Section, setting

TORCH_WEIGHT_DECAY = {"adamw": 0.01, "adam": 0.0, "sgd": 0.0}
"""The default weight decay of torch.optim.AdamW, Adam and SGD, keyed by `optimizer.type` (the other types: 0,
as torch.optim.Adafactor's and Lion's)."""
PER_UNIT_TYPES = ("lion", "adafactor")
"""Named types stepped through a torch.optim class, one instance per unit, like `torch:<class>` ones."""
TORCH_PREFIX = "torch:"
STATE_DTYPES = ("fp32", "bf16", "int8")
"""`optimizer.state_dtype`: how Adam's moments are stored (tierzero/optim/moments.py)."""


def _patterns(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) and p.strip() for p in value):
        raise ValueError(value)
    return tuple(value)


def _lr_multipliers(value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.strip() for k in value):
        raise ValueError(value)
    factors = {k: float(v) for k, v in value.items() if not isinstance(v, bool)}
    if len(factors) != len(value) or not all(0.0 <= f < float("inf") for f in factors.values()):
        raise ValueError(value)
    return factors


def _optimizer_type(value: Any) -> str:
    if isinstance(value, str) and value.startswith(TORCH_PREFIX):
        module, _, name = value[len(TORCH_PREFIX) :].rpartition(".")
        if module and name.isidentifier() and all(part.isidentifier() for part in module.split(".")):
            return value
        raise ValueError(value)
    if not isinstance(value, str) or value.lower() not in (*TORCH_WEIGHT_DECAY, *PER_UNIT_TYPES):
        raise ValueError(value)
    return value.lower()


def _kwargs(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise ValueError(value)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}


def per_unit(optimizer_type: str) -> bool:
    """Whether `optimizer.type` is a torch.optim class stepped unit by unit (lion, adafactor, torch:<class>)."""
    return optimizer_type in PER_UNIT_TYPES or optimizer_type.startswith(TORCH_PREFIX)


OPTIMIZER_TYPE = Check(
    f"one of {', '.join((*TORCH_WEIGHT_DECAY, *PER_UNIT_TYPES))}, or torch:<module.Class> such as torch:torch.optim.RAdam",
    " \\| ".join((*TORCH_WEIGHT_DECAY, *PER_UNIT_TYPES, "torch:<module.Class>")),
    _optimizer_type,
)
KWARGS = Check("a mapping of keyword arguments such as {betas: [0.9, 0.99]}", "mapping", _kwargs)
PATTERNS = Check("a list of patterns such as ['*bias']", "list[str]", _patterns)
LR_MULTIPLIERS = Check(
    "a mapping of name patterns to non-negative factors such as {'*embed*': 0.1}", "mapping", _lr_multipliers
)


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig(Section):
    """The optimizer that steps each fp32 master slice where its states live."""

    SECTION: ClassVar[str] = "optimizer"
    type: str = setting("adamw", OPTIMIZER_TYPE)
    """adamw (decoupled weight decay), adam (L2 added to the gradient) or sgd, stepped by the engine's own
    kernels on any tier; or lion (Chen et al. 2023), adafactor (torch.optim.Adafactor) or
    torch:<module.Class> (a torch.optim.Optimizer subclass, e.g. torch:torch.optim.RAdam), one instance per
    unit shard with its states in memory (not offload.optimizer nvme), given optimizer.lr,
    optimizer.weight_decay and optimizer.kwargs. Each default below is torch.optim's for the type."""
    lr: float = setting(1e-3, float_check(lo=0.0, lo_open=True))
    """Learning rate."""
    betas: tuple[float, float] = setting((0.9, 0.999), BETAS)
    """adam and adamw: coefficients for the running averages of the gradient and its square."""
    eps: float = setting(1e-8, float_check(lo=0.0, lo_open=True))
    """adam and adamw: term added to the denominator."""
    # None only until _resolve_defaults puts in the type's default; a built section always holds a float.
    weight_decay: float | None = setting(
        None,
        float_check(lo=0.0, optional=True),
        shown_default=", ".join(f"{name}: {decay:g}" for name, decay in TORCH_WEIGHT_DECAY.items()),
    )
    """Weight decay (decoupled for adamw, L2 for adam and sgd); absent or null: torch.optim's default
    for the type, as the default column says."""
    momentum: float = setting(0.0, float_check(lo=0.0, hi=1.0))
    """sgd: momentum (0 keeps no momentum buffer)."""
    no_decay: tuple[str, ...] = setting(("*bias",), PATTERNS)
    """Parameters that get no weight decay: glob patterns on their dotted names (e.g. `*bias`,
    `*embed_tokens*`); [] decays every parameter."""
    no_decay_modules: tuple[str, ...] = setting(("Norm",), PATTERNS)
    """Parameters of modules whose class name contains one of these get no weight decay: the
    default, Norm, covers LayerNorm, RMSNorm and the like (as the transformers Trainer does)."""
    lr_multipliers: dict[str, float] = setting({}, LR_MULTIPLIERS)
    """Glob pattern on parameter names -> factor on the learning rate of the parameters it matches
    (the first pattern that matches wins), e.g. {'*embed*': 0.1}."""
    state_dtype: str = setting("fp32", choice_check(STATE_DTYPES))
    """adam and adamw: how the two moments are stored, on every tier and in checkpoints: fp32 (8 bytes a
    parameter), bf16 (4), or int8 (2.004: 8-bit block-wise dynamic quantization as in Dettmers et al.'s
    8-bit optimizers, 2048 elements per fp32 absmax). Each step decodes them to fp32, updates them and
    stores them again; the fp32 master weights are unchanged. A checkpoint resumes only with its own."""

    kwargs: dict[str, Any] = setting({}, KWARGS)
    """lion, adafactor and torch:<class>: more keyword arguments of the class (not params, lr or weight_decay,
    which come from this section), e.g. {betas: [0.95, 0.98]}."""

    def _resolve_defaults(self) -> None:
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", TORCH_WEIGHT_DECAY.get(self.type, 0.0))

    def _validate(self) -> None:
        if self.type == "sgd" and self.state_dtype != "fp32":
            message = (
                f"optimizer.state_dtype {self.state_dtype} stores Adam's moments, and optimizer.type sgd keeps its "
                "momentum in fp32: set optimizer.state_dtype: fp32, or optimizer.type: adamw"
            )
            raise ConfigError(message, key="optimizer.state_dtype")
        if per_unit(self.type) and self.state_dtype != "fp32":
            message = (
                f"optimizer.state_dtype {self.state_dtype} stores Adam's moments, and optimizer.type {self.type} keeps "
                "its own states in fp32: set optimizer.state_dtype: fp32, or optimizer.type: adamw"
            )
            raise ConfigError(message, key="optimizer.state_dtype")
        if self.kwargs and not per_unit(self.type):
            message = (
                f"optimizer.kwargs is set but optimizer.type {self.type} takes its settings from this section's keys: "
                "remove optimizer.kwargs, or use optimizer.type lion, adafactor or torch:<module.Class>"
            )
            raise ConfigError(message, key="optimizer.kwargs")


SCHEDULE_TYPES = ("constant", "linear", "cosine")
_STEPS = int_check(1, limit=1 << 40)
OPTIONAL_STEPS = dataclasses.replace(
    _STEPS,
    expected=f"{_STEPS.expected} (or null)",
    type_name=f"{_STEPS.type_name} \\| null",
    convert=lambda value: None if value is None else _STEPS.convert(value),
)
"""`scheduler.total_steps`: a step count, or null for train.steps."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SchedulerConfig(Section):
    """The learning rate of each optimizer step: optimizer.lr times a warm-up and decay shape.

    The shapes are transformers' constant, linear and cosine schedules with warm-up, stepped
    once per optimizer step; `engine.lr` is the rate of the next step."""

    SECTION: ClassVar[str] = "scheduler"
    type: str = setting("constant", choice_check(SCHEDULE_TYPES))
    """constant, linear (to zero at total_steps) or cosine (half a cosine to zero at total_steps)."""
    warmup_steps: int = setting(0, int_check(0, limit=1 << 40))
    """Optimizer steps over which the rate climbs from warmup_start_ratio x optimizer.lr to optimizer.lr."""
    warmup_type: str = setting("linear", choice_check(("linear", "log")))
    """linear: the warm-up climbs in equal steps, to optimizer.lr at step warmup_steps; log: as ln(k+1) /
    ln(warmup_steps) at step k, to optimizer.lr at step warmup_steps - 1 (DeepSpeed's default)."""
    warmup_start_ratio: float = setting(0.0, RATIO)
    """The warm-up's first rate, as a fraction of optimizer.lr (0, as in transformers' schedules)."""
    min_lr_ratio: float = setting(0.0, RATIO)
    """linear and cosine: the rate decays to this fraction of optimizer.lr instead of to 0."""
    total_steps: int | None = setting(None, OPTIONAL_STEPS)
    """Optimizer steps the decay spans (null: train.steps)."""
    convention: str = setting("transformers", choice_check(("transformers", "deepspeed")))
    """transformers: optimizer step k runs at the shape's step k, as under torch's LambdaLR; deepspeed: as
    DeepSpeed runs WarmupLR (constant), WarmupDecayLR (linear) and WarmupCosineLR (cosine): the warm-up and
    the linear decay a step late, cosine's step 0 at 0, and the cosine held at min_lr_ratio past total_steps."""

    def _validate(self) -> None:
        if self.warmup_type == "log" and self.warmup_steps == 1:
            fix = "set scheduler.warmup_steps to 0 or 2, or scheduler.warmup_type to linear"
            message = f"scheduler.warmup_type log needs scheduler.warmup_steps 0 or at least 2 (ln 1 = 0), got 1: {fix}"
            raise ConfigError(message, key="scheduler.warmup_steps")
