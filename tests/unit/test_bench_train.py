"""`tierzero bench train` and `bench step-host`. Train: the two contenders train the same model on the same batches, so their
parameters agree at the end (fp32: to float rounding), and --dtype bf16 runs tierzero under
precision.autocast beside plain autocast, bit for bit."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from tierzero.cli.bench.step_host import _Model, bench_step_host
from tierzero.cli.bench.train.cpu import bench_train_step


@pytest.mark.parametrize(("dtype", "clip", "runs"), [("fp32", 0.0, 1), ("fp32", 1.0, 2), ("bf16", 0.0, 1)])
def test_both_contenders_train_the_same_model(dtype: str, clip: float, runs: int, tmp_path: Path) -> None:
    result = bench_train_step(
        nvme_path=tmp_path, preset="tiny", seq=32, batch=2, steps=3, warmup=1, measure_rss=False, clip=clip, dtype=dtype,
        disk_bytes=1 << 20, disk_settle_s=0.0, disk_seconds=0.0, runs=runs,
    )  # fmt: skip
    assert (result.dtype, result.clip, len(result.tierzero_seconds), len(result.plain_seconds)) == (dtype, clip, 3, 3)
    # fp32: the same AdamW on the same gradients (the clip factor from another summation order);
    # bf16: autocast's own arithmetic on the same bits
    assert result.max_param_difference < 1e-3 if dtype == "fp32" else result.max_param_difference == 0.0
    assert f"{dtype}, gradient clipping {clip:g}" in result.format()
    if dtype == "bf16":  # after 8 fresh steps exact fp32 drifts from autocast's rounding; tierzero does not
        assert result.autocast_difference is not None
        ours, exact = result.autocast_difference
        assert ours == 0.0 and 0 < exact < 1.0
        assert f"after 8 steps, largest per-tensor difference to autocast: tierzero {ours:.2e}" in result.format()
    else:
        assert result.autocast_difference is None
    target = 1.3 if dtype == "bf16" else 1.25 if clip else 1.2
    assert f"(target <= {target:.2f})" in result.format()
    # Each step writes every NVMe-homed byte once (new parameters and states) and reads the
    # optimizer's states once: Adam's two (8 of fp32's 12 bytes a parameter: its master is the
    # parameter, which may come from a gather's copy) and a bf16 unit's fp32 master (12 of 14
    # bytes; autocast's fp32 units are 8 of 12), plus what the gathers bring up.
    io = result.io
    assert io is not None and io.written_bytes == io.home_bytes > 0
    states = io.home_bytes * 8 / 12
    assert states <= io.read_bytes <= 2 * io.home_bytes
    assert io.read_gbs > 0 and io.write_gbs > 0 and io.serial_s >= io.overlapped_s > 0
    assert "x the serial floor" in result.format()


def test_bench_step_host_times_the_engine_beside_plain_autograd_and_bare_adamw() -> None:
    result = bench_step_host(2_000_000, units=2, steps=2, warmup=1)
    assert len(result.engine_s) == len(result.plain_s) == len(result.adam_s) == len(result.engine_step_s) == 2
    assert all(t > 0 for t in (*result.engine_s, *result.plain_s, *result.adam_s, *result.engine_step_s))
    assert result.host_s == pytest.approx(statistics.median(result.engine_s) - statistics.median(result.plain_s))
    assert result.ratio == pytest.approx(result.host_s / statistics.median(result.adam_s))
    text = result.format()
    assert "2M parameters in 2 units, bf16, clip 1.0" in text and f"host share / AdamW  {result.ratio:.2f}x" in text
    assert result.to_json()["ratio"] == result.ratio


def test_bench_step_host_cuts_each_unit_into_tensors_as_a_layer_has() -> None:
    result = bench_step_host(300_000, units=2, slots=3, steps=1, warmup=1)
    assert result.slots == 3 and result.to_json()["slots"] == 3
    assert "0M parameters in 2 units of 3 tensors, bf16" in result.format()
    model = _Model(300_000, 2, dtype=torch.float32, compute=torch.float32, slots=3)
    assert [p.numel() for p in model.parameters()] == [50_000] * 6
    with pytest.raises(ValueError, match="--slots must be between 1 and the parameters a unit"):
        bench_step_host(10, units=2, slots=6)
