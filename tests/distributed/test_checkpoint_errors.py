"""At 2 ranks, an error on one rank (a full disk, a corrupt file only it reads) is raised on both, and none hangs."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, run_ranks

import tierzero
import tierzero.checkpoint.format as fmt
from tierzero.checkpoint import CheckpointError, CheckpointWriteError, load_checkpoint, save_checkpoint

CASE = Case(stage=3, optimizer="adamw", steps=2, accumulation=1, global_batch=4)


def _step(engine: Any, step: int, *, rank: int) -> None:
    engine.backward(CASE.loss(engine, *CASE.micro_batch(step, micro=0, rank=rank, world_size=2)))
    engine.step()


def _raised(fn: Any, kind: type[Exception]) -> str:
    with pytest.raises(kind) as caught:
        fn()
    return str(caught.value)


def _job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tierzero.initialize(CASE.model(), CASE.config()) as engine:
        _step(engine, 0, rank=rank)
        first = save_checkpoint(engine, root)
        saved = engine.full_state_dict()
        _step(engine, 1, rank=rank)
        if rank == 1:
            def full(file: Any, data: Any) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            fmt.write_all = full  # forked: only this rank's disk is full
        out["enospc"] = _raised(lambda: save_checkpoint(engine, root), CheckpointWriteError)
        out["left"] = sorted(p.name for p in Path(root).iterdir())
        # rank 1's file is corrupt; at 2 ranks in stage 3 rank 0 never reads it
        torch.distributed.barrier()
        if rank == 0:
            target = first / "rank-00001.safetensors"
            data = bytearray(target.read_bytes())
            data[-1] ^= 0xFF
            target.write_bytes(bytes(data))
        torch.distributed.barrier()
        out["corrupt"] = _raised(lambda: load_checkpoint(engine, root), CheckpointError)
        out["step_after_refusal"] = engine.global_step
        if rank == 0:
            target.write_bytes(bytes(data[:-1] + bytearray([data[-1] ^ 0xFF])))
        torch.distributed.barrier()
        out["loaded"] = load_checkpoint(engine, root) == first
        state = engine.full_state_dict()
        out["same"] = rank != 0 or all(torch.equal(state[n], saved[n]) for n in saved)
    return out


def test_one_ranks_failure_is_every_ranks_error(tmp_path: Path) -> None:
    results = run_ranks(_job, world_size=2, payload=str(tmp_path), timeout=120)
    for r in results:
        assert r["enospc"] == (
            f"checkpoint of step 2 under {tmp_path} was not written (rank 1: [Errno 28] No space left on device); "
            f"the previous checkpoint {tmp_path / '1'} is intact and still loads: free space or pick another checkpoint.dir"
        )
        assert r["left"] == ["1", "latest"]
        assert r["corrupt"].startswith(f"rank 1: checkpoint file {tmp_path / '1' / 'rank-00001.safetensors'} fails its crc32c check")
        assert r["step_after_refusal"] == 2
        assert r["loaded"] and r["same"]
