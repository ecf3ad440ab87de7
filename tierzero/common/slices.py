"""The words every part of tierzero shares: tiers, kinds of state, slice keys, I/O alignment.

At the bottom of the import graph: everything may import it, and it imports nothing
of the project.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

#: Offsets, lengths and buffer addresses of direct I/O are multiples of this.
IO_ALIGNMENT = 4096


class Tier(enum.Enum):
    """Where a region lives, fastest first."""

    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"

    __hash__ = object.__hash__
    """Identity, as equality is: enum's own hashes the name in Python, a thousand times a step."""


class Kind(enum.Enum):
    """What a region holds; the store accounts bytes per tier and per kind."""

    PARAM = "param"
    GRAD = "grad"
    MASTER = "master"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    GATHERED = "gathered"
    """Full (unsharded) unit parameters or gradients while the unit computes."""
    STAGING = "staging"
    """The swapper's staging buffers."""
    ACTIVATION = "activation"
    """What autograd saves for backward, besides parameters (tierzero.stages.activations)."""
    SECONDARY = "param_secondary"
    """hpZ (`zero.hpz_partition_size`): this rank's part of a copy of the unit's parameters split
    inside its node, written by the forward's gather and gathered by the backward's."""

    __hash__ = object.__hash__


MODEL_STATE_KINDS: tuple[Kind, ...] = (
    Kind.PARAM,
    Kind.GRAD,
    Kind.MASTER,
    Kind.EXP_AVG,
    Kind.EXP_AVG_SQ,
)

KEPT_KINDS: tuple[Kind, ...] = (*MODEL_STATE_KINDS, Kind.SECONDARY)
"""What a rank keeps of each unit between steps: the model states, and hpZ's secondary copy,
which reports show only where there is one (the formulas of ZeRO count the five others)."""


def shown_kinds(nbytes: dict[Kind, int]) -> list[Kind]:
    """The kinds a report lists for `nbytes` per kind: the model states, SECONDARY where it holds bytes."""
    return [kind for kind in KEPT_KINDS if kind in MODEL_STATE_KINDS or nbytes.get(kind)]


@dataclass(frozen=True, slots=True)
class SliceKey:
    """Names one slice: the unit it belongs to and the kind of state it holds."""

    unit: str
    kind: Kind

    def __str__(self) -> str:
        return f"{self.unit}/{self.kind.value}"


def align_up(n: int, alignment: int = IO_ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def aligned_empty(nbytes: int, *, alignment: int = IO_ALIGNMENT) -> torch.Tensor:
    """A 1-D uint8 host tensor of exactly `nbytes` whose first byte is `alignment`-aligned.

    Over-allocates by one alignment and slices, since a large `torch.empty` is only
    64-byte aligned. The view keeps the whole allocation alive.
    """
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    start = (-raw.data_ptr()) % alignment
    return raw[start : start + nbytes]


def storage_id(tensor: torch.Tensor) -> int:
    """Which storage the tensor views, also on the meta device (where every data_ptr is 0,
    and where `tierzero estimate` runs the engine): the address of its storage object."""
    return tensor.untyped_storage()._cdata
