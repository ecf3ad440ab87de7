"""The three formats a checkpoint is written in, behind one writer/reader interface.

[Note: checkpoint formats]
tierzero writes a model's state in three formats, each with its own mechanism:

- `ShardedCheckpoint` ("tierzero"): every rank's own slices, optimizer states, RNG and
  scalars, to resume at any world size (save_load.py). Written and read.
- `TransformersDirectory` ("transformers"): the full model as `save_pretrained` writes it,
  for `from_pretrained` (export.py; from a saved checkpoint, consolidate.py). Written only.
- `PeftAdapters` ("peft"): a LoRA run's trained adapters as peft writes them, for
  `PeftModel.from_pretrained` (tierzero/pretrained/lora.py). Written only.

Call order, as torch DCP's `StorageWriter`/`StorageReader` spell theirs:

1. Build the format with its options (`keep`; `dtype`, `tokenizer`, `max_shard_size`), the
   same on every rank. Building touches neither the engine nor the disk.
2. `write(engine, path)`, or `read(engine, path)`, once on every rank of the engine's group,
   at the same point of training (the sharded format refuses any but an optimizer-step
   boundary). Both are collective: every rank gathers or reads its part in the same order.
   A failure on one rank is raised on every rank by the sharded format and the transformers
   export (the export once its last gather is done, so no rank waits on a collective that
   never comes); peft's files are written by rank 0 alone after the last gather.
3. The result: the sharded format's directory on every rank; an export's record on rank 0
   and None elsewhere, since only rank 0 writes a whole-model format.

What each side needs of the engine: the sharded format reads and writes each rank's slices
in place, through `Checkpointable` (its store, stage and module); the whole-model formats
gather each unit in turn and never see a store, through `Exportable` (a stage with
`gather_fp32`). See [Note: checkpointable engine] in protocol.py.

Why two formats have no reader: nothing in tierzero reads either into a live engine today.
A transformers directory is read only while an engine is built (`tierzero.initialize(model,
cfg, pretrained=DIR)` hands `tierzero.pretrained.PretrainedWeights` to the engine, which
streams each unit's range into its slices as the unit is installed), which is a start, not a
load into slices already home. peft's adapter files are read by peft alone; a LoRA run resumes
from its sharded checkpoint, whose units hold the adapters (and which keeps a peft copy of
them in `adapter/`, written by save_load.py itself so that its ranks agree on that file too).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

import torch

from tierzero.checkpoint.consolidate import Consolidated, consolidate_hf
from tierzero.checkpoint.engine_export import export_engine
from tierzero.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, Exported
from tierzero.checkpoint.protocol import Checkpointable, Exportable
from tierzero.checkpoint.save_load import load_checkpoint, save_checkpoint
from tierzero.pretrained.lora import save_adapters

__all__ = ["CheckpointReader", "CheckpointWriter", "PeftAdapters", "ShardedCheckpoint", "TransformersDirectory"]

R_co = TypeVar("R_co", covariant=True)


class CheckpointWriter(ABC, Generic[R_co]):
    """Writes an engine's state in one format; see [Note: checkpoint formats] for the call order."""

    __slots__ = ()

    name: ClassVar[str]
    """The format's name: tierzero, transformers or peft."""

    @abstractmethod
    def write(self, engine: Exportable, path: Path) -> R_co:
        """Write `engine`'s state at `path`. Collective: every rank calls it at the same step boundary."""


class CheckpointReader(ABC):
    """Reads a format back into a live engine; see [Note: checkpoint formats] for the call order."""

    __slots__ = ()

    name: ClassVar[str]

    @abstractmethod
    def read(self, engine: Checkpointable, path: Path) -> Path:
        """Load what `path` holds into `engine`; the directory read. Collective, and the engine's
        state changes only once every file it reads has been checked."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedCheckpoint(CheckpointWriter[Path], CheckpointReader):
    """tierzero's own format: `root/<step>/` with each rank's slices, a manifest and `root/latest`.

    It resumes a run bit for bit at any world size; see save_load.py for the atomic save and
    the checked load, which this class hands each call to.
    """

    name: ClassVar[str] = "tierzero"

    keep: int | None = None
    """How many of the newest checkpoints a write keeps under its root (None: all); save_checkpoint
    refuses a value below 1."""

    def write(self, engine: Checkpointable, path: Path) -> Path:
        """`path/<engine.global_step>` written atomically and named by `path/latest`: the directory."""
        return save_checkpoint(engine, path, keep=self.keep)

    def read(self, engine: Checkpointable, path: Path) -> Path:
        """The checkpoint `path` names, or the newest complete one under it, loaded into `engine`."""
        return load_checkpoint(engine, path)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformersDirectory(CheckpointWriter[Exported | None]):
    """The directory `save_pretrained` writes: safetensors shards, their index, config.json,
    generation_config.json and the tokenizer, streamed one unit at a time (export.py).

    Written from a live engine (`write`, `tierzero train --export`) or from a sharded
    checkpoint with no engine at all (`convert`, `tierzero consolidate --hf`). No reader: see
    [Note: checkpoint formats] for where such a directory is read.
    """

    name: ClassVar[str] = "transformers"

    dtype: torch.dtype | None = None
    """The dtype the weights are written in (None: the run's training dtype)."""
    tokenizer: str | Path | None = None
    """The tokenizer directory copied beside the weights (None: the run's own; see `check_export`)."""
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    """The largest weight file, e.g. 5GB; checked when the first file is planned."""
    merged: bool = False
    """`write` of a LoRA run's engine: its base with the adapters merged into it, bf16 unless `dtype`
    says ([Note: merged LoRA export]); `convert` always merges a LoRA run's checkpoint."""

    def write(self, engine: Exportable, path: Path) -> Exported | None:
        """The engine's model at `path`, gathered unit by unit; the record on rank 0, None elsewhere."""
        return export_engine(
            engine, path, dtype=self.dtype, tokenizer=self.tokenizer, max_shard_size=self.max_shard_size, merged=self.merged
        )

    def convert(self, checkpoint: str | Path, path: Path, *, note: Callable[[str], None] | None = None) -> Consolidated:
        """The model of the sharded `checkpoint` (or the newest under that root) at `path`, read on
        this process alone; `note` hears which checkpoint was chosen over newer broken ones."""
        return consolidate_hf(
            checkpoint, path, dtype=self.dtype, tokenizer=self.tokenizer, max_shard_size=self.max_shard_size, note=note
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PeftAdapters(CheckpointWriter[Path | None]):
    """A LoRA run's trained adapters as peft writes them: `adapter_model.safetensors` and
    `adapter_config.json` (tierzero/pretrained/lora.py). Only the trained units are gathered,
    never the frozen base. No reader: see [Note: checkpoint formats]."""

    name: ClassVar[str] = "peft"

    def write(self, engine: Exportable, path: Path) -> Path | None:
        """The adapters at `path` (replaced whole); the directory on rank 0, None elsewhere.
        ValueError when the engine's model is no peft model."""
        return save_adapters(engine, path)
