"""Ctrl-C while the `tierzero` script is still loading its command: one line and exit 130, no traceback.

The script's entry point (tierzero/cli/launch.py) owns SIGINT until the command line is parsed,
then hands it back to Python, so that the commands' own handling (cli/guard.py) takes over.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierzero.cli import guard, launch
from tierzero.cli.launch import quit_quietly
from tierzero.cli.main import main

REPO = Path(__file__).resolve().parents[2]

PRESSED_WHILE_LOADING = textwrap.dedent(
    """
    import importlib, os, signal, sys
    from tierzero.cli import launch

    real = importlib.import_module

    def loading(name, *args):
        if name == {module!r}:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C lands while the command's modules load
        return real(name, *args)

    importlib.import_module = loading
    sys.argv = ["tierzero", "estimate", "--help"]
    sys.exit(launch.run())
    """
)


@pytest.mark.parametrize("module", ["tierzero.cli.main", "tierzero.cli.estimate"])
def test_ctrl_c_while_the_command_loads_is_one_line_and_exit_130(module: str) -> None:
    """At the first import of the command line's parser, and at the import of the command's own module."""
    proc = subprocess.run(
        [sys.executable, "-c", PRESSED_WHILE_LOADING.format(module=module)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's foreground job, not a CI runner's
    )
    assert (proc.returncode, proc.stderr) == (130, "tierzero: interrupted\n")


@pytest.fixture
def launched() -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, quit_quietly)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("launched")
def test_once_parsed_the_command_gets_ctrl_c_as_keyboard_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def command(args: argparse.Namespace) -> int:
        seen.append(signal.getsignal(signal.SIGINT))
        return 0

    monkeypatch.setattr(guard, "run", command)
    assert main(["clean", "/nonexistent"]) == 0  # parsed only: `guard.run` is the stand-in above
    assert seen == [signal.default_int_handler]


def test_an_ignored_sigint_stays_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A background job's SIGINT is ignored by its shell; loading must not make it deliverable."""
    seen = []
    command_line = SimpleNamespace(main=lambda: seen.append(signal.getsignal(signal.SIGINT)) or 0)
    monkeypatch.setattr(launch, "importlib", SimpleNamespace(import_module=lambda name: command_line))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert launch.run() == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIG_IGN]
