"""`tierzero bench lora-base`: engines over one checkpoint with their frozen base in bf16 and NF4, side by side."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama

from tierzero.cli.bench.lora_base import TARGET, bench_lora_base
from tierzero.cli.main import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def _checkpoint(path: Path) -> Path:
    tiny_llama(vocab=256, hidden=64).save_pretrained(path, safe_serialization=True)
    return path


def test_the_bases_run_the_same_steps_and_the_nf4_one_reads_its_bytes(tmp_path: Path) -> None:
    result = bench_lora_base(_checkpoint(tmp_path / "llama"), tmp_path / "swap", r=4, alpha=8, seq=8, rounds=3)
    assert list(result.steps) == ["bf16", "nf4"]
    assert all(len(steps) == 3 for steps in result.steps.values())
    # 4 bits a weight and an fp32 absmax a 64-weight block, against bf16's 2 bytes
    assert result.base_bytes_per_parameter == {"bf16": 2.0, "nf4": 0.5625}
    # each step reads the whole base from NVMe (but what stays fetched from forward to backward)
    assert 0 < result.read_bytes["nf4"] < result.read_bytes["bf16"] * 0.5625 / 2 * 1.1
    nf4 = result.losses["nf4"]
    assert all(torch.isfinite(torch.tensor(nf4))) and nf4 != result.losses["bf16"], "the quantized base changes the loss"
    assert result.speedup("bf16") == 1.0
    assert result.judged() and result.met() == (result.speedup("nf4") >= TARGET)
    assert f"target: an nf4 base >= {TARGET}x a bf16 base's step: {result.met()}" in result.format()


def test_the_command_names_a_base_dtype_it_does_not_know(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "lora-base", "--pretrained", str(tmp_path), "--nvme-path", str(tmp_path), "--base-dtypes", "bf16,nf5"])
    assert rc == 2
    expected = "tierzero: error: bench lora-base --base-dtypes takes param, fp32, bf16, fp16, int8, nf4, comma-separated; got 'bf16,nf5'"
    assert capsys.readouterr().err.strip() == expected
