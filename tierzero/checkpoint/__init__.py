"""Sharded checkpoints: save and load (save_load.py), the on-disk format (format.py), the manifest
(manifest.py), per-rank shards (shards.py), RNG states (rng.py), what an engine hands over
(engine_state.py), what it must have (protocol.py), how ranks agree on every outcome
(agree.py) and consolidation into one state dict (consolidate.py)."""

from tierzero.checkpoint.format import CheckpointError
from tierzero.checkpoint.protocol import Checkpointable
from tierzero.checkpoint.save_load import (
    CheckpointWriteError,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "Checkpointable",
    "CheckpointWriteError",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]
