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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierzero.checkpoint.format import CheckpointError, FileRecord, json_checksum, read_json

FORMAT = "tierzero-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


def rank_tensor_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_state_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def tensor_name(unit: str, kind: str) -> str:
    return f"{unit}/{kind}"


#: Prefix of the module's own state_dict entries (buffers, frozen parameters) in a rank file.
MODULE_PREFIX = "module/"


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
    def from_json(cls, raw: dict[str, Any]) -> SlotLayout:
        return cls(names=tuple(raw["names"]), shape=tuple(int(d) for d in raw["shape"]), offset=int(raw["offset"]), numel=int(raw["numel"]))


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
    def from_json(cls, raw: dict[str, Any]) -> UnitLayout:
        return cls(
            name=str(raw["name"]),
            numel=int(raw["numel"]),
            padded_numel=int(raw["padded_numel"]),
            world_size=int(raw["world_size"]),
            slots=tuple(SlotLayout.from_json(s) for s in raw["slots"]),
            kinds={str(k): str(v) for k, v in raw["kinds"].items()},
        )

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

    def to_json(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "micro_steps": self.micro_steps, "lr": self.lr, "loss_scaler": self.loss_scaler}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> EngineScalars:
        return cls(
            global_step=int(raw["global_step"]),
            micro_steps=int(raw["micro_steps"]),
            lr=float(raw["lr"]),
            loss_scaler=dict(raw["loss_scaler"]),
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
        """The manifest of the checkpoint in `directory`; CheckpointError naming the file when unusable."""
        path = directory / MANIFEST
        raw = read_json(path)
        claimed = raw.pop("self_checksum", None)
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a tierzero checkpoint manifest (format {raw.get('format')!r}, expected {FORMAT!r})")
        if raw.get("version") != VERSION:
            raise CheckpointError(f"{path} has version {raw.get('version')!r}, this tierzero reads version {VERSION}: upgrade tierzero")
        try:
            actual = json_checksum(raw, algorithm=str(raw["checksum"]))
        except KeyError:
            actual = None
        if claimed is None or actual != claimed:
            raise CheckpointError(
                f"{path} fails its own checksum ({actual}, recorded {claimed}): it is corrupt or was edited; "
                "load an earlier checkpoint"
            )
        try:
            return cls(
                step=int(raw["step"]),
                world_size=int(raw["world_size"]),
                stage=int(raw["stage"]),
                param_dtype=str(raw["param_dtype"]),
                checksum=str(raw["checksum"]),
                scalars=EngineScalars.from_json(raw["engine"]),
                units=tuple(UnitLayout.from_json(u) for u in raw["units"]),
                files={
                    str(name): FileRecord(name=str(name), nbytes=int(r["bytes"]), checksum=str(r["checksum"]))
                    for name, r in raw["files"].items()
                },
                config=dict(raw.get("config", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{path} is malformed ({type(exc).__name__}: {exc}): it is corrupt or was edited") from None
