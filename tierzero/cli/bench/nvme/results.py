"""What `bench nvme` measures at each sweep point: GB/s of the repeats, beside fio's.

Apart from the sweep (`nvme/__init__.py`) and the report (`report.py`), so both can import them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tierzero.cli.bench.workload import Direction, SweepPoint


@dataclass(slots=True, kw_only=True)
class Runs:
    """GB/s of the repeats of one direction at one point, and of the fio runs beside them."""

    direction: Direction
    gbps: list[float] = field(default_factory=list)
    fio_gbps: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.gbps)

    @property
    def fio_median(self) -> float | None:
        return statistics.median(self.fio_gbps) if self.fio_gbps else None

    @property
    def vs_fio(self) -> float | None:
        if not self.fio_gbps:
            return None
        return statistics.median(mine / fio for mine, fio in zip(self.gbps, self.fio_gbps))


@dataclass(slots=True, kw_only=True)
class PointResult:
    point: SweepPoint
    write: Runs = field(default_factory=lambda: Runs(direction=Direction.WRITE))
    read: Runs = field(default_factory=lambda: Runs(direction=Direction.READ))

    def runs(self, direction: Direction) -> Runs:
        return self.write if direction is Direction.WRITE else self.read

    @property
    def score(self) -> float:
        """Geometric mean of read and write medians: the best point is good at both."""
        return (self.read.median * self.write.median) ** 0.5
