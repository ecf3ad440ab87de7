"""`tierzero bench zeropp` end to end for a few steps: every variant trains and sends fewer bytes across nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierzero.cli.bench.zeropp import VARIANTS, bench_zeropp

REPO = Path(__file__).resolve().parents[2]


def test_every_variant_trains_and_sends_fewer_bytes_across_nodes_than_exact_stage3(tmp_path: Path) -> None:
    out = tmp_path / "zeropp.json"
    run = subprocess.run(
        [sys.executable, "-m", "tierzero.cli", "bench", "zeropp", "--steps", "3", "--every", "2",
         "--block-size", "1024", "--json", str(out)],
        capture_output=True, text=True, check=False, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr  # 0: every variant within 1% of the exact loss
    result = json.loads(out.read_text())
    assert list(result["losses"]) == list(VARIANTS) and result["block_size"] == 1024
    exact, inter = result["losses"]["exact"], result["inter_bytes"]
    assert len(exact) == 3 and exact[2] < exact[0]  # it learns
    for name in VARIANTS:
        if name != "exact":
            assert result["losses"][name] != exact, name  # quantisation changed something, a little
            assert inter[name] < inter["exact"], name
    # Plain stage 3 sends 6 fp32 shards across nodes a step (2 a gather, 2 for the reduce-scatter); qwZ sends the
    # gathers' 4 as int8 with a scale per 1024 (1/4 each, and 0.4%): 1 + 2 = 3 shards, 0.5x
    assert inter["qwZ"] == pytest.approx(0.5 * inter["exact"], rel=0.01)
    assert inter["hpZ+qwZ+qgZ int4"] < 0.11 * inter["exact"]  # docs/architecture.md: 0.104x
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"]  # step 1, then every 2nd
    assert lines[-1].endswith("True")
    assert "inter-node bytes per step (rank 0), a scale per 1024 elements, against plain stage 3:" in lines


def test_bench_zeropp_refuses_a_block_the_config_would_before_forking() -> None:
    with pytest.raises(ValueError, match=r"zero.quantization_block_size is 1000, not a power of two from 64 to 16384"):
        bench_zeropp(steps=1, block_size=1000)


def test_bench_zeropp_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="steps, every and threads >= 1"):
        bench_zeropp(steps=0)
