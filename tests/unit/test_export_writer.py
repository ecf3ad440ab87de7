"""The export writer: shards planned in order, each tensor on disk as it comes, failures that leave no mix."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch
from test_export import _config, _hf, _train

import tierzero.checkpoint.format as format_module
from tierzero.checkpoint.consolidate import consolidate_hf
from tierzero.checkpoint.export import PretrainedWriter, plan_shards, saved_name
from tierzero.checkpoint.format import TensorEntry
from tierzero.checkpoint.shards import ShardReader

pytest.importorskip("transformers")


def _entries(*sizes: int) -> list[TensorEntry]:
    return [TensorEntry(f"t{i}", n, torch.float32, (n,)) for i, n in enumerate(sizes)]


def test_shards_follow_the_tensor_order_and_a_large_tensor_goes_alone() -> None:
    plan = plan_shards(_entries(10, 10, 30, 10, 10, 10), max_shard_bytes=80)
    assert [[e.name for e in shard] for shard in plan] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert [[e.name for e in s] for s in plan_shards(_entries(5, 5), max_shard_bytes=1 << 30)] == [["t0", "t1"]]


def test_each_tensor_is_on_disk_before_its_shard_is_complete(tmp_path: Path) -> None:
    entries = _entries(1 << 18, 1 << 18, 1 << 18)  # 1 MiB each, two to a shard
    writer = PretrainedWriter(tmp_path, entries, max_shard_size="2.1MB")
    assert writer.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    writer.write("t0", torch.ones(1 << 18, dtype=torch.float64))  # cast to the declared fp32
    (partial,) = tmp_path.glob(".model-00001-of-00002.safetensors.tmp-*")
    assert partial.stat().st_size > 4 << 18 and not (tmp_path / writer.files[0]).exists()
    writer.write("t1", torch.zeros(1 << 18))
    assert (tmp_path / writer.files[0]).is_file() and not partial.exists()
    writer.write("t2", torch.full((1 << 18,), 2.0))
    done = writer.finish()
    assert (done.tensors, done.nbytes, done.files) == (3, 3 << 20, writer.files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 3 << 20}, "weight_map": {"t0": writer.files[0], "t1": writer.files[0], "t2": writer.files[1]}}


def test_a_failed_sharded_export_leaves_nothing_that_loads_and_no_temp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _train(_config(_hf()), tmp_path / "ckpt")
    consolidate_hf(tmp_path / "ckpt", tmp_path / "hf")  # an earlier, single-file export
    real, calls = format_module.write_all, []

    def full_disk(file: object, data: bytes | memoryview) -> None:
        calls.append(1)
        if len(calls) > 12:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(file, data)  # type: ignore[arg-type]

    monkeypatch.setattr(format_module, "write_all", full_disk)
    with pytest.raises(OSError, match="No space left"):
        consolidate_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="20KB")
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert not [n for n in names if n.startswith(".")]
    assert "model.safetensors" not in names and "model.safetensors.index.json" not in names
    assert any(n.startswith("model-00001-of-") for n in names)  # a new shard landed before the disk filled


def test_consolidate_hf_reads_one_unit_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _train(_config(_hf(), dtype="bf16"), tmp_path / "ckpt")
    reads: list[tuple[str, int]] = []
    real_read = ShardReader.read

    def record(self: ShardReader, layout: object, kind: str, start: int, end: int, *, out: torch.Tensor) -> torch.Tensor:
        reads.append((layout.name, end - start))  # type: ignore[attr-defined]
        return real_read(self, layout, kind, start, end, out=out)  # type: ignore[arg-type]

    monkeypatch.setattr(ShardReader, "read", record)
    done = consolidate_hf(tmp_path / "ckpt", tmp_path / "hf")
    units = dict(reads)
    assert len(reads) == len(units) == 3  # two layers and the root, each read once, whole
    assert done.largest_unit_bytes == 4 * max(units.values()) < 4 * sum(units.values())


def test_the_name_kept_of_a_tied_pair_is_the_one_no_tie_targets() -> None:
    targets = [re.compile("lm_head.weight")]
    assert saved_name(["model.embed_tokens.weight", "lm_head.weight"], targets) == "model.embed_tokens.weight"
    assert saved_name(["lm_head.weight", "model.embed_tokens.weight"], targets) == "model.embed_tokens.weight"
    assert saved_name(["a", "b"], []) == "a"
