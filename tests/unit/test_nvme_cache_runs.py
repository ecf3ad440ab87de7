"""Training with the NVMe cache (tiers.nvme.cache): the bits of an uncached run, fewer disk bytes,
and checkpoints that cross between cached and uncached runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import TinyLM, assert_same_params, batch, config, make_model, train

import tierzero
from tierzero.checkpoint import load_checkpoint, save_checkpoint
from tierzero.store.nvme_cache import NvmeCache

ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
SLICES = 12 * 8192
"""TinyLM at stage 3 in fp32 has 3 units (root, blocks.0, blocks.1) of 4 NVMe-homed slices of 8 KiB each
(param, grad, exp_avg, exp_avg_sq)."""


def _config(tmp_path: Path, *, dtype: str = "fp32", cache: int = 0) -> dict[str, Any]:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    cfg = config(3, dtype=dtype, offload=ALL_NVME, swap=swap)
    cfg["tiers"]["nvme"]["cache"] = cache
    return cfg


def _run(cfg: dict[str, Any], steps: int) -> tuple[list[float], list[tuple[int, int]], dict[str, torch.Tensor], int]:
    """Losses, NVMe bytes (read, written) of set-up and of each step, final parameters, cached bytes."""
    losses, traffic = [], []
    with tierzero.initialize(make_model(), cfg) as engine:
        traffic.append(engine.store.nvme_traffic())
        for step in range(steps):
            tokens, targets = batch(step)
            loss = engine(tokens, targets)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
            traffic.append(engine.store.nvme_traffic())
        cached = engine.memory_report()["nvme_cache"]
        params = engine.full_state_dict()
    per_step = [traffic[0]] + [(b[0] - a[0], b[1] - a[1]) for a, b in zip(traffic, traffic[1:])]
    return losses, per_step, params, cached


def test_a_cached_run_has_the_bits_of_an_uncached_one_and_moves_fewer_disk_bytes(tmp_path: Path) -> None:
    losses, traffic, params, cached = _run(_config(tmp_path), 5)
    assert cached == 0
    assert traffic == [(0, SLICES), (SLICES + 9 * 8192, SLICES)] + [(SLICES, SLICES)] * 4
    # 7 slices of 8 KiB fit in 60000 bytes: each one's read and write a step stays in memory.
    cached_losses, cached_traffic, cached_params, cached = _run(_config(tmp_path, cache=60_000), 5)
    assert cached == 7 * 8192
    assert cached_losses == losses
    assert_same_params(cached_params, params)
    assert cached_traffic[0] == (0, SLICES - cached)  # the first values of the cached slices stay in memory
    assert cached_traffic[2:] == [(SLICES - cached, SLICES - cached)] * 4


def _count_evictions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """From now on, the keys of the slices every NvmeCache evicts."""
    evicted: list[Any] = []
    evict = NvmeCache._evict

    def counting(cache: NvmeCache, key: Any) -> Any:
        evicted.append(key)
        return evict(cache, key)

    monkeypatch.setattr(NvmeCache, "_evict", counting)
    return evicted


def test_evictions_during_training_keep_the_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: over its first three steps the cache trades slices set-up took for slices read more often."""
    losses, _, params, _ = _run(_config(tmp_path, dtype="bf16"), 4)
    evicted = _count_evictions(monkeypatch)
    cached_losses, traffic, cached_params, cached = _run(_config(tmp_path, dtype="bf16", cache=60_000), 4)
    assert evicted and cached > 0
    assert cached_losses == losses
    assert_same_params(cached_params, params)


def test_checkpoints_cross_between_cached_and_uncached_runs_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached, uncached = _config(tmp_path, cache=60_000), _config(tmp_path)
    with tierzero.initialize(make_model(), cached) as engine:
        train(engine, 0, 3)
        before = engine.store.nvme_traffic()
        written = save_checkpoint(engine, tmp_path / "ckpt")
        # The save reads its 9 slices (gradients are not saved) and writes nothing to the swap file:
        # the 6 cached ones (every unit's param, blocks.0's Adam states, blocks.1's exp_avg) come
        # from memory, 3 from the disk.
        assert engine.store.nvme_traffic() == (before[0] + 3 * 8192, before[1])
        # The save read every slice once more, which evicts nothing in the steps after it.
        evicted = _count_evictions(monkeypatch)
        train(engine, 3, 6)
        assert evicted == []
        uninterrupted = engine.full_state_dict()
    for cfg in (uncached, cached):
        torch.manual_seed(123)
        with tierzero.initialize(TinyLM(), cfg) as engine:
            assert load_checkpoint(engine, tmp_path / "ckpt") == written
            train(engine, 3, 6)
            assert_same_params(engine.full_state_dict(), uninterrupted)
