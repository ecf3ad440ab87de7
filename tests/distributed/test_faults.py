"""A rank that dies or hangs mid-step: the survivor fails with a clear error within the timeout, never hangs.

Nothing kills the survivor here (unlike torchrun, which would): it must notice on its
own. A dead peer closes its sockets, which gloo reports at once; a hung peer (stopped
with SIGSTOP) is only noticed by the process group's timeout, `dist.timeout` in the config. Under
`tierzero train` the survivor says in one line that it lost contact, with which rank (the
one that did not answer a roll call in the job's store, tierzero.comm.dist.unanswered_ranks), in
which step, and how to continue, and exits 2.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from harness import tiny_train_config
from test_checkpoint_resume import launch

pytestmark = pytest.mark.serial  # timed to a second or two: `make test` runs it alone on the cores

TIMEOUT_S = 4.0
#: Start-up (fork, group, engine) and the step before the fault, on a loaded 2-core machine.
SLACK_S = 20.0


def _rank(env: dict[str, str]) -> None:
    """Train; rank 1 dies (`TZ_FAULT=kill`) or stops (`stop`) inside step 2's forward. Errors go to a file."""
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    from harness import Case

    import tierzero

    torch.set_num_threads(1)
    rank = int(env["RANK"])
    case = Case(stage=3, optimizer="adamw", steps=4, accumulation=1, global_batch=4)
    # tierzero creates the group from the torchrun variables, with the config's timeout.
    engine = tierzero.initialize(case.model(), {**case.config(), "dist": {"timeout": float(env["TZ_TIMEOUT"])}})
    assert dist.is_initialized()
    fault = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[env["TZ_FAULT"]]

    def maybe_fault(*_: object) -> None:
        if rank == 1 and engine.global_step == 1:
            Path(env["TZ_DIR"], "fault-time").write_text(repr(time.time()))
            os.kill(os.getpid(), fault)

    engine.module.blocks[1].register_forward_pre_hook(maybe_fault)
    try:
        for step in range(case.steps):
            engine.backward(case.loss(engine, *case.micro_batch(step, micro=0, rank=rank, world_size=2)))
            engine.step()
    except Exception as exc:  # noqa: BLE001 - the test reads what the survivor saw
        Path(env["TZ_DIR"], f"error-{rank}").write_text(f"{type(exc).__name__}: {exc}")
        Path(env["TZ_DIR"], f"error-time-{rank}").write_text(repr(time.time()))
        os._exit(1)
    os._exit(0)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("kill", r"Connection (reset|closed) by peer"), ("stop", r"Timed out|timed out|Timeout|timeout")],
)
def test_survivor_exits_non_zero_with_the_cause_within_the_timeout(tmp_path: Path, fault: str, expected: str) -> None:
    import re

    env = {"TZ_FAULT": fault, "TZ_DIR": str(tmp_path), "TZ_TIMEOUT": str(TIMEOUT_S)}
    codes = launch(2, env, target=_rank, wait_for=0, timeout=TIMEOUT_S + SLACK_S)
    assert codes[0] == 1, f"survivor exit code {codes[0]}"
    assert codes[1] == (-signal.SIGKILL if fault == "kill" else None)  # the stopped rank is killed by the launcher
    waited = float((tmp_path / "error-time-0").read_text()) - float((tmp_path / "fault-time").read_text())
    message = (tmp_path / "error-0").read_text()
    assert re.search(expected, message), message
    # a dead peer is noticed at once; a hung one after the group's timeout, not the 30-minute default
    assert waited < (2.0 if fault == "kill" else TIMEOUT_S + 6.0), waited


def _train_rank(env: dict[str, str]) -> None:
    """`tierzero train` on one rank; rank 1 dies in its third step. stderr goes to a file."""
    os.environ.update(env)
    import torch

    import tierzero.cli.train as T
    from tierzero.cli.main import main

    torch.set_num_threads(1)
    rank = int(env["RANK"])
    real_step = T._train_step

    def step(engine: object, data: object, *, step: int, **kwargs: object) -> float:
        if rank == 1 and step == 2:
            Path(env["TZ_DIR"], "fault-time").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(engine, data, step=step, **kwargs)

    T._train_step = step
    with open(Path(env["TZ_DIR"], f"stderr-{rank}"), "w") as err:
        sys.stderr = err
        code = main(["train", "--config", env["TZ_CONFIG"], "--no-progress"])
    Path(env["TZ_DIR"], f"error-time-{rank}").write_text(repr(time.time()))
    os._exit(code)


def test_tierzero_train_survivor_says_which_rank_it_lost_and_how_to_resume(tmp_path: Path) -> None:
    config = tiny_train_config(tmp_path, steps=6)
    env = {"TZ_DIR": str(tmp_path), "TZ_CONFIG": str(config)}
    codes = launch(2, env, target=_train_rank, wait_for=0, timeout=SLACK_S + 10)
    assert codes == [2, -signal.SIGKILL]
    message = (tmp_path / "stderr-0").read_text().strip()
    assert message.startswith("tierzero: error: rank 0 of 2 lost contact with rank 1 in step 3 ("), message
    assert message.endswith("that rank died or hung, so the job stops; relaunch it with --resume to continue from the last checkpoint")
    assert "\n" not in message and "Traceback" not in message
    assert float((tmp_path / "error-time-0").read_text()) - float((tmp_path / "fault-time").read_text()) < 5.0
