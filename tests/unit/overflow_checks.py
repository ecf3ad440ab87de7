"""Overflow checks and unscaling on plain tensors, kept for the tests.

The engine decides overflow from its all-reduced gradient norm and folds the loss
scale into its gradient scale, so the library needs none of these; test_precision.py
still checks them against plain arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def found_inf_flag(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A float32 0-d tensor: 1.0 when any element is inf or nan, else 0.0.

    It stays on the tensors' device (the first one's; 0.0 on CPU for no tensors), ready
    for an all-reduce(MAX) without a host sync. One read pass per tensor: the min and
    the max carry any inf, and both propagate nan.
    """
    extremes: list[torch.Tensor] = []
    device: torch.device | None = None
    for t in tensors:
        if t.numel() == 0:
            continue
        if device is None:
            device = t.device
        lo, hi = torch.aminmax(t.detach())
        extremes += [lo.to(device=device, dtype=torch.float32), hi.to(device=device, dtype=torch.float32)]
    if not extremes:
        return torch.zeros((), dtype=torch.float32, device=device)
    return (~torch.isfinite(torch.stack(extremes))).any().to(torch.float32)


def found_inf(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any element of `tensors` is inf or nan (syncs with the device once)."""
    return bool(found_inf_flag(tensors).item())


def unscale_(tensors: Iterable[torch.Tensor], scale: float) -> bool:
    """Divide every tensor by `scale` in place; returns whether any result is inf or nan.

    One fused pass per device and dtype (torch's own AMP kernel, the one GradScaler
    uses), multiplying by the float32 reciprocal exactly as GradScaler does.
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"loss scale must be a finite number > 0, got {scale!r}")
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flags: list[torch.Tensor] = []
    for (device, _), group in groups.items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        flags.append(flag)
    return any(bool(f.item()) for f in flags)
