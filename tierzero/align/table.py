"""A precomputed DPO reference: each record's chosen and rejected summed log-probs, and the file that keeps them.

[Note: the reference table on disk]
With `dpo.reference: precomputed` the reference is the initial model, whose weights are gone
once the first step has run, so a resumed run cannot compute it again: the table is kept in
checkpoint.dir as `dpo-reference.safetensors`, written once, by rank 0, before the first step
(temp file, fsync, rename), and read back by every --resume of the run. It belongs to the run,
not to a step: every checkpoint of the run shares it, and pruning old steps leaves it. One
safetensors tensor `logps`, (records, 2) fp32 (chosen, rejected), and in the header's metadata
the run's id, the records' fingerprint (`PreferenceBatches.fingerprint`: their ids, seq_len and
max_prompt_len) and a crc32 over the metadata and the values. A table that is missing, fails
its checksum, names another run or other records is refused in one line, never recomputed
from the trained weights.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from tierzero.checkpoint.format import CheckpointError, open_for_reading, open_safetensors, write_bytes_atomic
from tierzero.data.preference import PreferenceBatch

__all__ = ["FORMAT", "REFERENCE_FILE", "ReferenceTable"]

REFERENCE_FILE = "dpo-reference.safetensors"
"""The table's name in checkpoint.dir."""
FORMAT = "tierzero-dpo-reference"
VERSION = "1"
_FIX = "restore this run's file, or start a fresh run without --resume"


@dataclass(frozen=True, slots=True)
class ReferenceTable:
    """The reference's summed log-probs of every record's completions, by record number; see [Note: the reference table on disk]."""

    logps: torch.Tensor
    """(records, 2) fp32 on the CPU: column 0 the chosen completion's, column 1 the rejected one's."""
    fingerprint: str
    """`PreferenceBatches.fingerprint()` of the records it was computed for."""

    def __post_init__(self) -> None:
        if self.logps.dtype != torch.float32 or self.logps.ndim != 2 or self.logps.shape[1] != 2:
            raise ValueError(
                f"reference log-probs of dtype {self.logps.dtype} and shape {tuple(self.logps.shape)}: expected (records, 2) fp32"
            )

    @property
    def records(self) -> int:
        return self.logps.shape[0]

    def lookup(self, batch: PreferenceBatch) -> torch.Tensor:
        """The (2B,) reference log-probs of `batch`'s rows, the B chosen first, as `dpo_loss` takes them."""
        if batch.records is None:
            raise ValueError("a precomputed DPO reference looks each pair up by its record number, and this batch names none")
        if batch.records.numel() and not 0 <= int(batch.records.min()) <= int(batch.records.max()) < self.records:
            raise ValueError(f"batch records {batch.records.tolist()} are outside the reference table's {self.records}")
        picked = self.logps[batch.records.cpu()]
        return torch.cat([picked[:, 0], picked[:, 1]])

    def write(self, path: Path, *, run_id: str) -> None:
        """The table at `path`, replacing any file there all at once."""
        fields = {"format": FORMAT, "version": VERSION, "records": str(self.records), "fingerprint": self.fingerprint, "run_id": run_id}
        metadata = fields | {"checksum": _checksum(fields, self.logps)}
        write_bytes_atomic(path, safetensors_bytes({"logps": self.logps.contiguous()}, metadata=metadata))

    @classmethod
    def read(cls, path: Path, *, fingerprint: str, run_id: str) -> ReferenceTable:
        """The table `write` left at `path` for the run `run_id` and the records of `fingerprint`; CheckpointError
        naming the file and the fix for anything else."""
        try:
            open_for_reading(path).close()  # a symlink or a non-file is refused before safetensors opens it
        except FileNotFoundError:
            raise CheckpointError(
                f"{path} is missing: a resumed dpo.reference precomputed run reads the reference log-probs its start "
                f"computed, which cannot be computed again from the trained weights; {_FIX}"
            ) from None
        try:
            reader = open_safetensors(path)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; {_FIX}") from None
        metadata = reader.metadata() or {}
        if metadata.get("format") != FORMAT or list(reader.keys()) != ["logps"]:
            raise CheckpointError(f"{path} is not a tierzero DPO reference table: {_FIX}")
        logps = reader.get_tensor("logps")
        fields = {key: metadata.get(key) for key in ("format", "version", "records", "fingerprint", "run_id")}
        shaped = logps.dtype == torch.float32 and logps.ndim == 2 and fields["records"] == str(logps.shape[0])
        if not shaped or metadata.get("checksum") != _checksum(fields, logps):
            raise CheckpointError(f"{path} fails its checksum: it is corrupt or was edited; {_FIX}")
        if metadata["run_id"] != run_id:
            raise CheckpointError(f"{path} is the reference of run {metadata['run_id']}, the checkpoint is of run {run_id}: {_FIX}")
        if metadata["fingerprint"] != fingerprint:
            raise CheckpointError(
                f"{path} was computed for other records ({metadata['records']} records, fingerprint {metadata['fingerprint']}, "
                f"these {fingerprint}): data.path, data.tokenizer, train.seq_len or dpo.max_prompt_len changed since the run "
                "began; resume with the run's data and settings, or start a fresh run without --resume"
            )
        return cls(logps=logps, fingerprint=fingerprint)


def _checksum(fields: dict[str, str | None], logps: torch.Tensor) -> str:
    """crc32 of the metadata (canonical JSON) and of the values' bytes."""
    crc = zlib.crc32(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return f"{zlib.crc32(logps.contiguous().numpy().tobytes(), crc):08x}"
