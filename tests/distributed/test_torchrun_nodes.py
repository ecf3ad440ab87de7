"""A multi-node torchrun job on this machine: 2 simulated nodes x 2 ranks equal the 4-rank one-node job.

Two `torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --rdzv-backend c10d` invocations
rendezvous on localhost, as two machines would; a third runs the same job as one node of
4. Each rank trains a 2-layer GPT for 3 AdamW steps at stage 3 on its own data (chosen by
its rank), so the two jobs must end bitwise equal, and each rank's layout comes from
torchrun's LOCAL_WORLD_SIZE alone: on 2 nodes a rank sends B/4 of each collective to its
node's other rank and 2 x B/4 across (tests/distributed/test_comm_links.py), on one node
nothing crosses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
JOB = '''
import json, os, sys, torch
import tierzero
from tierzero.config import load_config
from tierzero.models.builtin import build_model

out = sys.argv[1]
cfg = {
    "zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": 1e-3}, "train": {"seq_len": 8, "micro_batch_size": 2},
    "model": {"type": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 16},
}
torch.set_num_threads(1)
torch.manual_seed(0)  # torch seeds each process differently: rank 0's weights must be the same in both jobs
engine = tierzero.initialize(build_model(load_config(cfg).model), cfg)
rank = int(os.environ["RANK"])
for step in range(3):
    engine.reset_comm_report()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))
    _, loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
report = {"groups": engine.comm_report(per_group=True), "phi": sum(u.padded_numel for u in engine.units),
          "local": [int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])]}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(report, f)
state = engine.full_state_dict()
if state is not None:
    torch.save(state, f"{out}/params.pt")
engine.close()
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: Path, out: Path, *, nodes: int, per_node: int, node_args: Sequence[Sequence[str]] = (), check: bool = True,
    timeout: float = 120, wait_for: int | None = None,
) -> list[tuple[int, str]]:
    """Run `script out *node_args[node]` as `nodes` torchrun agents of `per_node` ranks that rendezvous on
    localhost, as separate machines would; returns each agent's exit code and output, node 0 first.
    Node 0's agent hosts the rendezvous store, which its workers' process group shares, as the
    machine named by the endpoint would.

    With `check`, every agent must exit 0. With `wait_for`, that node's agent alone is waited
    for and the others are killed once it ends (their workers, in sessions of their own, are
    the caller's to end). Whatever ends first, no agent outlives the call.
    """
    out.mkdir(exist_ok=True)
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    endpoint = f"127.0.0.1:{_port()}"
    logs = [out / f"agent{node}.log" for node in range(nodes)]
    agents = []
    for node, log in enumerate(logs):
        with log.open("w") as sink:  # a file, not a pipe: a worker left stopped cannot hold it open
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
                 "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                 "--rdzv-conf", f"is_host={int(node == 0)}",
                 "--max-restarts", "0", str(script), str(out), *(node_args[node] if node_args else ())],
                env=env, stdout=sink, stderr=subprocess.STDOUT,
            ))  # fmt: skip
    try:
        for agent in agents if wait_for is None else [agents[wait_for]]:
            agent.wait(timeout=timeout)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
            agent.wait()
    outputs = [log.read_text() for log in logs]
    for agent, output in zip(agents, outputs):
        assert not check or agent.returncode == 0, output
    return [(agent.returncode, output) for agent, output in zip(agents, outputs)]


def test_two_nodes_of_two_equal_one_node_of_four(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    torchrun(script, tmp_path / "one_node", nodes=1, per_node=4)
    torchrun(script, tmp_path / "two_nodes", nodes=2, per_node=2)
    one, two = (torch.load(tmp_path / name / "params.pt") for name in ("one_node", "two_nodes"))
    assert one.keys() == two.keys()
    for name, value in one.items():
        assert torch.equal(two[name], value), name
    for rank in range(4):
        for name, per_node in (("one_node", 4), ("two_nodes", 2)):
            report = json.loads((tmp_path / name / f"rank{rank}.json").read_text())
            assert report["local"] == [rank % per_node, per_node]
            piece, across = 4 * report["phi"] // 4, 4 - per_node  # fp32 B/4; peers on other nodes
            assert report["groups"]["world"] == {
                "all_gather": {"intra": 2 * (3 - across) * piece, "inter": 2 * across * piece},
                "reduce_scatter": {"intra": (3 - across) * piece, "inter": across * piece},
                "all_reduce": {"intra": 0, "inter": 0},
            }
