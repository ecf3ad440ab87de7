"""The model's costliest functions on the meta device, as shapes only: what a dry run needs of them.

A dry run (estimate/dry_run.py) runs the model on the meta device only to drive the engine:
its hooks fire as the units run, and every parameter receives a gradient of its shape, in the
order the autograd graph gives. The values are never there. Yet on the meta device a layer
norm, a GELU, a linear layer over a 3-d input, attention and the loss are decomposed into
torch's Python references, op by op, forward and backward: a 2-layer GPT's forward and backward
took 0.39 s per micro-step on a 2-core VM without AVX-512, 80% of the dry run (a GPT's dry
run at world sizes 1 and 2 took 1.0-4.5 s, and 0.23-0.51 s with the rules below). Under
`ShapesOnly` each of those functions is one autograd node that makes an empty output of the
right shape and dtype, and whose backward hands each input that needs it an empty gradient of
its own shape: the graph between the model's modules, and so the order in which the engine's
units finish, is the one the decomposed ops build (within one function its inputs' gradients
may land in another order, a linear's weight before its bias; the replay's counts are the same,
tests/unit/test_dry_run_shapes.py). Any other function, and these on a tensor off the meta
device, take torch's own path. (Autocast leaves meta tensors' dtypes as they are: so do these rules.)
The node saves nothing for backward: a run that books its saved activations
(tierzero/stages/activations.py) is replayed without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["ShapesOnly"]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Size:
    return torch.Size((*x.shape[:-1], weight.shape[0]))


def _same(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Size:
    return x.shape


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Size:
    return torch.Size((*q.shape[:-1], v.shape[-1]))


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Size | None:
    """A scalar for a mean or summed loss; None (torch's own path) for per-token losses, the legacy
    `size_average` and `reduce`, or any argument but the two passed by position."""
    legacy = kwargs.get("size_average") is not None or kwargs.get("reduce") is not None
    return torch.Size(()) if kwargs.get("reduction", "mean") in ("mean", "sum") and not args and not legacy else None


_RULES: dict[Callable[..., Any], Callable[..., torch.Size | None]] = {
    F.linear: _linear,
    F.layer_norm: _same,
    F.gelu: _same,
    F.silu: _same,
    F.scaled_dot_product_attention: _attention,
    F.cross_entropy: _cross_entropy,
}
"""What each function's output shape is: that of its first argument but where said. The output's
dtype is the first argument's (the models here compute a layer in one dtype), the loss's fp32."""

_INITS = {
    nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.trunc_normal_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_,
}  # fmt: skip
"""In-place initialisers (the tensor first): on a meta tensor they change nothing, so it is returned as it is."""


class _Shaped(torch.autograd.Function):
    """One node for a whole function: an empty output, empty gradients for the inputs."""

    @staticmethod
    def forward(ctx: Any, shape: torch.Size, dtype: torch.dtype, *inputs: Any) -> torch.Tensor:
        ctx.specs = [(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None for x in inputs]
        return torch.empty(shape, dtype=dtype, device="meta")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grads = [
            torch.empty(spec[0], dtype=spec[1], device="meta") if spec is not None and needed else None
            for spec, needed in zip(ctx.specs, ctx.needs_input_grad[2:], strict=True)
        ]
        return (None, None, *grads)


class ShapesOnly(TorchFunctionMode):
    """Within it, `_RULES`' functions and `_INITS` on meta tensors cost a node each, not a decomposition."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is None and func not in _INITS:
            return func(*args, **kwargs)  # nearly every call of a dry run: the engine's own copies and views
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if rule is None:
            return tensors[0] if tensors[0].device.type == "meta" else func(*args, **kwargs)
        if any(t.device.type != "meta" for t in tensors):
            return func(*args, **kwargs)
        shape = rule(*args, **kwargs)
        if shape is None:
            return func(*args, **kwargs)
        dtype = torch.float32 if func is F.cross_entropy else args[0].dtype
        return _Shaped.apply(shape, dtype, *tensors)
