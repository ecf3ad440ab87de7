"""`tierzero bench load`: a pretrained checkpoint streamed into NVMe-homed slices reads each byte once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from tiny_models import tiny_llama

from tierzero.cli.bench.load import bench_load
from tierzero.pretrained.files import scan_directory

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_load_reads_every_tensor_once(tmp_path: Path, dtype: torch.dtype) -> None:
    model = tiny_llama(vocab=512, hidden=64, layers=3, heads=4, kv_heads=4)
    model.to(dtype).save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    (tmp_path / "swap").mkdir()
    cfg = {
        "zero": {"stage": 3, "unit_classes": ["Linear"]},
        "model": {"pretrained": str(tmp_path / "ckpt")},
        "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
        "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    result = bench_load(str(tmp_path / "cfg.yaml"), overrides={}, cold=True)
    data = sum(info.numel * info.torch_dtype.itemsize for info in scan_directory(tmp_path / "ckpt").values())
    assert result.requested_bytes == data  # every tensor's bytes, each once
    assert result.parameters == sum(p.numel() for p in model.parameters())
    # (peak RSS is the process's lifetime peak, which a test run does not isolate: the bench runs alone)
    assert f"{result.requested_bytes / result.checkpoint_bytes:.4f}x the checkpoint" in result.format()
