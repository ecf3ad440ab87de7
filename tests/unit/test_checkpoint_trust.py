"""The loader trusts no name and no number: symlinks out of the root, hostile manifests, outputs into the root."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from crc32c import crc32c
from test_checkpoint import assert_same_params, config, make_model, train

import tierzero
from tierzero.checkpoint import (
    CheckpointError,
    CheckpointFallbackWarning,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tierzero.checkpoint.consolidate import consolidate
from tierzero.checkpoint.format import json_checksum
from tierzero.cli.main import main


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Checkpoints of steps 1 and 2 under tmp_path/ckpt; the state of step 1."""
    root = tmp_path / "ckpt"
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        train(engine, 0, 1)
        save_checkpoint(engine, root)
        state = engine.full_state_dict()
        train(engine, 1, 2)
        save_checkpoint(engine, root)
    return root, state


def test_a_step_directory_linked_out_of_the_root_is_never_followed(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    root, _ = saved
    elsewhere = tmp_path / "elsewhere"
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        train(engine, 0, 5)
        planted = save_checkpoint(engine, elsewhere)
        (root / "9").symlink_to(planted)
        with pytest.warns(CheckpointFallbackWarning) as caught:
            assert load_checkpoint(engine, root) == root / "2"
        assert engine.global_step == 2
        assert [str(w.message) for w in caught] == [
            (
                f"loading {root / '2'}, not the newer {root / '9'}: it is a symbolic link to {planted}, "
                "and step directories are never followed out of their root"
            )
        ]
        with pytest.raises(CheckpointError, match=rf"^{root / '9'} cannot be loaded: it is a symbolic link to {planted}"):
            find_checkpoint(root / "9")
        train(engine, 2, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointFallbackWarning)
            save_checkpoint(engine, root, keep=1)  # prunes 1 and 2, never through the link
    assert list_checkpoints(root) == [root / "3"] and (root / "9").is_symlink()
    assert sorted(p.name for p in planted.iterdir()) == ["manifest.json", "rank-00000.json", "rank-00000.safetensors"]


def test_a_missing_manifest_falls_back_saying_so(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, state = saved
    (root / "2" / "manifest.json").unlink()
    notes: list[str] = []
    assert find_checkpoint(root, note=notes.append) == root / "1"
    assert notes == [
        (
            f"loading {root / '1'}, not the newer {root / '2'}: it holds no manifest.json: its save never finished, "
            "or the manifest was removed"
        )
    ]
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        with pytest.warns(CheckpointFallbackWarning, match="not the newer"):
            load_checkpoint(engine, root)
        assert_same_params(engine.full_state_dict(), state)
        with pytest.raises(CheckpointError, match=rf"^{root / '2'} cannot be loaded: it holds no manifest.json"):
            load_checkpoint(engine, root / "2")  # named explicitly: refused, not silently another step


def _resign(step: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and recompute its checksum, as anyone who can write the directory can."""
    manifest = json.loads((step / "manifest.json").read_text())
    edit(manifest)
    for name, record in manifest["files"].items():
        data = (step / name).read_bytes()
        record.update({"bytes": len(data), "checksum": f"{crc32c(data):08x}"})
    del manifest["self_checksum"]
    manifest["self_checksum"] = json_checksum(manifest, algorithm="crc32c")
    (step / "manifest.json").write_text(json.dumps(manifest))


def _set_all_world_sizes(size: int) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["world_size"] = size
        for unit in m["units"]:
            unit["world_size"] = size

    return edit


def _unit(index: int, **values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["units"][index].update(values)


def _slot(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["units"][0]["slots"][1].update({key: value})


HOSTILE = [
    pytest.param(_unit(0, numel=10**15, padded_numel=10**15), r"units\[0\]\.slots|blocks.0/param is|holds other parameters", id="huge-numel"),
    pytest.param(_slot("offset", -64), r"units\[0\]\.slots\[1\]\.offset is -64, expected an integer >= 0", id="negative-offset"),
    pytest.param(_slot("shape", [16, 16]), r"units\[0\]\.slots\[1\]\.numel is \d+, expected 256, the size of its shape \[16, 16\]", id="shape-not-numel"),
    pytest.param(_set_all_world_sizes(0), r"world_size is 0, expected an integer >= 1", id="world-size-0"),
    pytest.param(_set_all_world_sizes(10**9), r"files lists 2 files, a checkpoint written at world size 1000000000 has 2000000000", id="world-size-1e9"),
    pytest.param(lambda m: m.update(step=7), r"step is 7, expected 2, the step its directory is named by", id="step-not-its-name"),
    pytest.param(lambda m: m["units"][0].update(padded_numel=m["units"][0]["padded_numel"] * 4), r"blocks.0/\w+ is torch.\w+ of shape \[2048\], the manifest says torch.\w+ of shape \[8192\]", id="padded-past-the-file"),
]


@pytest.mark.parametrize(("edit", "pattern"), HOSTILE)
def test_hostile_numbers_are_one_line_errors_for_load_and_consolidate(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, pattern: str
) -> None:
    root, _ = saved
    step = root / "2"
    _resign(step, edit)
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine, pytest.raises(CheckpointError, match=pattern) as caught:
        load_checkpoint(engine, step)
    assert "\n" not in str(caught.value) and str(step) in str(caught.value)
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(step), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierzero: error: ") and err.count("\n") == 1 and str(step) in err
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".model")] == []


def test_consolidate_refuses_to_write_into_the_checkpoint_root(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = saved
    shard = root / "2" / "rank-00000.safetensors"
    before = shard.read_bytes()
    for checkpoint, out in [(root / "2", shard), (root, root / "model.safetensors"), (root / "2", root / "2" / "hf")]:
        assert main(["consolidate", str(checkpoint), str(out)]) == 2
        assert capsys.readouterr().err == (
            f"tierzero: error: consolidate output {out} lies inside the run's checkpoint root {root}: writing there would "
            "overwrite or delete what the run reads; name an output that neither is, holds nor lies inside it\n"
        )
    assert shard.read_bytes() == before and not (root / "model.safetensors").exists() and not (root / "2" / "hf").exists()
    assert consolidate(root / "1", tmp_path / "m.safetensors").step == 1  # beside the root is fine
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        assert load_checkpoint(engine, root / "2") == root / "2"
