"""precision.reduce_dtype: bf16 compute with gradients reduced and kept in fp32."""

from __future__ import annotations

from typing import Any

from harness import Case, measure_case, reference_run, run_ranks, train_case

CASES = [Case(stage=s, optimizer="adamw", dtype="bf16", steps=20) for s in (2, 3)]


def _with(reduce_dtype: str | None) -> Any:
    import tierzero

    def make(model: Any, cfg: dict[str, Any]) -> Any:
        return tierzero.initialize(model, {**cfg, "precision": {**cfg["precision"], "reduce_dtype": reduce_dtype}})

    return make


def _job(rank: int, world_size: int, _: Any) -> list[dict[str, Any]]:
    out = []
    for case in CASES:
        row = {}
        for label, dtype in (("bf16", None), ("fp32", "fp32")):
            run = train_case(case, rank=rank, world_size=world_size, make_engine=_with(dtype))
            traffic = measure_case(case, rank=rank, world_size=world_size, make_engine=_with(dtype))
            row[label] = {"losses": run.losses, "comm": traffic.comm, "kinds": traffic.kinds}
        out.append(row)
    return out


def test_fp32_reduction_of_bf16_gradients() -> None:
    ranks = run_ranks(_job, world_size=2)
    reference = reference_run(Case(stage=1, optimizer="adamw", steps=20))
    for case, row in zip(CASES, ranks[0], strict=True):
        bf16, fp32 = row["bf16"], row["fp32"]
        # The gradient slices are kept in fp32: twice the bytes; the parameters are unchanged.
        assert fp32["kinds"]["grad"] == 2 * bf16["kinds"]["grad"], case.stage
        assert fp32["kinds"]["param"] == bf16["kinds"]["param"]
        # The reduce-scatters carry fp32: twice the bytes; the parameter gathers stay bf16.
        assert fp32["comm"]["reduce_scatter"] == 2 * bf16["comm"]["reduce_scatter"], case.stage
        assert fp32["comm"]["all_gather"] == bf16["comm"]["all_gather"]
        gaps = [abs(a - b) / abs(b) for a, b in zip(fp32["losses"], reference.losses, strict=True)]
        assert max(gaps) < 2e-2, (case.stage, gaps)
        assert fp32["losses"] != bf16["losses"]  # the sums were rounded differently
