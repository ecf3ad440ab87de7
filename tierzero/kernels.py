"""Kernels the engine may run in place of PyTorch's own: oneDNN's fp32 linear layer on the CPU.

[Note: the oneDNN linear]
PyTorch computes an fp32 `nn.Linear` on the CPU with MKL's sgemm. At the few tokens of
an offloaded fine-tuning step (64 on the oversized preset) that call packs the whole
weight on every use, and on an AMD host MKL picks its generic kernels: 100-131 GFLOP/s
on this machine's two cores, against 173-184 for the JIT kernels of oneDNN, which
PyTorch ships for its compiled CPU linear (`torch.ops.mkldnn._linear_pointwise`).
`precision.linear_kernel: onednn` runs each `nn.Linear`'s forward and its input
gradient there; the weight gradient stays MKL's `mm` (oneDNN's, on transposed copies,
took 16-17% off the 2B preset's 10240 x 2560 weight gradient and 5% off its block's
forward and backward, docs/BENCHMARKS.md session 20: not yet taken). Both libraries
compute in IEEE fp32, but they add a row's products in a different order, so the bits
differ from PyTorch's in the last places; hence opt-in,
and `torch` (plain `F.linear`) by default, which tierzero's bit-for-bit tests hold to.

Only where both kernels compute the same thing: fp32 input and weight on the CPU,
outside autocast (which lowers the layer to bf16, where PyTorch already uses oneDNN).
Anything else, a GPU included, takes `F.linear`. Only modules of exactly the type
`nn.Linear` change (not subclasses such as quantized or adapter layers, whose forward
is their own); their `forward` becomes the dispatch below, recomputation under
activation checkpointing included.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tierzero.config.precision import LINEAR_KERNELS

__all__ = ["OneDnnLinear", "onednn_available", "use_linear_kernel"]


def onednn_available() -> bool:
    """Whether this PyTorch build has the oneDNN linear (`torch.ops.mkldnn._linear_pointwise`)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return torch.ops.mkldnn._linear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(torch.autograd.Function):
    """`F.linear(x, weight, bias)` with the forward and the input gradient on oneDNN (see the note)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.needs_input_grad[2]:  # False for a None bias
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias


def _linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
    ):
        return OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def use_linear_kernel(model: nn.Module, kernel: str) -> int:
    """Give every `nn.Linear` of `model` the `kernel`'s forward (see the note); how many changed.
    `torch` changes nothing."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}: one of {', '.join(LINEAR_KERNELS)}")
    if kernel == "torch":
        return 0
    if not onednn_available():
        raise RuntimeError(
            "precision.linear_kernel onednn needs a PyTorch built with oneDNN "
            "(torch.backends.mkldnn.is_available() is False here): set precision.linear_kernel to torch"
        )
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            # A bound method, so that a deep copy of the model calls its own copy's weights.
            module.forward = types.MethodType(_linear, module)
            changed += 1
    return changed
