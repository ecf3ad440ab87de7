"""`tierzero --help` lists every command without importing torch or any command's module, and a
command run imports its own module alone; the table of commands names modules that add them."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from tierzero.cli.commands import COMMANDS

PROBE = """
import json, sys
from tierzero.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tierzero.cli.") or m == "torch")))
"""


def _loaded(*argv: str) -> tuple[set[str], str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300)
    return set(json.loads(done.stdout.strip().splitlines()[-1])), done.stdout


@pytest.mark.parametrize("argv", [("--help",), ("--version",), ("no-such-command",)])
def test_help_and_version_import_neither_torch_nor_the_commands(argv: tuple[str, ...]) -> None:
    loaded, out = _loaded(*argv)
    assert loaded == {"tierzero.cli.commands", "tierzero.cli.launch", "tierzero.cli.main"}, loaded
    if argv == ("--help",):
        for name, command in COMMANDS.items():
            assert name in out and command.help.split()[0] in out


def test_a_command_imports_its_own_module_alone() -> None:
    loaded, _ = _loaded("clean", "--help")
    commands = {c.module for c in COMMANDS.values()}
    assert loaded & commands == {"tierzero.cli.clean"}


def test_every_command_of_the_table_is_added_by_its_module_with_the_table_help() -> None:
    for name, command in COMMANDS.items():
        parser = argparse.ArgumentParser()
        subparsers = parser.add_subparsers(dest="command")
        getattr(importlib.import_module(command.module), command.adder)(subparsers)
        assert name in subparsers.choices, name
        added = next(a for a in subparsers._choices_actions if a.dest == name)
        assert added.help == command.help, name
