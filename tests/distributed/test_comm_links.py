"""comm_report per group: bytes inside and across nodes, on 4 real gloo ranks laid out as nodes.

The ranks see torchrun's LOCAL_WORLD_SIZE / LOCAL_RANK for three layouts in one job:
two nodes of two ranks, one node of four, four nodes of one; then two nodes of two given to
`tierzero.initialize` as a Topology, which wins over the launcher's variables. Each trains a 2-layer GPT
at stage 3 (fp32, AdamW, clipping on) for a warm-up step and one measured step.

The formula, Φ the padded parameter count of all units and B = 4Φ bytes (fp32), for a rank
with p of its N - 1 = 3 peers on other nodes ([Note: bytes inside and across nodes]):
each collective sends a B/N piece to each peer, so

- all-gather (forward and backward): 2 x B/4 per peer: inter 2p B/4, intra 2(3 - p) B/4;
- reduce-scatter of the gradients: B/4 per peer: inter p B/4, intra (3 - p) B/4;
- the clipping norm's all-reduce of one fp32 scalar: 2 x 3 x 4 // 4 = 6 bytes, of which
  2p x 4 // 4 cross nodes.

Two nodes of two (p = 2): 1.5 B = 6Φ bytes across nodes, 0.75 B = 3Φ inside, the norm 4 + 2.

`tierzero estimate --world-size 4 --local-world-size L` predicts each layout's bytes, and
those of hpZ + qwZ + qgZ on two nodes of two (at the default quantisation block and at 8192),
to the byte: its dry run is the same engine.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import run_ranks

from tierzero.config import load_config
from tierzero.estimate.estimator import estimate

LAYOUTS = {"two_by_two": 2, "one_node": 4, "one_per_node": 1}
CONFIG = {
    "zero": {"stage": 3},
    "optimizer": {"type": "adamw", "lr": 1e-3},
    "model": {"type": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 16},
    "train": {"seq_len": 8, "micro_batch_size": 2},
    "gradient_clipping": 1.0,
}
ZEROPP = CONFIG | {
    "zero": {"stage": 3, "hpz_partition_size": 2, "quantized_weights": True, "quantized_gradients": "int4"}
}
ZEROPP_8192 = ZEROPP | {"zero": ZEROPP["zero"] | {"quantization_block_size": 8192}}
"""A block of 8192 elements, four times the 2048 the I/O alignment pads a shard to: the shards pad further."""


def _measure(rank: int, topology: Any = None, config: dict[str, Any] = CONFIG) -> dict[str, Any]:
    import tierzero
    from tierzero.config import load_config
    from tierzero.models.builtin import build_model

    engine = tierzero.initialize(build_model(load_config(config).model, seed=0), config, topology=topology)
    with engine:
        for step in range(2):
            if step == 1:
                engine.reset_comm_report()
            g = torch.Generator().manual_seed(100 * step + rank)
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        return {
            "phi": sum(u.padded_numel for u in engine.units),
            "groups": engine.comm_report(per_group=True),
            "total": engine.comm_report(),
        }


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    from tierzero.comm.topology import Topology

    out = {}
    for name, per_node in LAYOUTS.items():
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
        os.environ["LOCAL_RANK"] = str(rank % per_node)
        out[name] = _measure(rank)
    # A layout given to initialize wins over the launcher's (one node of four, as set last).
    out["given"] = _measure(rank, Topology(world_size=world_size, rank=rank, local_world_size=2))
    out["zero++"] = _measure(rank, Topology(world_size=world_size, rank=rank, local_world_size=2), ZEROPP)
    out["zero++ 8192"] = _measure(rank, Topology(world_size=world_size, rank=rank, local_world_size=2), ZEROPP_8192)
    try:
        _measure(rank, Topology(world_size=world_size, rank=(rank + 1) % world_size, local_world_size=2))
    except ValueError as exc:
        out["wrong"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, world_size=4)


def test_stage3_bytes_inside_and_across_nodes_follow_the_formula(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        for name, per_node in LAYOUTS.items():
            run = out[name]
            full = 4 * run["phi"]
            piece = full // 4
            p = 4 - per_node  # peers on other nodes
            expected = {
                "world": {
                    "all_gather": {"intra": 2 * (3 - p) * piece, "inter": 2 * p * piece},
                    "reduce_scatter": {"intra": (3 - p) * piece, "inter": p * piece},
                    "all_reduce": {"intra": 6 - 2 * p * 4 // 4, "inter": 2 * p * 4 // 4},
                }
            }
            assert run["groups"] == expected, (rank, name)
            # the totals are the ring accounting of before: 3 x 3/4 B for the three passes
            assert run["total"] == {"all_gather": 2 * 3 * piece, "reduce_scatter": 3 * piece, "all_reduce": 6}
        assert out["given"]["groups"] == out["two_by_two"]["groups"]
        assert f"the topology is rank {(rank + 1) % 4} of 4, the process group's rank {rank} of 4" in out["wrong"]
        two_by_two = out["two_by_two"]["groups"]["world"]
        inter = sum(v["inter"] for v in two_by_two.values())
        assert inter == 6 * out["two_by_two"]["phi"] + 4  # 1.5 B across nodes, plus the norm's 4 bytes


@pytest.mark.parametrize(("name", "per_node"), [*LAYOUTS.items(), ("zero++", 2), ("zero++ 8192", 2)])
def test_the_estimate_predicts_every_rank_s_bytes_inside_and_across_nodes(
    results: list[dict[str, Any]], name: str, per_node: int
) -> None:
    config = {"zero++": ZEROPP, "zero++ 8192": ZEROPP_8192}.get(name, CONFIG)
    predicted = estimate(load_config(config), world_size=4, local_world_size=per_node)
    assert predicted.local_world_size == per_node
    for out in results:
        assert predicted.comm == out[name]["groups"]
