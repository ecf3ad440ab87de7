"""Ctrl-C pressed again and again during `tierzero train`: one line, exit 130, the engine closed once and fully."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_train import REPO, _parse, _tiny_config

import tierzero.cli.train as T
from tierzero.cli.stops import CtrlC
from tierzero.engine.engine import Engine


@pytest.fixture
def ctrl_c_delivered() -> Iterator[None]:
    """SIGINT handled as in a terminal: a shell starts background jobs (a CI runner's, say) with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)  # the handler runs here, in the main thread


class _PressingAgain(io.StringIO):
    """The run's output; the user presses Ctrl-C again as each line about stopping appears."""

    def write(self, text: str) -> int:
        if "interrupted after" in text or "tierzero train summary" in text:
            _ctrl_c()
        return super().write(text)


@pytest.mark.usefixtures("ctrl_c_delivered")
def test_ctrl_c_again_while_stopping_and_closing_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config, swap = _tiny_config(tmp_path, nvme=True)
    real_step, real_close, closes, steps = T._train_step, Engine.close, [], []

    def step(*args: Any, **kwargs: Any) -> float:
        steps.append(1)
        if len(steps) == 3:
            _ctrl_c()  # the first: stops the run
        return real_step(*args, **kwargs)

    def close(self: Engine) -> None:
        closes.append(1)
        _ctrl_c()  # two more while the engine closes
        _ctrl_c()
        real_close(self)

    monkeypatch.setattr(T, "_train_step", step)
    monkeypatch.setattr(Engine, "close", close)
    out = _PressingAgain()
    before = signal.getsignal(signal.SIGINT)
    args = _parse(["train", "--config", str(config), "--no-progress", "--set", f"checkpoint.dir={tmp_path / 'ck'}"])
    try:
        rc = T.run_train(args, out=out)
    except KeyboardInterrupt:  # caught here: escaping, it would end the whole test session
        pytest.fail("a second Ctrl-C escaped the run as KeyboardInterrupt")
    assert rc == 130
    assert closes == [1]
    assert list(swap.iterdir()) == [] and list((tmp_path / "ck").iterdir()) == []  # no swap or owner file, no lock
    assert "interrupted after 2 steps" in out.getvalue() and "steps                2 of 20 (interrupted)" in out.getvalue()
    assert capsys.readouterr().err == "tierzero: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before


def _terminal_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored
    # across exec: restore the default, so that Python turns it into KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("apart_s", [0.0005, 0.05])
def test_ctrl_c_pressed_until_the_process_exits_as_a_terminal_sends_it(tmp_path: Path, apart_s: float) -> None:
    config, swap = _tiny_config(tmp_path, nvme=True, steps=200, log_every=1)
    command = [sys.executable, "-m", "tierzero.cli", "train", "--config", str(config), "--no-progress",
               "--set", f"checkpoint.dir={tmp_path / 'ck'}"]
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"}, preexec_fn=_terminal_sigint, start_new_session=True,  # noqa: PLW1509 - it only resets a signal
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:  # the terminal signals the whole foreground group
            with contextlib.suppress(ProcessLookupError):  # the group may have just exited
                os.killpg(proc.pid, signal.SIGINT)
            time.sleep(apart_s)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines()[-1] == "tierzero: interrupted", err
    assert "(interrupted)" in rest
    assert list(swap.iterdir()) == [] and list((tmp_path / "ck").iterdir()) == []


@pytest.mark.usefixtures("ctrl_c_delivered")
@pytest.mark.parametrize("ignore_after", [False, True])
def test_after_an_interrupted_run_ctrl_c_is_handed_back_or_ignored_as_asked(ignore_after: bool) -> None:
    before = signal.getsignal(signal.SIGINT)
    with CtrlC(ignore_after=ignore_after):  # never pressed: handed back either way
        pass
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt), CtrlC(ignore_after=ignore_after):
        _ctrl_c()
    assert signal.getsignal(signal.SIGINT) is (signal.SIG_IGN if ignore_after else before)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_run_ended_by_sigterm_or_sighup_leaves_no_lock_and_no_swap_file(tmp_path: Path, signum: int) -> None:
    """The default action ends the process without the run's close: the signal clean-up removes the
    swap files and the checkpoint root's lock file (the saved checkpoints stay)."""
    config, swap = _tiny_config(tmp_path, nvme=True, steps=200, log_every=1)
    root = tmp_path / "ck"
    command = [sys.executable, "-m", "tierzero.cli", "train", "--config", str(config), "--no-progress",
               "--set", f"checkpoint.dir={root}", "--set", "checkpoint.every=1"]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        assert (root / ".lock").exists() and list(swap.iterdir())
        proc.send_signal(signum)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signum
    assert list(swap.iterdir()) == []
    assert not (root / ".lock").exists() and [p.name for p in root.iterdir() if p.name.startswith(".")] == []
