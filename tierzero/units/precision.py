"""Mixed-precision helpers: compute dtypes by name, autocast's fp32 parameters, and loss scaling.

Loss scalers decide from a found-inf flag; making every rank see the same flag is the
engine's job (a non-finite all-reduced gradient norm), so that all ranks skip or step
together.

[Note: autocast's fp32 parameters]
Plain PyTorch under `torch.autocast(dtype=bf16)` keeps fp32 parameters and rounds them to
bf16 only where an op it lowers reads them (a linear layer's matmul); everything else
(embedding lookups, layer norms, the residual stream between them) computes in fp32. An
engine that stores every parameter in bf16 (`precision.param_dtype: bf16` alone, as FSDP's
MixedPrecisionPolicy does) computes those in bf16 too: after 8 AdamW steps on the 30M GPT
a typical tensor lands 3% of its norm from autocast's (fp32 itself: 2%), and a bias with no
gradient to speak of (the keys' part of qkv) 77% (fp32: 55%): Adam turns rounding into steps.
`precision.autocast: true` reproduces autocast instead. The forward runs under
`torch.autocast`; the weights and biases of the layers autocast lowers are stored,
gathered and moved in bf16 (the rounding autocast would do at each use, done once per step
from the fp32 master); every other parameter, and one tied to such a layer and to anything
else, stays fp32 and is its own master, in units of its own (tierzero/units/unit.py): its
module's `:fp32` unit, or, below a MiB a module (a block's norms), the root's, gathered all
step, which spares each block a slice's gather, read and write per step. The gradients are
the bits autocast produces (a bf16 gradient widened to fp32 is exact), so at one rank the
steps are bitwise those of plain PyTorch under autocast with an fp32 optimizer; across ranks,
with fp32 reduction (`precision.reduce_dtype: fp32`), the sums are plain ZeRO's and the
sharded optimizer rounds a few elements one ulp apart from torch's, as it does in fp32. The
bytes moved are bf16's for the lowered weights and fp32's for the rest; in a transformer the
rest is the embeddings and the norms.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from tierzero.units.unit import Binding

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a config name: "fp32", "bf16" or "fp16"."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"precision.param_dtype must be one of {', '.join(_DTYPES)}, got {name!r}: pick one of those names"
        ) from None


#: Layers whose parameters autocast reads only through an op it lowers on both CPU and CUDA
#: (linear, convolutions; not `nn.Bilinear`, whose trilinear op it leaves in fp32).
LOWERED_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
)  # fmt: skip


#: Lowered layers of other libraries, by (module, class) name: transformers' GPT-2 `Conv1D` is an addmm.
LOWERED_BY_NAME: frozenset[tuple[str, str]] = frozenset({("transformers.pytorch_utils", "Conv1D")})


def reads_fp32_under_autocast(bindings: Sequence[Binding]) -> bool:
    """Whether autocast would read a parameter bound at `bindings` in fp32 somewhere: unless
    every binding is a lowered layer's own weight or bias ([Note: autocast's fp32 parameters])."""
    return not all(_lowered(b.module) and b.attr in ("weight", "bias") for b in bindings)


def _lowered(module: nn.Module) -> bool:
    kind = type(module)
    return isinstance(module, LOWERED_LAYERS) or (kind.__module__, kind.__name__) in LOWERED_BY_NAME


def autocast(device: torch.device, precision_cfg: Any) -> AbstractContextManager[Any]:
    """`torch.autocast` to the compute dtype on the device's type under `precision.autocast`; else nothing.
    Nothing on the meta device either, which autocast does not know: the estimator's dry run
    counts the units' slices, whose dtypes the units fix, and meta ops take mixed dtypes."""
    if not precision_cfg.autocast or device.type == "meta":
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype_of(precision_cfg.param_dtype))


class LossScaler(ABC):
    """Multiplies the loss before backward and decides, from a found-inf flag, whether to step."""

    __slots__ = ()

    @property
    @abstractmethod
    def scale(self) -> float:
        """The factor to multiply the loss by before backward (and divide gradients by after)."""

    @abstractmethod
    def update(self, found_inf: bool) -> bool:
        """Record one step's overflow flag; returns True when the optimizer step must be skipped."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class StaticLossScaler(LossScaler):
    """A fixed scale (1.0 means no scaling). Steps with non-finite gradients are still skipped."""

    __slots__ = ("_scale",)

    def __init__(self, scale: float = 1.0) -> None:
        _check_positive("precision.loss_scale", scale)
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, found_inf: bool) -> bool:
        return bool(found_inf)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_keys(state, {"scale"})
        _check_positive("loss scaler state 'scale'", state["scale"])
        self._scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """Halves the scale on overflow (not below `min_scale`), grows it after `scale_window` clean steps.

    The same policy as torch.amp.GradScaler, with a floor: an fp16 run that keeps
    overflowing at `min_scale` keeps skipping steps rather than scaling towards zero.
    """

    __slots__ = ("_scale", "_clean_steps", "scale_window", "min_scale", "growth", "backoff")

    def __init__(
        self,
        *,
        initial_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        growth: float = 2.0,
        backoff: float = 0.5,
    ) -> None:
        _check_positive("precision.initial_scale", initial_scale)
        _check_positive("precision.min_scale", min_scale)
        if min_scale > initial_scale:
            raise ValueError(
                f"precision.min_scale ({min_scale}) is above precision.initial_scale ({initial_scale}): "
                "lower min_scale or raise initial_scale"
            )
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"precision.scale_window must be an integer >= 1, got {scale_window!r}")
        if not growth > 1.0:
            raise ValueError(f"loss scale growth must be > 1, got {growth}")
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"loss scale backoff must be in (0, 1), got {backoff}")
        self._scale = float(initial_scale)
        self._clean_steps = 0
        self.scale_window, self.min_scale, self.growth, self.backoff = scale_window, float(min_scale), growth, backoff

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def clean_steps(self) -> int:
        """Steps without overflow since the scale last changed (or overflowed)."""
        return self._clean_steps

    def update(self, found_inf: bool) -> bool:
        if found_inf:
            self._scale = max(self._scale * self.backoff, self.min_scale)
            self._clean_steps = 0
            return True
        self._clean_steps += 1
        if self._clean_steps >= self.scale_window:
            grown = self._scale * self.growth
            # Past float range the scale would turn every loss into inf; stay put instead.
            if math.isfinite(grown):
                self._scale = grown
            self._clean_steps = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_keys(state, {"scale", "clean_steps"})
        _check_positive("loss scaler state 'scale'", state["scale"])
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])


def make_loss_scaler(precision_cfg: Any) -> LossScaler:
    """The scaler for `cfg.precision` (.param_dtype .loss_scale .initial_scale .scale_window .min_scale).

    Dynamic scaling only matters for fp16: bf16 and fp32 share fp32's exponent range, so
    "dynamic" with them means no scaling. An explicit number is honoured for every dtype.
    """
    dtype = dtype_of(precision_cfg.param_dtype)
    if precision_cfg.loss_scale == "dynamic":
        if dtype is not torch.float16:
            return StaticLossScaler(1.0)
        return DynamicLossScaler(
            initial_scale=float(precision_cfg.initial_scale),
            scale_window=int(precision_cfg.scale_window),
            min_scale=float(precision_cfg.min_scale),
        )
    if isinstance(precision_cfg.loss_scale, str):
        raise ValueError(
            f"precision.loss_scale must be 'dynamic' or a positive number, got {precision_cfg.loss_scale!r}"
        )
    return StaticLossScaler(float(precision_cfg.loss_scale))


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_keys(state: Mapping[str, Any], expected: set[str]) -> None:
    if set(state) != expected:
        raise ValueError(
            f"loss scaler state has keys {sorted(state)}, expected {sorted(expected)}: "
            "was it saved by a different kind of scaler (static vs dynamic)?"
        )
