"""zero.gather_ahead: stage 3 all-gathers several units ahead, within prefetch.max_live_bytes, same bits."""

from __future__ import annotations

from typing import Any

import torch
from harness import Case, measure_case, run_ranks, train_case


def _with(gather_ahead: int, max_live_bytes: int = 2**30) -> Any:
    import tierzero

    def make(model: Any, cfg: dict[str, Any]) -> Any:
        zero = {**cfg["zero"], "gather_ahead": gather_ahead}
        prefetch = {"bytes": min(64 * 2**20, max_live_bytes), "max_live_bytes": max_live_bytes}
        return tierzero.initialize(model, {**cfg, "zero": zero, "prefetch": prefetch})

    return make


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    case = Case(stage=3, optimizer="adamw", steps=3, accumulation=1)
    out: dict[str, Any] = {}
    for label, make in (("one", _with(1)), ("three", _with(3)), ("three, tight budget", _with(3, max_live_bytes=4096))):
        run = train_case(case, rank=rank, world_size=world_size, make_engine=make)
        out[label] = {"params": run.params, "losses": run.losses, "traffic": measure_case(case, rank=rank, world_size=world_size, make_engine=make)}
    return out


def test_gathering_further_ahead_holds_more_units_and_changes_no_bit() -> None:
    ranks = run_ranks(_job, world_size=2)
    one, three, tight = (ranks[0][k] for k in ("one", "three", "three, tight budget"))
    for other in (three, tight):
        assert other["losses"] == one["losses"]
        for name, value in one["params"].items():
            assert torch.equal(value, other["params"][name]), name
        assert other["traffic"].comm == one["traffic"].comm  # the same collectives, earlier
    units = one["traffic"].unit_bytes
    root = units["root"]
    block = max(n for name, n in units.items() if name != "root")
    # The root and the unit computing, plus one (or three) gathered ahead.
    assert one["traffic"].peak_gathered <= root + 2 * block
    assert three["traffic"].peak_gathered > one["traffic"].peak_gathered
    assert three["traffic"].peak_gathered <= root + 4 * block
    # Beyond the first unit ahead, only what fits in prefetch.max_live_bytes.
    assert tight["traffic"].peak_gathered == one["traffic"].peak_gathered
