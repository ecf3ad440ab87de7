"""Loading refuses what it cannot trust, naming the file, before touching the engine; no pickle ever runs."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from crc32c import crc32c
from test_checkpoint import config, make_model, train

import tierzero
from tierzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tierzero.checkpoint.format import json_checksum


class _Payload:
    """Unpickling this opens (creates) `marker`: the proof that a pickle executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Any, Path, dict[str, torch.Tensor]]]:
    """An engine after 3 steps whose checkpoint (step 2) differs from its live weights."""
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        train(engine, 0, 2)
        path = save_checkpoint(engine, tmp_path / "ckpt")
        train(engine, 2, 3)
        yield engine, path, engine.full_state_dict()


def _refused(engine: Any, path: Path, live: dict[str, torch.Tensor], pattern: str) -> str:
    with pytest.raises(CheckpointError, match=pattern) as caught:
        load_checkpoint(engine, path)
    message = str(caught.value)
    assert "\n" not in message
    # nothing was written into the engine before the refusal
    assert engine.global_step == 3
    after = engine.full_state_dict()
    assert all(torch.equal(after[name], live[name]) for name in live)
    return message


def _resign(path: Path, name: str) -> None:
    """What an attacker who can write the directory could do: make the manifest vouch for `name`."""
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "checksum": f"{crc32c(data):08x}"}
    del manifest["self_checksum"]
    manifest["self_checksum"] = json_checksum(manifest, algorithm="crc32c")
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_flipped_byte_is_caught_by_the_checksum(saved: tuple[Any, Path, dict[str, torch.Tensor]]) -> None:
    engine, path, live = saved
    target = path / "rank-00000.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    _refused(engine, path, live, rf"checkpoint file {target} fails its crc32c check \([0-9a-f]{{8}}, manifest [0-9a-f]{{8}}\)")


def test_a_truncated_file_is_refused(saved: tuple[Any, Path, dict[str, torch.Tensor]]) -> None:
    engine, path, live = saved
    target = path / "rank-00000.safetensors"
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(size - 100)
    _refused(engine, path, live, rf"checkpoint file {target} has {size - 100} bytes, the manifest recorded {size}: it is truncated")


@pytest.mark.parametrize("name", ["rank-00000.safetensors", "rank-00000.json"])
def test_a_missing_file_is_refused(saved: tuple[Any, Path, dict[str, torch.Tensor]], name: str) -> None:
    engine, path, live = saved
    (path / name).unlink()
    _refused(engine, path, live, rf"checkpoint file {path / name} is missing: the checkpoint is incomplete")


def test_a_flipped_byte_in_the_manifest_is_caught(saved: tuple[Any, Path, dict[str, torch.Tensor]]) -> None:
    engine, path, live = saved
    manifest = path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"global_step": 2', '"global_step": 3'))
    _refused(engine, path, live, rf"{manifest} fails its own checksum")


def test_a_planted_pickle_never_runs(saved: tuple[Any, Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    engine, path, live = saved
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof)))
    assert proof.exists()  # the payload is live: unpickling it runs code
    proof.unlink()
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    tensors = path / "rank-00000.safetensors"
    tensors.write_bytes(payload)
    _refused(engine, path, live, rf"checkpoint file {tensors} (has \d+ bytes|fails its crc32c check)")
    _resign(path, tensors.name)
    message = _refused(engine, path, live, rf"{tensors} is not a readable safetensors file \(.*\): it is corrupt or was replaced")
    assert "rank 0" in message
    (path / "rank-00000.json").write_bytes(payload)
    _resign(path, "rank-00000.json")
    (path / "manifest.json").write_bytes(payload)
    _refused(engine, path, live, rf"{path / 'manifest.json'} is not a JSON file \(UnicodeDecodeError\)")
    assert not marker.exists()


def test_a_pickled_rank_state_is_refused_even_when_vouched_for(saved: tuple[Any, Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    engine, path, live = saved
    marker = tmp_path / "pwned"
    state = path / "rank-00000.json"
    state.write_bytes(pickle.dumps(_Payload(marker)))
    _resign(path, state.name)
    _refused(engine, path, live, rf"{state} is not a JSON file")
    assert not marker.exists()


def test_the_intact_checkpoint_still_loads(saved: tuple[Any, Path, dict[str, torch.Tensor]]) -> None:
    engine, path, _ = saved
    assert load_checkpoint(engine, path) == path
    assert engine.global_step == 2
