"""Block-wise quantizers for stored state: NF4 and int8 for a frozen base, 8-bit dynamic codes for Adam's moments.

Each function takes one tensor and returns its quantized form (or the reverse), on the
tensor's device, so a model is quantized slice by slice while it streams in, never whole.
Temporaries are a few fp32 copies of that one tensor. Inputs are fp32, bf16 or fp16 and
finite; the arithmetic is fp32 throughout, each result rounded once to the asked dtype.

[Note: nearest code]
Every quantizer here maps an element x of a block with absmax a > 0 to the code c nearest
to r = fl32(x / a) (a correctly rounded fp32 division, so |r| <= 1), ties to the lower code
(the one with the smaller index, i.e. toward -inf), as bitsandbytes' NF4 decision tree does
(`x > midpoint` takes the upper code). The comparison is exact: r > (c_i + c_{i+1}) / 2
holds exactly when r > m_i, where m_i is that midpoint rounded *down* to fp32, because no
fp32 value lies strictly between m_i and the exact midpoint; so the code index is the number
of m_i below r (`torch.bucketize` against the m_i), found by one table lookup ([Note: code
tables] in code_tables.py). An all-zero block has absmax 0,
its r are taken as 0 and it comes back as zeros. The code value times the fp32 absmax,
rounded once to fp32, is the reconstruction; its error is at most the largest distance from
a point of [-1, 1] ([0, 1] for the unsigned dynamic code) to its nearest code, times a,
plus an ulp or two of a.

[Note: NF4]
QLoRA's NormalFloat4 (Dettmers et al. 2023, appendix E): the quantiles of N(0, 1) at 8
equal steps from 1 - d to 1/2 on the positive side and 7 on the negative (d = (1/30 +
1/32) / 2), an exact zero, normalised so the extremes are -1 and 1. `NF4_CODE` is the
published table (bitsandbytes' `get_4bit_type("nf4")`) as fp32 values. Blocks of 64 by
default, each with its fp32 absmax. Indices are packed two per byte over the whole flat
tensor, the even-indexed element in the HIGH nibble (bitsandbytes' order, so the packed
bytes equal its `quantize_4bit`'s; note it is the reverse of comm/quant.py's int4); an odd
numel leaves the last low nibble 0. Double quantization (the paper's section 3) keeps
instead the absmax minus their mean (the float64 mean rounded to fp32), 8-bit
dynamic-coded in blocks of 256 with an fp32 scale each (`QuantizedAbsmax`); the 4-bit
indices are those of the exact absmax, as in bitsandbytes, and dequantization uses the
reconstructed ones.

[Note: the dynamic code]
The 8-bit optimizers' dynamic data type (Dettmers et al. 2022; bitsandbytes'
`create_dynamic_map`): for exponent i = 0..6, n_i linear fractions split [0.1, 1] into
n_i equal bins and take the bin centres times 10^(i-6); n_i = 2^i with a sign (127
magnitudes, each with both signs) or 2^(i+1) without one (254 magnitudes); plus 0 and 1.
Each value here is the exact one rounded once to fp32; bitsandbytes computes them in fp32
steps and differs from these by one ulp in some (72 signed, 100 unsigned) of them. The
signed code's smallest value is -0.99297, not -1. Blocks of 256 by default, as
bitsandbytes' 8-bit optimizers use (the paper: 2048): 4 B of absmax per 256 moments, so
two int8 moments cost 2.03 B per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from tierzero.comm.quant import quantize as quantize_flat
from tierzero.units.code_tables import CHUNK, CodeTable, Scratch, code_table, dequantize_into, quantize_into

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPE = torch.float32
NF4_BLOCK = 64
INT8_BLOCK = 64
DYNAMIC_BLOCK = 256
ABSMAX_BLOCK = 256
"""Block of the double-quantized NF4 absmax, as in the QLoRA paper."""

NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
"""The 16 NormalFloat4 values, sorted: index i is the 4-bit code i."""


def dynamic_code(*, signed: bool) -> tuple[float, ...]:
    """The 256 values of the dynamic data type, sorted, each the exact value rounded to fp32."""
    values = [Fraction(0), Fraction(1)]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        for j in range(n):
            centre = Fraction(1, 10) + Fraction(9 * (2 * j + 1), 20 * n)
            value = centre * Fraction(10) ** (i - 6)
            values += [value, -value] if signed else [value]
    return tuple(float(torch.tensor(float(v), dtype=torch.float32)) for v in sorted(values))


def _midpoints_below(code: torch.Tensor) -> torch.Tensor:
    """Each midpoint of neighbouring fp32 codes rounded down to fp32 (see [Note: nearest code])."""
    exact = (code[:-1].double() + code[1:].double()) / 2
    mids = exact.float()
    return torch.where(mids.double() > exact, torch.nextafter(mids, torch.tensor(-math.inf)), mids)


_NF4 = torch.tensor(NF4_CODE, dtype=torch.float32)
_DYNAMIC = {signed: torch.tensor(dynamic_code(signed=signed), dtype=torch.float32) for signed in (True, False)}


def _check_input(x: torch.Tensor, *, what: str, finite: bool = True) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"{what} takes a float32, bfloat16 or float16 tensor, got {got}: cast it first, e.g. x.float()"
        )
    if finite:
        _check_finite(x, what=what)


def _check_finite(x: torch.Tensor, *, what: str) -> None:
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(
            f"{what} needs finite values, got {bad} inf/NaN of {x.numel()} in a tensor of shape {tuple(x.shape)}: "
            "find where they came from before quantizing"
        )


def _check_block(block: int, *, even: bool = False) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or (even and block % 2):
        need = "a positive even int (two 4-bit codes per byte)" if even else "a positive int"
        raise ValueError(f"block must be {need}, got {block!r}: e.g. block=64")


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _nearest(
    x: torch.Tensor, *, block: int, table: CodeTable, what: str, signed: bool = True, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block fp32 absmax of ``x`` (flattened) and each element's nearest code index, uint8, flat.

    The finiteness check rides on the absmax pass: a NaN or inf makes its block's absmax non-finite."""
    flat = x.detach().reshape(-1).to(torch.float32).contiguous()
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device) if out is None else out
    if not flat.numel():
        return flat.new_zeros(0), codes
    absmax = flat.new_empty(_blocks(flat.numel(), block))
    step = max(block, CHUNK // block * block)
    scratch, table = Scratch.of(min(step, flat.numel()), device=x.device), table.to(x.device)
    finite = True
    for lo in range(0, flat.numel(), step):
        hi = min(lo + step, flat.numel())
        blocks = absmax[lo // block : _blocks(hi, block)]
        finite &= quantize_into(flat[lo:hi], block=block, table=table, signed=signed, codes=codes[lo:hi], absmax=blocks, scratch=scratch)
    if not finite:
        _check_finite(x, what=what)
    if not signed and bool(flat.amin() < 0):
        raise ValueError(
            f"quantize_dynamic(signed=False) takes non-negative values (exp_avg_sq), got a minimum of "
            f"{float(x.min())}: pass signed=True for a signed state"
        )
    return absmax, codes


_TABLES = {name: code_table(c, _midpoints_below(c)) for name, c in (("nf4", _NF4), *_DYNAMIC.items())}
"""The tables of NF4 and of the signed (True) and unsigned (False) dynamic codes."""


def dynamic_table(*, signed: bool, device: torch.device) -> CodeTable:
    """The signed or unsigned dynamic code's tables on ``device``, for `quantize_into` and `dequantize_into`
    (code_tables.py) a chunk at a time."""
    return _TABLES[signed].to(device)


def _reconstruct(values: torch.Tensor, absmax: torch.Tensor, *, block: int) -> torch.Tensor:
    """Flat code values times their block's absmax, fp32."""
    numel = values.numel()
    padded = torch.nn.functional.pad(values, (0, absmax.numel() * block - numel)).view(-1, block)
    return (padded * absmax[:, None]).view(-1)[:numel]


def _expect(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be {dtype} of shape {shape}, got {tensor.dtype} of shape {tuple(tensor.shape)}")


# --- 8-bit dynamic codes (Adam's moments) -------------------------------------------------------


def quantize_dynamic(
    x: torch.Tensor, *, signed: bool, block: int = DYNAMIC_BLOCK, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as 8-bit dynamic codes: uint8 indices of ``x``'s shape, and the fp32 absmax of each block.

    ``signed=True`` for signed states (Adam's exp_avg), ``False`` for non-negative ones
    (exp_avg_sq), which then refuses a negative element. Blocks run over ``x`` flattened.
    ``out``: (codes, absmax) to write instead, contiguous, 1-D, of the returned dtypes and sizes.
    """
    _check_input(x, what="quantize_dynamic", finite=False)
    _check_block(block)
    if out is not None:
        _expect("out codes", out[0], torch.uint8, (x.numel(),))
        _expect("out absmax", out[1], SCALE_DTYPE, (_blocks(x.numel(), block),))
    absmax, index = _nearest(
        x, block=block, table=_TABLES[signed], what="quantize_dynamic", signed=signed, out=None if out is None else out[0]
    )
    if out is None:
        return index.view(x.shape), absmax
    out[1].copy_(absmax)
    return out


def dequantize_dynamic(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    *,
    signed: bool,
    block: int = DYNAMIC_BLOCK,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values of ``codes`` (uint8, any shape) with their blocks' ``absmax``, in ``codes``' shape and ``dtype``.

    ``out``: a contiguous 1-D fp32 tensor of ``codes.numel()`` to write instead (``dtype`` fp32)."""
    _check_block(block)
    _expect("codes", codes, torch.uint8, tuple(codes.shape))
    _expect("absmax", absmax, SCALE_DTYPE, (_blocks(codes.numel(), block),))
    flat = codes.reshape(-1)
    if out is None:
        values = torch.empty(flat.numel(), dtype=torch.float32, device=codes.device)
    else:
        _expect("out", out, torch.float32, (flat.numel(),))
        values = out
    step = max(block, CHUNK // block * block)
    scratch, table = Scratch.of(min(step, flat.numel()), device=codes.device), dynamic_table(signed=signed, device=codes.device)
    for lo in range(0, flat.numel(), step):
        hi = min(lo + step, flat.numel())
        blocks = absmax[lo // block : _blocks(hi, block)]
        dequantize_into(flat[lo:hi], blocks, block=block, table=table, out=values[lo:hi], scratch=scratch)
    return values if out is not None else values.view(codes.shape).to(dtype)


def dynamic_nbytes(numel: int, *, block: int = DYNAMIC_BLOCK) -> int:
    """Bytes of ``numel`` dynamic-coded elements: one per element and 4 per block."""
    _check_block(block)
    return numel + SCALE_DTYPE.itemsize * _blocks(numel, block)


# --- NF4 (a frozen base) ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantizedAbsmax:
    """NF4's per-block absmax, double-quantized: absmax - offset as signed 8-bit dynamic codes."""

    codes: torch.Tensor
    """uint8, one per NF4 block."""
    scales: torch.Tensor
    """fp32, the absmax of each block of ``block`` codes."""
    offset: torch.Tensor
    """fp32, 0-d: the mean subtracted from the absmax before quantizing them."""
    block: int = ABSMAX_BLOCK
    """Codes per scale."""

    def __post_init__(self) -> None:
        _check_block(self.block)
        _expect("codes", self.codes, torch.uint8, (self.codes.numel(),))
        _expect("scales", self.scales, SCALE_DTYPE, (_blocks(self.codes.numel(), self.block),))
        _expect("offset", self.offset, SCALE_DTYPE, ())

    def dequantize(self) -> torch.Tensor:
        """The fp32 absmax the NF4 values are scaled by."""
        centred = dequantize_dynamic(self.codes, self.scales, signed=True, block=self.block)
        return centred + self.offset

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + SCALE_DTYPE.itemsize * (self.scales.numel() + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class NF4Tensor:
    """A tensor in NF4: packed 4-bit codes and a scale per block, all a tier or a checkpoint keeps of it."""

    codes: torch.Tensor
    """uint8, 1-D, ceil(numel / 2): two code indices per byte, the even element in the high nibble."""
    absmax: torch.Tensor | QuantizedAbsmax
    """The absmax of each block: fp32, 1-D, or double-quantized."""
    shape: torch.Size
    """The original tensor's shape."""
    dtype: torch.dtype
    """The original tensor's dtype, which `dequantize_nf4` returns by default."""
    block: int = NF4_BLOCK
    """Elements per block, over the tensor flattened; the last block may be shorter."""

    def __post_init__(self) -> None:
        _check_block(self.block, even=True)
        numel = math.prod(self.shape)
        _expect("codes", self.codes, torch.uint8, (-(-numel // 2),))
        blocks = _blocks(numel, self.block)
        if isinstance(self.absmax, QuantizedAbsmax):
            _expect("absmax.codes", self.absmax.codes, torch.uint8, (blocks,))
        else:
            _expect("absmax", self.absmax, SCALE_DTYPE, (blocks,))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes kept: packed codes plus the scales, equal to `nf4_nbytes`."""
        scales = self.absmax.nbytes if isinstance(self.absmax, QuantizedAbsmax) else 4 * self.absmax.numel()
        return self.codes.numel() + scales

    def block_absmax(self) -> torch.Tensor:
        """The fp32 absmax of each block, reconstructed when double-quantized."""
        return self.absmax.dequantize() if isinstance(self.absmax, QuantizedAbsmax) else self.absmax


def nf4_nbytes(numel: int, *, block: int = NF4_BLOCK, double_quant: bool = False) -> int:
    """Bytes of ``numel`` elements in NF4: ceil(numel / 2) plus 4 B a block, or 1 B a block + 4 per 256 + 4."""
    _check_block(block, even=True)
    blocks = _blocks(numel, block)
    if not double_quant:
        return -(-numel // 2) + SCALE_DTYPE.itemsize * blocks
    return -(-numel // 2) + blocks + SCALE_DTYPE.itemsize * (_blocks(blocks, ABSMAX_BLOCK) + 1)


def quantize_nf4(x: torch.Tensor, *, block: int = NF4_BLOCK, double_quant: bool = False) -> NF4Tensor:
    """``x`` in NF4 with per-block absmax, double-quantized when asked (see [Note: NF4])."""
    _check_input(x, what="quantize_nf4", finite=False)
    _check_block(block, even=True)
    absmax, nibbles = _nearest(x, block=block, table=_TABLES["nf4"], what="quantize_nf4")
    if nibbles.numel() % 2:  # the last byte's low nibble: the code of 0.0, as bitsandbytes pads it
        nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=NF4_CODE.index(0.0))
    pairs = nibbles.view(-1, 2)
    codes = (pairs[:, 0] << 4) | pairs[:, 1]
    scales = _double_quantize(absmax) if double_quant else absmax
    return NF4Tensor(codes=codes, absmax=scales, shape=x.shape, dtype=x.dtype, block=block)


def dequantize_nf4(q: NF4Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q``'s values in ``q.shape``: code value times block absmax in fp32, rounded once to ``dtype``.

    ``dtype`` defaults to ``q.dtype``.
    """
    index = torch.stack((q.codes >> 4, q.codes & 0x0F), dim=1).view(-1)[: q.numel].long()
    values = _NF4.to(q.codes.device)[index]
    return _reconstruct(values, q.block_absmax(), block=q.block).view(q.shape).to(q.dtype if dtype is None else dtype)


def _double_quantize(absmax: torch.Tensor) -> QuantizedAbsmax:
    # float64 for the mean, where the device has it (MPS has not), so the offset is the exact mean
    # rounded to fp32 up to a 1e-16 relative chance; any offset reconstructs, this one is reproducible.
    wide = absmax if absmax.device.type != "mps" else absmax.cpu()
    offset = wide.double().mean().float().to(absmax.device) if absmax.numel() else absmax.new_zeros(())
    codes, scales = quantize_dynamic(absmax - offset, signed=True, block=ABSMAX_BLOCK)
    return QuantizedAbsmax(codes=codes, scales=scales, offset=offset, block=ABSMAX_BLOCK)


# --- int8 (a frozen base) --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Int8Tensor:
    """A tensor in block-wise symmetric int8: codes in [-127, 127] and an fp32 scale per block."""

    codes: torch.Tensor
    """int8, 1-D, numel: round-half-even of x / scale."""
    scales: torch.Tensor
    """fp32, 1-D: ``absmax / 127`` per block; 0 for an all-zero block."""
    shape: torch.Size
    """The original tensor's shape."""
    dtype: torch.dtype
    """The original tensor's dtype, which `dequantize_int8` returns by default."""
    block: int = INT8_BLOCK
    """Elements per block, over the tensor flattened; the last block may be shorter."""

    def __post_init__(self) -> None:
        _check_block(self.block)
        numel = math.prod(self.shape)
        _expect("codes", self.codes, torch.int8, (numel,))
        _expect("scales", self.scales, SCALE_DTYPE, (_blocks(numel, self.block),))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + SCALE_DTYPE.itemsize * self.scales.numel()


def quantize_int8(x: torch.Tensor, *, block: int = INT8_BLOCK) -> Int8Tensor:
    """``x`` in block-wise int8: scale = fl32(absmax / 127), code = round-half-even(fl32(x / scale)).

    The arithmetic is ZeRO++'s (tierzero/comm/quant.py), shared rather than copied.
    """
    _check_input(x, what="quantize_int8")
    _check_block(block)
    flat = quantize_flat(x.detach().reshape(-1), bits=8, block_size=block)
    return Int8Tensor(codes=flat.data.view(torch.int8), scales=flat.scales, shape=x.shape, dtype=x.dtype, block=block)


def dequantize_int8(q: Int8Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q``'s values in ``q.shape``: code times scale in fp32, rounded once to ``dtype`` (default ``q.dtype``)."""
    values = _reconstruct(q.codes.to(torch.float32), q.scales, block=q.block)
    return values.view(q.shape).to(q.dtype if dtype is None else dtype)
