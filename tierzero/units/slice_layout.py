"""Where each element of a flat slice sits: its original tensor, its parameter group, its vector lane.

The engine steps a unit's parameters as one flat slice. torch.optim steps them tensor by
tensor and group by group, and on the CPU an element's bits depend on its place in its
tensor ([Note: vector lanes and scalar tails]). `SliceLayout` records the tensor and group
boundaries a slice crosses; `adam_pieces` cuts a slice so that every element takes the
path torch.optim would give it.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ParamGroup", "Piece", "SliceLayout", "adam_pieces", "cpu_vector_width"]

# [Note: vector lanes and scalar tails]
# torch's CPU fused Adam runs each tensor of its list through SIMD vectors, except the
# last `numel % width` elements, which go through a scalar loop that the compiler
# contracts into FMAs: those elements round differently (measured: about a quarter of
# random inputs differ in the last bit). So torch.optim's bits depend on where each
# parameter tensor ends. Given the unit's tensor boundaries (`SliceLayout`), `FlatAdam`
# cuts a slice into views so that every element takes the path it takes under
# torch.optim: runs of whole vectors counted from a tensor's start run in place, each
# tensor's tail runs as a view of its own (shorter than a vector, so all scalar), and
# the few elements that a slice cut separates from their vector go through a
# vector-sized scratch buffer. Vector lanes are independent, so an element's position
# inside a vector does not change its bits. The width must be the kernel's own: a
# multiple would be wrong where a slice cut falls inside a tensor's last vectors.
# CUDA kernels treat every element alike and need none of this.


@dataclass(frozen=True, slots=True)
class ParamGroup:
    """Hyper-parameters some of the model's tensors share, as in torch.optim's `param_groups`."""

    lr: float
    """The group's base learning rate; a schedule multiplies it, as `LambdaLR` multiplies each group's."""
    weight_decay: float


@dataclass(kw_only=True, slots=True, frozen=True)
class SliceLayout:
    """Where a slice sits in its unit, and where the unit's original tensors start.

    With it, Adam on the slice gives the bits torch.optim gives the original tensors
    (see [Note: vector lanes and scalar tails]); without it, the bits torch.optim gives
    one flat parameter.
    """

    offset: int
    """First element of the slice, counted in the unit's flat buffer."""
    tensor_offsets: tuple[int, ...]
    """Start of each original tensor in the flat buffer, then the end of the last one.
    Elements past the end (padding) count as one more tensor."""
    tensor_groups: tuple[int, ...] = ()
    """The parameter group of each original tensor (empty: all group 0); padding is group 0."""

    def __post_init__(self) -> None:
        offsets = self.tensor_offsets
        if self.offset < 0 or not offsets or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
            raise ValueError(
                f"slice layout needs offset >= 0 and non-decreasing tensor offsets, "
                f"got offset {self.offset}, tensor_offsets {offsets}: build it with SliceLayout.of(numels, offset=...)"
            )
        if self.tensor_groups and len(self.tensor_groups) != len(offsets) - 1:
            raise ValueError(
                f"slice layout has {len(offsets) - 1} tensors but {len(self.tensor_groups)} group ids: give one per tensor"
            )

    @classmethod
    def of(cls, numels: Sequence[int], *, offset: int = 0, groups: Sequence[int] = ()) -> SliceLayout:
        """The layout of a unit flattened from tensors of `numels` (in `groups`), seen from a slice at `offset`."""
        bounds = [0]
        for n in numels:
            bounds.append(bounds[-1] + n)
        return cls(offset=offset, tensor_offsets=tuple(bounds), tensor_groups=tuple(groups))

    def group_at(self, element: int) -> int:
        """The group of the tensor holding `element` of the flat buffer (0 past the last tensor)."""
        if not self.tensor_groups or element >= self.tensor_offsets[-1]:
            return 0
        return self.tensor_groups[bisect.bisect_right(self.tensor_offsets, element) - 1]

    def group_runs(self, numel: int) -> list[tuple[int, int, int]]:
        """(start, end, group) of the slice's maximal runs of one group, slice-relative."""
        lo, hi = self.offset, self.offset + numel
        cuts = sorted({lo, hi, *(b for b in self.tensor_offsets if lo < b < hi)})
        runs: list[tuple[int, int, int]] = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            group = self.group_at(a)
            if runs and runs[-1][2] == group:
                runs[-1] = (runs[-1][0], b - lo, group)
            else:
                runs.append((a - lo, b - lo, group))
        return runs


@functools.cache
def cpu_vector_width() -> int:
    """fp32 elements per vector in the fused CPU Adam kernel this process dispatches to.

    Measured, not read off `torch.backends.cpu.get_cpu_capability()`: on some AVX-512
    CPUs (seen on an AMD EPYC with torch 2.13) the kernel runs 8-wide vectors. One call
    steps 47 elements whose vector and scalar results differ; the scalar tail starts
    after the last whole vector, at 47 - 47 % width. tests/unit/test_optim.py checks the
    answer against the kernel with other inputs.
    """
    g = torch.Generator().manual_seed(20261201)
    n = 1024
    p, grad, m = (torch.randn(n, generator=g) for _ in range(3))
    v = torch.rand(n, generator=g)
    vector = _probe_adamw([p], [grad], [m], [v])
    # A list of one-element tensors: each is all tail, so every element takes the scalar path.
    scalar = _probe_adamw(*(list(t.split(1)) for t in (p, grad, m, v)))
    pick = (vector != scalar).any(0).nonzero().flatten()[:47]
    if len(pick) < 47:
        return 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8
    out = _probe_adamw([p[pick]], [grad[pick]], [m[pick]], [v[pick]])
    tail = int((out != scalar[:, pick]).any(0).nonzero().max()) + 1
    return next(width for width in (4, 8, 16, 32, 64) if 47 - 47 % width == tail)


def _probe_adamw(*lists: list[torch.Tensor]) -> torch.Tensor:
    """One fused AdamW call on copies of (params, grads, exp_avgs, exp_avg_sqs): the stepped
    params, exp_avgs and exp_avg_sqs, each list's tensors end to end, as three rows."""
    params, grads, avgs, sqs = ([t.clone() for t in ts] for ts in lists)
    steps = [torch.tensor(3.0) for _ in params]
    torch._fused_adamw_(
        params, grads, avgs, sqs, [], steps,
        lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
    )  # fmt: skip
    return torch.stack([torch.cat(params), torch.cat(avgs), torch.cat(sqs)])


Piece = tuple[int, int, int]
"""(start, end, group): a slice-relative range of one parameter group."""


def adam_pieces(numel: int, layout: SliceLayout, lanes: int) -> tuple[list[Piece], list[Piece]]:
    """Slice-relative ranges to step in place, and ranges to step in a lane-sized scratch, with their groups.

    Every element lands where torch.optim's per-tensor call would put it: in a vector
    lane or in its tensor's scalar tail ([Note: vector lanes and scalar tails]).
    """
    lo, hi = layout.offset, layout.offset + numel
    bounds = sorted({min(lo, layout.tensor_offsets[0]), *layout.tensor_offsets, max(hi, layout.tensor_offsets[-1])})
    direct: list[Piece] = []
    scratch: list[Piece] = []

    def run_in_place(a: int, b: int, group: int) -> None:
        # A view whose length is a whole number of vectors may take more elements of its
        # group behind it: they keep the path they would have had alone.
        last = direct[-1] if direct else None
        if last is not None and last[1] == a and last[2] == group and (last[1] - last[0]) % lanes == 0:
            direct[-1] = (last[0], b, group)
        else:
            direct.append((a, b, group))

    for start, end in zip(bounds, bounds[1:], strict=False):
        a, b = max(start, lo), min(end, hi)
        if a >= b:
            continue
        group = layout.group_at(start)
        tail = end - (end - start) % lanes
        vector_end = min(b, tail)
        if vector_end > a:
            whole = a + (vector_end - a) // lanes * lanes
            if whole > a:
                run_in_place(a - lo, whole - lo, group)
            if vector_end > whole:
                scratch.append((whole - lo, vector_end - lo, group))
        if b > max(a, tail):
            run_in_place(max(a, tail) - lo, b - lo, group)
    return direct, scratch
