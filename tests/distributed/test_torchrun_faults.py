"""A lost node: the other node's ranks fail the job within dist.timeout, naming the ranks that went away.

Two `torchrun --nnodes 2 --nproc-per-node 2` invocations on localhost (tests/distributed/
test_torchrun_nodes.py) run `tierzero train`. Inside step 3, node 1 goes away at once: one
of its ranks signals its torchrun agent, the node's other rank and itself, with SIGKILL (a
crashed node: its sockets close, which node 0 hears at once) or SIGSTOP (a node that lost
power or network: nothing closes, and only the collective's timeout ends the wait). Each
rank of node 0 that notices asks the job's store (hosted by node 0's agent) which ranks still
answer, and exits 2 with one line naming node 1's ranks, as one node's ranks do when one of
them dies (tests/distributed/test_faults.py). A rank stuck behind its node's other rank (in a
ring all-gather it waits on that one's data) notices only when that one exits, and its agent
ends it first: it answered the roll call from its thread, so it is never named, but it says
nothing itself.

With `dist.timeout` 5 s, the collectives wait 3.75 s and the roll call 1.25 s (a quarter of
a timeout under 8 s: tierzero.comm.dist.roll_call_s), so a hung node ends the job within 5 s of
going away, and a dead one within the roll call's wait (measured here: 5.04 s and 1.32 s
from the fault to the survivors' exit; 7.05 s and 2.06 s when the collectives waited the
whole timeout and the roll call 2 s after it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
from harness import tiny_train_config
from test_torchrun_nodes import torchrun

pytestmark = pytest.mark.serial  # timed to a second or two: `make test` runs it alone on the cores

TIMEOUT_S = 5.0
EXIT_SLACK_S = 0.5
"""From the end of the roll call to the exit time a survivor writes: the engine's close and the
process group's teardown, about 0.05 s here."""
JOB = '''
import os, signal, sys, time
from pathlib import Path
import torch
import tierzero.cli.train as T
from tierzero.cli.main import main

out, config, node, fault = sys.argv[1:5]
rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
torch.set_num_threads(1)
Path(out, f"node{node}-local{local}").write_text(f"{rank} {os.getpid()}")
real_step = T._train_step


def step(engine, data, *, step, **kwargs):
    if node == "1" and local == 0 and step == 2:
        Path(out, "fault-time").write_text(repr(time.time()))
        other = int(Path(out, "node1-local1").read_text().split()[1])
        for pid in (os.getppid(), other, os.getpid()):  # the agent first, so that nothing restarts or reports
            os.kill(pid, getattr(signal, fault))
    return real_step(engine, data, step=step, **kwargs)


T._train_step = step
with open(Path(out, f"stderr-{rank}"), "w") as err:
    sys.stderr = err
    code = main(["train", "--config", config, "--no-progress"])
Path(out, f"exit-time-{rank}").write_text(repr(time.time()))
sys.exit(code)
'''


@pytest.mark.parametrize(
    ("fault", "cause", "within"),
    [
        ("SIGKILL", r"Connection (reset|closed) by peer", 2.0 + 3.0),  # at most a 2 s roll call, slack for start-up
        ("SIGSTOP", r"[Tt]imed out", TIMEOUT_S + EXIT_SLACK_S),  # the collective's wait and the roll call's share
    ],
)
def test_a_lost_node_fails_the_job_naming_its_ranks(tmp_path: Path, fault: str, cause: str, within: float) -> None:
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(JOB)
    config = tiny_train_config(tmp_path, steps=6, dist={"timeout": TIMEOUT_S})
    started = time.monotonic()
    try:
        (node0, output0), (node1, _) = torchrun(
            script, out, nodes=2, per_node=2, node_args=[[str(config), str(n), fault] for n in range(2)], check=False,
            wait_for=0,
        )  # fmt: skip
    finally:  # a stopped node's workers are in sessions of their own: end them here
        for worker in out.glob("node1-local*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(worker.read_text().split()[1]), signal.SIGKILL)
    assert node1 == -9 and node0 != 0, output0  # node 1's agent is gone; node 0's reports its ranks' failure
    ranks = {n: sorted(int((out / f"node{n}-local{k}").read_text().split()[0]) for k in range(2)) for n in (0, 1)}
    gone = ", ".join(map(str, ranks[1]))
    lost = float((out / "fault-time").read_text())
    reported = [rank for rank in ranks[0] if (out / f"exit-time-{rank}").exists()]
    # A rank stuck behind its node's other rank may be ended by its agent first (see above).
    assert reported, [(out / f"stderr-{rank}").read_text() for rank in ranks[0]]
    for rank in reported:
        message = (out / f"stderr-{rank}").read_text().strip()
        expected = f"tierzero: error: rank {rank} of 4 lost contact with ranks {gone} in step 3 ("
        assert message.startswith(expected), message
        assert re.search(cause, message), message
        assert message.endswith(
            "those ranks died or hung, so the job stops; relaunch it with --resume to continue from the last checkpoint"
        )
        assert "\n" not in message and "Traceback" not in message
        assert float((out / f"exit-time-{rank}").read_text()) - lost < within
    assert time.monotonic() - started < 60
