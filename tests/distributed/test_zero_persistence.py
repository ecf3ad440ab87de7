"""zero.param_persistence_threshold: small units stay gathered from forward to backward."""

from __future__ import annotations

from typing import Any

import torch
from harness import Case, measure_case, run_ranks, train_case


def _with_threshold(threshold: int) -> Any:
    import tierzero

    def make(model: Any, cfg: dict[str, Any]) -> Any:
        return tierzero.initialize(model, {**cfg, "zero": {**cfg["zero"], "param_persistence_threshold": threshold}})

    return make


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    case = Case(stage=3, optimizer="adamw", steps=3, accumulation=1)
    out: dict[str, Any] = {}
    for label, threshold in (("released", 0), ("persistent", 10**9)):
        run = train_case(case, rank=rank, world_size=world_size, make_engine=_with_threshold(threshold))
        traffic = measure_case(case, rank=rank, world_size=world_size, make_engine=_with_threshold(threshold))
        out[label] = {"params": run.params, "losses": run.losses, "traffic": traffic}
    return out


def test_persistent_units_skip_the_backward_gather_with_identical_results() -> None:
    ranks = run_ranks(_job, world_size=2)
    released, persistent = ranks[0]["released"], ranks[0]["persistent"]
    assert released["losses"] == persistent["losses"]
    for name, value in released["params"].items():
        assert torch.equal(value, persistent["params"][name]), name
    full, kept = released["traffic"], persistent["traffic"]
    # Released: every unit is gathered in forward and again in backward (the root once more
    # after forward). Persistent: each unit is gathered once per step, in forward.
    sent_once = sum(full.unit_bytes.values()) // 2  # (N-1)/N of each unit at N = 2
    assert kept.comm["all_gather"] == sent_once
    assert full.comm["all_gather"] > 2 * sent_once - 1
    assert kept.comm["reduce_scatter"] == full.comm["reduce_scatter"]
    # Kept gathered, every unit is on the device at once at the end of forward.
    assert kept.peak_gathered == sum(kept.unit_bytes.values())
    assert full.peak_gathered < kept.peak_gathered
    assert ranks[1]["persistent"]["traffic"].comm == kept.comm
