"""`tierzero bench activations`: the offloaded run books its activations in the cpu tier, and the
estimate predicts each run's device peak."""

from __future__ import annotations

from pathlib import Path

from tierzero.cli.bench.activations import bench_activations


def test_offload_moves_the_activations_to_the_cpu_tier(tmp_path: Path) -> None:
    results = bench_activations(nvme_path=str(tmp_path), preset="tiny", seq=128, batch=2, steps=2, warmup=1)
    alone, offloaded = results["checkpoint"], results["checkpoint+offload"]
    assert alone.activations["device"] > 0 and alone.activations.get("cpu", 0) == 0
    assert offloaded.activations["device"] == 0 and offloaded.activations["cpu"] == alone.activations["device"]
    assert offloaded.device_peak < alone.device_peak
    for run in (alone, offloaded):
        assert len(run.seconds) == 2
        assert abs(run.predicted_peak - run.device_peak) <= 0.10 * run.device_peak
