"""An NVMe block size the machine cannot hold: refused at construction, and no error on close hides the first."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from tierzero.offload.disk import chunk_queue as nvme_io
from tierzero.offload.nvme import NvmeTier

MiB, GiB = 1 << 20, 1 << 30


def nvme_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tierzero-nvme")]


def test_block_size_beyond_available_memory_is_refused_at_construction(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * GiB))
    with pytest.raises(ValueError) as info:
        NvmeTier(tmp_path, capacity=64 * MiB, block_size=64 * GiB, queue_depth=16)
    assert str(info.value) == (
        "tiers.nvme.block_size 64.0 GiB x tiers.nvme.queue_depth 16 = 1.0 TiB of bounce blocks, 8.0 GiB of memory "
        "available: lower tiers.nvme.block_size (8 MiB is the default) or tiers.nvme.queue_depth"
    )
    # The bound counts every block the pool may hold, not just one.
    with pytest.raises(ValueError, match=r"= 9\.0 GiB of bounce blocks, 8\.0 GiB of memory available"):
        NvmeTier(tmp_path, capacity=64 * MiB, block_size=GiB, queue_depth=9)
    with NvmeTier(tmp_path, capacity=64 * MiB, block_size=GiB, queue_depth=8):
        pass
    assert os.listdir(tmp_path) == [] and nvme_threads() == []


def test_block_size_beyond_this_machine_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^tiers\.nvme\.block_size 1024\.0 TiB x tiers\.nvme\.queue_depth 1 = "):
        NvmeTier(tmp_path, capacity=64 * MiB, block_size=1 << 50, queue_depth=1)
    assert os.listdir(tmp_path) == []


def test_a_bounce_block_that_cannot_be_allocated_fails_its_request_and_close_stays_quiet(
    tmp_path: Path, monkeypatch
) -> None:
    real = nvme_io.aligned_empty

    def no_big_blocks(nbytes: int, **kwargs) -> torch.Tensor:
        if nbytes >= MiB:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {nbytes} bytes")
        return real(nbytes, **kwargs)

    monkeypatch.setattr(nvme_io, "aligned_empty", no_big_blocks)
    tier = NvmeTier(tmp_path, capacity=64 * MiB, block_size=MiB, queue_depth=2, threads=2)
    region = tier.allocate(2 * MiB, label="u0/param")
    raw = torch.ones(2 * MiB + 2 * 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096 + 1  # one byte past alignment: every chunk needs a whole bounce block
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        tier.write(region, raw[start : start + 2 * MiB])
    assert tier.bounce_stats().held == 0
    # The pool is not left short: an aligned write with a tail still takes its small block.
    small = tier.allocate(5000, label="u1/param")
    data = real(5000)
    data.copy_(torch.arange(5000).to(torch.uint8))
    tier.write(small, data)
    out = real(5000)
    tier.read(small, out)
    assert torch.equal(out, data)
    tier.close()  # the first error was the one that counts: nothing more here
    assert os.listdir(tmp_path) == [] and nvme_threads() == []


def test_close_after_a_failed_construction_is_quiet(tmp_path: Path) -> None:
    tier = NvmeTier.__new__(NvmeTier)
    with pytest.raises(ValueError, match="tiers.nvme.block_size"):
        tier.__init__(tmp_path, capacity=64 * MiB, block_size=1 << 50)
    tier.close()
    tier.close()
    assert os.listdir(tmp_path) == []
