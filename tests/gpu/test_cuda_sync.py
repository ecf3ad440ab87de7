"""Steady-state stage 3 steps on a GPU never block the host, and parameters come up from pinned memory.

Skipped without CUDA. After warm-up steps (the prefetcher learns the unit order, the
allocators fill their caches), steps run under `torch.cuda.set_sync_debug_mode("error")`:
any synchronising CUDA call (a blocking copy, `.item()`, a stream synchronize) raises,
in whichever thread makes it, since the mode is global. Parameters homed in host memory
or on NVMe come up on the swapper's copy stream, ordered by events.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tierzero.cli.bench.contenders import PLACEMENTS, EngineTraining, engine_config, token_batch
from tierzero.cli.bench.train.copies import profiled_traffic
from tierzero.prefetch import Mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WARMUP = 2
STEADY = 3


@contextmanager
def host_syncs_raise() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def warmed_engine(placement: str, nvme_path: Path) -> Iterator[tuple[EngineTraining, list]]:
    """A stage 3 engine past its warm-up steps, and the steady-state batches, already on the GPU."""
    tz = EngineTraining("tiny", engine_config(stage=3, placement=PLACEMENTS[placement], nvme_path=nvme_path))
    batches = [token_batch(step, batch=2, seq=32, device="cuda") for step in range(WARMUP + STEADY)]
    try:
        for tokens, targets in batches[:WARMUP]:
            tz.step(tokens, targets)
        torch.cuda.synchronize()
        yield tz, batches[WARMUP:]
    finally:
        tz.close()


@pytest.mark.parametrize("placement", ["device", "params-cpu", "params-nvme"])
def test_steady_state_steps_never_synchronise_the_host(placement: str, tmp_path: Path) -> None:
    with warmed_engine(placement, tmp_path) as (tz, batches):
        with host_syncs_raise():
            losses = [tz.step(tokens, targets) for tokens, targets in batches]
        torch.cuda.synchronize()
        assert all(bool(torch.isfinite(loss)) for loss in losses)
        report = tz.engine.prefetch_report()
        assert report is not None and report.mode is Mode.FOLLOWING


@pytest.mark.parametrize("placement", ["params-cpu", "params-nvme"])
def test_parameters_come_up_from_pinned_memory(placement: str, tmp_path: Path) -> None:
    with warmed_engine(placement, tmp_path) as (tz, batches):
        traffic = profiled_traffic(lambda: tz.step(*batches[0]), torch.device("cuda"))
    # Each step rewrites the parameters at their home, so each comes up again: the profiler saw it.
    assert traffic.h2d_bytes > 0, traffic
    assert traffic.pageable_copies == 0, f"{traffic.pageable_copies} of {traffic.copies} copies from pageable memory"
