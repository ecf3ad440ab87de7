"""An output never eats an input: `consolidate` (all three forms) and `train --export` refuse a path that
is, holds or lies inside what the run reads, through `..` and symlinks; `--export` and `--summary-json`
paths that cannot be written are refused at start-up, before the model is built."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_left_behind import made_run

import tierzero.cli.train as T
from tierzero.cli.main import main
from tierzero.common.output_paths import check_writable, input_root, refuse_overlap

pytest.importorskip("transformers")

FIX = "writing there would overwrite or delete what the run reads; name an output that neither is, holds nor lies inside it"


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A made pretrained directory M, byte-level data, and a checkpoint root of a run fine-tuning M on it."""
    return made_run(tmp_path_factory.mktemp("run"))


def test_the_helper_says_is_lies_inside_and_holds_through_dots_and_symlinks(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "m")
    m = tmp_path / "m"
    cases = [
        (m, "is", f"{m}"),
        (m / "sub", "lies inside", f"{m / 'sub'}"),
        (tmp_path, "holds", f"{tmp_path}"),
        (tmp_path / "x" / ".." / "m", "is", f"{tmp_path / 'x' / '..' / 'm'} (which is {m})"),
        (tmp_path / "link" / "out", "lies inside", f"{tmp_path / 'link' / 'out'} (which is {m / 'out'})"),
    ]
    for out, relation, shown in cases:
        with pytest.raises(ValueError) as caught:
            refuse_overlap(out, {"model.pretrained": m, "data.path": None}, what="--export")
        assert str(caught.value) == f"--export {shown} {relation} the run's model.pretrained {m}: {FIX}"
    with pytest.raises(ValueError, match=rf"^--export {tmp_path / 'm'} is the run's data.path {tmp_path / 'link'} \(which is {m}\): "):
        refuse_overlap(m, {"data.path": tmp_path / "link"}, what="--export")
    refuse_overlap(tmp_path / "beside", {"model.pretrained": m, "data.path": m / "*.txt"}, what="--export")  # apart: fine
    assert input_root("corpus/**/*.txt") == Path("corpus") and input_root("*.txt") == Path(".")


@pytest.mark.parametrize("hf", [True, False])
def test_consolidate_refuses_the_runs_pretrained_directory(run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], hf: bool) -> None:
    pretrained, _, root = run
    before = _snapshot(pretrained)
    (tmp_path / "link").symlink_to(pretrained)
    flag = ["--hf"] if hf else []
    routes = [
        (pretrained, "is", f"{pretrained}"),
        (tmp_path / "link", "is", f"{tmp_path / 'link'} (which is {pretrained})"),
        (pretrained / ".." / "M", "is", f"{pretrained / '..' / 'M'} (which is {pretrained})"),
        (tmp_path / "link" / "sub", "lies inside", f"{tmp_path / 'link' / 'sub'} (which is {pretrained / 'sub'})"),
    ]
    for out, relation, shown in routes:
        assert main(["consolidate", str(root), str(out), *flag]) == 2
        assert capsys.readouterr().err == f"tierzero: error: consolidate output {shown} {relation} the run's model.pretrained {pretrained}: {FIX}\n"
    if not hf:  # the one-file form, into M
        out = pretrained / "model.safetensors"
        assert main(["consolidate", str(root), str(out)]) == 2
        assert capsys.readouterr().err == f"tierzero: error: consolidate output {out} lies inside the run's model.pretrained {pretrained}: {FIX}\n"
    assert _snapshot(pretrained) == before and not (pretrained / "sub").exists()
    assert main(["consolidate", str(root), str(tmp_path / "out"), *flag]) == 0  # beside it is fine
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_consolidate_refuses_the_data_and_a_directory_holding_the_root(run: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, data, root = run
    before = _snapshot(data)
    assert main(["consolidate", str(root), str(data / "model.safetensors")]) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: consolidate output {data / 'model.safetensors'} lies inside the run's data.path {data / '*.txt'} "
        f"(which is {data}): {FIX}\n"
    )
    assert main(["consolidate", str(root), str(root.parent), "--hf"]) == 2  # it holds every input
    assert capsys.readouterr().err == f"tierzero: error: consolidate output {root.parent} holds the run's checkpoint root {root}: {FIX}\n"
    assert _snapshot(data) == before and not (root.parent / "config.json").exists()


def _train_args(tmp_path: Path, pretrained: Path, *more: str) -> list[str]:
    (tmp_path / "run.json").write_text(json.dumps({"zero": {"stage": 3}, "train": {"steps": 1, "seq_len": 16}}))
    return ["train", "--config", str(tmp_path / "run.json"), "--set", f"model.pretrained={pretrained}", "--no-progress", *more]


def _no_model(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model was built: the output was checked too late")


def test_train_export_onto_its_pretrained_directory_is_refused_before_the_model(
    run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pretrained, data, _ = run
    monkeypatch.setattr(T, "build_model", _no_model)
    before = _snapshot(pretrained)
    (tmp_path / "link").symlink_to(pretrained)
    assert main(_train_args(tmp_path, pretrained, "--export", str(tmp_path / "link"))) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: --export {tmp_path / 'link'} (which is {pretrained}) is the run's model.pretrained {pretrained}: {FIX}\n"
    )
    args = _train_args(tmp_path, pretrained, "--set", f"data.path={data}", "--export", str(data / ".." / "corpus" / "x"))
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: --export {data / '..' / 'corpus' / 'x'} (which is {data / 'x'}) lies inside the run's data.path {data}: {FIX}\n"
    )
    assert _snapshot(pretrained) == before


def test_unwritable_export_and_summary_paths_are_refused_before_the_model(
    run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pretrained, _, _ = run
    monkeypatch.setattr(T, "build_model", _no_model)
    (tmp_path / "file").write_text("x")
    summary = tmp_path / "missing" / "s.json"
    assert main(_train_args(tmp_path, pretrained, "--summary-json", str(summary))) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: --summary-json {summary} cannot be written: its directory {summary.parent} does not exist; "
        "create it or name another path\n"
    )
    assert main(_train_args(tmp_path, pretrained, "--summary-json", str(tmp_path))) == 2
    assert capsys.readouterr().err == f"tierzero: error: --summary-json {tmp_path} is a directory: name a file\n"
    export = tmp_path / "file" / "out" / "deeper"
    assert main(_train_args(tmp_path, pretrained, "--export", str(export))) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: --export {export} cannot be created: {tmp_path / 'file'} is not a directory; name another path\n"
    )


def test_paths_this_user_cannot_write_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root nothing is read-only, so there `os.access` says no for the locked paths (as it would for a user)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "s.json").write_text("{}")
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: not str(p).startswith(str(locked)) and real(p, mode, **kw))
    else:
        (locked / "s.json").chmod(0o444)
        locked.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=rf"^--summary-json {locked / 's.json'} cannot be replaced: it is not writable by this user; name another path$"):
            check_writable(locked / "s.json", what="--summary-json", directory=False)
        with pytest.raises(PermissionError, match=rf"^--summary-json {locked / 'n.json'} cannot be written: its directory {locked} is not writable by this user"):
            check_writable(locked / "n.json", what="--summary-json", directory=False)
        with pytest.raises(PermissionError, match=rf"^--export {locked / 'a' / 'b'} cannot be written: {locked} is not writable by this user"):
            check_writable(locked / "a" / "b", what="--export", directory=True)
        check_writable(tmp_path / "a" / "b", what="--export", directory=True)
        check_writable(tmp_path / "s.json", what="--summary-json", directory=False)
    finally:
        locked.chmod(0o755)
