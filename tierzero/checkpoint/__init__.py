"""Checkpoints in three formats behind one writer/reader interface (formats.py): tierzero's sharded one,
a transformers directory and peft's adapter files.

Sharded checkpoints: save and load (save_load.py), which checkpoint a root holds (find.py), the
root a run writes, probed and locked (directory.py), the on-disk format (format.py), the manifest
(manifest.py, read strictly through fields.py), per-rank shards (shards.py), RNG states (rng.py),
what an engine hands over (engine_state.py), what it must have (protocol.py), how ranks agree on
every outcome (agree.py) and consolidation into one state dict (consolidate.py)."""

from tierzero.checkpoint.directory import (
    CheckpointDirError,
    RootLock,
    claim_root,
    probe_root,
)
from tierzero.checkpoint.find import (
    CheckpointFallbackWarning,
    find_checkpoint,
    list_checkpoints,
)
from tierzero.checkpoint.format import CheckpointError
from tierzero.checkpoint.formats import (
    CheckpointReader,
    CheckpointWriter,
    PeftAdapters,
    ShardedCheckpoint,
    TransformersDirectory,
)
from tierzero.checkpoint.protocol import Checkpointable
from tierzero.checkpoint.save_load import (
    CheckpointWriteError,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointDirError",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointReader",
    "CheckpointWriteError",
    "CheckpointWriter",
    "Checkpointable",
    "PeftAdapters",
    "RootLock",
    "ShardedCheckpoint",
    "TransformersDirectory",
    "claim_root",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "probe_root",
    "save_checkpoint",
]
