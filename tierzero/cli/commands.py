"""The `tierzero` command's table of contents: each command's name, one-line help, and the module
that builds its arguments and runs it.

It imports nothing (of torch or of the project), so `tierzero --help` lists every command in a
fraction of a second, and a command run loads its own module alone (cli/main.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    module: str
    """The module under tierzero/cli/ that adds the command's parser."""
    adder: str
    """Its function that adds the parser: `adder(subparsers)`."""
    help: str


COMMANDS: dict[str, Command] = {
    "bench": Command("tierzero.cli.bench", "add_bench_commands", "measure the NVMe tier and stress the swapper"),
    "config": Command("tierzero.cli.config", "add_config_commands", "check a config file, or print the config reference"),
    "train": Command("tierzero.cli.train", "add_train_command", "train the configured model"),
    "demo": Command("tierzero.cli.train", "add_demo_command", "train the demo model (configs/demo.yaml), swapping to ./.tierzero-swap"),
    "estimate": Command("tierzero.cli.estimate", "add_estimate_command", "bytes per tier, NVMe traffic and step-time floor of a config"),
    "generate": Command("tierzero.cli.generate", "add_generate_command", "complete prompts with the configured (or a trained) model"),
    "consolidate": Command(
        "tierzero.cli.consolidate", "add_consolidate_command",
        "write a sharded checkpoint's full model to safetensors (--hf: a transformers directory)",
    ),  # fmt: skip
    "make-checkpoint": Command(
        "tierzero.cli.make_checkpoint", "add_make_checkpoint_command", "write a random-weight transformers checkpoint with a tokenizer"
    ),
    "clean": Command("tierzero.cli.clean", "add_clean_command", "remove the swap files that dead runs left under a tiers.nvme.path"),
}
"""In the order `tierzero --help` lists them."""
