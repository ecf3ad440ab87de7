"""What one `tierzero train` call did: steps, losses, throughput, memory per tier, NVMe traffic."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tierzero.common.sizes import format_size
from tierzero.offload.disk.busy import Busy

__all__ = ["TIERS", "PartClock", "RunSummary"]

TIERS = ("device", "cpu", "nvme")


@dataclass(slots=True, kw_only=True)
class RunSummary:
    """What one `train` call did; `format()` is the table printed at the end."""

    steps: int = 0
    planned_steps: int = 0
    losses: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    """train.objective dpo: each step's mean reward margin, beta x (chosen - rejected log-ratio); else empty."""
    accuracies: list[float] = field(default_factory=list)
    """train.objective dpo: each step's share of pairs with a positive margin; else empty."""
    lrs: list[float] = field(default_factory=list)
    """The learning rate each step ran at (`engine.lr` before it)."""
    tokens: int = 0
    """Tokens trained on, over all ranks."""
    seconds: float = 0.0
    """Wall time of the steps (set-up excluded)."""
    parameters: int = 0
    state_bytes: int = 0
    """Model-state bytes per rank (params, grads, master, Adam states) from the engine's accounting."""
    peak_tier_bytes: dict[str, int] = field(default_factory=dict)
    tier_capacity: dict[str, int | None] = field(default_factory=dict)
    peak_rss: int = 0
    io_wait_s: float | None = None
    interrupted: bool = False
    step_seconds: list[float] = field(default_factory=list)
    nvme_steps: list[tuple[int, int]] = field(default_factory=list)
    """Bytes of NVMe-homed state each step read and wrote (this rank)."""
    nvme_cache: int = 0
    """Bytes of NVMe-homed slices held in host memory at the end (tiers.nvme.cache)."""
    predicted_step_s: float | None = None
    """The step time the placement planner predicted (`offload: auto`), set beside the measured one."""
    predicted_parts: dict[str, float] = field(default_factory=dict)
    """The planner's prediction of each part of the step (forward, backward, step), by name."""
    part_seconds: list[dict[str, float]] = field(default_factory=list)
    """Each step's seconds in each part (`PartClock`), where `predicted_parts` are set."""
    nvme_busy: Busy | None = None
    """The NVMe tier's moves in the steps after the first, and the time they were in flight."""
    linear_gradients: str | None = None
    """Where the linear layers' gradients ran (`kernels.chosen_text`), with the onednn kernel."""
    complete_at: int | None = None
    """A resumed run whose checkpoint had done train.steps already: the step it was at. Nothing ran,
    and nothing is summarised."""

    def note_preference(self, stats: Any) -> float:
        """Keep a DPO step's margin and accuracy (`tierzero.align.DpoStats`); its loss, for the loop to keep as any loss."""
        self.margins.append(stats.margin)
        self.accuracies.append(stats.accuracy)
        return stats.loss

    def preference_text(self) -> str:
        """The last DPO step's margin and accuracy for the log line; "" for a next-token run."""
        return f"margin={self.margins[-1]:.4f} acc={self.accuracies[-1]:.2f}" if self.margins else ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        first = f"{self.losses[0]:.4f}" if self.losses else "-"
        last = f"{self.losses[-1]:.4f}" if self.losses else "-"
        rows = [
            ("steps", f"{self.steps} of {self.planned_steps}" + (" (interrupted)" if self.interrupted else "")),
            ("loss first -> last", f"{first} -> {last}"),
            *self._preference_rows(),
            ("tokens/s", f"{self.tokens_per_s:,.0f}"),
            ("time", f"{self.seconds:.1f} s"),
            ("parameters", f"{self.parameters:,}"),
            ("training state", format_size(self.state_bytes) + self._state_ratio()),
            ("peak RSS", format_size(self.peak_rss)),
        ]
        if self.io_wait_s is not None:
            rows.append(("I/O wait", f"{self.io_wait_s:.2f} s"))
        if self.nvme_steps and (any(self.nvme_steps[-1]) or self.nvme_cache):
            read, written = self.nvme_steps[-1]
            rows.append(("last step", f"{self.step_seconds[-1]:.1f} s, NVMe read {format_size(read)}, written {format_size(written)}"))
        if self.nvme_busy is not None and self.nvme_busy.any_s > 0:
            rows.append(("disk busy", self._disk_busy(self.nvme_busy)))
        if self.predicted_step_s is not None and len(self.step_seconds) >= 2:
            rows.append(("planned step", self._against_prediction(self.predicted_step_s)))
            if self.predicted_parts and len(self.part_seconds) >= 2:
                rows.append(("by part", self._parts_against_prediction()))
        if self.linear_gradients:
            rows.append(("linear gradients", self.linear_gradients))
        if self.nvme_cache:
            rows.append(("NVMe cache", f"{format_size(self.nvme_cache)} of NVMe-homed slices in host memory"))
        lines = ["", "tierzero train summary", *(f"  {k:<20} {v}" for k, v in rows)]
        lines += ["", f"  {'tier':<8} {'peak':>12} {'capacity':>12}"]
        for tier in TIERS:
            if tier in self.peak_tier_bytes:
                capacity = self.tier_capacity.get(tier)
                shown = format_size(capacity) if capacity is not None else "unbounded"
                lines.append(f"  {tier:<8} {format_size(self.peak_tier_bytes[tier]):>12} {shown:>12}")
        return "\n".join(lines) + "\n"

    def _preference_rows(self) -> list[tuple[str, str]]:
        if not self.margins:
            return []
        return [("reward margin", f"{self.margins[0]:.4f} -> {self.margins[-1]:.4f}, accuracy {self.accuracies[-1]:.2f} at the last step")]

    def _against_prediction(self, predicted: float) -> str:
        """The plan's step beside the measured one (the median of the steps after the first, which
        learns the units' order), and how far the prediction is from it, a share of the measured."""
        measured = statistics.median(self.step_seconds[1:])
        off = (predicted - measured) / measured
        return f"predicted {predicted:.2f} s, measured {measured:.2f} s after the first step (prediction {off:+.0%})"

    def _parts_against_prediction(self) -> str:
        """Each part's predicted seconds beside its measured ones (the median of the steps after the
        first): where a prediction that misses misses."""
        shown = []
        for part, predicted in self.predicted_parts.items():
            measured = statistics.median(seconds.get(part, 0.0) for seconds in self.part_seconds[1:])
            shown.append(f"{part} {predicted:.2f} s predicted, {measured:.2f} s measured")
        return "; ".join(shown)

    @property
    def after_first(self) -> tuple[int, float]:
        """The steps after the first (those `nvme_busy` covers) and their seconds in all."""
        return len(self.step_seconds) - 1, sum(self.step_seconds[1:])

    def _disk_busy(self, busy: Busy) -> str:
        """Seconds a step the disk moved bytes, after the first step, and the rates that makes."""
        steps, seconds = self.after_first
        text = f"{busy.any_s / steps:.2f} s a step after the first, of {seconds / steps:.2f} s"
        rates = busy.rates()
        if rates is None:
            return text
        return f"{text}: {rates[0] / 1e9:.2f} GB/s read, {rates[1] / 1e9:.2f} GB/s write as the planner counts them"

    def _state_ratio(self) -> str:
        capacity = self.tier_capacity.get("device")
        return f" ({self.state_bytes / capacity:.1f}x the device capacity)" if capacity else ""


class PartClock:
    """Seconds of each part of a step (`micro_step`'s marks: forward, backward, step), summed over
    its micro-steps. On a GPU the marks are events on the compute stream, read once the step has
    synchronized, so that timing adds no wait; on the host, the wall clock."""

    def __init__(self, *, cuda: bool) -> None:
        self._cuda = cuda
        self._marks: list[tuple[str, object]] = []

    def mark(self, part: str) -> None:
        """`part` begins now; "" ends the part under way (the end of a micro-step)."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((part, event))
        else:
            self._marks.append((part, time.perf_counter()))

    def step_done(self) -> dict[str, float]:
        """The seconds of each part since the last call, by name; call it after the step synchronized."""
        seconds: dict[str, float] = {}
        for (part, began), (_, ended) in zip(self._marks, self._marks[1:]):
            if part:
                took = began.elapsed_time(ended) / 1e3 if self._cuda else ended - began
                seconds[part] = seconds.get(part, 0.0) + took
        self._marks.clear()
        return seconds
