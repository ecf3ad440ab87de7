"""Atomic, sharded checkpoints of an engine: save at one world size, load at any.

Saving step S under `root`:
1. rank 0 creates `root/.tmp-S-<random>` (0700, refused if it exists); every rank
   streams its own slices into `rank-<r>.safetensors` one slice at a time (fetched from
   its tier to host memory, written, released: the whole state is never staged), and its
   RNG states into `rank-<r>.json`; each file is created new (0600, never through a
   symlink), checksummed as written and fsynced;
2. rank 0 writes `manifest.json` (layouts, dtypes, world size, config, scalars, every
   file's size and checksum), fsyncs the directory, renames it to `root/S`, fsyncs
   `root`, then replaces `root/latest` (temp file + rename) and prunes to the last K.

A crash anywhere leaves either the old set of checkpoints or the new one: a directory
is complete exactly when it is named by a step and holds a manifest, and `.tmp-*`
directories are never loaded (the next successful save deletes them). Every outcome
is agreed by all ranks, so an error on one rank (a full disk) is raised on all of them
rather than leaving the others waiting in a collective (agree.py).

Loading reads the manifest, checks every number in it against the others and against
the files (fields.py, manifest.py, shards.py), verifies the size, checksum and header of
every file it will read before using a byte of it, and writes each slice home through
the store. Which checkpoint a root holds is find.py's business. The layout
(see [Note: checkpoint layout] in checkpoint/manifest.py) lets a checkpoint written
at N ranks load at M.
"""

from __future__ import annotations

import copy
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tierzero.checkpoint.agree import (
    RankFailure,
    all_gather_objects,
    from_rank0,
    on_every_rank,
)
from tierzero.checkpoint.base_codes import check_codes, source_of_param
from tierzero.checkpoint.directory import failure_fix, prune
from tierzero.checkpoint.engine_state import (
    read_scalars,
    require_step_boundary,
    restore_scalars,
    saved_specs,
    saved_tensors,
    slice_for_reading,
    unit_layout,
    wanted_range,
)
from tierzero.checkpoint.find import (
    LATEST,
    TMP_PREFIX,
    find_checkpoint,
    list_checkpoints,
    run_of,
)
from tierzero.checkpoint.format import (
    DIR_MODE,
    CheckpointError,
    FileRecord,
    SafetensorsStream,
    TensorEntry,
    checksum_algorithm,
    dtype_from_name,
    dtype_name,
    fsync_dir,
    make_private_dir,
    read_json,
    verify_file,
    write_json,
    write_text_atomic,
)
from tierzero.checkpoint.manifest import (
    MANIFEST,
    MODULE_PREFIX,
    Manifest,
    UnitLayout,
    absmax_kind,
    rank_state_file,
    rank_tensor_file,
    tensor_name,
)
from tierzero.checkpoint.moments import check_absmax, check_state_dtype, join, packed, saved_parts
from tierzero.checkpoint.optim_state import read_optimizer_state, write_optimizer_state
from tierzero.checkpoint.protocol import Checkpointable
from tierzero.checkpoint.rng import RngState, parse_rng_state, rng_state, set_rng_state
from tierzero.checkpoint.shards import ShardReader
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.offload.disk.files import forget, on_signals
from tierzero.optim.moments import MOMENT_BLOCK
from tierzero.pretrained.lora import adapter_state, is_peft_model, write_adapters
from tierzero.stages.plan import SliceSpec
from tierzero.units.unit import Unit

#: Where a LoRA run's checkpoint keeps its adapters in peft's format.
ADAPTER_DIR = "adapter"

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]


class CheckpointWriteError(OSError):
    """A save failed on some rank; the half-written directory is gone and earlier checkpoints are untouched."""


# ---- saving ------------------------------------------------------------------------


def save_checkpoint(engine: Checkpointable, root: str | Path, *, keep: int | None = None) -> Path:
    """Write `root/<engine.global_step>` atomically, point `root/latest` at it, keep the newest `keep`.

    Collective: every rank calls it at the same step. Raises CheckpointWriteError (an
    OSError) on every rank when any rank fails; earlier checkpoints are left intact.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1 (or None to keep all), got {keep}")
    require_step_boundary(engine, action="save a checkpoint")
    root, comm, step = Path(root), engine.comm, engine.global_step
    engine.stage.finish()  # parameter all-gathers still in flight write the buffers being saved
    algorithm, fail = checksum_algorithm(), _save_failure(step, root)
    half = _HalfWritten(root / f"{TMP_PREFIX}{step}-{secrets.token_hex(4)}")  # rank 0's is the one made
    if comm.rank == 0:
        on_signals(half)  # before it exists: SIGTERM or SIGHUP mid-save leaves no half-written directory
    try:
        made = on_every_rank(comm, lambda: _make_tmp_dir(half.path) if comm.rank == 0 else None, fail=fail)
        tmp = from_rank0(comm, made)
        assert tmp is not None
        if is_peft_model(engine.module):
            # A LoRA run's adapters in peft's format too, inside the checkpoint (pruned with it).
            adapters = adapter_state(engine)
            on_every_rank(comm, lambda: write_adapters(engine.module, adapters, tmp / ADAPTER_DIR) if adapters else None, fail=fail)
        records = on_every_rank(comm, lambda: _write_rank_files(engine, tmp, algorithm=algorithm), fail=fail)
        per_rank = all_gather_objects(comm, records)
        return on_every_rank(
            comm, lambda: _publish(engine, root, tmp, per_rank, algorithm=algorithm, keep=keep), fail=fail
        )
    except CheckpointWriteError:
        if comm.rank == 0:
            half.remove()
        all_gather_objects(comm, None)  # every rank raises once the half-written directory is gone
        raise
    except BaseException:  # Ctrl-C mid-save: this process is going down, and its peers fail on their own
        if comm.rank == 0:
            half.remove()
        raise
    finally:
        forget(half)


@dataclass(frozen=True, slots=True)
class _HalfWritten:
    """A save's temporary directory, removed whole if the save does not finish."""

    path: Path

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _make_tmp_dir(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    return make_private_dir(path)


def _save_failure(step: int, root: Path) -> Callable[[RankFailure], Exception]:
    def make(failure: RankFailure) -> Exception:
        previous = list_checkpoints(root)
        kept = f"the previous checkpoint {previous[-1]} is intact and still loads" if previous else "no earlier checkpoint exists"
        return CheckpointWriteError(
            f"checkpoint of step {step} under {root} was not written ({failure}); {kept}: {failure_fix(failure.errno)}"
        )

    return make


def _load_failure(failure: RankFailure) -> CheckpointError:
    return CheckpointError(str(failure))


def _write_rank_files(engine: Checkpointable, tmp: Path, *, algorithm: str) -> list[FileRecord]:
    """This rank's slices streamed one at a time, its module's buffers and frozen parameters, its RNG states."""
    rank = engine.comm.rank
    todo = [(unit, spec) for unit in engine.units for spec in saved_specs(engine, unit)]
    parts = [[(tensor_name(unit.name, kind), numel, dtype) for kind, numel, dtype in saved_parts(spec, unit.shard_numel)] for unit, spec in todo]
    entries = [TensorEntry(*part) for of_slice in parts for part in of_slice]
    module = engine.module.state_dict()
    entries += [TensorEntry(MODULE_PREFIX + name, t.numel(), t.dtype, tuple(t.shape)) for name, t in module.items()]
    stream = SafetensorsStream(tmp / rank_tensor_file(rank), entries, algorithm=algorithm)
    try:
        for (unit, spec), of_slice in zip(todo, parts, strict=True):
            with slice_for_reading(engine, unit, spec) as tensor:
                for (name, _, _), values in zip(of_slice, saved_tensors(engine, unit, spec, tensor), strict=True):
                    stream.write(name, values)
        for name, tensor in module.items():
            stream.write(MODULE_PREFIX + name, tensor.detach())
        tensors = stream.finish()
    except BaseException:
        stream.abort()
        raise
    state = write_json(tmp / rank_state_file(rank), {"rank": rank, "rng": rng_state()}, algorithm=algorithm)
    optimizer = getattr(engine.stage, "optimizer", None)  # [Note: torch.optim states in a checkpoint]
    return [tensors, state, *write_optimizer_state(optimizer, tmp, rank=rank, algorithm=algorithm)]


def _publish(engine: Checkpointable, root: Path, tmp: Path, per_rank: list[list[FileRecord]], *, algorithm: str, keep: int | None) -> Path:
    """Rank 0: manifest, rename into place, move `latest`, prune. Other ranks only learn the path."""
    final = root / str(engine.global_step)
    if engine.comm.rank != 0:
        return final
    manifest = Manifest(
        step=engine.global_step,
        world_size=engine.comm.world_size,
        stage=engine.stage.number,
        param_dtype=dtype_name(engine.stage.param_dtype),
        checksum=algorithm,
        scalars=read_scalars(engine),
        units=tuple(unit_layout(engine, unit) for unit in engine.units),
        files={record.name: record for records in per_rank for record in records},
        config=engine.cfg.to_dict(),
    )
    write_json(tmp / MANIFEST, manifest.to_json(), algorithm=algorithm)
    fsync_dir(tmp)
    replaced = None
    if os.path.lexists(final) and run_of(final) != engine.run_id:
        raise FileExistsError(
            f"{final} already exists and is not a checkpoint of this run: it is left alone; "
            "move it away, or save into a fresh checkpoint.dir"
        )
    if os.path.lexists(final):
        # The same step saved twice (e.g. right after a resume): the new copy replaces it.
        replaced = root / f"{TMP_PREFIX}old-{final.name}-{secrets.token_hex(4)}"
        final.rename(replaced)
    tmp.rename(final)
    fsync_dir(root)
    write_text_atomic(root / LATEST, f"{final.name}\n")
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    prune(root, keep=keep, current=final, run_id=engine.run_id)
    return final



# ---- loading -----------------------------------------------------------------------


def load_checkpoint(engine: Checkpointable, path: str | Path) -> Path:
    """Load the checkpoint `path` names (or the newest complete one under it) into `engine`.

    Collective. Every file is verified before any state changes; a mismatch raises
    CheckpointError (a ValueError) naming the file on every rank. Returns the directory loaded.
    """
    require_step_boundary(engine, action="load a checkpoint")
    directory = find_checkpoint(path, note=None if engine.comm.rank == 0 else lambda _: None)
    engine.stage.finish()
    loaded = on_every_rank(engine.comm, lambda: _prepare_load(engine, directory), fail=_load_failure)
    on_every_rank(engine.comm, lambda: _write_slices(engine, loaded.reader, loaded.plan), fail=_load_failure)
    on_every_rank(engine.comm, lambda: _load_module_state(engine, loaded.reader), fail=_load_failure)
    restore_scalars(engine, loaded.reader.manifest.scalars)
    if loaded.optimizer is not None:
        getattr(engine.stage, "optimizer").load_state_dict(loaded.optimizer)
    set_rng_state(loaded.rng)
    return directory


@dataclass(frozen=True, slots=True)
class _SliceLoad:
    """One slice to fill: logical elements [start, end) of `source` in the checkpoint's unit."""

    unit: Unit
    spec: SliceSpec
    layout: UnitLayout
    source: str
    start: int
    end: int
    absmax: torch.Tensor | None = None
    """An int8 moment's absmax, read and checked before any state changes ([Note: int8 moments in a checkpoint])."""


@dataclass(frozen=True, slots=True)
class _Load:
    """A verified checkpoint, ready to write into the engine."""

    reader: ShardReader
    plan: list[_SliceLoad]
    rng: RngState
    optimizer: dict[str, Any] | None = None
    """A torch.optim class's per-unit states ([Note: torch.optim states in a checkpoint])."""


def _prepare_load(engine: Checkpointable, directory: Path) -> _Load:
    manifest = Manifest.read(directory)
    reader = ShardReader(directory, manifest)
    plan = []
    for unit in engine.units:
        layout = manifest.unit(unit.name)
        mine = unit_layout(engine, unit)
        if layout is None or not layout.same_parameters(mine):
            raise CheckpointError(
                f"{directory / MANIFEST}: unit {unit.name} "
                + ("is missing" if layout is None else "holds other parameters than this model's")
                + ": load a checkpoint of the same model (and zero.unit_classes)"
            )
        for spec in saved_specs(engine, unit):
            start, end = wanted_range(engine, unit, spec)
            base = None if spec.kind is not Kind.PARAM else source_of_param(
                spec.codec, layout.kinds, unit=unit.name, world_size=engine.comm.world_size,
                saved_at=manifest.world_size, path=directory / MANIFEST,
            )  # fmt: skip
            source = base or _source_kind(spec.kind, layout, directory=directory)
            if spec.kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ):
                check_state_dtype(spec, layout, directory=directory)
            plan.append(_SliceLoad(unit=unit, spec=spec, layout=layout, source=source, start=start, end=end))
    # The files of the ranges this rank reads, and the one it takes buffers and frozen parameters from.
    needed = {rank for s in plan for rank in reader.files_for(s.layout, s.start, s.end)}
    reader.verify(needed | {engine.comm.rank % manifest.world_size})
    plan = [_with_absmax(s, reader) if packed(s.spec) else s for s in plan]
    for s in plan:
        if s.spec.codec is not None:
            _check_base(s, reader)
    _check_module_state(engine, reader)
    _check_loss_scaler(engine, directory, manifest)
    optimizer = read_optimizer_state(
        getattr(engine.stage, "optimizer", None), directory, manifest, rank=engine.comm.rank, world_size=engine.comm.world_size
    )
    return _Load(reader=reader, plan=plan, rng=_read_rng(engine, directory, manifest), optimizer=optimizer)


def _check_module_state(engine: Checkpointable, reader: ShardReader) -> None:
    """Buffers and frozen parameters of this model's names and sizes, before any state changes."""
    expected = engine.module.state_dict()
    if not expected:
        return
    source = engine.comm.rank % reader.manifest.world_size
    stored, path = reader.module_entries(source), reader.directory / rank_tensor_file(source)
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise CheckpointError(
            f"{path} has no {missing[0]} (of {len(missing)} missing module "
            "buffers or frozen parameters): load a checkpoint of the same model"
        )
    for name, tensor in expected.items():
        if stored[name].shape != tuple(tensor.shape):
            raise CheckpointError(
                f"{path}: {MODULE_PREFIX}{name} has shape {list(stored[name].shape)}, this model's {list(tensor.shape)}: "
                "load a checkpoint of the same model"
            )


def _check_loss_scaler(engine: Checkpointable, directory: Path, manifest: Manifest) -> None:
    """The saved scaler state, tried on a copy of the engine's scaler: refused here, not halfway through the load."""
    try:
        copy.deepcopy(engine.loss_scaler).load_state_dict(manifest.scalars.loss_scaler)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{directory / MANIFEST}: engine.loss_scaler does not fit this run ({exc})") from None


def _write_slices(engine: Checkpointable, reader: ShardReader, plan: list[_SliceLoad]) -> None:
    """Each slice in turn: read its range on the host, cast, write it home."""
    for s in plan:
        stored = torch.empty(s.end - s.start, dtype=dtype_from_name(s.layout.kinds[s.source], where=str(reader.directory)))
        value = reader.read(s.layout, s.source, s.start, s.end, out=stored).to(s.spec.dtype)
        if s.absmax is not None:
            value = join(value, s.absmax, kind=s.spec.kind, padding=max(s.end - max(s.layout.numel, s.start), 0))
        if s.spec.home is Tier.DEVICE:
            value = value.to(engine.stage.device)
        engine.store.write_back(SliceKey(s.unit.name, s.spec.kind), value.contiguous()).wait()


def _with_absmax(s: _SliceLoad, reader: ShardReader) -> _SliceLoad:
    """`s` with its int8 moment's absmax (its range's blocks: a shard is whole blocks), read from the verified files and checked."""
    kind = absmax_kind(s.source)
    first, last = s.start // MOMENT_BLOCK, s.end // MOMENT_BLOCK
    absmax = reader.read(s.layout, kind, first, last, out=torch.empty(last - first, dtype=torch.float32))
    check_absmax(absmax, unit=s.unit.name, kind=s.source, path=reader.directory)
    return replace(s, absmax=absmax)


def _check_base(s: _SliceLoad, reader: ShardReader) -> None:
    """Every scale of a quantized base's range finite and >= 0, read from the verified files, before any state changes."""
    assert s.spec.codec is not None
    stored = reader.read(s.layout, s.source, s.start, s.end, out=torch.empty(s.end - s.start, dtype=torch.uint8))
    pieces = s.spec.parameters // s.unit.shard_numel
    check_codes(s.spec.codec, stored, numel=s.spec.parameters, pieces=pieces, unit=s.unit.name, path=reader.directory)


def _load_module_state(engine: Checkpointable, reader: ShardReader) -> None:
    """Buffers and frozen parameters, from this rank's file (or, at a larger world size, rank r % N's); checked before."""
    expected = engine.module.state_dict()
    if not expected:
        return
    values = reader.whole_tensors(engine.comm.rank % reader.manifest.world_size, prefix=MODULE_PREFIX)
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(values[name])


def _read_rng(engine: Checkpointable, directory: Path, manifest: Manifest) -> RngState:
    # At another world size the ranks beyond the writer's reuse its ranks' generators.
    name = rank_state_file(engine.comm.rank % manifest.world_size)
    verify_file(directory, manifest.file(name, directory=directory), algorithm=manifest.checksum)
    rng = read_json(directory / name).get("rng")
    if not isinstance(rng, dict) or not {"torch", "numpy", "python"} <= set(rng):
        raise CheckpointError(f"{directory / name} holds no RNG state: it is corrupt or was edited")
    return parse_rng_state(rng, path=directory / name)


def _source_kind(kind: Kind, layout: UnitLayout, *, directory: Path) -> str:
    """Which stored kind fills `kind`: fp32 masters fill both PARAM and MASTER when present.

    In mixed precision the stored PARAM is the master cast down, so reading the master
    and casting gives the same bits, and a fp32 run resumed in bf16 (or back) works too.
    """
    if kind in (Kind.PARAM, Kind.MASTER):
        return Kind.MASTER.value if Kind.MASTER.value in layout.kinds else Kind.PARAM.value
    if kind.value not in layout.kinds:
        raise CheckpointError(
            f"{directory / MANIFEST}: unit {layout.name} has no {kind.value} state (it holds {sorted(layout.kinds)}): "
            "resume with the optimizer the checkpoint was trained with"
        )
    return kind.value

