"""The NVMe tier against real files: bytes, layout on disk, limits, failures and clean-up."""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time
import warnings
import zlib
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tierzero.common.sizes import format_size
from tierzero.common.slices import IO_ALIGNMENT, Tier, align_up
from tierzero.offload.base import ChecksumError, Region, TierCapacityError
from tierzero.offload.disk import chunk_queue as nvme_io
from tierzero.offload.disk.files import NvmeSpaceError
from tierzero.offload.nvme import ExtentAllocator, NvmeTier

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
DiskUsage = namedtuple("DiskUsage", "total used free")


def make_tier(path: Path, **kwargs) -> NvmeTier:
    settings = {"capacity": 64 * MiB, "block_size": MiB, "queue_depth": 4, "threads": 4} | kwargs
    return NvmeTier(path, **settings)


def random_bytes(nbytes: int, *, aligned: bool, seed: int) -> torch.Tensor:
    """Random bytes whose first byte is 4096-aligned, or deliberately one byte past alignment."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes + 2 * IO_ALIGNMENT,), dtype=torch.uint8, generator=gen)
    start = (-raw.data_ptr()) % IO_ALIGNMENT + (0 if aligned else 1)
    return raw[start : start + nbytes]


def dest_buffer(nbytes: int, *, aligned: bool) -> torch.Tensor:
    raw = torch.full((nbytes + 2 * IO_ALIGNMENT,), 0xA5, dtype=torch.uint8)
    start = (-raw.data_ptr()) % IO_ALIGNMENT + (0 if aligned else 1)
    return raw[start : start + nbytes]


def file_bytes(tier: NvmeTier, offset: int, nbytes: int) -> bytes:
    with open(tier.file_path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


@pytest.fixture
def tmpfs(mount_tmpfs) -> Path:
    return mount_tmpfs("8m")


# --- bytes in, the same bytes out -------------------------------------------------------


@pytest.mark.parametrize("backend", ["pread", "aiofiles"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_round_trip_sizes_bit_exact(tmp_path: Path, backend: str, aligned: bool) -> None:
    sizes = [1, 4095, 4096, 4097, 3 * MiB + 777, 2 * MiB]
    # verify=True also checks that checksums cover exactly the data bytes on every path.
    with make_tier(tmp_path, backend=backend, verify=True) as tier:
        for seed, nbytes in enumerate(sizes):
            region = tier.allocate(nbytes, label=f"unit{seed}/param")
            src = random_bytes(nbytes, aligned=aligned, seed=seed)
            tier.write(region, src)
            dst = dest_buffer(nbytes, aligned=aligned)
            tier.read(region, dst)
            assert torch.equal(dst, src), f"{nbytes} bytes came back different"
        assert tier.used == sum(align_up(n) for n in sizes)


def test_direct_io_wherever_the_filesystem_takes_it(tmp_path: Path) -> None:
    try:
        os.close(os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        expected = True
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        expected = False
    (tmp_path / "probe").unlink(missing_ok=True)
    with make_tier(tmp_path) as tier:
        assert tier.direct is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_round_trip_dtypes_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    values = (torch.randn(300_001, generator=gen) * 1e3).to(dtype)
    values[:3] = torch.tensor([float("inf"), float("-inf"), -0.0]).to(dtype) if dtype.is_floating_point else 0
    src = values.view(torch.uint8)
    with make_tier(tmp_path) as tier:
        region = tier.allocate(src.numel(), label="unit0/master")
        tier.write(region, src)
        out = torch.empty_like(values)
        tier.read(region, out.view(torch.uint8))
    assert torch.equal(out.view(torch.uint8), src)


def test_padding_of_the_extent_is_zeros_on_disk(tmp_path: Path) -> None:
    with make_tier(tmp_path) as tier:
        for aligned in (True, False):
            dirty = tier.allocate(8192, label="dirty")
            tier.write(dirty, torch.full((8192,), 0xFF, dtype=torch.uint8))
            tier.free(dirty)
            region = tier.allocate(4097, label="tail")
            assert region.offset == dirty.offset
            src = random_bytes(4097, aligned=aligned, seed=3)
            tier.write(region, src)
            assert file_bytes(tier, region.offset, 8192) == bytes(src.tolist()) + bytes(8192 - 4097)
            tier.free(region)


def test_empty_region_round_trip(tmp_path: Path) -> None:
    with make_tier(tmp_path) as tier:
        region = tier.allocate(0, label="empty")
        tier.write(region, torch.empty(0, dtype=torch.uint8))
        tier.read(region, torch.empty(0, dtype=torch.uint8))
        assert tier.used == IO_ALIGNMENT


def test_many_concurrent_requests_on_different_regions(tmp_path: Path) -> None:
    rng = random.Random(11)
    with make_tier(tmp_path, capacity=128 * MiB, block_size=256 * 1024, queue_depth=6) as tier:
        sizes = [rng.choice([1, 4095, 4097, 300_000, 1_000_003, 2 * MiB]) for _ in range(40)]
        regions = [tier.allocate(n, label=f"u{i}") for i, n in enumerate(sizes)]
        sources = [random_bytes(n, aligned=i % 2 == 0, seed=i) for i, n in enumerate(sizes)]
        first = sources[:20]
        for future in [tier.submit_write(r, s) for r, s in zip(regions[:20], first)]:
            future.result()
        outs = [dest_buffer(n, aligned=i % 3 == 0) for i, n in enumerate(sizes)]
        # Reads of the first half run alongside writes of the second half.
        futures = [tier.submit_read(r, o) for r, o in zip(regions[:20], outs[:20])]
        futures += [tier.submit_write(r, s) for r, s in zip(regions[20:], sources[20:])]
        for future in futures:
            future.result()
        for future in [tier.submit_read(r, o) for r, o in zip(regions[20:], outs[20:])]:
            future.result()
        for i, (src, out) in enumerate(zip(sources, outs)):
            assert torch.equal(src, out), f"region {i} ({sizes[i]} bytes) differs"
        assert tier.inflight_peak <= 6


def test_queue_depth_bounds_chunks_in_flight_across_requests(tmp_path: Path, monkeypatch) -> None:
    lock = threading.Lock()
    state = {"now": 0, "max": 0, "calls": 0}

    def counted(real):
        def call(fd, iov, offset):
            with lock:
                state["now"] += 1
                state["calls"] += 1
                state["max"] = max(state["max"], state["now"])
            time.sleep(0.004)
            try:
                return real(fd, iov, offset)
            finally:
                with lock:
                    state["now"] -= 1

        return call

    with make_tier(tmp_path, block_size=64 * 1024, queue_depth=3, threads=8) as tier:
        regions = [tier.allocate(512 * 1024, label=f"u{i}") for i in range(8)]
        monkeypatch.setattr(os, "pwritev", counted(os.pwritev))
        monkeypatch.setattr(os, "preadv", counted(os.preadv))
        sources = [random_bytes(512 * 1024, aligned=True, seed=i) for i in range(8)]
        for future in [tier.submit_write(r, s) for r, s in zip(regions, sources)]:
            future.result()
        outs = [torch.empty(512 * 1024, dtype=torch.uint8) for _ in regions]
        for future in [tier.submit_read(r, o) for r, o in zip(regions, outs)]:
            future.result()
    assert state["calls"] == 2 * 8 * 8
    assert state["max"] == 3, f"{state['max']} chunks were in flight at once with queue_depth=3"
    assert tier.inflight_peak == 3
    assert all(torch.equal(s, o) for s, o in zip(sources, outs))


def test_short_transfers_are_resumed(tmp_path: Path, monkeypatch) -> None:
    calls = {"n": 0}

    def short(real):
        def call(fd, iov, offset):
            calls["n"] += 1
            total = sum(len(b) for b in iov)
            limit = max(IO_ALIGNMENT, total // 2 // IO_ALIGNMENT * IO_ALIGNMENT)
            kept, room = [], limit
            for buf in iov:
                if room <= 0:
                    break
                kept.append(buf[:room])
                room -= len(kept[-1])
            return real(fd, kept, offset)

        return call

    with make_tier(tmp_path) as tier:
        region = tier.allocate(3 * MiB + 5, label="unit3/exp_avg")
        src = random_bytes(3 * MiB + 5, aligned=True, seed=5)
        monkeypatch.setattr(os, "pwritev", short(os.pwritev))
        monkeypatch.setattr(os, "preadv", short(os.preadv))
        tier.write(region, src)
        dst = torch.empty_like(src)
        tier.read(region, dst)
    assert torch.equal(src, dst)
    assert calls["n"] > 2 * 4, "every chunk should have needed more than one call"


def test_io_error_names_the_region(tmp_path: Path, monkeypatch) -> None:
    def failing(fd, iov, offset):
        raise OSError(errno.EIO, "Input/output error")

    with make_tier(tmp_path) as tier:
        tier.allocate(5 * IO_ALIGNMENT, label="before")
        region = tier.allocate(MiB, label="unit7/exp_avg_sq")
        monkeypatch.setattr(os, "pwritev", failing)
        with pytest.raises(OSError) as info:
            tier.write(region, torch.zeros(MiB, dtype=torch.uint8))
        monkeypatch.undo()
    assert info.value.errno == errno.EIO
    assert str(info.value) == (
        f"[Errno 5] NVMe write of unit7/exp_avg_sq failed: {tier.file_path} at offset {region.offset} "
        f"({MiB} bytes): Input/output error"
    )


def test_bounce_memory_is_bounded_and_lazy(tmp_path: Path) -> None:
    with make_tier(tmp_path, block_size=256 * 1024, queue_depth=2) as tier:
        region = tier.allocate(10 * 256 * 1024 + 100, label="u")
        aligned = random_bytes(10 * 256 * 1024, aligned=True, seed=1)
        exact = tier.allocate(aligned.numel(), label="exact")
        tier.write(exact, aligned)
        back = dest_buffer(aligned.numel(), aligned=True)
        tier.read(exact, back)
        assert torch.equal(back, aligned)
        assert tier.bounce_peak_bytes == 0, "an aligned, block-multiple tensor moves with no bounce memory"
        src = random_bytes(region.nbytes, aligned=False, seed=2)
        tier.write(region, src)
        dst = dest_buffer(region.nbytes, aligned=False)
        tier.read(region, dst)
        assert torch.equal(src, dst)
        assert 0 < tier.bounce_peak_bytes <= 2 * 256 * 1024
        assert tier.bounce_bytes <= 2 * 256 * 1024


# --- the allocator ----------------------------------------------------------------------


def test_allocator_reuses_first_fit_and_coalesces(tmp_path: Path) -> None:
    with make_tier(tmp_path, capacity=1 * MiB) as tier:
        a = tier.allocate(100_000, label="a")
        b = tier.allocate(200_000, label="b")
        c = tier.allocate(100, label="c")
        assert (a.offset, b.offset, c.offset) == (0, align_up(100_000), align_up(100_000) + align_up(200_000))
        tier.free(b)
        d = tier.allocate(50_000, label="d")
        assert d.offset == b.offset, "first fit takes the hole b left"
        tier.free(a)
        tier.free(d)
        e = tier.allocate(align_up(100_000) + align_up(200_000), label="e")
        assert e.offset == 0, "a, d and the rest of b's hole coalesce into one extent"
        tier.free(e)
        tier.free(c)
        assert tier.used == 0
        assert tier._allocator.free_extents == [(0, MiB)]
        assert tier.allocate(MiB, label="all").offset == 0


def test_allocator_random_against_reference() -> None:
    rng = random.Random(3)
    alloc = ExtentAllocator(256 * IO_ALIGNMENT)
    live: dict[int, int] = {}
    for step in range(2000):
        if live and (rng.random() < 0.45 or len(live) > 40):
            offset = rng.choice(list(live))
            alloc.free(offset)
            del live[offset]
        else:
            nbytes = rng.randint(1, 12 * IO_ALIGNMENT)
            try:
                offset = alloc.allocate(nbytes, label=f"s{step}")
            except TierCapacityError:
                free = alloc.free_extents
                assert all(length < align_up(nbytes) for _, length in free)
                continue
            live[offset] = align_up(nbytes)
        spans = sorted(live.items()) + [(o, -n) for o, n in alloc.free_extents]
        spans = sorted((o, abs(n)) for o, n in spans)
        assert sum(n for _, n in spans) == alloc.capacity, "allocated and free extents tile the file"
        assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))
        free = alloc.free_extents
        assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in zip(free, free[1:])), "free neighbours are coalesced"
        assert alloc.used == sum(live.values())


def test_capacity_error_text(tmp_path: Path) -> None:
    with make_tier(tmp_path, capacity=MiB) as tier:
        tier.allocate(MiB - 8192, label="big")
        with pytest.raises(TierCapacityError) as info:
            tier.allocate(10_000, label="unit4/exp_avg")
    assert str(info.value) == (
        "nvme tier is full: needs 12.0 KiB for unit4/exp_avg, 1016.0 KiB of its 1.0 MiB capacity already in use; "
        "raise tiers.nvme.capacity or move state to a lower tier"
    )
    assert info.value.tier is Tier.NVME


def test_capacity_error_names_fragmentation(tmp_path: Path) -> None:
    with make_tier(tmp_path, capacity=64 * 1024) as tier:
        regions = [tier.allocate(8192, label=f"r{i}") for i in range(8)]
        for region in regions[::2]:
            tier.free(region)
        with pytest.raises(TierCapacityError) as info:
            tier.allocate(16384, label="unit9/grad")
    assert str(info.value) == (
        "nvme tier is full: needs 16.0 KiB for unit9/grad (free space is fragmented: largest free extent 8.0 KiB), "
        "32.0 KiB of its 64.0 KiB capacity already in use; raise tiers.nvme.capacity or move state to a lower tier"
    )


def test_capacity_rounds_up_to_alignment(tmp_path: Path) -> None:
    with make_tier(tmp_path, capacity=10_000) as tier:
        assert tier.capacity == 12_288
        assert os.stat(tier.file_path).st_size == 12_288
        assert os.stat(tier.file_path).st_blocks * 512 >= 12_288, "the file is preallocated, not sparse"


# --- full disks -------------------------------------------------------------------------


def test_space_check_before_anything_is_created(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "keep.bin").write_bytes(b"precious")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(1 << 40, 0, int(31.0 * (1 << 30))))
    with pytest.raises(NvmeSpaceError) as info:
        NvmeTier(tmp_path, capacity=int(48.2 * (1 << 30)))
    assert str(info.value) == (
        f"NVMe tier needs 48.2 GiB at {tmp_path}, 31.0 GiB free: lower tiers.nvme.capacity or pick another path"
    )
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["keep.bin"]


def test_enospc_from_fallocate_removes_only_the_partial_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "keep.bin").write_bytes(b"precious")
    first = make_tier(tmp_path, run_id="job1", rank=0)
    region = first.allocate(4096, label="r0")
    first.write(region, torch.full((4096,), 7, dtype=torch.uint8))

    def partial_then_full(fd, offset, length):
        os.pwrite(fd, b"x" * 8192, 0)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", partial_then_full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(1 << 40, 0, 100 * MiB))
    with pytest.raises(NvmeSpaceError) as info:
        make_tier(tmp_path, run_id="job1", rank=1)
    assert str(info.value) == (
        f"NVMe tier needs 64.0 MiB at {tmp_path}, 100.0 MiB free: lower tiers.nvme.capacity or pick another path"
    )
    assert sorted(os.listdir(tmp_path / "job1")) == ["rank0.owner", "rank0.swap"]
    assert (tmp_path / "keep.bin").read_bytes() == b"precious"
    out = torch.empty(4096, dtype=torch.uint8)
    first.read(region, out)
    assert torch.equal(out, torch.full((4096,), 7, dtype=torch.uint8))
    first.close()
    assert sorted(os.listdir(tmp_path)) == ["keep.bin"]


def test_real_small_tmpfs(tmpfs: Path, monkeypatch) -> None:
    (tmpfs / "keep.bin").write_bytes(b"precious" * 1000)
    free = shutil.disk_usage(tmpfs).free
    with pytest.raises(NvmeSpaceError) as info:
        NvmeTier(tmpfs, capacity=16 * MiB)
    assert str(info.value) == (
        f"NVMe tier needs 16.0 MiB at {tmpfs}, {format_size(free)} free: lower tiers.nvme.capacity or pick another path"
    )
    assert os.listdir(tmpfs) == ["keep.bin"]
    # Past the up-front check (as when other ranks take the space meanwhile) the real
    # fallocate hits ENOSPC: same error, and the partial file is gone.
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(1 << 40, 0, 1 << 40))
    with pytest.raises(NvmeSpaceError):
        NvmeTier(tmpfs, capacity=16 * MiB)
    monkeypatch.setattr(shutil, "disk_usage", real_usage)
    assert os.listdir(tmpfs) == ["keep.bin"]
    assert (tmpfs / "keep.bin").read_bytes() == b"precious" * 1000
    assert shutil.disk_usage(tmpfs).free == free
    with NvmeTier(tmpfs, capacity=4 * MiB, block_size=MiB) as tier:
        region = tier.allocate(3 * MiB + 1, label="fits")
        src = random_bytes(region.nbytes, aligned=False, seed=9)
        tier.write(region, src)
        dst = torch.empty_like(src)
        tier.read(region, dst)
        assert torch.equal(src, dst)
    assert os.listdir(tmpfs) == ["keep.bin"]


# --- buffered fallback and checksums ----------------------------------------------------


def test_buffered_fallback_warns_once_per_path(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    other = tmp_path / "other"
    other.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = make_tier(tmp_path, run_id="a")
        second = make_tier(tmp_path, run_id="b")
        third = make_tier(other, run_id="c")
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"{tmp_path} does not support O_DIRECT: the NVMe tier falls back to buffered I/O, which goes through "
        "the page cache; put tiers.nvme.path on a local ext4/xfs NVMe disk",
        f"{other} does not support O_DIRECT: the NVMe tier falls back to buffered I/O, which goes through "
        "the page cache; put tiers.nvme.path on a local ext4/xfs NVMe disk",
    ]
    assert (first.direct, second.direct, third.direct) == (False, False, False)
    for size in (4097, 2 * MiB + 3):
        region = first.allocate(size, label="b")
        src = random_bytes(size, aligned=False, seed=size)
        first.write(region, src)
        dst = torch.empty_like(src)
        first.read(region, dst)
        assert torch.equal(src, dst)
        assert file_bytes(first, region.offset, align_up(size)) == bytes(src.tolist()) + bytes(align_up(size) - size)
    assert first.bounce_peak_bytes == 0
    for tier in (first, second, third):
        tier.close()


@pytest.mark.parametrize(("backend", "algorithm"), [("pread", "default"), ("aiofiles", "default"), ("pread", "zlib")])
def test_flipped_byte_is_caught_with_verify(tmp_path: Path, backend: str, algorithm: str, monkeypatch) -> None:
    if algorithm == "zlib":
        monkeypatch.setattr(nvme_io, "checksum", zlib.crc32)
    with make_tier(tmp_path, verify=True, backend=backend) as tier:
        region = tier.allocate(3 * MiB + 10, label="unit2/master")
        src = random_bytes(region.nbytes, aligned=True, seed=4)
        tier.write(region, src)
        dst = torch.empty_like(src)
        tier.read(region, dst)
        assert torch.equal(src, dst)
        bad = region.offset + MiB + 123
        fd = os.open(tier.file_path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, bad)[0] ^ 0x10]), bad)
        finally:
            os.close(fd)
        with pytest.raises(ChecksumError) as info:
            tier.read(region, dst)
    message = str(info.value)
    assert message.startswith(f"checksum mismatch reading unit2/master: {tier.file_path} at offset {region.offset + MiB} ({MiB} bytes)")
    assert message.endswith("the swap file was changed behind the tier or the disk returned bad data")


def test_half_written_region_is_not_taken_for_good_data(tmp_path: Path, monkeypatch) -> None:
    with make_tier(tmp_path, verify=True) as tier:
        region = tier.allocate(4 * MiB, label="unit5/param")
        tier.write(region, torch.zeros(4 * MiB, dtype=torch.uint8))
        real = os.pwritev
        failing_offset = region.offset + 2 * MiB

        def fail_third_chunk(fd, iov, offset):
            if offset == failing_offset:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, iov, offset)

        monkeypatch.setattr(os, "pwritev", fail_third_chunk)
        with pytest.raises(OSError, match=f"NVMe write of unit5/param failed: .* at offset {failing_offset}"):
            tier.write(region, torch.ones(4 * MiB, dtype=torch.uint8))
        monkeypatch.undo()
        with pytest.raises(ChecksumError, match=f"checksum mismatch reading unit5/param: .* at offset {failing_offset} "):
            tier.read(region, torch.empty(4 * MiB, dtype=torch.uint8))


def test_verify_off_returns_the_flipped_byte(tmp_path: Path) -> None:
    with make_tier(tmp_path) as tier:
        region = tier.allocate(8192, label="x")
        tier.write(region, torch.zeros(8192, dtype=torch.uint8))
        with open(tier.file_path, "r+b") as f:
            f.seek(region.offset + 5)
            f.write(b"\x01")
        dst = torch.empty(8192, dtype=torch.uint8)
        tier.read(region, dst)
    assert dst[5].item() == 1 and int(dst.sum()) == 1


def test_use_after_close_and_bad_arguments(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    region = tier.allocate(100, label="unit1/grad")
    with pytest.raises(ValueError, match=r"needs a contiguous 1-D uint8 CPU tensor of 100 bytes, got torch.float32 of shape \(25,\)"):
        tier.write(region, torch.zeros(25))
    foreign = Region(tier=Tier.CPU, nbytes=100, label="unit1/param", buffer=torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unit1/param is not a live region of .*rank0.swap: it was freed or comes from"):
        tier.read(foreign, torch.zeros(100, dtype=torch.uint8))
    tier.free(region)
    with pytest.raises(ValueError, match="unit1/grad is not a live region"):
        tier.read(region, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(AssertionError, match="unit1/grad freed twice or not from this tier"):
        tier.free(region)
    tier.close()
    with pytest.raises(ValueError, match="cannot use unit1/grad: the NVMe tier at .*rank0.swap is closed"):
        tier.write(region, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 4096, got 5000"):
        make_tier(tmp_path, block_size=5000)
    with pytest.raises(ValueError, match="backend must be one of pread, aiofiles, got 'io_uring'"):
        make_tier(tmp_path, backend="io_uring")
    with pytest.raises(ValueError, match="is not a directory"):
        make_tier(tmp_path / "missing")


def test_from_config(tmp_path: Path) -> None:
    nvme = SimpleNamespace(
        path=str(tmp_path), capacity=8 * MiB, block_size=MiB, queue_depth=2, threads=3, verify=True, backend="aiofiles"
    )
    cfg = SimpleNamespace(tiers=SimpleNamespace(nvme=nvme))
    with NvmeTier.from_config(cfg.tiers.nvme, rank=2, run_id="cfg") as tier:
        assert (tier.capacity, tier.block_size, tier.queue_depth, tier.threads) == (8 * MiB, MiB, 2, 3)
        assert (tier.verify, tier.backend, tier.file_path) == (True, "aiofiles", tmp_path / "cfg" / "rank2.swap")
    with NvmeTier.from_config(cfg.tiers.nvme, rank=0, capacity=4 * MiB) as tier:
        assert tier.capacity == 4 * MiB
    nvme.path = None
    with pytest.raises(ValueError, match="tiers.nvme.path is not set"):
        NvmeTier.from_config(cfg.tiers.nvme, rank=0)
