"""`tierzero bench placement` sets each contender beside auto round by round, then the finalists in fresh pairs."""

from __future__ import annotations

import io
from typing import Any

import pytest

import tierzero.cli.bench.placement as P
from tierzero.cli.bench.placement import EVERYTHING_ON_DEVICE, Contender, Final, _finalists, _report, _report_finals


def _contender(name: str, rounds: list[float]) -> Contender:
    """A contender that took one step a round."""
    return Contender(name=name, config={}, times=list(rounds), rounds=list(rounds), label=name)


def test_each_contender_is_set_beside_auto_round_by_round() -> None:
    """`drifted` was 5% faster than auto in two rounds and 10% slower in three, when the machine
    ran at half speed: its median step (1.9 s) is under auto's (2.0 s), but round by round it is
    1.1x auto. `tie` steps as auto does. The best whole-kind placement is `tie`, and auto ties."""
    auto = _contender("auto", [2.0, 2.0, 2.0, 1.0, 1.0])
    drifted = _contender("drifted", [1.9, 1.9, 2.2, 1.1, 1.1])
    tie = _contender("tie", [2.0, 2.0, 2.0, 1.0, 1.0])
    assert drifted.median_s < auto.median_s
    assert drifted.against(auto) == pytest.approx(1.1) and auto.against(drifted) == pytest.approx(1 / 1.1)
    out = io.StringIO()
    _report([auto, drifted, tie], out=out)
    lines = out.getvalue().splitlines()
    assert lines[-2].split()[:4] == ["drifted", "drifted", "1.900", "s"] and lines[-2].split()[4] == "1.100x"
    assert lines[-1] == (
        "auto 2.000 s against the best whole-kind placement (tie) 2.000 s: 1.000x, the median of 5 rounds' ratios (screening)"
    )


def test_the_finalists_are_the_fastest_beside_auto_and_the_device_for_everything() -> None:
    auto = _contender("auto", [1.0, 1.0, 1.0])
    slow, fast, fastest = _contender("slow", [1.3] * 3), _contender("fast", [0.9] * 3), _contender("fastest", [0.8] * 3)
    device = _contender(EVERYTHING_ON_DEVICE, [1.1] * 3)
    contenders = [auto, slow, device, fast, fastest]
    assert [c.name for c in _finalists(contenders, 2)] == ["fastest", "fast", EVERYTHING_ON_DEVICE]
    assert [c.name for c in _finalists(contenders, 3)] == ["fastest", "fast", EVERYTHING_ON_DEVICE]  # not twice
    assert [c.name for c in _finalists([auto, slow, fast], 1)] == ["fast"]  # where the device cannot hold it all


class _Clock:
    """perf_counter for the bench: each step moves it on by its contender's step time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_pair_is_built_anew_and_gives_auto_over_the_other_whatever_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, built, closed = _Clock(), [], []
    step_s = {"auto": 0.9, "other": 1.2}

    class Training:
        def __init__(self, preset: str, config: dict[str, Any]) -> None:
            self.name = config["name"]
            built.append(self.name)

        def step(self, tokens: Any, targets: Any) -> float:
            clock.now += step_s[self.name]
            return 0.0

        def close(self) -> None:
            closed.append(self.name)

    monkeypatch.setattr(P, "EngineTraining", Training)
    monkeypatch.setattr(P, "perf_counter", clock)
    auto, other = Contender(name="auto", config={"name": "auto"}), Contender(name="other", config={"name": "other"})
    for pair in ([auto.fresh(), other.fresh()], [other.fresh(), auto.fresh()]):
        built.clear(), closed.clear()
        assert P._pair(pair, "30m", 3, steps=2, batch=1, seq=8) == pytest.approx(0.9 / 1.2)
        assert built == [c.name for c in pair] and sorted(closed) == ["auto", "other"]
        assert all(c.training is None and len(c.times) == 6 for c in pair)  # warm-up step not timed
    assert auto.times == [] and other.times == []  # the screening's contenders are left as they were


def test_the_final_reports_auto_against_the_finalist_it_fares_worst_against_and_the_device() -> None:
    finals = [Final(name="cpu/nvme/device", ratios=[0.97, 1.02, 0.99]), Final(name=EVERYTHING_ON_DEVICE, ratios=[1.04, 0.95, 1.0])]
    assert finals[0].ratio == 0.99 and finals[1].ratio == 1.0
    out = io.StringIO()
    _report_finals(sorted(finals, key=lambda f: f.ratio, reverse=True), out=out)
    assert out.getvalue().splitlines() == [
        f"auto against the best whole-kind placement in the final ({EVERYTHING_ON_DEVICE}): 1.000x, the median of 3 fresh pairs' ratios",
        "auto against offload: device (everything on the device): 1.000x (builds 0.950-1.040)",
    ]


@pytest.mark.parametrize(("builds", "finalists"), [(0, 2), (5, -1)])
def test_a_final_without_pairs_is_refused_before_anything_is_built(builds: int, finalists: int) -> None:
    with pytest.raises(ValueError, match=rf"--builds of at least 1 and --finalists of at least 0, not {builds} and {finalists}"):
        P.bench_placement(nvme_path="/nonexistent", builds=builds, finalists=finalists, out=io.StringIO())
