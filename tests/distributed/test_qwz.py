"""ZeRO++ qwZ (zero.quantized_weights) on 4 gloo ranks laid out as 2 nodes x 2.

Each parameter all-gather over the 4 ranks sends every rank's shard as int8 with one fp32
scale per 2048 elements ([Note: qwZ] in tierzero/comm/quantized.py). For a unit whose shard
holds s elements (a multiple of 2048), a gather sends quantized_nbytes(s) = s + 4 s / 2048
bytes to each of the 3 peers, 1 inside the node and 2 across, against 4 s (fp32) or 2 s
(bf16) unquantised: a quarter or a half, plus the scales. Without hpZ both gathers of a
step are quantised; with hpZ (groups of 2) the forward one is, and backward gathers its
unquantised secondary copy inside the node.

With hpZ and qwZ together (qgZ off: the reduce-scatter unquantised, flat), a
rank's bytes across nodes in an fp32 step fall from plain stage 3's 6Φ + 4 to
2 q + 2Φ + 4, q = Σ quantized_nbytes(Φ_unit / 4): the test states the ratio, 0.42.

At zero.quantization_block_size 512 a gather sends s + 4 s / 512 bytes a peer instead, and
every gathered weight is within half of its own 512-element block's scale.

The masters never see a quantised value: with a learning rate of 0 they end bitwise where
they started. With a real one the run stays close to plain stage 3 (not equal: the forward
uses weights within half a block scale of the masters).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import Case, measure_comm, rel_error, run_ranks, train_case

from tierzero.comm.quant import quantized_nbytes

QWZ = (("quantized_weights", True),)
HPZ_QWZ = (("quantized_weights", True), ("hpz_partition_size", 2))
TRAIN = Case(stage=3, optimizer="sgd", steps=4, zero=QWZ)
MEASURE = {
    name: Case(stage=3, optimizer="adamw", accumulation=1, global_batch=4, steps=2, dtype=dtype, zero=zero)
    for name, dtype, zero in [
        ("plain", "fp32", ()), ("qwz", "fp32", QWZ), ("qwz-bf16", "bf16", QWZ), ("hpz-qwz", "fp32", HPZ_QWZ),
        ("qwz-512", "fp32", (*QWZ, ("quantization_block_size", 512))),
    ]
}  # fmt: skip


def _shard(rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of 2048 elements, each 512-block of a different magnitude."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(2048, generator=g) * torch.tensor([1e-3, 1.0, 10.0, 0.1]).repeat_interleave(512)


def _gather_at_512(rank: int) -> torch.Tensor:
    from tierzero.comm.mesh import build_mesh
    from tierzero.comm.quantized import all_gather_quantized
    from tierzero.comm.topology import Topology

    comm = build_mesh(Topology(world_size=4, rank=rank, local_world_size=2)).shard
    out = torch.empty(4 * 2048)
    all_gather_quantized(out, _shard(rank), comm=comm, block_size=512).wait()
    return out


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    import tierzero

    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)

    def frozen_lr(model: torch.nn.Module, config: dict[str, Any]) -> Any:
        return tierzero.initialize(model, config, lr_lambda=lambda step: 0.0)

    return {
        "plain": train_case(Case(stage=3, optimizer="sgd", steps=4), rank=rank, world_size=world_size),
        "qwz": train_case(TRAIN, rank=rank, world_size=world_size),
        "lr0": train_case(TRAIN, rank=rank, world_size=world_size, make_engine=frozen_lr),
        "measure": {name: measure_comm(case, rank=rank, world_size=world_size) for name, case in MEASURE.items()},
        "gather": _gather_at_512(rank),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, world_size=4)


def test_masters_never_see_a_quantised_value(results: list[dict[str, Any]]) -> None:
    lr0 = results[0]["lr0"]
    assert lr0.params is not None
    for name, value in TRAIN.model().state_dict().items():
        assert torch.equal(lr0.params[name], value), name


def test_qwz_trains_close_to_plain_stage3(results: list[dict[str, Any]]) -> None:
    """Losses within 1% after 4 SGD steps; parameters within 1e-3 (norm-wise relative), but for the
    LayerNorm biases, which start at zero and share a block's scale with weights far larger (about 2%)."""
    plain, qwz = results[0]["plain"], results[0]["qwz"]
    assert qwz.losses != plain.losses  # the forward really used quantised weights
    assert max(abs(a - b) / b for a, b in zip(qwz.losses, plain.losses)) < 1e-2
    errors = {name: rel_error(qwz.params[name], value) for name, value in plain.params.items()}
    assert max(e for name, e in errors.items() if not name.endswith("norm.bias")) < 1e-3, errors
    assert max(errors.values()) < 5e-2, errors


def _q(shards: list[int], block: int = 2048) -> int:
    return sum(quantized_nbytes(s, bits=8, block_size=block) for s in shards)


def test_quantised_gathers_send_a_quarter_of_fp32_and_half_of_bf16_plus_scales(results: list[dict[str, Any]]) -> None:
    for rank in results:
        for name, itemsize in (("qwz", 4), ("qwz-bf16", 2)):
            run = rank["measure"][name]
            assert all(s % 2048 == 0 for s in run["shards"])
            q, plain = _q(run["shards"]), sum(s * itemsize for s in run["shards"])
            assert q == sum(s + 4 * s // 2048 for s in run["shards"])
            assert run["groups"]["world"]["all_gather"] == {"intra": 2 * q, "inter": 2 * 2 * q}  # two gathers
            assert run["groups"]["world"]["reduce_scatter"] == {"intra": plain, "inter": 2 * plain}
            assert q * itemsize == plain + 4 * itemsize * sum(s // 2048 for s in run["shards"])


def test_hpz_and_qwz_send_0_42_of_plain_stage3_across_nodes(results: list[dict[str, Any]]) -> None:
    for rank in results:
        plain, both = rank["measure"]["plain"], rank["measure"]["hpz-qwz"]
        assert plain["shards"] == both["shards"]
        q, piece = _q(both["shards"]), 4 * sum(both["shards"])  # piece: Φ bytes, an fp32 shard of every unit
        world, hpz = both["groups"]["world"], both["groups"]["hpz"]
        assert world["all_gather"] == {"intra": q, "inter": 2 * q}  # the forward gather only, quantised
        assert hpz["all_gather"] == {"intra": 2 * piece, "inter": 0}  # backward: half the unit, fp32, in the node
        inter = sum(v["inter"] for group in both["groups"].values() for v in group.values())
        plain_inter = sum(v["inter"] for v in plain["groups"]["world"].values())
        assert plain_inter == 6 * piece + 4 and inter == 2 * q + 2 * piece + 4
        assert round(inter / plain_inter, 2) == 0.42



def test_a_block_of_512_sends_a_scale_per_512_elements(results: list[dict[str, Any]]) -> None:
    """zero.quantization_block_size 512: both gathers send 3 (s + 4 s / 512) a shard of s elements,
    2 of the 3 peers across nodes; the reduce-scatter is plain stage 3's."""
    for rank in results:
        run = rank["measure"]["qwz-512"]
        shards = run["shards"]
        assert shards == rank["measure"]["qwz"]["shards"]  # 512 divides the 2048 the I/O alignment pads to
        q = sum(s + 4 * s // 512 for s in shards)
        assert q == _q(shards, 512) > _q(shards)
        assert run["groups"]["world"]["all_gather"] == {"intra": 2 * q, "inter": 2 * 2 * q}
        assert run["groups"]["world"]["reduce_scatter"] == rank["measure"]["qwz"]["groups"]["world"]["reduce_scatter"]


def test_each_gathered_weight_is_within_half_its_512_block_s_scale(results: list[dict[str, Any]]) -> None:
    """Every rank gets every shard back within absmax / 127 / 2 of its own 512-element block (blocks
    10^4 apart in magnitude: one scale for 2048 would break the small blocks' bound), the same on all."""
    exact = torch.cat([_shard(r) for r in range(4)])
    bound = exact.view(-1, 512).abs().amax(dim=1, keepdim=True) / 127 / 2
    for rank in results:
        error = (rank["gather"] - exact).view(-1, 512).abs()
        assert bool((error <= bound * (1 + 1e-5)).all())
        assert torch.equal(rank["gather"], results[0]["gather"]) and not torch.equal(rank["gather"], exact)
