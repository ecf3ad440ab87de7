"""A quantized frozen base in a checkpoint: its codes and scales saved as the tier keeps them, bit for bit.

[Note: a quantized base in a checkpoint]
A frozen unit whose PARAM slice is quantized ([Note: quantized base] in units/quantized_base.py)
saves it as the kind `param.<codec>` (`param.nf4`, `param.nf4dq`, `param.int8`), dtype uint8, in
place of `param`: rank r's file holds its piece, the encoding of its shard. The kind's logical
buffer is the unit's N pieces end to end (`UnitLayout.of_kind`), so stages 1 and 2, which keep
all N pieces, save rank r's and read back all of them. A piece encodes one shard, so the
checkpoint resumes only at the world size it was written at, and only with the
`model.lora.base_dtype` it was written with; every scale is checked (finite, >= 0) before any
state changes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tierzero.checkpoint.format import CheckpointError
from tierzero.units.quantized_base import BaseCodec, BaseDtype

__all__ = ["BASE_KINDS", "check_codes", "codec_kind", "codec_of_kind", "source_of_param"]

_PREFIX = "param."
_CODECS = {
    "nf4": BaseCodec(dtype=BaseDtype.NF4),
    "nf4dq": BaseCodec(dtype=BaseDtype.NF4, double_quant=True),
    "int8": BaseCodec(dtype=BaseDtype.INT8),
}
BASE_KINDS = frozenset(_PREFIX + tag for tag in _CODECS)
"""The kind names a quantized base is saved under."""


def codec_kind(codec: BaseCodec) -> str:
    """The kind a slice quantized by `codec` is saved as."""
    return next(_PREFIX + tag for tag, known in _CODECS.items() if known == codec)


def codec_of_kind(kind: str) -> BaseCodec | None:
    """The codec a saved kind was quantized by; None for any other kind."""
    return _CODECS.get(kind.removeprefix(_PREFIX)) if kind.startswith(_PREFIX) else None


def _setting(codec: BaseCodec | None) -> str:
    if codec is None:
        return "param (precision.param_dtype)"
    return codec.name + (" with model.lora.double_quant" if codec.double_quant else "")


def source_of_param(codec: BaseCodec | None, kinds: dict[str, str], *, unit: str, world_size: int, saved_at: int, path: Path) -> str | None:
    """The saved kind a frozen unit's PARAM comes from when either side is quantized (None: neither is);
    refuses a checkpoint whose base is stored otherwise than this run's, or written at another world size."""
    saved = next((codec_of_kind(k) for k in kinds if k in BASE_KINDS), None)
    if saved is None and codec is None:
        return None
    if saved != codec:
        raise CheckpointError(
            f"{path}: unit {unit}'s frozen base is stored as model.lora.base_dtype {_setting(saved)}, this run's is "
            f"{_setting(codec)}: resume with the model.lora.base_dtype the checkpoint was written with"
        )
    assert codec is not None
    if saved_at != world_size:
        raise CheckpointError(
            f"{path}: unit {unit}'s quantized base was written at {saved_at} ranks, each rank's piece quantized "
            f"alone; this run has {world_size}: resume at {saved_at} ranks (model.lora.base_dtype {codec.name})"
        )
    return codec_kind(codec)


def check_codes(codec: BaseCodec, stored: torch.Tensor, *, numel: int, pieces: int, unit: str, path: Path) -> None:
    """Refuse saved codes of `numel` elements whose scales no quantizer writes (a flipped byte), in one line."""
    try:
        codec.decode(stored, out=torch.empty(numel), pieces=pieces, what=f"{path}: unit {unit}")
    except ValueError as exc:
        raise CheckpointError(str(exc).replace("reload the weights or an earlier checkpoint", "load an earlier checkpoint")) from None

