"""Reading a unit's logical flat buffer back from the N rank files of a checkpoint.

See [Note: checkpoint layout] in checkpoint/manifest.py. A reader asks for elements
[start, end) of one unit's kind; the range is cut at the writer's slice boundaries and
each piece is read (memory-mapped, not whole files) from the rank file that holds it.
Every file is verified against the manifest before its first read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tierzero.checkpoint.format import CheckpointError, dtype_from_name, open_safetensors, read_range, verify_file
from tierzero.checkpoint.manifest import Manifest, UnitLayout, rank_tensor_file, tensor_name


def pieces(layout: UnitLayout, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(writer rank, start, end) in that rank's slice for logical elements [start, end), padding excluded."""
    end = min(end, layout.numel)
    shard = layout.shard_numel
    pos = start
    while pos < end:
        rank = pos // shard
        stop = min(end, (rank + 1) * shard)
        yield rank, pos - rank * shard, stop - rank * shard
        pos = stop


class ShardReader:
    """Logical ranges of a checkpoint's units, read from whichever rank files hold them."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory, self.manifest = directory, manifest
        self._open: dict[int, Any] = {}

    def files_for(self, layout: UnitLayout, start: int, end: int) -> set[int]:
        return {rank for rank, _, _ in pieces(layout, start, end)}

    def verify(self, ranks: set[int]) -> None:
        """Check the named rank files' sizes and checksums (before any byte of them is used)."""
        for rank in sorted(ranks):
            self._reader(rank)

    def read(self, layout: UnitLayout, kind: str, start: int, end: int, *, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (end - start elements) with logical elements [start, end); elements past `numel` are 0."""
        assert out.numel() == end - start
        if kind not in layout.kinds:
            raise CheckpointError(f"{self.directory}: unit {layout.name} has no {kind} state in this checkpoint")
        stored = dtype_from_name(layout.kinds[kind], where=f"{self.directory} unit {layout.name}")
        out.zero_()
        name = tensor_name(layout.name, kind)
        for rank, a, b in pieces(layout, start, end):
            values = read_range(self._reader(rank), name, a, b, where=str(self.directory / rank_tensor_file(rank)))
            if values.dtype != stored or values.numel() != b - a:
                raise CheckpointError(
                    f"{self.directory / rank_tensor_file(rank)}: {name} is {values.dtype} x {values.numel()}, "
                    f"the manifest says {stored}: the file does not match its manifest"
                )
            first = rank * layout.shard_numel + a - start
            out[first : first + (b - a)].copy_(values)
        return out

    def whole_tensors(self, rank: int, *, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor of rank `rank`'s file whose name starts with `prefix`, by the rest of its name."""
        reader = self._reader(rank)
        return {name[len(prefix) :]: reader.get_tensor(name) for name in reader.keys() if name.startswith(prefix)}

    def _reader(self, rank: int) -> Any:
        if rank not in self._open:
            name = rank_tensor_file(rank)
            verify_file(self.directory, self.manifest.file(name, directory=self.directory), algorithm=self.manifest.checksum)
            self._open[rank] = open_safetensors(self.directory / name)
        return self._open[rank]
