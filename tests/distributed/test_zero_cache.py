"""The NVMe cache (tiers.nvme.cache) at two gloo ranks: each rank caches its own slices, and no bit
changes, with gradient accumulation and with frozen parameters (cached once, never written again)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, run_ranks, train_case

import tierzero

ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
FROZEN = ("embed.", "blocks.1.")
CASES = [
    (Case(stage=3, optimizer="adamw", steps=3, dtype="bf16"), ALL_NVME),
    (Case(stage=3, optimizer="adamw", steps=3, frozen=FROZEN), {"params": "nvme", "optimizer": "nvme"}),
]
CACHE = 64 << 10


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    results = []
    for case, offload in CASES:
        for cache in (0, CACHE):

            def make(model: torch.nn.Module, config: dict[str, Any], offload: Any = offload, cache: int = cache) -> Any:
                tiers = {"nvme": {"path": swap_dir, "cache": cache}}
                return tierzero.initialize(model, config | {"offload": offload, "tiers": tiers})

            results.append(train_case(case, rank=rank, world_size=world_size, make_engine=make))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[Any]]:
    swap_dir: Path = tmp_path_factory.mktemp("swap")
    results = run_ranks(_rank_job, world_size=2, payload=str(swap_dir))
    assert list(swap_dir.iterdir()) == []  # close removed the swap files, cached or not
    return results


@pytest.mark.parametrize("index", range(len(CASES)), ids=["bf16-accumulation", "fp32-frozen"])
def test_a_cached_run_is_bitwise_the_uncached_run_on_every_rank(ranks: list[list[Any]], index: int) -> None:
    for rank in ranks:
        plain, cached = rank[2 * index], rank[2 * index + 1]
        assert cached.losses == plain.losses
        # 64 KiB of this rank's 224 KiB (bf16) or 144 KiB (fp32, frozen) of NVMe slices stay in memory.
        assert plain.memory["nvme_cache"] == 0 and cached.memory["nvme_cache"] == CACHE
    plain, cached = ranks[0][2 * index], ranks[0][2 * index + 1]  # rank 0 gathers the full parameters
    assert cached.params.keys() == plain.params.keys()
    assert all(torch.equal(cached.params[n], plain.params[n]) for n in plain.params)
