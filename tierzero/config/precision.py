"""The `precision` section: the compute dtype, autocast, the reduce dtype and fp16 loss scaling."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tierzero.config.checks import (
    BOOL,
    FLOAT32_MAX,
    LOSS_SCALE,
    Check,
    choice_check,
    float_check,
    int_check,
)
from tierzero.config.errors import ConfigError
from tierzero.config.tree import Section, setting

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each `precision.param_dtype`."""

OPTIONAL_DTYPE = Check(
    f"one of {', '.join(DTYPE_BYTES)} (or null)",
    " \\| ".join(DTYPE_BYTES) + " \\| null",
    lambda value: None if value is None else choice_check(tuple(DTYPE_BYTES)).convert(value),
)
"""`precision.reduce_dtype`: a compute dtype, or null for the param_dtype."""

CPU_INFO = Path("/proc/cpuinfo")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags of the instructions that compute in bf16; without them PyTorch emulates bf16 in fp32."""

LINEAR_KERNELS = ("torch", "onednn")
"""`precision.linear_kernel`: PyTorch's own, or oneDNN's fp32 CPU linear (`tierzero.units.kernels`)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PrecisionConfig(Section):
    """Compute dtype and fp16 loss scaling. Master weights and optimizer states are always fp32."""

    SECTION: ClassVar[str] = "precision"
    param_dtype: str = setting("fp32", choice_check(tuple(DTYPE_BYTES)))
    """dtype of parameters and gradients in forward and backward."""
    reduce_dtype: str | None = setting(None, OPTIONAL_DTYPE)
    """dtype gradients are reduced across ranks, accumulated and kept in until the step (null: the
    param_dtype). fp32 with bf16 parameters reduces bf16 gradients without bf16 rounding in the
    sums, as FSDP's MixedPrecisionPolicy(reduce_dtype=torch.float32) does; the GRAD slices then
    take 4 bytes a parameter."""
    autocast: bool = setting(False, BOOL)
    """Run the forward under torch.autocast to param_dtype and keep in fp32 every parameter
    autocast reads in fp32 (embeddings, norms): the numerics of plain PyTorch under autocast
    (bitwise at one rank; across ranks with reduce_dtype fp32, up to the last bit of a few
    elements of the sharded optimizer, as in fp32), with bf16 bytes for the linear layers' weights only."""
    linear_kernel: str = setting("torch", choice_check(LINEAR_KERNELS))
    """fp32 nn.Linear layers on the CPU: 'torch' (F.linear, MKL's sgemm) or 'onednn', oneDNN's
    JIT kernels for the forward, and for each gradient whichever of oneDNN and PyTorch's mm the
    first backward of its shape times faster, a choice the machine keeps for a day: a GPT block's
    forward and backward at 64 tokens 1.3-1.5x faster on two dev machines (tierzero/units/kernels.py).
    IEEE fp32 either way, but the sums run in another order, so the bits differ from PyTorch's
    (and where two machines timed differently, from each other's) in the last places. No effect
    on a GPU or under autocast."""
    loss_scale: str | float = setting("dynamic", LOSS_SCALE)
    """fp16 only: 'dynamic' (halve on overflow, grow after scale_window clean steps) or a fixed
    positive scale."""
    initial_scale: float = setting(2.0**16, float_check(lo=0.0, lo_open=True, limit=FLOAT32_MAX))
    """Starting dynamic loss scale."""
    scale_window: int = setting(1000, int_check(1))
    """Steps without overflow before the dynamic scale doubles."""
    min_scale: float = setting(1.0, float_check(lo=0.0, lo_open=True, limit=FLOAT32_MAX))
    """The dynamic scale never drops below this."""

    def _validate(self) -> None:
        if self.autocast and self.param_dtype == "fp32":
            raise ConfigError(
                "precision.autocast needs a lower compute dtype than fp32: set precision.param_dtype to bf16 "
                "(or fp16), or drop precision.autocast",
                key="precision.autocast",
            )
        if self.min_scale > self.initial_scale:
            raise ConfigError(
                f"precision.min_scale {self.min_scale:g} is above precision.initial_scale "
                f"{self.initial_scale:g}: lower min_scale or raise initial_scale",
                key="precision.min_scale",
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.param_dtype]


def cpu_flags(path: Path = CPU_INFO) -> frozenset[str] | None:
    """The instruction-set flags of this machine's first CPU in `path` (Linux's /proc/cpuinfo);
    None where the file is missing or names none (another OS, an emulator that hides them)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):  # x86's name, then Arm's
            return frozenset(value.split())
    return None


def slow_bf16_note(precision: PrecisionConfig, *, flags: frozenset[str] | None) -> str | None:
    """One line when `precision` computes in bf16 on a CPU whose `flags` lack bf16 instructions, else None.

    Only for compute on the CPU: the caller asks where no GPU does the work. Unknown flags say nothing.
    """
    if precision.param_dtype != "bf16" or flags is None or flags.intersection(BF16_CPU_FLAGS):
        return None
    return (
        f"precision.param_dtype is bf16, but this CPU has no bf16 instructions ({' or '.join(BF16_CPU_FLAGS)} in "
        f"{CPU_INFO}): PyTorch emulates them, several times slower than fp32 (13x in one run); set "
        "precision.param_dtype: fp32 on this machine"
    )
