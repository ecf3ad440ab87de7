"""`tierzero config check FILE [--set key=value ...]` and `tierzero config docs`.

Errors are raised as `ConfigError` (a ValueError); tierzero.cli.main.main prints them as one
`tierzero: error: ...` line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, TextIO

import yaml

from tierzero.cli.commands import COMMANDS
from tierzero.config import AUTO
from tierzero.config.errors import ConfigError, TierZeroConfigWarning
from tierzero.config.loading import load_config
from tierzero.config.markdown import config_markdown
from tierzero.config.reading import load_yaml
from tierzero.config.sections import MAX_GENERATE_BATCH


def add_config_commands(subparsers: Any) -> None:
    """Register `config check` and `config docs` on the `tierzero` command's sub-parsers."""
    config = subparsers.add_parser("config", help=COMMANDS["config"].help)
    commands = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")

    check = commands.add_parser("check", help="validate a config and print it resolved, as YAML")
    check.add_argument("file", help="a tierzero .yaml/.yml/.json config, or a DeepSpeed .json config")
    check.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one dotted key, e.g. --set zero.stage=2 (the value is read as YAML)",
    )
    check.add_argument("--nvme-path", help="shorthand for --set tiers.nvme.path=PATH")
    check.set_defaults(func=run_check)

    docs = commands.add_parser("docs", help="print the markdown reference of every config key")
    docs.set_defaults(func=run_docs)


def parse_batch_size(text: str) -> int | str:
    """`--batch-size` of `generate` and `estimate --generate`: auto, or a whole number from 1 to MAX_GENERATE_BATCH."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_GENERATE_BATCH:
        raise ValueError(
            f"--batch-size {text} is not auto or a whole number in 1..{MAX_GENERATE_BATCH}: give auto or a positive batch size"
        )
    return n


def parse_overrides(items: list[str], *, nvme_path: str | None = None) -> dict[str, Any]:
    """["zero.stage=2", "tiers.nvme.path=/x"] -> {"zero.stage": 2, "tiers.nvme.path": "/x"}."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE such as zero.stage=2, got {item!r}")
        try:
            value = load_yaml(text, source=f"--set {key.strip()}") if text.strip() else None
        except yaml.YAMLError:
            value = text
        overrides[key.strip()] = value
    if nvme_path is not None:
        overrides["tiers.nvme.path"] = nvme_path
    return overrides


def run_check(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the resolved config as YAML; config warnings go to stderr, one line each."""
    out, err = out or sys.stdout, err or sys.stderr
    overrides = parse_overrides(args.overrides, nvme_path=args.nvme_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TierZeroConfigWarning)
        cfg = load_config(args.file, overrides=overrides)
    for warning in caught:
        if issubclass(warning.category, TierZeroConfigWarning):
            print(f"tierzero: warning: {warning.message}", file=err)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    out.write(str(cfg))
    return 0


def run_docs(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """Print the markdown of docs/config.md."""
    (out or sys.stdout).write(config_markdown())
    return 0
