"""Gradient and parameter buckets: fewer exchanges, the same bits as one collective per unit."""

from __future__ import annotations

from typing import Any

import torch
from harness import Case, run_ranks, train_case

STAGES = (1, 2, 3)


def _engine_with_buckets(bucket_bytes: int, engines: list[Any]) -> Any:
    import tierzero

    def make(model: Any, cfg: dict[str, Any]) -> Any:
        engine = tierzero.initialize(model, {**cfg, "zero": {**cfg["zero"], "reduce_bucket_size": bucket_bytes}})
        engines.append(engine)
        return engine

    return make


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in STAGES:
        case = Case(stage=stage, optimizer="adamw", steps=3)
        for label, bucket_bytes in (("per_unit", 1), ("bucketed", 64 * 2**20)):
            engines: list[Any] = []
            run = train_case(case, rank=rank, world_size=world_size, make_engine=_engine_with_buckets(bucket_bytes, engines))
            out[f"{stage}/{label}"] = {"params": run.params, "losses": run.losses, "exchanges": engines[0].comm.counter.sequence}
    return out


def test_buckets_send_fewer_exchanges_with_identical_results() -> None:
    ranks = run_ranks(_job, world_size=2)
    for stage in STAGES:
        per_unit, bucketed = ranks[0][f"{stage}/per_unit"], ranks[0][f"{stage}/bucketed"]
        assert per_unit["losses"] == bucketed["losses"]
        for name, value in per_unit["params"].items():
            assert torch.equal(value, bucketed["params"][name]), (stage, name)
        assert bucketed["exchanges"] < per_unit["exchanges"], (stage, bucketed["exchanges"], per_unit["exchanges"])
        assert ranks[1][f"{stage}/bucketed"]["exchanges"] == bucketed["exchanges"]
