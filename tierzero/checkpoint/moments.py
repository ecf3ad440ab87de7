"""Compact optimizer moments in a checkpoint: int8 codes and their absmax saved as they are, resharded block for block.

[Note: int8 moments in a checkpoint]
An int8 moment slice ([Note: compact moments] in optim/moments.py) is saved as two logical
buffers of its unit: `<unit>/exp_avg` holds the uint8 codes, one per element like any kind
(so [Note: checkpoint layout] slices them at any world size), and `<unit>/exp_avg.absmax`
the fp32 absmax, one per block of `MOMENT_BLOCK` elements, whose logical buffer is the
unit's blocks: a rank's file holds shard_numel / MOMENT_BLOCK of them. Every shard is a
whole number of blocks (`DEFAULT_ALIGN_NUMEL`), so the blocks are the unit's at every world
size and a resume reads back the very bytes it saved. bf16 moments are a kind of dtype
bfloat16 and need nothing here. A checkpoint resumes only with the state_dtype it was
saved with: an absmax must be finite and non-negative, or the file is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from tierzero.checkpoint.base_codes import codec_kind
from tierzero.checkpoint.format import CheckpointError, dtype_name
from tierzero.checkpoint.manifest import MANIFEST, UnitLayout, absmax_kind
from tierzero.common.slices import Kind
from tierzero.optim.moments import MOMENT_BLOCK, SIGNED, ZERO_CODE, MomentFormat, StateDtype
from tierzero.stages.plan import SliceSpec

__all__ = ["check_absmax", "check_state_dtype", "join", "packed", "saved_parts", "split"]

_INT8 = MomentFormat(StateDtype.INT8)
_STATE_DTYPES = {"float32": StateDtype.FP32, "bfloat16": StateDtype.BF16, "uint8": StateDtype.INT8}


def packed(spec: SliceSpec) -> bool:
    """Whether the slice packs int8 codes and absmax in one byte buffer (saved as two tensors)."""
    return spec.kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ) and spec.dtype == torch.uint8


def saved_parts(spec: SliceSpec, shard_numel: int) -> list[tuple[str, int, torch.dtype]]:
    """(kind name, elements per rank, dtype) of each tensor a slice is saved as."""
    if spec.codec is not None:  # [Note: a quantized base in a checkpoint]
        return [(codec_kind(spec.codec), spec.codec.piece_nbytes(shard_numel), torch.uint8)]
    if not packed(spec):
        return [(spec.kind.value, shard_numel, spec.dtype)]
    return [(spec.kind.value, shard_numel, torch.uint8), (absmax_kind(spec.kind.value), shard_numel // MOMENT_BLOCK, torch.float32)]


def split(stored: torch.Tensor, shard_numel: int) -> Iterator[torch.Tensor]:
    """A packed slice's codes, then its absmax: what `saved_parts` names, in its order."""
    absmax, codes = _INT8.split(stored, shard_numel)
    yield codes
    yield absmax


def join(codes: torch.Tensor, absmax: torch.Tensor, *, kind: Kind, padding: int) -> torch.Tensor:
    """The packed slice of `codes` and their blocks' `absmax`, as the store keeps it. The last `padding`
    elements are the unit's padding, never saved: always zero, so the code of 0."""
    stored = torch.empty(_INT8.storage_numel(codes.numel()), dtype=torch.uint8)
    into_absmax, into_codes = _INT8.split(stored, codes.numel())
    into_absmax.copy_(absmax)
    into_codes.copy_(codes)
    into_codes[codes.numel() - padding :].fill_(ZERO_CODE[SIGNED[kind]])
    return stored


def check_state_dtype(spec: SliceSpec, layout: UnitLayout, *, directory: Path) -> None:
    """Refuse a checkpoint whose moments are stored otherwise than this run stores them."""
    saved = _STATE_DTYPES.get(layout.kinds.get(spec.kind.value, ""))
    mine = _STATE_DTYPES[dtype_name(spec.dtype)]
    packed_ok = (saved is StateDtype.INT8) == (absmax_kind(spec.kind.value) in layout.kinds)
    if saved is None or not packed_ok:
        raise CheckpointError(
            f"{directory / MANIFEST}: unit {layout.name} stores {spec.kind.value} as "
            f"{layout.kinds.get(spec.kind.value)!r}{' without its absmax' if saved is StateDtype.INT8 else ''}, "
            "which no optimizer.state_dtype writes: the manifest is corrupt; load an earlier checkpoint"
        )
    if saved is not mine:
        raise CheckpointError(
            f"{directory / MANIFEST}: its optimizer states are stored as optimizer.state_dtype {saved.value}, this run's "
            f"are {mine.value}: resume with optimizer.state_dtype: {saved.value} (a checkpoint keeps its moments' format)"
        )


def check_absmax(absmax: torch.Tensor, *, unit: str, kind: str, path: Path) -> None:
    """Refuse absmax that no quantization writes: negative, inf or NaN."""
    bad = ~(torch.isfinite(absmax) & (absmax >= 0))
    if bool(bad.any()):
        block = int(bad.nonzero()[0, 0])
        raise CheckpointError(
            f"{path}: {unit}/{absmax_kind(kind)} holds {float(absmax[block])!r} at block {block} "
            f"({int(bad.sum())} of {absmax.numel()} bad), an absmax must be finite and >= 0: the file is corrupt; "
            "load an earlier checkpoint"
        )
