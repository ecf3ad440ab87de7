"""How Adam's two moments are stored: fp32, bf16, or 8-bit block-wise dynamic codes (`optimizer.state_dtype`).

[Note: compact moments]
The 8-bit optimizers of Dettmers et al. ("8-bit Optimizers via Block-wise Quantization",
2022) keep each moment as one byte an element, a code of the dynamic data type
(tierzero/units/blockwise.py, [Note: the dynamic code]: the signed code for exp_avg, the
unsigned one for exp_avg_sq), and one fp32 absmax per block of `MOMENT_BLOCK` elements.
A step reads a block's codes, dequantizes them to fp32 (code value x absmax), runs Adam's
update in fp32 and quantizes the new values (new absmax, nearest code): `FlatAdam` does it
a window of whole blocks at a time, never on an fp32 copy of the whole slice.

One slice of int8 moments is one uint8 tensor: the fp32 absmax of its blocks first, then
its codes, `numel + 4 x ceil(numel / MOMENT_BLOCK)` bytes, so the store, the tiers, the NVMe
file and every transfer hold and move only those bytes (2.004 bytes a parameter for both
moments, against 8 in fp32). The absmax come first so that their fp32 view is aligned
whatever the slice's length. A zero moment is what quantizing zeros gives: absmax 0 and
the code of 0 (`ZERO_CODE`), as a slice is registered and a checkpoint's padding is loaded.

Blocks of 2048, as in the paper (bitsandbytes' optimizers use 256 on the GPU): 4 bytes of
absmax per 2048 moments, and 2048 elements is the units' alignment step
(`DEFAULT_ALIGN_NUMEL`), so every shard of every unit, at any world size, starts and ends
on a block boundary: the blocks are the unit's own, and a checkpoint written at N ranks
reshards to M block for block (tierzero/checkpoint/moments.py).

bf16 moments are stored as bf16 and stepped in fp32: each window is widened to fp32,
updated, and rounded back to nearest-even bf16.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tierzero.common.slices import Kind
from tierzero.units.blockwise import SCALE_DTYPE, dynamic_code, dynamic_nbytes, dynamic_table
from tierzero.units.code_tables import Scratch, dequantize_into, quantize_into

__all__ = ["MOMENT_BLOCK", "SIGNED", "ZERO_CODE", "MomentFormat", "MomentWindows", "StateDtype"]

MOMENT_BLOCK = 2048
"""Elements per absmax of an int8 moment: the paper's block, and the units' alignment step."""

SIGNED: dict[Kind, bool] = {Kind.EXP_AVG: True, Kind.EXP_AVG_SQ: False}
"""Which dynamic code each moment takes: exp_avg has a sign, exp_avg_sq is never negative."""


class StateDtype(enum.Enum):
    """`optimizer.state_dtype`: how the moments are stored."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"


ZERO_CODE = {signed: dynamic_code(signed=signed).index(0.0) for signed in (True, False)}
"""The code of 0 in each dynamic code: what a zero moment (and a unit's padding, always zero) holds."""

_STORED = {StateDtype.FP32: torch.float32, StateDtype.BF16: torch.bfloat16, StateDtype.INT8: torch.uint8}


@dataclass(frozen=True, slots=True)
class MomentFormat:
    """The storage of one optimizer's moments, and how a window of them is read and written."""

    dtype: StateDtype = StateDtype.FP32
    block: int = MOMENT_BLOCK
    """int8: elements per absmax."""

    @classmethod
    def of(cls, name: str) -> MomentFormat:
        try:
            return cls(StateDtype(str(name).lower()))
        except ValueError:
            choices = ", ".join(d.value for d in StateDtype)
            raise ValueError(f"optimizer.state_dtype must be one of {choices}, got {name!r}") from None

    @property
    def compact(self) -> bool:
        """Whether the moments are stored in fewer than 4 bytes an element (stepped a window at a time)."""
        return self.dtype is not StateDtype.FP32

    @property
    def stored_dtype(self) -> torch.dtype:
        return _STORED[self.dtype]

    @property
    def align(self) -> int:
        """Windows start at multiples of this many elements: a block of int8 moments is quantized whole."""
        return self.block if self.dtype is StateDtype.INT8 else 1

    def storage_numel(self, numel: int) -> int:
        """Elements of `stored_dtype` one moment of `numel` parameters takes."""
        return dynamic_nbytes(numel, block=self.block) if self.dtype is StateDtype.INT8 else numel

    def nbytes(self, numel: int) -> int:
        """Bytes one moment of `numel` parameters takes: 4, 2, or 1 + 4 / block a parameter."""
        return self.storage_numel(numel) * self.stored_dtype.itemsize

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def zeros(self, numel: int, *, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero moment of `numel` parameters, as a fresh optimizer starts: for int8, what quantizing
        zeros gives (absmax 0, the code of 0), so that a moment's bytes depend only on its values."""
        stored = torch.zeros(self.storage_numel(numel), dtype=self.stored_dtype, device=device)
        if self.dtype is StateDtype.INT8:
            self.split(stored, numel)[1].fill_(ZERO_CODE[signed])
        return stored

    def check(self, name: str, stored: torch.Tensor, numel: int, device: torch.device) -> None:
        """Refuse a stored moment that is not this format's for a slice of `numel` parameters on `device`."""
        want = self.storage_numel(numel)
        if stored.dtype != self.stored_dtype or stored.dim() != 1 or not stored.is_contiguous() or stored.numel() != want:
            raise ValueError(
                f"optimizer {name} slice must be a contiguous 1-D {self.stored_dtype} tensor of {want} elements "
                f"(optimizer.state_dtype {self.dtype.value}, {numel} parameters), got {stored.dtype} of shape "
                f"{tuple(stored.shape)}: pass the slice the store registered for this state_dtype"
            )
        if stored.device != device:
            raise ValueError(f"optimizer {name} slice is on {stored.device}, param on {device}: pass slices of one device")

    def split(self, stored: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 moment's (fp32 absmax per block, uint8 codes): views of `stored`."""
        head = SCALE_DTYPE.itemsize * self.blocks(numel)
        return stored[:head].view(SCALE_DTYPE), stored[head : head + numel]

    def windows(self, states: Mapping[Kind, torch.Tensor], *, numel: int, window: int, device: torch.device) -> MomentWindows:
        """The moments `states` of a slice of `numel` parameters, read and written `window` elements at a time."""
        return MomentWindows(self, states, numel=numel, window=window, device=device)


class MomentWindows:
    """One slice's stored moments, decoded to fp32 a window at a time and encoded back, in buffers
    allocated once for the slice ([Note: stepping in the cache] in windows.py)."""

    __slots__ = ("_blocks", "_codes", "_fmt", "_scratch", "_stored", "_tables", "buffers")

    def __init__(
        self, fmt: MomentFormat, states: Mapping[Kind, torch.Tensor], *, numel: int, window: int, device: torch.device
    ) -> None:
        self._fmt, self._stored = fmt, states
        size = min(window, numel)
        self.buffers = {kind: torch.empty(size, dtype=torch.float32, device=device) for kind in SIGNED}
        """fp32 per moment: the window being stepped."""
        int8 = fmt.dtype is StateDtype.INT8
        split = {kind: fmt.split(states[kind], numel) for kind in SIGNED} if int8 else {}
        self._blocks = {kind: absmax for kind, (absmax, _) in split.items()}
        self._codes = {kind: codes for kind, (_, codes) in split.items()}
        self._tables = {kind: dynamic_table(signed=SIGNED[kind], device=device) for kind in split}
        self._scratch = Scratch.of(size, device=device) if int8 else None

    def decode(self, kind: Kind, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of moment `kind` in fp32, in its buffer; `lo` a multiple of `align`."""
        out = self.buffers[kind]
        out = out if out.numel() == hi - lo else out[: hi - lo]
        if self._scratch is None:
            return out.copy_(self._stored[kind][lo:hi])
        block = self._fmt.block
        absmax = self._blocks[kind][lo // block : -(-hi // block)]
        dequantize_into(self._codes[kind][lo:hi], absmax, block=block, table=self._tables[kind], out=out, scratch=self._scratch)
        return out

    def encode(self, kind: Kind, values: torch.Tensor, lo: int) -> None:
        """Store fp32 `values` as elements [lo, lo + len) of moment `kind`: rounded to bf16, or re-quantized
        (each block's new absmax and nearest codes, written in place; the window holds whole blocks).
        exp_avg_sq is quantized unchecked for sign: Adam's never is negative. Non-finite values are refused
        with a ValueError saying "finite"."""
        hi = lo + values.numel()
        if self._scratch is None:
            self._stored[kind][lo:hi].copy_(values)
            return
        block = self._fmt.block
        absmax = self._blocks[kind][lo // block : -(-hi // block)]
        codes = self._codes[kind][lo:hi]
        table, signed = self._tables[kind], SIGNED[kind]
        if not quantize_into(values, block=block, table=table, signed=signed, codes=codes, absmax=absmax, scratch=self._scratch):
            raise ValueError(f"int8 moments need finite values, got inf or NaN in elements {lo}-{hi}")
