"""`tierzero bench placement`: `offload: auto` against every placement of whole kinds that fits.

The built-in GPT (30m by default) at stage 3 is trained by one engine per contender, each
with its own swap directory: `auto` (the planner's choice, tierzero/placement/planner.py)
and every placement of whole kinds (params, gradients and optimizer states each wholly on
device, cpu or nvme) whose estimate fits the same budgets. With `--device-share D
--cpu-share C` the device tier may hold 1/D and the cpu tier 1/C of the model's state
(`tiers.*.capacity`), and the prefetcher keeps at most a quarter of the device's share
fetched; without them no capacity is set and the machine's budgets apply, which on this
machine hold everything. The contenders run in rounds, a few steps each in turn, each
round starting one contender later, so that they share the machine's slow and fast
minutes. Each one is set beside auto by the median over the rounds of its steps over
auto's in the same round (and auto beside the best one likewise), which cancels the
machine's drift from round to round: on the 2-core VM the medians of two engines of nearly
the same placement came 6% apart in one run (docs/benchmarks-journal.md, session 14).

Engines also differ one from another for their whole life: two of one placement, built anew
six times, stepped 0.95-1.04x each other from build to build (docs/benchmarks-journal.md, session 21),
and in the screening above auto, built first of 28, ran 0.83-0.95x most in-memory placements
and 1.20x the fastest, which tied it in fresh pairs. So the screening only picks the
finalists: the `finalists` fastest beside auto, and the device for everything where it fits
(`offload: device`, what auto should match when all fits). In the final each is set beside
auto in `builds` fresh pairs, both engines built anew each time (auto planned anew too),
alternately first, the rest closed; the median of the builds' ratios is the figure, with its
range as the noise beside it.

The default shape, one sequence of 64 tokens, is the oversized preset's: a step whose traffic
counts beside its compute, as it does where offloading is needed at all. At 4 x 128 tokens
the 30M step's compute on the 2-core VM (0.7-0.9 s) hides every placement's disk traffic,
and the placements that fit tie within the machine's noise (session 15).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, TextIO

from tierzero.cli.bench.contenders import EngineTraining, Placement, engine_config, gpt, token_batch
from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.config import load_config
from tierzero.estimate import estimate
from tierzero.models.builtin import PRESETS, count_parameters

__all__ = ["Contender", "Final", "add_command", "bench_placement"]

EVERYTHING_ON_DEVICE = "device/device/device"


@dataclass(slots=True, kw_only=True)
class Contender:
    name: str
    config: dict[str, Any]
    training: EngineTraining | None = None
    times: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)
    """The mean step of each round."""
    label: str = ""
    predicted_s: float | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    def against(self, other: Contender) -> float:
        """This contender's steps over `other`'s, round by round: the median of the ratios."""
        return statistics.median(mine / theirs for mine, theirs in zip(self.rounds, other.rounds, strict=True))

    def fresh(self) -> Contender:
        """The same contender, not built and not yet timed."""
        return Contender(name=self.name, config=self.config, label=self.label)


@dataclass(slots=True, kw_only=True)
class Final:
    """Auto beside one finalist, each pair built anew: auto's steps over the finalist's, build by build."""

    name: str
    ratios: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def describe(self) -> str:
        return f"auto {self.ratio:.3f}x {self.name} ({self.spread()})"

    def spread(self) -> str:
        return f"builds {min(self.ratios):.3f}-{max(self.ratios):.3f}"


def bench_placement(
    *,
    nvme_path: str | Path,
    preset: str = "30m",
    device_share: int | None = None,
    cpu_share: int | None = None,
    rounds: int = 9,
    steps: int = 3,
    batch: int = 1,
    seq: int = 64,
    finalists: int = 2,
    builds: int = 5,
    out: TextIO,
) -> list[Final]:
    """Screen every contender (`rounds` x `steps` steps after one warm-up step each), then set the
    finalists beside auto in `builds` fresh pairs; the finals, the one auto fares worst against first."""
    if builds < 1 or finalists < 0:
        raise ValueError(f"bench placement needs --builds of at least 1 and --finalists of at least 0, not {builds} and {finalists}")
    base = _base_config(nvme_path, preset=preset, seq=seq, batch=batch)
    state = _state_bytes(base)
    capacities = {}
    if device_share is not None:
        capacities["device"] = {"capacity": state // device_share}
        # The prefetcher keeps up to 1 GiB of parameters fetched by default, all of a 30M model's:
        # within a quarter of the state it may keep a few units, for every contender alike.
        base["prefetch"] = {"bytes": state // device_share // 8, "max_live_bytes": state // device_share // 4}
    if cpu_share is not None:
        capacities["cpu"] = {"capacity": state // cpu_share}
    contenders = [_contender("auto", base, "auto", capacities, nvme_path)]
    for p, g, o in itertools.product(Tier, repeat=3):
        name = f"{p.value}/{g.value}/{o.value}"
        offload = Placement(name=name, params=p, gradients=g, optimizer=o).offload()
        contender = _contender(name, base, offload, capacities, nvme_path)
        if estimate(load_config(contender.config), suggest=False).fits:
            contender.label = f"params {p.value}, grads {g.value}, optimizer {o.value}"
            contenders.append(contender)
    params = count_parameters(gpt(preset))
    out.write(
        f"bench placement: GPT {preset} ({params / 1e6:.1f}M parameters, state {format_size(state)}), stage 3, "
        f"batch {batch} x {seq}; budgets: {_budget_text(capacities)}; {len(contenders) - 1} whole-kind placements fit\n"
    )
    try:
        for contender in contenders:
            contender.training = EngineTraining(preset, contender.config)
            placement = contender.training.engine.placement
            if placement is not None:
                contender.label, contender.predicted_s = placement.label, placement.prediction.step_s
            _steps(contender, 1, batch=batch, seq=seq, record=False)
        _rounds(contenders, rounds, steps=steps, batch=batch, seq=seq)
    finally:
        _close(contenders)
    _report(contenders, out=out)
    chosen = _finalists(contenders, finalists)
    out.write(f"final: auto beside each of {', '.join(c.name for c in chosen)} in {builds} fresh pairs\n")
    finals = []
    for contender in chosen:
        final = Final(name=contender.name)
        for build in range(builds):
            pair = [contenders[0].fresh(), contender.fresh()]
            pair = pair if build % 2 == 0 else pair[::-1]
            final.ratios.append(_pair(pair, preset, rounds, steps=steps, batch=batch, seq=seq))
        out.write(f"  {final.describe()}\n")
        finals.append(final)
    finals.sort(key=lambda f: f.ratio, reverse=True)
    _report_finals(finals, out=out)
    return finals


def _rounds(contenders: list[Contender], rounds: int, *, steps: int, batch: int, seq: int) -> None:
    """Each round every contender takes `steps` steps, the round starting one contender later than the last."""
    for r in range(rounds):
        for i in range(len(contenders)):
            _steps(contenders[(r + i) % len(contenders)], steps, batch=batch, seq=seq, record=True)


def _close(contenders: list[Contender]) -> None:
    for contender in contenders:
        if contender.training is not None:
            contender.training.close()
            contender.training = None


def _finalists(contenders: list[Contender], n: int) -> list[Contender]:
    """The `n` whole-kind placements that stepped fastest beside auto, and the device for everything where it fits."""
    whole = sorted(contenders[1:], key=lambda c: c.against(contenders[0]))
    return whole[:n] + [c for c in whole[n:] if c.name == EVERYTHING_ON_DEVICE]


def _pair(pair: list[Contender], preset: str, rounds: int, *, steps: int, batch: int, seq: int) -> float:
    """Build both anew in this order, warm each, step them in rounds: auto's steps over the other's."""
    try:
        for contender in pair:
            contender.training = EngineTraining(preset, contender.config)
            _steps(contender, 1, batch=batch, seq=seq, record=False)
        _rounds(pair, rounds, steps=steps, batch=batch, seq=seq)
    finally:
        _close(pair)
    auto, other = pair if pair[0].name == "auto" else pair[::-1]
    return auto.against(other)


def _base_config(nvme_path: str | Path, *, preset: str, seq: int, batch: int) -> dict[str, Any]:
    """The contenders' config; its model section is the preset's, for the estimate and the planner."""
    config = engine_config(stage=3, placement=Placement(name="base"), nvme_path=nvme_path)
    config["train"] = {"micro_batch_size": batch, "seq_len": seq}
    config["model"] = {"type": "gpt", **dataclasses.asdict(PRESETS[preset])}
    return config


def _state_bytes(base: dict[str, Any]) -> int:
    """Bytes of the model's state: parameters, gradients and optimizer states, all homed."""
    cpu = {**base, "offload": {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}}
    return estimate(load_config(cpu), suggest=False).tiers[Tier.CPU].home_total


def _contender(
    name: str, base: dict[str, Any], offload: Any, capacities: dict[str, Any], root: str | Path
) -> Contender:
    swap = Path(root) / name.replace("/", "-")
    swap.mkdir(parents=True, exist_ok=True)
    tiers = {**capacities, "nvme": {"path": str(swap)}}
    return Contender(name=name, config={**base, "offload": offload, "tiers": tiers})


def _steps(contender: Contender, n: int, *, batch: int, seq: int, record: bool) -> None:
    assert contender.training is not None
    times = []
    for step in range(n):
        tokens, targets = token_batch(step, batch=batch, seq=seq)
        began = perf_counter()
        float(contender.training.step(tokens, targets))
        times.append(perf_counter() - began)
    if record:
        contender.times += times
        contender.rounds.append(statistics.mean(times))


def _budget_text(capacities: dict[str, Any]) -> str:
    if not capacities:
        return "the machine's (no capacity set)"
    return ", ".join(f"{tier} {format_size(c['capacity'])}" for tier, c in capacities.items())


def _report(contenders: list[Contender], *, out: TextIO) -> None:
    auto = contenders[0]
    rows = [["contender", "placement", "median step", "vs auto", "predicted"]]
    for c in sorted(contenders, key=lambda c: c.against(auto)):
        predicted = "-" if c.predicted_s is None else f"{c.predicted_s:.3f} s"
        rows.append([c.name, c.label, f"{c.median_s:.3f} s", f"{c.against(auto):.3f}x", predicted])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
    whole = [c for c in contenders if c is not auto]
    if whole:
        best = max(whole, key=auto.against)
        out.write(
            f"auto {auto.median_s:.3f} s against the best whole-kind placement ({best.name}) {best.median_s:.3f} s: "
            f"{auto.against(best):.3f}x, the median of {len(auto.rounds)} rounds' ratios (screening)\n"
        )


def _report_finals(finals: list[Final], *, out: TextIO) -> None:
    """The final's verdicts: auto against the best of the finalists, and against the device for everything."""
    if not finals:
        return
    worst = finals[0]
    n = len(worst.ratios)
    out.write(
        f"auto against the best whole-kind placement in the final ({worst.name}): {worst.ratio:.3f}x, "
        f"the median of {n} fresh pairs' ratios\n"
    )
    for final in finals:
        if final.name == EVERYTHING_ON_DEVICE:
            out.write(f"auto against offload: device (everything on the device): {final.ratio:.3f}x ({final.spread()})\n")


def _command(args: argparse.Namespace) -> int:
    bench_placement(
        nvme_path=args.nvme_path, preset=args.preset, device_share=args.device_share, cpu_share=args.cpu_share,
        rounds=args.rounds, steps=args.steps, batch=args.batch, seq=args.seq, finalists=args.finalists,
        builds=args.builds, out=sys.stdout,
    )  # fmt: skip
    return 0


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench placement`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "placement", help="offload: auto beside every whole-kind placement that fits the same budgets",
        description="Stage 3 on a built-in GPT, one engine per placement, in rounds: median step of each against auto's; "
        "then the fastest, and the device for everything, beside auto again in pairs built anew.",
    )
    parser.add_argument("--nvme-path", required=True, help="directory for the contenders' swap directories")
    parser.add_argument("--preset", default="30m", help="built-in GPT size (default 30m)")
    parser.add_argument("--device-share", type=int, help="the device tier holds 1/D of the model's state")
    parser.add_argument("--cpu-share", type=int, help="the cpu tier holds 1/C of the model's state")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of steps (default 9)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each contender per round (default 3)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch (default 1, as the oversized preset)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64, as the oversized preset)")
    parser.add_argument("--finalists", type=int, default=2, help="fastest placements set beside auto again (default 2)")
    parser.add_argument("--builds", type=int, default=5, help="fresh pairs of auto and each finalist (default 5)")
    parser.set_defaults(func=_command)
