"""Every number the CLI takes is bounded and checked before any work: a huge `estimate --world-size`
ran for a quarter of an hour, `--flops nan` was taken as a rate. Each is refused in one line naming
the flag and the bound, exit 2; nothing is read or built first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tierzero.cli.estimate as E
import tierzero.cli.train as T
from tierzero.cli.main import main

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")


@pytest.fixture(autouse=True)
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag that is let through reaches the config: fail there instead of running the work."""

    def reached(*args: Any, **kwargs: Any) -> Any:
        pytest.fail("the config was read before the flags were checked")

    monkeypatch.setattr(E, "load_config", reached)
    monkeypatch.setattr(T, "read_config", reached)


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    return captured.err


@pytest.mark.parametrize("world", ["100000000", "65537", "0", "-4"])
def test_estimate_refuses_a_world_size_past_its_bound(capsys: pytest.CaptureFixture[str], world: str) -> None:
    assert _refusal(capsys, "estimate", "--config", DEMO, "--world-size", world) == (
        f"tierzero: error: --world-size {world} is outside 1..65536, the ranks an estimate covers: give at most 65536\n"
    )


@pytest.mark.parametrize("rate", ["nan", "inf", "-inf", "0", "-3"])
def test_estimate_refuses_a_flops_rate_that_is_not_a_positive_number(capsys: pytest.CaptureFixture[str], rate: str) -> None:
    shown = {"-3": "-3.0", "0": "0.0"}.get(rate, rate)
    assert _refusal(capsys, "estimate", "--config", DEMO, f"--flops={rate}") == (
        f"tierzero: error: --flops must be a positive GFLOP/s rate, got {shown}\n"
    )


def test_the_bound_itself_passes_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    class Reached(Exception):
        pass

    def reached(*args: Any, **kwargs: Any) -> Any:
        raise Reached

    monkeypatch.setattr(E, "load_config", reached)
    with pytest.raises(Reached):
        main(["estimate", "--config", DEMO, "--world-size", str(E.MAX_WORLD_SIZE), "--flops", "1e-3"])


@pytest.mark.parametrize("steps", ["10000000000", "0"])
def test_train_refuses_steps_past_its_bound(capsys: pytest.CaptureFixture[str], steps: str) -> None:
    assert _refusal(capsys, "train", "--config", DEMO, "--steps", steps) == (
        f"tierzero: error: --steps {steps} is outside 1..{T.MAX_STEPS}: give at most {T.MAX_STEPS} optimizer steps\n"
    )
