"""A lost node: the other node's ranks fail the job within dist.timeout, naming the ranks that went away.

Two `torchrun --nnodes 2 --nproc-per-node 2` invocations on localhost (tests/distributed/
test_torchrun_nodes.py) run `tierzero train`. Inside step 3, node 1 goes away at once, as a
machine that loses power would: one of its ranks SIGKILLs its torchrun agent, the node's
other rank and itself. Each rank of node 0 notices on its own (its sockets to node 1 close),
asks the job's store (hosted by node 0's agent) which ranks still answer, and exits 2 with
one line naming node 1's ranks, as one node's ranks do when one of them dies
(tests/distributed/test_faults.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from harness import tiny_train_config
from test_torchrun_nodes import torchrun

TIMEOUT_S = 10.0
JOB = '''
import os, signal, sys, time
from pathlib import Path
import torch
import tierzero.train as T
from tierzero.cli import main

out, config, node = sys.argv[1:4]
rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
torch.set_num_threads(1)
Path(out, f"node{node}-local{local}").write_text(f"{rank} {os.getpid()}")
real_step = T._train_step


def step(engine, data, *, step, **kwargs):
    if node == "1" and local == 0 and step == 2:
        Path(out, "fault-time").write_text(repr(time.time()))
        other = int(Path(out, "node1-local1").read_text().split()[1])
        for pid in (os.getppid(), other, os.getpid()):  # the agent first, so that nothing restarts or reports
            os.kill(pid, signal.SIGKILL)
    return real_step(engine, data, step=step, **kwargs)


T._train_step = step
with open(Path(out, f"stderr-{rank}"), "w") as err:
    sys.stderr = err
    code = main(["train", "--config", config, "--no-progress"])
Path(out, f"exit-time-{rank}").write_text(repr(time.time()))
sys.exit(code)
'''


def test_a_lost_node_fails_the_job_naming_its_ranks(tmp_path: Path) -> None:
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(JOB)
    config = tiny_train_config(tmp_path, steps=6, dist={"timeout": TIMEOUT_S})
    started = time.monotonic()
    (node0, output0), (node1, _) = torchrun(
        script, out, nodes=2, per_node=2, node_args=[[str(config), str(node)] for node in range(2)], check=False
    )
    assert node1 == -9 and node0 != 0, output0  # node 1 was killed; node 0's agent reports its ranks' failure
    ranks = {n: sorted(int((out / f"node{n}-local{k}").read_text().split()[0]) for k in range(2)) for n in (0, 1)}
    gone = ", ".join(map(str, ranks[1]))
    fault = float((out / "fault-time").read_text())
    for rank in ranks[0]:
        message = (out / f"stderr-{rank}").read_text().strip()
        expected = f"tierzero: error: rank {rank} of 4 lost contact with ranks {gone} in step 3 ("
        assert message.startswith(expected), message
        assert message.endswith(
            "those ranks died or hung, so the job stops; relaunch it with --resume to continue from the last checkpoint"
        )
        assert "\n" not in message and "Traceback" not in message
        assert float((out / f"exit-time-{rank}").read_text()) - fault < TIMEOUT_S
    assert time.monotonic() - started < 60
