"""A `DeviceMesh` of shape (nodes, ranks per node) given to `tierzero.initialize` lays the job out as nodes.

On 4 real gloo ranks, `init_device_mesh("cpu", (2, 2))` gives the same layout as a `Topology` of
2 nodes x 2, so the engine's bytes inside and across nodes are the same, with hpZ over the node
(tests/distributed/test_comm_links.py has the formulas); a mesh of shape (4,) is one node. A
mesh whose rows are not consecutive ranks, or given with a topology too, is refused on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from harness import run_ranks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

CONFIG = {
    "zero": {"stage": 3, "hpz_partition_size": 2},
    "optimizer": {"type": "adamw", "lr": 1e-3},
    "model": {"type": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 16},
    "train": {"seq_len": 8, "micro_batch_size": 2},
}


def _bytes(rank: int, **layout: Any) -> dict[str, Any]:
    import tierzero
    from tierzero.config import load_config
    from tierzero.models.builtin import build_model

    with tierzero.initialize(build_model(load_config(CONFIG).model, seed=0), CONFIG, **layout) as engine:
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return engine.comm_report(per_group=True)


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    from tierzero.comm.topology import Topology

    out: dict[str, Any] = {
        "mesh": _bytes(rank, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))),
        "topology": _bytes(rank, topology=Topology(world_size=world_size, rank=rank, local_world_size=2)),
        "flat": _bytes(rank, mesh=init_device_mesh("cpu", (4,))),
    }
    crossed = DeviceMesh("cpu", [[0, 2], [1, 3]])
    for name, layout in {
        "crossed": {"mesh": crossed},
        "both": {"mesh": crossed, "topology": Topology(world_size=world_size, rank=rank, local_world_size=2)},
    }.items():
        try:
            _bytes(rank, **layout)
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_a_device_mesh_gives_the_node_layout() -> None:
    for out in run_ranks(_job, world_size=4):
        assert out["mesh"] == out["topology"]
        assert out["mesh"]["hpz"]["all_gather"]["inter"] == 0 < out["mesh"]["world"]["all_gather"]["inter"]
        assert all(links["inter"] == 0 for group in out["flat"].values() for links in group.values())
        assert out["crossed"].startswith("the device mesh's rows are not nodes of consecutive ranks ([[0, 2], [1, 3]]")
        assert out["both"] == "initialize got both a topology and a device mesh: pass one, they both give the layout"
