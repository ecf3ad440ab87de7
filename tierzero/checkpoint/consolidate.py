"""`tierzero consolidate CKPT out.safetensors`: one fp32 state dict from a sharded checkpoint.

Given a directory instead (`tierzero consolidate CKPT out/`), it writes `out/model.safetensors`
and, for a `model.type: transformers` run, the model's `config.json` beside it, so that the
class's `from_pretrained(out)` loads the trained weights.

The output is an ordinary safetensors file of the model's full fp32 parameters by the
model's own names, plus its buffers and frozen parameters, for `model.load_state_dict`
(through `load_consolidated`) or `safetensors.torch.load_model`. A tied parameter is
stored once, under its first name, as `save_pretrained` does; the file's metadata lists
its other names, which `load_consolidated` fills in.

It streams: one unit's full buffer is rebuilt from the rank files at a time, so memory
is bounded by the largest unit, never the model. The checkpoint's files are verified
first, every number of its manifest against them; the output is written beside its final
name and renamed when complete, never inside the checkpoint's root (it would replace the
checkpoint's own files, or be pruned with them).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from tierzero.checkpoint.find import find_checkpoint
from tierzero.checkpoint.format import (
    CheckpointError,
    SafetensorsStream,
    TensorEntry,
    checksum_algorithm,
    dtype_from_name,
    open_safetensors,
)
from tierzero.checkpoint.manifest import MANIFEST, MODULE_PREFIX, Manifest, UnitLayout
from tierzero.checkpoint.shards import ShardReader
from tierzero.sizes import format_size

__all__ = ["Consolidated", "add_consolidate_command", "consolidate", "consolidate_pretrained", "load_consolidated"]

ALIASES_KEY = "tierzero.aliases"
#: An exported model is an ordinary file (the umask applies), unlike the checkpoint's own 0600 files.
OUTPUT_MODE = 0o644


@dataclass(frozen=True, slots=True)
class Consolidated:
    """What `consolidate` wrote."""

    path: Path
    step: int
    tensors: int
    nbytes: int
    largest_unit_bytes: int
    """The most memory one unit's rebuilt buffer took: the bound on what consolidation holds."""


def consolidate(checkpoint: str | Path, out: str | Path, *, note: Callable[[str], None] | None = None) -> Consolidated:
    """Write the checkpoint's full fp32 model to `out` (a .safetensors file), unit by unit."""
    directory = find_checkpoint(checkpoint, note=note)
    out = Path(out)
    refuse_inside_root(directory, out)
    manifest = Manifest.read(directory)
    reader = ShardReader(directory, manifest)
    reader.verify(set(range(manifest.world_size)))
    module = reader.whole_tensors(0, prefix=MODULE_PREFIX)
    named = {name for unit in manifest.units for slot in unit.slots for name in slot.names}
    clash = sorted(named & set(module))
    if clash:
        raise CheckpointError(f"{directory / MANIFEST}: {clash[0]} is both a parameter and a module buffer: it was edited")
    entries = [
        TensorEntry(slot.names[0], slot.numel, torch.float32, slot.shape) for unit in manifest.units for slot in unit.slots
    ]
    entries += [TensorEntry(name, t.numel(), t.dtype, tuple(t.shape)) for name, t in module.items()]
    aliases = {alias: slot.names[0] for unit in manifest.units for slot in unit.slots for alias in slot.names[1:]}
    metadata = {"format": "pt", ALIASES_KEY: json.dumps(aliases, sort_keys=True), "tierzero.step": str(manifest.step)}
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    stream = SafetensorsStream(tmp, entries, algorithm=checksum_algorithm(), metadata=metadata, mode=OUTPUT_MODE)
    largest = 0
    try:
        for unit in manifest.units:
            full = _full_fp32(reader, unit)
            largest = max(largest, full.numel() * full.element_size())
            for slot in unit.slots:
                stream.write(slot.names[0], full[slot.offset : slot.offset + slot.numel])
            del full
        for name, tensor in module.items():
            stream.write(name, tensor)
        record = stream.finish()
    except BaseException:
        stream.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return Consolidated(path=out, step=manifest.step, tensors=len(entries), nbytes=record.nbytes, largest_unit_bytes=largest)


def refuse_inside_root(directory: Path, out: Path) -> None:
    """ValueError when `out` lies in the root that holds the checkpoint `directory` (or in it)."""
    root = directory.parent if directory.name.isdigit() else directory
    base, target = root.resolve(), out.resolve()
    if target == base or base in target.parents:
        raise ValueError(
            f"consolidate output {out} is inside the checkpoint root {root}: it would replace or be pruned with "
            "the checkpoints there; write it outside"
        )


def _full_fp32(reader: ShardReader, unit: UnitLayout) -> torch.Tensor:
    """The unit's parameters end to end in fp32: its masters in mixed precision, else its parameters."""
    kind = "master" if "master" in unit.kinds else "param"
    stored = torch.empty(unit.numel, dtype=dtype_from_name(unit.kinds[kind], where=f"{reader.directory} unit {unit.name}"))
    reader.read(unit, kind, 0, unit.numel, out=stored)
    return stored if stored.dtype == torch.float32 else stored.float()


def consolidate_pretrained(checkpoint: str | Path, out_dir: str | Path, *, note: Callable[[str], None] | None = None) -> Consolidated:
    """`out_dir/model.safetensors`, plus `config.json` when the checkpoint's run was a transformers model."""
    out_dir, directory = Path(out_dir), find_checkpoint(checkpoint, note=note)
    refuse_inside_root(directory, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = consolidate(directory, out_dir / "model.safetensors")
    model = Manifest.read(directory).config.get("model", {})
    if not isinstance(model, dict) or not isinstance(model.get("transformers_config") or {}, dict):
        raise CheckpointError(f"{directory / MANIFEST}: config.model is not a model section: it was edited")
    if model.get("type") == "transformers":
        import transformers

        model_class = getattr(transformers, str(model.get("transformers_class")), None)
        if model_class is None:
            raise ValueError(
                f"the checkpoint's model.transformers_class {model.get('transformers_class')!r} is not in this "
                "transformers: install the version it was trained with"
            )
        model_class.config_class(**dict(model.get("transformers_config") or {})).save_pretrained(out_dir)
    return done


def load_consolidated(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in a consolidated file, tied names included (sharing one tensor), for `load_state_dict`."""
    reader = open_safetensors(Path(path))
    state = {name: reader.get_tensor(name) for name in reader.keys()}
    aliases = json.loads((reader.metadata() or {}).get(ALIASES_KEY, "{}"))
    for alias, name in aliases.items():
        state[alias] = state[name]
    return state


# ---- the command -------------------------------------------------------------------


def add_consolidate_command(subparsers: Any) -> None:
    """Register `tierzero consolidate CKPT OUT` on the `tierzero` command's sub-parsers."""
    parser = subparsers.add_parser("consolidate", help="write a sharded checkpoint's full fp32 model to one safetensors file")
    parser.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its newest complete checkpoint)")
    parser.add_argument(
        "out", help="the .safetensors file to write, or a directory for model.safetensors (and a transformers config.json)"
    )
    parser.set_defaults(func=run_consolidate)


def run_consolidate(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    target = Path(args.out)
    if target.suffix and target.suffix != ".safetensors":
        raise ValueError(
            f"consolidate writes safetensors, got output {args.out}: name it <something>.safetensors, or give a directory"
        )
    stream = out or sys.stdout

    def note(line: str) -> None:
        stream.write(f"{line}\n")

    if target.suffix:
        done = consolidate(args.checkpoint, target, note=note)
    else:
        done = consolidate_pretrained(args.checkpoint, target, note=note)
    stream.write(
        f"wrote {done.tensors} tensors ({format_size(done.nbytes)}) of step {done.step} to {done.path}; "
        f"largest unit held in memory {format_size(done.largest_unit_bytes)}\n"
    )
    return 0
