"""Reading a unit's logical flat buffer back from the N rank files of a checkpoint.

See [Note: checkpoint layout] in checkpoint/manifest.py. A reader asks for elements
[start, end) of one unit's kind; the range is cut at the writer's slice boundaries and
each piece is read (memory-mapped, not whole files) from the rank file that holds it.
Every file is verified against the manifest before its first read: its size and checksum,
then its safetensors header, read here rather than trusted to the library: every tensor's
dtype, shape and byte range within the file, and each unit's shard where the manifest
says it is. Only then does safetensors map the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierzero.checkpoint.fields import Fields
from tierzero.checkpoint.format import (
    MAX_JSON_BYTES,
    SAFETENSORS_CODES,
    CheckpointError,
    dtype_from_name,
    open_for_reading,
    open_safetensors,
    read_range,
    verify_file,
)
from tierzero.checkpoint.manifest import (
    MODULE_PREFIX,
    Manifest,
    UnitLayout,
    rank_tensor_file,
    tensor_name,
)


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


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor a safetensors file declares: its dtype, shape and bytes [begin, end) after the header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """The tensors of the safetensors file `path`, each checked against the file's length, none overlapping."""
    with open_for_reading(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 <= length <= min(size - 8, MAX_JSON_BYTES):
            raise CheckpointError(f"{path} is not a readable safetensors file (no header within its {size} bytes): it is corrupt or was replaced")
        raw = f.read(length)
    try:
        header = Fields(json.loads(raw.decode("utf-8")), path=path, where="header ")
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file (its header is not JSON: {type(exc).__name__}): it is corrupt or was replaced") from None
    data = size - 8 - length
    entries = {name: _entry(header, name, data=data) for name in header.raw if name != "__metadata__"}
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise header.error(f"tensor {name} starts at data byte {entry.begin}, expected {position}: tensors overlap or leave a gap")
        position = entry.end
    if position != data:
        raise header.error(f"its tensors end at data byte {position} of {data}")
    return entries


def _entry(header: Fields, name: str, *, data: int) -> HeaderEntry:
    f = header.obj(name)
    dtype = SAFETENSORS_CODES[f.text("dtype", choices=set(SAFETENSORS_CODES))]
    shape, offsets = f.integers("shape"), f.integers("data_offsets")
    if len(offsets) != 2 or not offsets[0] <= offsets[1] <= data:
        raise f.bad("data_offsets", list(offsets), f"[begin, end] within the file's {data} data bytes")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise f.bad("data_offsets", list(offsets), f"{math.prod(shape) * dtype.itemsize} bytes for shape {list(shape)}")
    return HeaderEntry(dtype=dtype, shape=shape, begin=offsets[0], end=offsets[1])


class ShardReader:
    """Logical ranges of a checkpoint's units, read from whichever rank files hold them."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory, self.manifest = directory, manifest
        self._open: dict[int, Any] = {}
        self._headers: dict[int, dict[str, HeaderEntry]] = {}

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
        layout = layout.of_kind(kind)  # an int8 moment's absmax: one per block
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

    def module_entries(self, rank: int) -> dict[str, HeaderEntry]:
        """The module's own tensors (buffers, frozen parameters) in rank `rank`'s file, by name, unread."""
        self._reader(rank)
        return {name[len(MODULE_PREFIX) :]: e for name, e in self._headers[rank].items() if name.startswith(MODULE_PREFIX)}

    def whole_tensors(self, rank: int, *, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor of rank `rank`'s file whose name starts with `prefix`, by the rest of its name."""
        reader = self._reader(rank)
        return {name[len(prefix) :]: reader.get_tensor(name) for name in reader.keys() if name.startswith(prefix)}

    def _reader(self, rank: int) -> Any:
        if rank not in self._open:
            name = rank_tensor_file(rank)
            verify_file(self.directory, self.manifest.file(name, directory=self.directory), algorithm=self.manifest.checksum)
            header = read_header(self.directory / name)
            self._check_header(self.directory / name, header)
            self._headers[rank] = header
            self._open[rank] = open_safetensors(self.directory / name)
        return self._open[rank]

    def _check_header(self, path: Path, header: dict[str, HeaderEntry]) -> None:
        """Each unit's shard of each kind, as the manifest describes it, and nothing the manifest does not."""
        wanted = set()
        for unit in self.manifest.units:
            for kind, dtype in unit.kinds.items():
                name = tensor_name(unit.name, kind)
                wanted.add(name)
                shard = unit.of_kind(kind).shard_numel
                entry, expected = header.get(name), (dtype_from_name(dtype, where=str(path)), (shard,))
                if entry is None or (entry.dtype, entry.shape) != expected:
                    held = "missing" if entry is None else f"{entry.dtype} of shape {list(entry.shape)}"
                    raise CheckpointError(
                        f"{path}: {name} is {held}, the manifest says {expected[0]} of shape [{shard}]: "
                        "the file does not match its manifest"
                    )
        extra = sorted(n for n in header if n not in wanted and not n.startswith(MODULE_PREFIX))
        if extra:
            raise CheckpointError(f"{path} holds {extra[0]}, which its manifest lists in no unit: the file does not match its manifest")
