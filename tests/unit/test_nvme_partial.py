"""Part-of-region I/O on the NVMe tier: bytes at `start`, and checksums that follow region positions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierzero.common.slices import aligned_empty
from tierzero.offload.base import ChecksumError
from tierzero.offload.nvme import NvmeTier

KiB, MiB = 1 << 10, 1 << 20


def make_tier(path: Path, **kwargs) -> NvmeTier:
    settings = {"capacity": 8 * MiB, "block_size": 256 * KiB, "queue_depth": 4, "threads": 2, "verify": True}
    return NvmeTier(path, **(settings | kwargs))


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def on_disk(tier: NvmeTier, offset: int, nbytes: int) -> bytes:
    with open(tier.file_path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def flip_byte(tier: NvmeTier, offset: int) -> None:
    fd = os.open(tier.file_path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x40]), offset)
    finally:
        os.close(fd)


def staged(data: torch.Tensor) -> torch.Tensor:
    """`data` in a 4096-aligned buffer, as the swapper's staging buffers are (direct I/O, no bounce)."""
    out = aligned_empty(data.numel())
    out.copy_(data)
    return out


@pytest.mark.parametrize("backend", ["pread", "aiofiles"])
def test_partial_writes_then_a_whole_read_verify(tmp_path: Path, backend: str) -> None:
    with make_tier(tmp_path, backend=backend) as tier:
        n = 3 * MiB + 777
        region = tier.allocate(n, label="u0/master")
        src = random_bytes(n, 1)
        # 192 KiB pieces straddle the 256 KiB blocks; written last first, half of them unaligned in memory.
        step = 192 * KiB
        for i, start in enumerate(reversed(range(0, n, step))):
            piece = src[start : start + step]
            tier.write(region, staged(piece) if i % 2 else piece.clone(), start=start)
        dst = torch.empty(n, dtype=torch.uint8)
        tier.read(region, dst)
        assert torch.equal(dst, src)
        assert on_disk(tier, region.offset, n) == bytes(src.tolist())
        # A byte changed behind the tier is caught, named by the piece that covered it.
        flip_byte(tier, region.offset + 200 * KiB)
        with pytest.raises(ChecksumError) as info:
            tier.read(region, dst)
    assert str(info.value).startswith(
        f"checksum mismatch reading u0/master: {tier.file_path} at offset {region.offset + step} ({64 * KiB} bytes)"
    )


def test_a_whole_write_then_partial_reads_verify(tmp_path: Path) -> None:
    with make_tier(tmp_path) as tier:
        n = 2 * MiB + 5
        region = tier.allocate(n, label="u1/param")
        src = random_bytes(n, 2)
        tier.write(region, src)
        step = 512 * KiB
        for start in range(0, n, step):
            part = aligned_empty(min(step, n - start))
            tier.read(region, part, start=start)
            assert torch.equal(part, src[start : start + part.numel()]), f"bytes at {start}"
        flip_byte(tier, region.offset + MiB + 3)
        # Only the partial read that covers the changed byte fails; the others still pass.
        tier.read(region, aligned_empty(step), start=0)
        with pytest.raises(ChecksumError, match=f"at offset {region.offset + MiB} \\({256 * KiB} bytes\\)"):
            tier.read(region, aligned_empty(step), start=MiB)


def test_a_partial_write_replaces_only_its_bytes_and_their_checksums(tmp_path: Path) -> None:
    with make_tier(tmp_path) as tier:
        n = MiB + 100
        region = tier.allocate(n, label="u2/grad")
        old, new = random_bytes(n, 3), random_bytes(n, 4)
        tier.write(region, old)
        tier.write(region, staged(new[4096 : 3 * 4096]), start=4096)
        tier.write(region, staged(new[MiB:]), start=MiB)  # the tail ends at the region's end
        expected = old.clone()
        expected[4096 : 3 * 4096] = new[4096 : 3 * 4096]
        expected[MiB:] = new[MiB:]
        dst = torch.empty(n, dtype=torch.uint8)
        tier.read(region, dst)
        assert torch.equal(dst, expected)
        assert on_disk(tier, region.offset + n, 4096 - 100) == bytes(4096 - 100)  # padding stays zeros
        tail = torch.empty(100, dtype=torch.uint8)
        tier.read(region, tail, start=MiB)
        assert torch.equal(tail, new[MiB:])


def test_bad_ranges_are_refused_with_the_fix(tmp_path: Path) -> None:
    with make_tier(tmp_path) as tier:
        region = tier.allocate(3 * 4096 + 10, label="u3/exp_avg")
        with pytest.raises(
            ValueError,
            match=r"NVMe read of u3/exp_avg: bytes \[100, 4196\) do not fit its 12298 bytes at a multiple of 4096: "
            r"pass start as a multiple of 4096",
        ):
            tier.read(region, torch.empty(4096, dtype=torch.uint8), start=100)
        with pytest.raises(ValueError, match=r"bytes \[8192, 16384\) do not fit its 12298 bytes"):
            tier.write(region, torch.empty(8192, dtype=torch.uint8), start=8192)
        with pytest.raises(
            ValueError,
            match=r"NVMe write of u3/exp_avg: a partial write must end on a multiple of 4096 or at the region's end "
            r"\(12298\), got bytes \[4096, 4196\): write whole blocks",
        ):
            tier.write(region, torch.empty(100, dtype=torch.uint8), start=4096)
