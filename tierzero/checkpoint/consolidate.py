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
first; the output is written beside its final name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from tierzero.checkpoint.format import (
    SafetensorsStream,
    TensorEntry,
    checksum_algorithm,
    dtype_from_name,
    open_safetensors,
)
from tierzero.checkpoint.manifest import MODULE_PREFIX, Manifest, UnitLayout
from tierzero.checkpoint.save_load import find_checkpoint
from tierzero.checkpoint.shards import ShardReader
from tierzero.sizes import format_size

__all__ = ["Consolidated", "add_consolidate_command", "consolidate", "consolidate_pretrained", "load_consolidated"]

ALIASES_KEY = "tierzero.aliases"


@dataclass(frozen=True, slots=True)
class Consolidated:
    """What `consolidate` wrote."""

    path: Path
    step: int
    tensors: int
    nbytes: int
    largest_unit_bytes: int
    """The most memory one unit's rebuilt buffer took: the bound on what consolidation holds."""


def consolidate(checkpoint: str | Path, out: str | Path) -> Consolidated:
    """Write the checkpoint's full fp32 model to `out` (a .safetensors file), unit by unit."""
    directory = find_checkpoint(checkpoint)
    manifest = Manifest.read(directory)
    reader = ShardReader(directory, manifest)
    reader.verify(set(range(manifest.world_size)))
    module = reader.whole_tensors(0, prefix=MODULE_PREFIX)
    entries = [
        TensorEntry(slot.names[0], slot.numel, torch.float32, slot.shape) for unit in manifest.units for slot in unit.slots
    ]
    entries += [TensorEntry(name, t.numel(), t.dtype, tuple(t.shape)) for name, t in module.items()]
    aliases = {alias: slot.names[0] for unit in manifest.units for slot in unit.slots for alias in slot.names[1:]}
    metadata = {"format": "pt", ALIASES_KEY: json.dumps(aliases, sort_keys=True), "tierzero.step": str(manifest.step)}
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    stream = SafetensorsStream(tmp, entries, algorithm=checksum_algorithm(), metadata=metadata)
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


def _full_fp32(reader: ShardReader, unit: UnitLayout) -> torch.Tensor:
    """The unit's parameters end to end in fp32: its masters in mixed precision, else its parameters."""
    kind = "master" if "master" in unit.kinds else "param"
    stored = torch.empty(unit.numel, dtype=dtype_from_name(unit.kinds[kind], where=f"{reader.directory} unit {unit.name}"))
    reader.read(unit, kind, 0, unit.numel, out=stored)
    return stored if stored.dtype == torch.float32 else stored.float()


def consolidate_pretrained(checkpoint: str | Path, out_dir: str | Path) -> Consolidated:
    """`out_dir/model.safetensors`, plus `config.json` when the checkpoint's run was a transformers model."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = consolidate(checkpoint, out_dir / "model.safetensors")
    model = Manifest.read(find_checkpoint(checkpoint)).config.get("model", {})
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
    done = consolidate(args.checkpoint, target) if target.suffix else consolidate_pretrained(args.checkpoint, target)
    (out or sys.stdout).write(
        f"wrote {done.tensors} tensors ({format_size(done.nbytes)}) of step {done.step} to {done.path}; "
        f"largest unit held in memory {format_size(done.largest_unit_bytes)}\n"
    )
    return 0
