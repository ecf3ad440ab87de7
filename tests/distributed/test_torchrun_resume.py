"""A 2-node torchrun job's checkpoint resumes on 1 node of 2 ranks, bitwise.

Two `torchrun --nnodes 2 --nproc-per-node 2` invocations on localhost (tests/distributed/
test_torchrun_nodes.py) train a small GPT for 3 AdamW steps at stage 3 with hpZ over the
node and every kind on NVMe, each node swapping into its own directory, and save one
checkpoint from all 4 ranks into one directory. One `torchrun --nnodes 1 --nproc-per-node 2`
invocation then resumes that job with the same config (hpZ over its one node, its own swap
directory) and trains 3 more steps; in the same processes a reference engine, plain stage 3
with every state in memory, loads the same checkpoint and trains the same 3 steps.

Bitwise, because the design allows it: the weights at load are the saved ones (the
checkpoint reshards 4 -> 2 exactly), and the resumed run's losses and final weights are
the reference's, because hpZ's backward gathers the bits the forward gather did and NVMe
moves bytes losslessly (docs/architecture.md). The resumed run is not held to what 4 ranks
would have done next: at 2 ranks the global batch and the gradient sums differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_torchrun_nodes import torchrun

JOB = '''
import json, os, sys, torch
import torch.distributed as dist
import tierzero
from tierzero.config import load_config
from tierzero.models.builtin import build_model

out, mode, swap = sys.argv[1:4]
model = {"type": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 16}
base = {"optimizer": {"type": "adamw", "lr": 1e-2}, "train": {"seq_len": 8, "micro_batch_size": 2}, "model": model}
tiered = base | {
    "zero": {"stage": 3, "hpz_partition_size": 2},
    "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}, "tiers": {"nvme": {"path": swap}},
}
plain = base | {"zero": {"stage": 3}}
torch.set_num_threads(1)
dist.init_process_group("gloo")  # the job's own group, so that two engines can use it in turn
rank = int(os.environ["RANK"])


def train(engine, steps):
    losses = []
    for step in steps:
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(100 * step + rank))
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def swapping():
    return sorted(p.name for p in __import__("pathlib").Path(swap).glob("*/rank*.swap"))


report = {"local": [int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])]}
runs = {"save": [("saved", tiered)], "resume": [("resumed", tiered), ("reference", plain)]}[mode]
for name, cfg in runs:
    engine = tierzero.initialize(build_model(load_config(cfg).model), cfg)
    if mode == "save":
        report["losses"] = train(engine, range(3))
        engine.save_checkpoint(f"{out}/../checkpoint")
    else:
        engine.load_checkpoint(f"{out}/../checkpoint")
        report[name + "_step"] = engine.global_step
        at_load = engine.full_state_dict()
        if at_load is not None:
            torch.save(at_load, f"{out}/{name}-at-load.pt")
        report[name] = train(engine, range(3, 6))
    report[name + "_swap"] = swapping()
    state = engine.full_state_dict()
    if state is not None:
        torch.save(state, f"{out}/{name}.pt")
    engine.close()
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


def test_a_two_node_checkpoint_resumes_on_one_node_bitwise(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    save, resume = tmp_path / "two_nodes", tmp_path / "one_node"
    swaps = [tmp_path / f"swap-node{node}" for node in range(2)]
    for swap in (*swaps, tmp_path / "swap-resume"):
        swap.mkdir()
    torchrun(script, save, nodes=2, per_node=2, node_args=[["save", str(swap)] for swap in swaps])
    torchrun(script, resume, nodes=1, per_node=2, node_args=[["resume", str(tmp_path / "swap-resume")]])

    two = [json.loads((save / f"rank{rank}.json").read_text()) for rank in range(4)]
    one = [json.loads((resume / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(two):
        assert report["local"] == [rank % 2, 2]
        # Each node swapped into its own directory, each rank into its own file there.
        assert report["saved_swap"] == [f"rank{r}.swap" for r in (2 * (rank // 2), 2 * (rank // 2) + 1)]
    for rank, report in enumerate(one):
        assert report["local"] == [rank, 2]
        assert report["resumed_step"] == report["reference_step"] == 3
        assert report["resumed_swap"] == ["rank0.swap", "rank1.swap"] and report["reference_swap"] == []
        assert report["resumed"] == report["reference"]  # the same floats, to the last bit
    assert not any(any(swap.iterdir()) for swap in swaps)  # each node cleaned its own up

    saved = torch.load(save / "saved.pt")
    for name in ("resumed-at-load", "reference-at-load"):
        at_load = torch.load(resume / f"{name}.pt")
        assert at_load.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(at_load[key], value), (name, key)
    resumed, reference = torch.load(resume / "resumed.pt"), torch.load(resume / "reference.pt")
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key
        assert not torch.equal(value, saved[key]), key  # the resumed job did train
