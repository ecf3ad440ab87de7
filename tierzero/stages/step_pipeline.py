"""The optimizer step where the optimizer states live: device, host, or a pipeline over NVMe.

The step tier is the device when the states live there, else the host (CPU): states
homed on the CPU tier are stepped in place by torch's fused CPU kernel, and states
homed on NVMe are read into host memory a unit at a time. Gradients living on the
device are copied into host scratch first; the new parameters go to their home tier
in the compute dtype (the stage's `publish`).

[Note: the step pipeline]
Each unit's step needs a group of slices (gradient, fp32 master, exp_avg,
exp_avg_sq). `StepPipeline.run` walks the groups in unit order and, while group j
computes, has group j+1 being read and group j-1 being written back:

    push(j+1): drain writes until only group j-1's are pending     (bounds memory)
               start reading group j+1
               wait for group j's reads, compute j, start writing j back, release j

so at most three groups are resident at once (`MAX_RESIDENT_GROUPS`). Given each group's
bytes (`sizes`), the bound is the bytes of the three largest groups instead of a count:
small groups (`precision.autocast`'s fp32 norms, a few KiB each) then fit beside the large
ones rather than each taking a large one's place, and memory never holds more than
three of the largest groups would. A caller that
knows which group comes next before it is ready (stage 3, when a unit's backward
starts) may `prepare` it: all its reads but the gradient's start then, if the bound
allows, and `push` adds the gradient; reads prepared by one pipeline can be pushed by
another (`hand_over`, `prepared=`), for a step whose scalars come later. After a group's
step each slice is written home and released, unless `hand_off` takes its copy over (the
new parameters, up to the device) or `keep_home` leaves its home unwritten (a stale
gradient). A group counts against the bound until its host copies are freed: after its
write-backs, and after the moves of the copies handed off, which read them (a move still
queued behind other transfers would otherwise keep a copy past the bound, beyond what
`tierzero estimate` counts). A group whose slices live in memory costs nothing here:
fetching a slice to its own home tier hands back the home tensor and its write-back is
a no-op, so device and CPU homes take the same path with nothing to overlap. The
arithmetic is the same on every path — the same kernel on the same fp32 values — so
where the states live changes no bit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.common.transfer import Transfer
from tierzero.store.protocol import SliceStore

__all__ = ["MAX_RESIDENT_GROUPS", "PendingWrite", "PipelineReport", "Prepared", "SliceGroup", "StepPipeline", "step_tier"]

#: Groups whose slices are in host memory at once: one read ahead, one computing, one writing
#: (with `sizes`, as many bytes as the largest three groups hold).
MAX_RESIDENT_GROUPS = 3


def step_tier(optimizer_home: Tier) -> Tier:
    """Where the optimizer step runs: on the device for device-homed states, else on the host."""
    return Tier.DEVICE if optimizer_home is Tier.DEVICE else Tier.CPU


@dataclass(frozen=True, slots=True)
class SliceGroup:
    """The slices one unit's step reads and writes back, each fetched to the tier named beside it."""

    unit: str
    fetches: tuple[tuple[Kind, Tier], ...]

    def keys(self) -> list[SliceKey]:
        return [SliceKey(self.unit, kind) for kind, _ in self.fetches]


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """A write the compute started itself (the new parameters), with the source it reads kept alive."""

    transfer: Transfer[None]
    source: torch.Tensor


@dataclass(slots=True)
class _Writing:
    """A group written back and released: done once every write, every move of a copy handed off,
    and the frees they hold back have run."""

    weight: int = 1
    """What the group counts against the pipeline's bound (`StepPipeline._weight`)."""
    done: list[threading.Event] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    transfers: list[Transfer[None]] = field(default_factory=list)

    def landed(self) -> bool:
        # Asking the transfers first lets the estimator's counting store land its writes here.
        return all(t.done() for t in self.transfers) and all(event.is_set() for event in self.done)

    def wait(self) -> None:
        """Block until the group has landed; a write that failed raises here."""
        for transfer in self.transfers:
            # Waiting on the transfer first lets a write that lands only when waited for
            # (the estimator's counting store) land now; the events follow its callbacks.
            transfer.future.exception()
        for event in self.done:
            event.wait()
        for transfer in self.transfers:
            transfer.future.result()


@dataclass(slots=True)
class PipelineReport:
    """What one run of the pipeline did."""

    groups: int = 0
    """Groups pushed."""
    peak_resident_groups: int = 0
    """Most groups holding copies (fetched, or still writing back) at once: at most
    MAX_RESIDENT_GROUPS of equal size. A group whose slices all live in the step tier holds none."""
    read_wait_s: float = 0.0
    """Seconds the compute waited for reads."""
    prepared: int = 0
    """Groups whose reads started before their push (`prepare`)."""
    unfinished: list[_Writing] = field(default_factory=list, repr=False)
    """The last groups' write-backs, still landing when `run(drain=False)` returned."""

    def wait(self) -> None:
        """Block until every write-back of the run has landed and its host copies are freed."""
        while self.unfinished:
            self.unfinished.pop(0).wait()


#: A group and the reads started for it, by kind.
Prepared = tuple[SliceGroup, dict[Kind, Transfer[torch.Tensor]]]

#: One group's compute: the fetched slices by kind in, the writes it started out.
Compute = Callable[[SliceGroup, dict[Kind, torch.Tensor]], Sequence[PendingWrite]]


class StepPipeline:
    """Reads slice groups ahead of the compute and writes them back behind it; see the module note.

    Fed one group at a time (`push`), as each becomes ready to step (stage 3 pushes a
    unit as soon as backward has finished its gradient), or all at once (`run`). A
    pushed group's reads start at once; it computes when the next group is pushed (so
    its reads overlap whatever the caller did in between) or at `flush`.
    """

    def __init__(
        self,
        store: SliceStore,
        compute: Compute,
        *,
        written: Callable[[SliceGroup], None] | None = None,
        max_resident: int = MAX_RESIDENT_GROUPS,
        prepared: Sequence[Prepared] = (),
        hand_off: Callable[[SliceKey], Transfer[torch.Tensor] | None] | None = None,
        keep_home: Callable[[SliceKey], bool] | None = None,
        sizes: Mapping[str, int] | None = None,
    ) -> None:
        """`written(group)` is told once the group's write-backs are queued: a read of its slices
        submitted after that sees the new bytes, as the swapper orders a key's operations.
        `max_resident` lowers the bound on groups held at once (a step that shares memory with a forward).
        `prepared` takes over the reads another pipeline started (its `hand_over`).
        `hand_off(key)` is offered each fetched slice of a stepped group once its write-back is
        queued: the move of the copy it took over (`SliceStore.adopt`), which is then not released
        and holds the group until it lands; None when it took nothing.
        `keep_home(key)`: the slice's home stays as it is, and its copy is released unwritten.
        `sizes`: each unit's group bytes; the bound is then the `max_resident` largest groups' bytes."""
        self._store, self._compute, self._written = store, compute, written
        self._hand_off, self._keep_home = hand_off, keep_home
        self._sizes = dict(sizes or {})
        self._largest = max(self._sizes.values(), default=1)
        self._bound = sum(sorted(self._sizes.values(), reverse=True)[:max_resident]) if self._sizes else max_resident
        self._writing: deque[_Writing] = deque()
        self._outside: dict[str, frozenset[Kind]] = {}
        """Per unit pushed, the kinds given from outside the store (`push`)."""
        self._waiting: Prepared | None = None
        self._prepared: list[Prepared] = list(prepared)
        self.report = PipelineReport(prepared=len(self._prepared))

    def is_prepared(self, group: SliceGroup) -> bool:
        return any(held == group for held, _ in self._prepared)

    def has_room(self, group: SliceGroup, *, wait: bool = False) -> bool:
        """Whether `prepare(group)` would take the group now (one more fits in the bound); `wait`:
        let the oldest write-backs land first where that makes room, as `push` would."""
        if self.is_prepared(group):
            return False
        while self._writing and (self._writing[0].landed() or (wait and not self._fits(group))):
            self._writing.popleft().wait()  # at once for a landed one (and raises a failed write)
        return self._fits(group)

    def _weight(self, group: SliceGroup) -> int:
        """What a group counts against the bound: its bytes given `sizes` (the largest group's for
        a unit it lacks), else one."""
        return self._sizes.get(group.unit, self._largest)

    def _resident(self) -> int:
        held = [self._waiting[0]] if self._waiting is not None else []
        held += [group for group, _ in self._prepared]
        return sum(job.weight for job in self._writing) + sum(map(self._weight, held))

    def _fits(self, group: SliceGroup) -> bool:
        return self._resident() + self._weight(group) <= self._bound

    def prepare(
        self, group: SliceGroup, *, given: dict[Kind, Transfer[torch.Tensor]] | None = None, leave: Kind | None = None
    ) -> None:
        """Start reading `group`'s slices but its gradient (which backward is still producing)
        ahead of its `push`, if `has_room`; never waits. `given`: slices already on their way
        to the step tier (a gather's copy moved down), which the group then holds. `leave`: a
        kind more to leave to `push` (a PARAM slice a gather has yet to read)."""
        if not self.has_room(group):
            assert not given, "a slice was handed down to a pipeline without room for it"
            return
        given = given or {}
        # Slices still held by someone (a gather's fetched copy) are left to `push`.
        kinds = tuple(
            (kind, tier)
            for kind, tier in group.fetches
            if kind not in (Kind.GRAD, leave) and kind not in given and self._store.at_home(SliceKey(group.unit, kind))
        )
        self._prepared.append((group, given | self._read(SliceGroup(unit=group.unit, fetches=kinds))))
        self.report.prepared += 1
        self._note_resident()

    def hand_over(self) -> list[Prepared]:
        """The groups prepared and not pushed, for a pipeline built later to push (`prepared=`):
        a step whose scalars are known only after backward, whose reads started during it."""
        held, self._prepared = self._prepared, []
        return held

    def drop_prepared(self, units: Collection[str]) -> None:
        """Release the reads prepared for `units`, unchanged: they step elsewhere ([Note: one host step])."""
        for held in [held for held in self._prepared if held[0].unit in units]:
            self._drop(*held)
        self._prepared = [held for held in self._prepared if held[0].unit not in units]

    def push(
        self, group: SliceGroup, *, given: dict[Kind, Transfer[Any]] | None = None, outside: frozenset[Kind] = frozenset()
    ) -> None:
        """Start reading `group` (what `prepare` did not), then compute the group pushed before it.
        `given`: slices already on their way to the step tier (a gradient handed over from memory);
        `outside`: kinds of those that are not the store's copies (nothing to write back or release)."""
        given = given or {}
        if outside:
            self._outside[group.unit] = outside
        prepared = next((reads for held, reads in self._prepared if held == group), None)
        if prepared is not None:
            self._prepared = [(held, reads) for held, reads in self._prepared if held != group]
        else:
            self._make_room(group)
            prepared = {}
        have = prepared | given
        rest = tuple((kind, tier) for kind, tier in group.fetches if kind not in have)
        reads = have | self._read(SliceGroup(unit=group.unit, fetches=rest))
        self.report.groups += 1
        previous, self._waiting = self._waiting, (group, reads)
        self._note_resident(extra=None if previous is None else previous[0])
        if previous is not None:
            self._step(*previous)

    def _note_resident(self, *, extra: SliceGroup | None = None) -> None:
        """Record the groups holding copies now (`extra`: one about to compute, besides those counted)."""
        held = [self._waiting[0]] if self._waiting is not None else []
        held += [group for group, _ in self._prepared] + ([extra] if extra is not None else [])
        resident = sum(job.weight > 0 for job in self._writing) + sum(self._weight(group) > 0 for group in held)
        self.report.peak_resident_groups = max(self.report.peak_resident_groups, resident)

    def drain(self, *, keep: int) -> None:
        """Wait until at most `keep` groups are still writing back (the oldest land first)."""
        while len(self._writing) > keep:
            self._writing.popleft().wait()

    def _make_room(self, group: SliceGroup) -> None:
        """Drain write-backs until `group` fits in the bound."""
        while self._writing and not self._fits(group):
            self._writing.popleft().wait()

    def flush(self, *, drain: bool = True) -> PipelineReport:
        """Compute the last group pushed. With `drain=False` the last write-backs may still be
        landing on return: they overlap whatever the caller does next, and `report.wait()`
        finishes them."""
        previous, self._waiting = self._waiting, None
        if previous is not None:
            self._step(*previous)
        for held in self._prepared:
            self._drop(*held)  # prepared but never pushed: its unit's gradient did not complete
        self._prepared = []
        self.report.unfinished = list(self._writing)
        self._writing.clear()
        if drain:
            self.report.wait()
        return self.report

    def abort(self) -> None:
        """After a failure: drop the groups read ahead unchanged and let every write land."""
        for held in ([self._waiting] if self._waiting else []) + self._prepared:
            self._drop(*held)
        self._waiting, self._prepared = None, []
        self.flush(drain=True)

    def _drop(self, group: SliceGroup, reads: dict[Kind, Transfer[torch.Tensor]]) -> None:
        """Release a group's fetched copies unchanged, once their reads have ended."""
        outside = self._outside.pop(group.unit, frozenset())
        for kind, transfer in reads.items():
            transfer.future.exception()
            if kind not in outside:
                self._store.release(SliceKey(group.unit, kind))

    def run(self, groups: Sequence[SliceGroup], *, drain: bool = True) -> PipelineReport:
        """Push every group in order, then flush."""
        try:
            for group in groups:
                self.push(group)
        except BaseException:
            self.abort()
            raise
        return self.flush(drain=drain)

    def _step(self, group: SliceGroup, reads: dict[Kind, Transfer[torch.Tensor]]) -> None:
        started = time.perf_counter()
        try:
            fetched = {kind: transfer.wait() for kind, transfer in reads.items()}
        finally:
            self.report.read_wait_s += time.perf_counter() - started
        writes = list(self._compute(group, fetched))
        self._writing.append(self._write_back(group, writes))
        if self._written is not None:
            self._written(group)

    def _read(self, group: SliceGroup) -> dict[Kind, Transfer[torch.Tensor]]:
        store = self._store
        return {kind: store.fetch(SliceKey(group.unit, kind), to=tier) for kind, tier in group.fetches}

    def _write_back(self, group: SliceGroup, writes: list[PendingWrite]) -> _Writing:
        store = self._store
        job = _Writing(weight=self._weight(group), sources=[w.source for w in writes])
        transfers = [w.transfer for w in writes]
        moves: list[Transfer[torch.Tensor]] = []
        outside = self._outside.pop(group.unit, frozenset())
        for key in group.keys():
            if key.kind in outside:
                continue
            if self._keep_home is not None and self._keep_home(key):
                store.release(key)
                continue
            transfer = store.write_back(key)
            moved = None if self._hand_off is None else self._hand_off(key)
            if moved is None:
                store.release(key)
            else:
                moves.append(moved)  # its old copy goes once the move has read it
            # Registered after the release's own callback, so this one fires after the free.
            transfers.append(transfer)
        job.transfers = transfers
        # A failed move is the taker's to raise (it waits for the copy); here it only has to have ended.
        for transfer in transfers + moves:
            if transfer.settled():
                continue  # the callbacks added to it ran as they were added: nothing to wait for
            event = threading.Event()
            transfer.future.add_done_callback(lambda _f, e=event: e.set())
            job.done.append(event)
        return job
