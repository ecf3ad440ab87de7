"""`tierzero bench placement` sets each contender beside auto round by round."""

from __future__ import annotations

import io

import pytest

from tierzero.bench.placement import Contender, _report


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
        "auto 2.000 s against the best whole-kind placement (tie) 2.000 s: 1.000x, the median of 5 rounds' ratios"
    )
