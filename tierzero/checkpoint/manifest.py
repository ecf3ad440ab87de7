"""What a checkpoint's manifest.json records, as typed records that read and write JSON.

[Note: checkpoint layout]
Every unit's state of one kind is, logically, one flat buffer of `numel` elements
(the unit's parameters end to end, in slot order), padded to `padded_numel` for the
world size it was written at. Rank r's file `rank-<r>.safetensors` holds the tensor
`<unit>/<kind>` = elements [r * shard_numel, (r + 1) * shard_numel) of that buffer, for
every kind but gradients (zero at a step boundary). Stages 1 and 2 replicate the
parameters; each rank still writes only its own range. What the engine does not
shard (the module's buffers and frozen parameters: its remaining `state_dict()`) is
stored whole in every rank file as `module/<name>`. Reading the same logical
elements back at any world size is then a matter of slicing the N files, which is
what resharding (and consolidation) does; padding is never read.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierzero.checkpoint.base_codes import BASE_KINDS, codec_of_kind
from tierzero.checkpoint.fields import Fields, shown
from tierzero.checkpoint.format import (
    CHECKSUM_ALGORITHMS,
    DTYPE_NAMES,
    CheckpointError,
    FileRecord,
    json_checksum,
    read_json,
)
from tierzero.common.slices import Kind
from tierzero.optim.moments import MOMENT_BLOCK

FORMAT = "tierzero-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


def rank_tensor_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_state_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def optimizer_files(rank: int) -> tuple[str, str]:
    """A torch.optim class's states of `rank`: tensors, then the rest ([Note: torch.optim states in a checkpoint])."""
    return f"optimizer-{rank:05d}.safetensors", f"optimizer-{rank:05d}.json"


def tensor_name(unit: str, kind: str) -> str:
    return f"{unit}/{kind}"


#: Prefix of the module's own state_dict entries (buffers, frozen parameters) in a rank file.
MODULE_PREFIX = "module/"

ABSMAX_SUFFIX = ".absmax"
"""Names the absmax of an int8 moment, saved beside its codes ([Note: int8 moments in a checkpoint] in moments.py)."""
MOMENTS = (Kind.EXP_AVG.value, Kind.EXP_AVG_SQ.value)


def absmax_kind(kind: str) -> str:
    return kind + ABSMAX_SUFFIX


#: The kinds a checkpoint stores (gradients are zero at a step boundary).
SAVED_KINDS = frozenset({Kind.PARAM.value, Kind.MASTER.value, *MOMENTS, *map(absmax_kind, MOMENTS), *BASE_KINDS})
_RANK_FILE = re.compile(r"rank-\d+\.(safetensors|json)")


def is_step_name(name: str) -> bool:
    """Whether `name` is a step directory's: ASCII digits only. str.isdigit() alone also takes "²", which
    int() refuses, and "٣", which no step was ever saved as."""
    return name.isascii() and name.isdigit()


_HEX8 = re.compile(r"[0-9a-f]{8}")
#: Steps and micro-steps fit an int64 wherever they are used (a tensor, a seed).
MAX_STEP = 2**62



@dataclass(frozen=True, slots=True)
class SlotLayout:
    """One parameter inside a unit's flat buffer, and every name the model knows it by."""

    names: tuple[str, ...]
    """The first is the parameter's own name; the others are tied aliases of it."""
    shape: tuple[int, ...]
    offset: int
    numel: int

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "shape": list(self.shape), "offset": self.offset, "numel": self.numel}

    @classmethod
    def from_json(cls, f: Fields) -> SlotLayout:
        slot = cls(names=f.texts("names"), shape=f.integers("shape"), offset=f.integer("offset"), numel=f.integer("numel"))
        if math.prod(slot.shape) != slot.numel:
            raise f.bad("numel", slot.numel, f"{math.prod(slot.shape)}, the size of its shape {list(slot.shape)}")
        return slot


@dataclass(frozen=True, slots=True)
class UnitLayout:
    """One unit as written: its slots, its padded length at the writing world size, its kinds' dtypes."""

    name: str
    numel: int
    padded_numel: int
    world_size: int
    slots: tuple[SlotLayout, ...]
    kinds: dict[str, str]
    """Kind value (param, master, exp_avg, ...) -> dtype name (float32, bfloat16, ...)."""

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def of_kind(self, kind: str) -> UnitLayout:
        """The logical buffer `kind` is cut from: the unit's elements, for an absmax its blocks, for a
        quantized base its pieces' bytes ([Note: a quantized base in a checkpoint] in base_codes.py)."""
        codec = codec_of_kind(kind)
        if codec is not None:
            nbytes = self.world_size * codec.piece_nbytes(self.shard_numel)
            return dataclasses.replace(self, numel=nbytes, padded_numel=nbytes, slots=())
        if not kind.endswith(ABSMAX_SUFFIX):
            return self
        blocks = -(-self.numel // MOMENT_BLOCK)
        return dataclasses.replace(self, numel=blocks, padded_numel=self.padded_numel // MOMENT_BLOCK, slots=())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "world_size": self.world_size,
            "slots": [s.to_json() for s in self.slots],
            "kinds": dict(self.kinds),
        }

    @classmethod
    def from_json(cls, f: Fields, *, world_size: int) -> UnitLayout:
        numel = f.integer("numel")
        written_at = f.integer("world_size", lo=1)
        if written_at != world_size:
            raise f.bad("world_size", written_at, f"the manifest's world size {world_size}")
        padded = f.integer("padded_numel", lo=numel)
        if padded % world_size:
            raise f.bad("padded_numel", padded, f"a multiple of the world size {world_size}")
        slots = tuple(SlotLayout.from_json(s) for s in f.objs("slots"))
        for i, slot in enumerate(slots):
            if slot.offset + slot.numel > numel:
                raise f.error(f"{f.where}slots[{i}] ends at {slot.offset + slot.numel}, past the unit's {numel} elements")
        kinds = f.mapping("kinds")
        params = [k for k in kinds if k == Kind.PARAM.value or (k in BASE_KINDS and kinds[k] == "uint8")]
        if len(params) != 1 or not all(k in SAVED_KINDS and isinstance(v, str) and v in DTYPE_NAMES for k, v in kinds.items()):
            raise f.bad("kinds", kinds, f"param and others of {sorted(SAVED_KINDS)}, each a dtype of {sorted(DTYPE_NAMES)}")
        for moment in MOMENTS:
            scales = kinds.get(absmax_kind(moment))
            if scales is not None and (kinds.get(moment) != "uint8" or scales != "float32" or (padded // world_size) % MOMENT_BLOCK):
                expected = f"float32 beside {moment} uint8 codes, in shards of whole {MOMENT_BLOCK}-element blocks"
                raise f.bad(f"kinds.{absmax_kind(moment)}", scales, expected)
        return cls(name=f.text("name"), numel=numel, padded_numel=padded, world_size=world_size, slots=slots, kinds=dict(kinds))

    def same_parameters(self, other: UnitLayout) -> bool:
        """Same slots at the same offsets: the logical buffers line up element for element."""
        return self.numel == other.numel and [(s.names[0], s.shape, s.offset) for s in self.slots] == [
            (s.names[0], s.shape, s.offset) for s in other.slots
        ]


@dataclass(frozen=True, slots=True)
class EngineScalars:
    """The engine's counters and schedules: the same on every rank."""

    global_step: int
    micro_steps: int
    lr: float
    loss_scaler: dict[str, Any]
    run_id: str | None = None
    """The run that wrote it (None: a checkpoint from before runs were named, which no run prunes)."""

    def to_json(self) -> dict[str, Any]:
        named = {} if self.run_id is None else {"run_id": self.run_id}
        return {"global_step": self.global_step, "micro_steps": self.micro_steps, "lr": self.lr, "loss_scaler": self.loss_scaler} | named

    @classmethod
    def from_json(cls, f: Fields) -> EngineScalars:
        scaler = f.obj("loss_scaler")
        return cls(
            global_step=f.integer("global_step", hi=MAX_STEP),
            micro_steps=f.integer("micro_steps", hi=MAX_STEP),
            lr=f.number("lr", lo=0.0),
            loss_scaler={key: scaler.number(key) for key in scaler.raw},
            run_id=f.run_id("run_id") if "run_id" in f.raw else None,
        )


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything about a checkpoint but the bytes; written last, so its presence means complete."""

    step: int
    world_size: int
    stage: int
    param_dtype: str
    checksum: str
    """The files' checksum algorithm: crc32c (or crc32 where crc32c is not installed)."""
    scalars: EngineScalars
    units: tuple[UnitLayout, ...]
    files: dict[str, FileRecord]
    config: dict[str, Any] = field(default_factory=dict)

    def unit(self, name: str) -> UnitLayout | None:
        return next((u for u in self.units if u.name == name), None)

    def file(self, name: str, *, directory: Path) -> FileRecord:
        record = self.files.get(name)
        if record is None:
            raise CheckpointError(f"{directory / MANIFEST} lists no file {name}: the checkpoint was written by another job")
        return record

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON, carrying a checksum of itself (no other file vouches for it)."""
        body = self._body()
        return body | {"self_checksum": json_checksum(body, algorithm=self.checksum)}

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "stage": self.stage,
            "param_dtype": self.param_dtype,
            "checksum": self.checksum,
            "engine": self.scalars.to_json(),
            "units": [u.to_json() for u in self.units],
            "files": {name: record.to_json() for name, record in sorted(self.files.items())},
            "config": self.config,
        }

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """The manifest of the checkpoint in `directory`; CheckpointError naming the file when unusable.

        Every number is checked against the others and against the files it describes
        (their names and count) before anything is allocated or read by it; shards.py checks
        each tensor file's header against it (dtypes, shapes, byte ranges) when it is opened.
        """
        path = directory / MANIFEST
        f = Fields(read_json(path), path=path)
        _check_identity(f)
        step, world_size = f.integer("step", hi=MAX_STEP), f.integer("world_size", lo=1)
        if is_step_name(directory.name) and int(directory.name) != step:
            raise f.bad("step", step, f"{int(directory.name)}, the step its directory is named by")
        manifest = cls(
            step=step,
            world_size=world_size,
            stage=f.integer("stage", lo=1, hi=3),
            param_dtype=f.text("param_dtype", choices=set(DTYPE_NAMES)),
            checksum=f.text("checksum", choices=set(CHECKSUM_ALGORITHMS)),
            files=_file_records(f, world_size=world_size),  # first: it bounds the world size by the files
            scalars=EngineScalars.from_json(f.obj("engine")),
            units=tuple(UnitLayout.from_json(u, world_size=world_size) for u in f.objs("units")),
            config=f.mapping("config") if "config" in f.raw else {},
        )
        if manifest.scalars.global_step != step:
            raise f.bad("engine.global_step", manifest.scalars.global_step, f"the manifest's step {step}")
        _check_names(f, manifest.units)
        _check_no_other_rank_files(f, directory, manifest)
        return manifest


def _check_identity(f: Fields) -> None:
    """Format, version and the manifest's checksum of itself, before any other field is believed."""
    claimed = f.raw.pop("self_checksum", None)
    if f.raw.get("format") != FORMAT:
        raise CheckpointError(f"{f.path} is not a tierzero checkpoint manifest (format {shown(f.raw.get('format'))}, expected {FORMAT!r})")
    if f.raw.get("version") != VERSION:
        raise CheckpointError(f"{f.path} has version {shown(f.raw.get('version'))}, this tierzero reads version {VERSION}: upgrade tierzero")
    algorithm = f.raw.get("checksum")
    actual = json_checksum(f.raw, algorithm=algorithm) if algorithm in CHECKSUM_ALGORITHMS else None
    if claimed is None or actual != claimed:
        raise CheckpointError(
            f"{f.path} fails its own checksum ({actual}, recorded {shown(claimed)}): it is corrupt or was edited; "
            "load an earlier checkpoint"
        )


def _file_records(f: Fields, *, world_size: int) -> dict[str, FileRecord]:
    """Exactly a tensor file and a state file per rank, and a torch.optim class's two where it has states;
    counted before any name is built."""
    raw = f.mapping("files")
    if len(raw) not in (2 * world_size, 4 * world_size):
        expected_count = f"{2 * world_size} (or {4 * world_size})"
        raise f.error(f"files lists {len(raw)} files, a checkpoint written at world size {world_size} has {expected_count}")
    per_rank = (lambda r: (rank_tensor_file(r), rank_state_file(r))) if len(raw) == 2 * world_size else (
        lambda r: (rank_tensor_file(r), rank_state_file(r), *optimizer_files(r))
    )
    expected = {name for rank in range(world_size) for name in per_rank(rank)}
    if set(raw) != expected:
        raise f.bad("files", min(set(raw) - expected), f"the rank files of world size {world_size}")
    records = {}
    for name in sorted(raw):
        record = f.obj("files").obj(name)
        checksum = record.text("checksum")
        if not _HEX8.fullmatch(checksum):
            raise record.bad("checksum", checksum, "8 lowercase hex digits")
        records[name] = FileRecord(name=name, nbytes=record.integer("bytes"), checksum=checksum)
    return records


def _check_names(f: Fields, units: tuple[UnitLayout, ...]) -> None:
    """Unit names, and parameter names over all units, each once: a consolidated file has one key per name."""
    for what, names in (("unit", [u.name for u in units]), ("parameter", [n for u in units for s in u.slots for n in s.names])):
        seen: set[str] = set()
        for name in names:
            if name in seen or name == "__metadata__":  # safetensors' own key
                raise f.error(f"{what} name {shown(name)} is listed twice or reserved")
            seen.add(name)


def _check_no_other_rank_files(f: Fields, directory: Path, manifest: Manifest) -> None:
    for entry in directory.iterdir():
        if _RANK_FILE.fullmatch(entry.name) and entry.name not in manifest.files:
            raise f.error(f"{entry.name} is in the directory, but world size {manifest.world_size} writes no such file")
