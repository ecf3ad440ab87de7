"""What a stopped or refused command leaves behind: nothing. `consolidate` (one file, and `--hf`)
stopped by SIGTERM, SIGHUP or Ctrl-C mid-write leaves no partial `.tmp-` file; a bad
`--max-shard-size` is refused before the output directory is made; a save stopped while it writes
the root's `latest` pointer leaves no temp file beside it; an NVMe tier whose swap path
was renamed mid-run still removes its run directory, where the directory now is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tierzero
from tierzero.checkpoint import save_checkpoint
from tierzero.checkpoint.stand_in import make_checkpoint
from tierzero.cli.main import main
from tierzero.config import load_config
from tierzero.models.builtin import build_model
from tierzero.offload.nvme import NvmeTier

REPO = Path(__file__).resolve().parents[2]
STOP_MID_WRITE = """
import os, signal, sys
from tierzero.checkpoint import format as F
from tierzero.cli.main import main
write = F.SafetensorsStream.write
def stopping(self, name, tensor):
    write(self, name, tensor)
    os.kill(os.getpid(), int(sys.argv[1]))  # after the first tensor: the output's temp file exists
F.SafetensorsStream.write = stopping
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root of a tiny transformers model (a made pretrained directory) after no steps."""
    pytest.importorskip("transformers")
    return made_run(tmp_path_factory.mktemp("run"))[2]


def made_run(base: Path) -> tuple[Path, Path, Path]:
    """Under `base`: a made pretrained directory M, byte-level data, and the checkpoint root of a run
    fine-tuning M on it, saved after no steps (test_output_paths.py's run too)."""
    pretrained, data, root = base / "M", base / "corpus", base / "ckpt"
    make_checkpoint(pretrained, size="tiny")
    data.mkdir()
    (data / "a.txt").write_text("hello world\n" * 100)
    cfg = load_config({
        "zero": {"stage": 3, "unit_classes": ["LlamaDecoderLayer"]}, "model": {"pretrained": str(pretrained)},
        "data": {"path": str(data / "*.txt")}, "checkpoint": {"dir": str(root)},
    })  # fmt: skip
    with tierzero.initialize(build_model(cfg.model), cfg) as engine:
        save_checkpoint(engine, root)
    return pretrained, data, root


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["TERM", "HUP", "INT"])
@pytest.mark.parametrize("hf", [True, False], ids=["hf", "file"])
def test_consolidate_stopped_mid_write_leaves_no_temp_file(root: Path, tmp_path: Path, signum: int, hf: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = [str(root), str(out), "--hf", "--max-shard-size", "1KB"] if hf else [str(root), str(out / "m.safetensors")]
    ran = subprocess.run(
        [sys.executable, "-c", STOP_MID_WRITE, str(int(signum)), "consolidate", *args],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert ran.returncode == (130 if signum == signal.SIGINT else -signum), ran.stderr
    assert sorted(p.name for p in out.iterdir()) == [], ran.stderr


STOP_AT_POINTER = """
import os, signal, sys
from pathlib import Path
from tierzero.checkpoint import format as F
replace = os.replace
def stopping(src, dst):
    if Path(dst).name == "latest":
        os.kill(os.getpid(), int(sys.argv[1]))  # the pointer's temp file is written, not yet renamed
    replace(src, dst)
F.os.replace = stopping
F.write_text_atomic(Path(sys.argv[2]) / "latest", "1\\n")
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["TERM", "HUP", "INT"])
def test_a_save_stopped_while_writing_the_latest_pointer_leaves_no_temp_file(tmp_path: Path, signum: int) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", STOP_AT_POINTER, str(int(signum)), str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert ran.returncode in ((1, -signum) if signum == signal.SIGINT else (-signum,)), ran.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], ran.stderr


@pytest.mark.parametrize(
    ("size", "refusal"),
    [
        ("0", "--max-shard-size is '0', expected a positive size such as 5GB or 500MB"),
        ("lots", "--max-shard-size: expected a size such as 4096, '512MB' or '8GiB', got 'lots'"),
    ],
)
def test_a_bad_max_shard_size_is_refused_before_the_output_directory_is_made(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str, refusal: str
) -> None:
    out = tmp_path / "new" / "out"
    capsys.readouterr()
    assert main(["consolidate", str(root), str(out), "--hf", "--max-shard-size", size]) == 2
    assert capsys.readouterr().err == f"tierzero: error: {refusal}\n"
    assert not (tmp_path / "new").exists()


def test_the_library_call_checks_the_size_before_making_the_directory(root: Path, tmp_path: Path) -> None:
    from tierzero.checkpoint.consolidate import consolidate_hf

    with pytest.raises(ValueError, match=r"^max shard size is '0', expected a positive size"):
        consolidate_hf(root, tmp_path / "out", max_shard_size="0")
    assert not (tmp_path / "out").exists()


def test_a_swap_path_renamed_mid_run_still_loses_its_run_directory(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    tier = NvmeTier(swap, capacity=1 << 20)
    (run_dir,) = swap.iterdir()
    os.rename(swap, tmp_path / "renamed")
    tier.close()
    assert list((tmp_path / "renamed").iterdir()) == []
    # and where nothing moved, the run directory goes as before
    swap.mkdir()
    tier = NvmeTier(swap, capacity=1 << 20)
    assert len(list(swap.iterdir())) == 1
    tier.close()
    assert list(swap.iterdir()) == []
    assert run_dir.name.startswith("tz-")
