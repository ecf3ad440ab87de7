"""`dpo.reference: precomputed`: the initial model's log-probs of every record, computed once before the first step.

[Note: precomputing the reference]
Before the first step the engine still holds the initial model, which is the reference. A
no-grad pass runs it over every preference record, `micro_batch_size` records a forward in
record order, and keeps each record's chosen and rejected summed log-probs (2 floats a
record, `ReferenceTable`); each training micro-batch then looks its pairs up by record number
in place of a reference forward, so full fine-tuning needs no second copy of the model (as
TRL's `precompute_ref_log_probs`). With N ranks, forward k goes to rank k mod N, so that the
batches, and so the bits, are those of one rank; every rank runs the same number of forwards,
a rank short of one running a one-record forward whose result it drops, because at stage 3 a
forward gathers each unit from every rank and a rank that stopped early would leave the others
waiting. The shares are then all-gathered, and every rank holds the whole table.

`tierzero train` keeps the table in checkpoint.dir for --resume ([Note: the reference table on
disk] in table.py); a read or write is done by rank 0 and its outcome agreed by every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar, cast

import torch

from tierzero.align.dpo import sequence_logps
from tierzero.align.step import logits_of
from tierzero.align.table import REFERENCE_FILE, ReferenceTable
from tierzero.checkpoint.format import CheckpointError
from tierzero.comm import collectives as C
from tierzero.data.preference import PreferenceBatches

__all__ = ["forwards_per_rank", "precompute_reference", "reference_for_run"]

T = TypeVar("T")


def precompute_reference(engine: Any, data: PreferenceBatches, *, is_hf: bool, device: torch.device | None = None) -> ReferenceTable:
    """Every record's reference log-probs from `engine`'s current model; see [Note: precomputing the reference].

    Collective: every rank of `data` calls it, before the first step. `device`: where the batches go (the CPU by default).
    """
    device = device or torch.device("cpu")
    count, size, rank, world = len(data.pairs), data.micro_batch_size, data.rank, data.world_size
    forwards, rounds = -(-count // size), forwards_per_rank(data)
    share = torch.zeros(rounds, size, 2, dtype=torch.float32, device=device)
    for turn in range(rounds):
        k = turn * world + rank
        records = range(k * size, min((k + 1) * size, count)) if k < forwards else range(1)
        batch = data.of_records(records)
        with torch.no_grad():
            logps = sequence_logps(logits_of(engine, batch.tokens.to(device), is_hf=is_hf), batch.targets.to(device))
        if k < forwards:
            share[turn, : len(records)] = logps.view(2, -1).T
    return ReferenceTable(logps=_gathered(share, world, engine.comm).transpose(0, 1).reshape(-1, 2)[:count].cpu(), fingerprint=data.fingerprint())


def forwards_per_rank(data: PreferenceBatches) -> int:
    """The no-grad forwards each rank runs to precompute `data`'s reference: micro_batch_size records each, ranks taking turns."""
    forwards = -(-len(data.pairs) // data.micro_batch_size)
    return -(-forwards // data.world_size)


def _gathered(share: torch.Tensor, world: int, comm: C.CommGroup) -> torch.Tensor:
    """(world, *share.shape): every rank's share, in rank order, over the engine's own group."""
    if world == 1:
        return share[None]
    gathered = torch.empty((world, *share.shape), dtype=share.dtype, device=share.device)
    C.all_gather(gathered.view(-1), share.contiguous().view(-1), comm=comm).wait()
    return gathered


def reference_for_run(
    engine: Any, cfg: Any, data: PreferenceBatches, *, resumed: bool, device: torch.device, out: TextIO | None
) -> ReferenceTable | None:
    """`tierzero train`'s precomputed reference: computed (and kept in checkpoint.dir) at a run's start, read back
    on --resume; None when the run takes no precomputed reference. Collective; `out` (rank 0's) hears what it cost."""
    if cfg.train.objective != "dpo" or cfg.dpo_reference != "precomputed":
        return None
    path = Path(cfg.checkpoint.dir) / REFERENCE_FILE if cfg.checkpoint.dir is not None else None
    if resumed:
        assert path is not None, "a resumed run has a checkpoint.dir"
        table = _on_rank0(data.rank, lambda: ReferenceTable.read(path, fingerprint=data.fingerprint(), run_id=engine.run_id))
        _say(out, f"dpo reference: the log-probs of {table.records:,} records read from {path}")
        return table
    began = time.perf_counter()
    table = precompute_reference(engine, data, is_hf=cfg.model.is_transformers, device=device)
    seconds = time.perf_counter() - began
    if path is not None:
        _on_rank0(data.rank, lambda: table.write(path, run_id=engine.run_id))
    kept = f", kept in {path}" if path is not None else ""
    ranks = f" on each of {data.world_size} ranks" if data.world_size > 1 else ""
    _say(
        out,
        f"dpo reference: the initial model's log-probs of {table.records:,} records computed in {seconds:.2f} s "
        f"({forwards_per_rank(data)} no-grad forwards{ranks}){kept}",
    )
    return table


def _on_rank0(rank: int, fn: Callable[[], T]) -> T:
    """`fn()` run by rank 0, its result or its error (OSError or ValueError) the same on every rank."""
    value, error = None, None
    if rank == 0:
        try:
            value = fn()
        except (OSError, ValueError) as exc:
            error = (isinstance(exc, OSError), str(exc))
            if not _distributed():
                raise
    if _distributed():
        box = [value, error]
        torch.distributed.broadcast_object_list(box, src=0)
        value, error = box
    if error is not None:
        raise (OSError if error[0] else CheckpointError)(error[1])
    return cast(T, value)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _say(out: TextIO | None, line: str) -> None:
    if out is not None:
        out.write(line + "\n")
