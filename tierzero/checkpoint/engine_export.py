"""A live engine's model written as a transformers directory (export.py's writer), unit by unit: `tierzero train --export`.

Every rank gathers each unit in turn and rank 0 writes it as it comes ([Note: streamed export] in
export.py); a LoRA run's export may merge its adapters into the base first ([Note: merged LoRA
export] in lora_merge.py), the same arithmetic `consolidate --hf` applies to a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.checkpoint.agree import RankFailure, on_every_rank
from tierzero.checkpoint.export import (
    DEFAULT_MAX_SHARD_SIZE,
    Exported,
    PretrainedWriter,
    check_export,
    copy_tokenizer,
    saved_name,
    tied_targets,
    write_model_files,
    written_dtype,
)
from tierzero.checkpoint.format import TensorEntry
from tierzero.checkpoint.lora_merge import MERGED_DTYPE, LoraMerge
from tierzero.checkpoint.protocol import Exportable
from tierzero.pretrained.lora import is_peft_model

__all__ = ["export_engine"]


def export_engine(
    engine: Exportable,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    merged: bool = False,
) -> Exported | None:
    """Write the engine's model as a transformers directory `out`, unit by unit; the record on rank 0.
    `merged`: a LoRA run's base with its adapters merged into it ([Note: merged LoRA export]), bf16
    unless `dtype` says, the adapters gathered first (all of them, in fp32: they are small).

    Collective: every rank gathers each unit in turn (`stage.gather_fp32`), rank 0 alone writes,
    and a failure on rank 0 is raised on every rank once all gathers are done, so none waits on
    a collective that never comes. `dtype` defaults to the training dtype; the tokenizer to the
    one `check_export` finds in the run's config. Memory on rank 0: one unit's fp32 buffer on
    the device, plus one tensor cast to `dtype` on its way to the file.
    """
    out, comm, model = Path(out), engine.comm, engine.module
    if merged and not is_peft_model(model):
        raise ValueError(f"a merged export of {out} folds LoRA adapters into their base, and this engine's model has none: "
                         "export it unmerged")
    merge = LoraMerge.of(model) if merged else None
    peft_model: Any = model  # with `merged`, a peft PeftModel: its base is the model the directory describes
    plain, written_model = (merge.plain_name, peft_model.get_base_model()) if merge else (str, model)
    dtype = dtype or (MERGED_DTYPE if merge else engine.stage.param_dtype)
    fail = _failure(out)
    wanted = None if tokenizer is None else Path(tokenizer)
    source = on_every_rank(comm, lambda: _prepare(engine, written_model, out, wanted) if comm.rank == 0 else None, fail=fail)
    targets = tied_targets(written_model)
    # Each unit with its slots and the name each is stored under (a merge's adapters in none).
    plan = [
        (unit, [(slot, saved_name([plain(b.name) for b in slot.bindings], targets)) for slot in unit.slots
                if merge is None or slot.bindings[0].name not in merge.adapters])
        for unit in engine.units
    ]  # fmt: skip
    plan = [(unit, slots) for unit, slots in plan if slots]
    module_state = {plain(n): t for n, t in model.state_dict().items()}
    entries = [TensorEntry(name, slot.numel, dtype, tuple(slot.shape)) for _, slots in plan for slot, name in slots]
    entries += [TensorEntry(n, t.numel(), written_dtype(t, dtype), tuple(t.shape)) for n, t in module_state.items()]
    adapters = _adapters(engine, merge) if merge else {}
    writer = on_every_rank(
        comm, lambda: PretrainedWriter(out, entries, max_shard_size=max_shard_size) if comm.rank == 0 else None, fail=fail
    )

    def value(slot: Any, full: torch.Tensor) -> torch.Tensor:
        adapted = merge.weights.get(slot.bindings[0].name) if merge else None
        return slot.view(full) if adapted is None else adapted.merged(slot.view(full), adapters)

    error = _stream_units(engine, plan, writer, value)

    def finish() -> Exported | None:
        if error is not None:
            raise error
        if writer is None:
            return None
        with writer:
            for name, tensor in module_state.items():
                writer.write(name, tensor)
            done = writer.finish()
        write_model_files(out, written_model, dtype=dtype)
        if source is not None:
            copy_tokenizer(source, out)
        return done

    return on_every_rank(comm, finish, fail=fail)


def _adapters(engine: Exportable, merge: LoraMerge) -> dict[str, torch.Tensor]:
    """Every adapter parameter in fp32 by the peft model's name, gathered on every rank (a collective)."""
    engine.stage.finish()  # the last step, deferred, may still be owed to the adapters
    held: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        slots = [slot for slot in unit.slots if slot.bindings[0].name in merge.adapters]
        if slots:
            full = engine.stage.gather_fp32(unit)
            held.update({slot.bindings[0].name: slot.view(full).clone() for slot in slots})
    return held


def _stream_units(
    engine: Any, plan: list[tuple[Any, list[tuple[Any, str]]]], writer: PretrainedWriter | None,
    value: Callable[[Any, torch.Tensor], torch.Tensor],
) -> Exception | None:  # fmt: skip
    """Every rank gathers every unit; rank 0 (with the writer) writes each slot's `value` from the unit's
    full buffer. Its first error, kept so that the other ranks' gathers still find a partner; anything
    else (Ctrl-C) ends it here."""
    engine.stage.finish()  # collectives still in flight write the slices about to be read
    error: Exception | None = None
    try:
        for unit, slots in plan:
            full = engine.stage.gather_fp32(unit)
            if writer is not None and error is None:
                try:
                    for slot, name in slots:
                        writer.write(name, value(slot, full))
                except Exception as exc:  # noqa: BLE001 - raised on every rank after the last gather
                    writer.abort()
                    error = exc
            del full
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return error


def _prepare(engine: Any, model: nn.Module, out: Path, tokenizer: Path | None) -> Path | None:
    source = check_export(engine.cfg.to_dict(), out, what="--export", tokenizer=tokenizer, module=model)
    out.mkdir(parents=True, exist_ok=True)
    return source


def _failure(out: Path) -> Any:
    def make(failure: RankFailure) -> Exception:
        kind = OSError if failure.errno is not None else ValueError
        return kind(f"export to {out} failed on {failure}")

    return make
