"""Every path the user names (the config, a machine file, a bench file, data, a tokenizer, a pretrained
model's files) is refused in one line when it is a FIFO or a device, before it is opened: never "does
not exist", never a read that blocks for ever (a FIFO) or never ends (/dev/zero)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierzero.cli.estimate import load_bench
from tierzero.cli.generate import read_prompts
from tierzero.cli.main import main
from tierzero.config import ConfigError, load_config
from tierzero.data import find_files, load_tokenizer
from tierzero.estimate.machines import load_machine
from tierzero.pretrained import PretrainedError, PretrainedWeights, build_meta_model

LIMIT_S = 30


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """A test that would block on a FIFO fails after LIMIT_S seconds instead of hanging the suite."""

    def expire(*_: Any) -> None:
        raise TimeoutError(f"blocked for {LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _refusal(call: Callable[[], Any], error: type[Exception] = ValueError) -> str:
    with pytest.raises(error) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_config_that_is_a_fifo_or_a_device_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    path, what = (_fifo(tmp_path / "run.yaml"), "a FIFO") if kind == "fifo" else (Path("/dev/zero"), "a character device")
    refusal = f"config file {path} is {what}, not a regular file: pass the path of a config file"
    assert _refusal(lambda: load_config(path), ConfigError) == refusal
    for command in (["train", "--no-progress"], ["estimate"]):
        capsys.readouterr()
        assert main([command[0], "--config", str(path), *command[1:]]) == 2
        assert capsys.readouterr().err == f"tierzero: error: {refusal}\n"


def test_a_missing_config_still_says_so_and_a_directory_says_what_it_is(tmp_path: Path) -> None:
    assert _refusal(lambda: load_config(tmp_path / "gone.yaml"), ConfigError) == (
        f"config file {tmp_path / 'gone.yaml'} does not exist: pass the path of a config file"
    )
    (tmp_path / "dir.yaml").mkdir()
    assert _refusal(lambda: load_config(tmp_path / "dir.yaml"), ConfigError) == (
        f"config file {tmp_path / 'dir.yaml'} is a directory: pass the path of a config file"
    )


def test_a_machine_file_and_a_bench_file_that_are_fifos_are_refused(tmp_path: Path) -> None:
    machine = _fifo(tmp_path / "box.yaml")
    assert _refusal(lambda: load_machine(str(machine)), ConfigError) == (
        f"machine file {machine} is a FIFO, not a regular file: pass the path of a config file"
    )
    bench = _fifo(tmp_path / "bench.json")
    assert _refusal(lambda: load_bench(str(bench))) == (
        f"--nvme-bench {bench} is a FIFO, not a regular file: pass the file `tierzero bench nvme --json` wrote"
    )


def test_data_that_is_a_fifo_is_refused_and_one_inside_a_directory_is_left_out(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "corpus.txt")
    assert _refusal(lambda: find_files(fifo)) == (
        f"data.path {fifo} is a FIFO, not a regular file: point it at a text file, a directory or a glob"
    )
    (tmp_path / "text.txt").write_text("hello")
    assert find_files(tmp_path) == [tmp_path / "text.txt"]


def test_a_tokenizer_directory_holding_a_fifo_is_refused_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    fifo = _fifo(tmp_path / "tokenizer.json")
    assert _refusal(lambda: load_tokenizer(tmp_path)) == (
        f"data.tokenizer {tmp_path}: {fifo} is a FIFO, not a regular file: replace it with the file save_pretrained wrote"
    )


def test_pretrained_files_that_are_fifos_or_devices_are_refused_naming_them(tmp_path: Path) -> None:
    fix = "point at the folder save_pretrained wrote, which holds regular files"
    config = _fifo(tmp_path / "config.json")
    assert _refusal(lambda: build_meta_model(tmp_path), PretrainedError) == f"{config} is a FIFO, not a regular file: {fix}"
    config.unlink()
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}))
    weights = _fifo(tmp_path / "model.safetensors")
    assert _refusal(lambda: PretrainedWeights.open(tmp_path), PretrainedError) == f"{weights} is a FIFO, not a regular file: {fix}"
    weights.unlink()
    weights.symlink_to("/dev/zero")
    assert _refusal(lambda: PretrainedWeights.open(tmp_path), PretrainedError) == (
        f"{weights} is a character device, not a regular file: {fix}"
    )
    weights.unlink()
    index = _fifo(tmp_path / "model.safetensors.index.json")
    assert _refusal(lambda: PretrainedWeights.open(tmp_path), PretrainedError) == f"{index} is a FIFO, not a regular file: {fix}"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_a_prompts_file_that_is_no_regular_file_is_refused_naming_it(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        path, what = _fifo(tmp_path / "p.jsonl"), "a FIFO, not a regular file"
    elif kind == "dev-zero":
        path, what = Path("/dev/zero"), "a character device, not a regular file"
    else:
        path, what = tmp_path, "a directory, not a regular file"
    assert _refusal(lambda: read_prompts(path)) == f'--prompts {path} is {what}: give a JSON Lines file with a "prompt" string a line'
    missing = tmp_path / "none.jsonl"
    assert _refusal(lambda: read_prompts(missing), FileNotFoundError) == (
        f'--prompts {missing}: no such file; give a JSON Lines file with a "prompt" string a line'
    )
