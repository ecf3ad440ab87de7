"""A unit's fp32 gradient pieces stepped on the device: one fused launch a parameter group, not one a
tensor ([Note: gradient pieces] in tierzero/stages/grads/pieces.py), with the bits of a step a tensor."""

from __future__ import annotations

import torch
from cuda_or_cpu import ON_CPU, needs_cuda
from torch.profiler import ProfilerActivity, profile

from tierzero.optim.flat import FlatAdam, OptimizerSpec, OptimizerType, SliceLayout
from tierzero.units.slice_layout import ParamGroup

pytestmark = needs_cuda


def _launches(fn) -> int:
    """The fused AdamW calls `fn` makes."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key == "aten::_fused_adamw_")


def test_a_units_slots_step_in_one_launch_a_group_with_the_bits_of_a_step_a_slot(cuda: torch.device) -> None:
    optimizer = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-3, weight_decay=0.1), [ParamGroup(1e-3, 0.1), ParamGroup(3e-3, 0.0)])
    numels, groups = [4096 * 3, 4096, 77, 1024 * 1024, 5], [0, 1, 0, 1, 1]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    n = sum(numels) + 128
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=gen).to(cuda)
    runs = [(start.clone(), optimizer.new_states(n, device=cuda)) for _ in range(2)]
    counts = []
    for step in (1, 2, 3):
        grads = [torch.randn(k, generator=gen).to(cuda) for k in numels]
        (together, states), (alone, alone_states) = runs
        slots = [(o, g.clone(), group) for o, g, group in zip(offsets, grads, groups, strict=True)]

        def in_one() -> None:
            optimizer.step_slots(param=together, grads=slots, scale=0.5, states=states, step=step, lr=[1e-3, 3e-3])

        def a_slot_at_a_time() -> None:
            for offset, grad, group in zip(offsets, grads, groups, strict=True):
                part = slice(offset, offset + grad.numel())
                optimizer.step(
                    param=alone[part], grad=grad.mul(0.5), states={k: s[part] for k, s in alone_states.items()}, step=step,
                    lr=[1e-3, 3e-3], layout=SliceLayout.of([grad.numel()], groups=[group]),
                )  # fmt: skip

        counts.append((_launches(in_one), _launches(a_slot_at_a_time)))
    (together, states), (alone, alone_states) = runs
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32))
    assert all(torch.equal(states[k].view(torch.int32), alone_states[k].view(torch.int32)) for k in states)
    assert not torch.equal(together, start) and torch.equal(together[-128:], start[-128:])
    if not ON_CPU:  # the host steps each tensor with its native kernel, not torch's fused one
        assert counts == [(2, len(numels))] * 3
