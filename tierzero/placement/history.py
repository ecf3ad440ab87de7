"""Measurements of this machine kept across runs: each key's of the last day, and their medians.

A shared VM's disk and cores change speed from minute to minute (docs/benchmarks-journal.md, sessions
14-17), so one measurement samples one moment of them. The planner keeps what it measures, the
disk's rates per directory and I/O setting (placement/disk.py) and a block's compute rate per
shape and disk (placement/compute.py), for `HISTORY_S`, the newest `HISTORY_SAMPLES`, and
plans with their medians. When the machine changes speed for good (a slow afternoon after a
fast morning: the 2B block read 97-109 GFLOP/s against 137, the disk 2.2-2.5 GB/s against
2.7-2.9, and the first plan of the afternoon, on the day's medians, missed by 25%), its newest
`CONFIRM` measurements all lie more than `SHIFT` off the median of those before them, on one
side: the earlier ones are dropped (`since_shift`), and the medians are the new ones'. One
measurement that far off alone is taken for noise. Each kind lives in a JSON file of its own under
`$TIERZERO_CACHE_DIR` (default `~/.cache/tierzero`); a file, an entry or a sample that cannot
be read is ignored and rewritten, never trusted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from tierzero.common.cache_files import cache_path, read_json, write_json

__all__ = [
    "CONFIRM", "HISTORY_S", "HISTORY_SAMPLES", "SHIFT", "Sample", "kept", "medians", "off_median", "remember",
    "samples", "since_shift", "span_text",
]  # fmt: skip

#: Seconds a measurement counts for in its key's medians, and how many of them are kept: a disk
#: whose rate moves 15% within minutes is known better by a day of its measurements than by its last.
HISTORY_S = 86400.0
HISTORY_SAMPLES = 12
#: How far off the median of the earlier measurements, in one figure, the newest `CONFIRM` must all
#: lie, on one side, for the machine to count as changed: above the 15% a disk moves within minutes.
SHIFT = 0.15
CONFIRM = 2


@dataclass(frozen=True, slots=True)
class Sample:
    """One measurement, as the cache keeps it: its figures (each > 0), what took it and when."""

    values: dict[str, float]
    how: str
    measured: float
    """Seconds since the epoch."""

    def to_json(self) -> dict[str, object]:
        return {**self.values, "how": self.how, "measured": self.measured}


def samples(entry: object, fields: tuple[str, ...]) -> list[Sample]:
    """The well-formed measurements of an entry's `samples` (every one of `fields` a positive
    number), oldest first; none from an entry that is not one."""
    listed = entry.get("samples") if isinstance(entry, dict) else None
    good = []
    for item in listed if isinstance(listed, list) else []:
        try:
            values = {name: float(item[name]) for name in fields}
            sample = Sample(values, str(item["how"]), float(item["measured"]))
        except (TypeError, KeyError, ValueError):
            continue
        if all(value > 0 for value in values.values()):
            good.append(sample)
    return sorted(good, key=lambda sample: sample.measured)


def kept(entry: object, fields: tuple[str, ...], new: Sample) -> list[Sample]:
    """An entry's measurements of the `HISTORY_S` before `new` and `new`, the newest
    `HISTORY_SAMPLES` of them, oldest first: from the change, if they show one (`since_shift`)."""
    earlier = [s for s in samples(entry, fields) if new.measured - HISTORY_S <= s.measured <= new.measured]
    return since_shift([*earlier, new], fields)[-HISTORY_SAMPLES:]


def _off(sample: Sample, before: list[Sample], name: str) -> float:
    """`sample`'s figure `name` over its median in `before`, less one: +0.2 for 20% above."""
    return sample.values[name] / statistics.median(s.values[name] for s in before) - 1.0


def off_median(measured: list[Sample], fields: tuple[str, ...]) -> bool:
    """Whether the newest of `measured` lies more than `SHIFT` off the median of those before it (at
    least `CONFIRM`) in one of `fields`: noise, or the first sign of a change that a next
    measurement would confirm (`since_shift`)."""
    return len(measured) > CONFIRM and any(abs(_off(measured[-1], measured[:-1], name)) > SHIFT for name in fields)


def since_shift(measured: list[Sample], fields: tuple[str, ...]) -> list[Sample]:
    """`measured` (oldest first), or its newest `CONFIRM` alone when each of them lies more than
    `SHIFT` off the median of the (at least `CONFIRM`) before them, on one side, in one of `fields`."""
    before, newest = measured[:-CONFIRM], measured[-CONFIRM:]
    if len(before) < CONFIRM:  # too few to tell which side is the odd one
        return measured
    for name in fields:
        offs = [_off(sample, before, name) for sample in newest]
        if all(off > SHIFT for off in offs) or all(off < -SHIFT for off in offs):
            return newest
    return measured


def remember(name: str, key: str, values: dict[str, float], *, how: str) -> list[Sample]:
    """Add a measurement of `values` (each > 0), taken by `how`, to `key`'s in the cache file `name`;
    the measurements its medians are now taken over (`kept`). Keys with none of the last
    `HISTORY_S` are dropped from the file."""
    path, new = cache_path(name), Sample(values, how, time.time())
    cache = {k: entry for k, entry in read_json(path).items() if len(kept(entry, (), new)) > 1}
    measured = kept(cache.get(key), tuple(values), new)
    cache[key] = {"samples": [sample.to_json() for sample in measured]}
    write_json(path, cache)
    return measured


def medians(measured: list[Sample]) -> dict[str, float]:
    """Each figure's median over `measured` (not empty)."""
    return {name: statistics.median(s.values[name] for s in measured) for name in measured[-1].values}


def span_text(measured: list[Sample], what: str) -> str:
    """E.g. 'the median of 5 measurements since 2026-12-02 20:35 UTC, the last a probe ...,
    2026-12-02 21:57 UTC', or the one measurement's `how` and time, `what` after `how`."""
    newest = measured[-1]
    text = f"{newest.how}{what}, {_stamp(newest.measured)}"
    if len(measured) == 1:
        return text
    return f"the median of {len(measured)} measurements since {_stamp(measured[0].measured)}, the last a {text}"


def _stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
