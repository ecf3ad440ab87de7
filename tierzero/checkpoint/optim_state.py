"""A torch.optim class's states in a checkpoint: one safetensors file and one JSON file per rank.

[Note: torch.optim states in a checkpoint]
A per-unit torch.optim instance ([Note: a torch.optim class per unit] in optim/torch_opt.py)
keeps states of the class's own choosing, so they are not store slices of known kinds:
its `state_dict()` is saved as it is, per rank. Every tensor goes to
`optimizer-NNNNN.safetensors` under the name `unit/param index/state name` (raw bytes: the
resume is bit-exact), and the rest (param groups, non-tensor states such as a step kept as
a number) to `optimizer-NNNNN.json`, each state tensor replaced by its name. Both files are
in the manifest with their checksums. The pieces are the rank's, so a checkpoint with these
states resumes at the world size that wrote it only, refused in one line elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tierzero.checkpoint.format import (
    CheckpointError,
    FileRecord,
    SafetensorsStream,
    TensorEntry,
    open_safetensors,
    read_json,
    verify_file,
    write_json,
)
from tierzero.checkpoint.manifest import Manifest, optimizer_files
from tierzero.optim.torch_opt import TorchOptimizer

__all__ = ["read_optimizer_state", "write_optimizer_state"]

_TENSOR = "__tensor__"


def write_optimizer_state(optimizer: Any, directory: Path, *, rank: int, algorithm: str) -> list[FileRecord]:
    """This rank's per-unit torch.optim states as two files (none for the engine's own optimizers)."""
    if not isinstance(optimizer, TorchOptimizer):
        return []
    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {}
    for unit, state_dict in optimizer.state_dict().items():
        states = {}
        for index, state in state_dict["state"].items():
            states[str(index)] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[name := f"{unit}/{index}/{key}"] = value.detach()
                    states[str(index)][key] = {_TENSOR: name}
                else:
                    states[str(index)][key] = value
        rest[unit] = {"state": states, "param_groups": state_dict["param_groups"]}
    weights, meta = optimizer_files(rank)
    entries = [TensorEntry(name, t.numel(), t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    stream = SafetensorsStream(directory / weights, entries, algorithm=algorithm)
    try:
        for name, t in tensors.items():
            stream.write(name, t)
        record = stream.finish()
    except BaseException:
        stream.abort()
        raise
    return [record, write_json(directory / meta, {"class": optimizer.cls.__qualname__, "units": rest}, algorithm=algorithm)]


def read_optimizer_state(
    optimizer: Any, directory: Path, manifest: Manifest, *, rank: int, world_size: int
) -> dict[str, Any] | None:
    """This rank's per-unit states, verified, for `TorchOptimizer.load_state_dict` (None for the engine's own)."""
    if not isinstance(optimizer, TorchOptimizer):
        return None
    weights, meta = optimizer_files(rank)
    if meta not in manifest.files:
        raise CheckpointError(
            f"{directory}: holds no {optimizer.cls.__name__} states for rank {rank}: resume with the optimizer.type "
            "the checkpoint was trained with"
        )
    if manifest.world_size != world_size:
        raise CheckpointError(
            f"{directory}: optimizer.type states are per rank, written at {manifest.world_size} ranks, loaded at "
            f"{world_size}: resume at {manifest.world_size} ranks"
        )
    for name in (weights, meta):
        verify_file(directory, manifest.file(name, directory=directory), algorithm=manifest.checksum)
    saved = read_json(directory / meta)
    if saved.get("class") != optimizer.cls.__qualname__:
        raise CheckpointError(
            f"{directory / meta}: holds {saved.get('class')} states, the run steps {optimizer.cls.__qualname__}: resume "
            "with the optimizer.type the checkpoint was trained with"
        )
    reader = open_safetensors(directory / weights)
    out = {}
    for unit, state_dict in saved["units"].items():
        state = {
            int(index): {k: reader.get_tensor(v[_TENSOR]) if isinstance(v, dict) else v for k, v in values.items()}
            for index, values in state_dict["state"].items()
        }
        groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in state_dict["param_groups"]]
        out[unit] = {"state": state, "param_groups": groups}
    return out
