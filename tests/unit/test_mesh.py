"""Hybrid sharding's and hpZ's groups and settings without a process group: the mesh, the config, the estimate."""

from __future__ import annotations

import pytest
import torch

from tierzero.cli.estimate import to_json
from tierzero.comm.collectives import CommCounter, CommGroup
from tierzero.comm.mesh import build_mesh
from tierzero.comm.quantized import all_gather_quantized, reduce_scatter_hierarchical
from tierzero.comm.topology import Topology
from tierzero.common.slices import Kind, Tier
from tierzero.config import ConfigError, load_config
from tierzero.estimate import estimate
from tierzero.estimate.dry_run import dry_run

MODEL = {"type": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 16}


def test_shard_and_replica_groups_of_a_hybrid_mesh() -> None:
    """8 ranks, 2 nodes of 4, shards over each node: rank 6 is shard rank 2 of ranks 4-7 and replica 1 of ranks 2, 6."""
    mesh = build_mesh(Topology(world_size=8, rank=6, local_world_size=4), shard_group_size=4, dry_run=True)
    assert (mesh.shard.rank, mesh.shard.world_size, mesh.shard.members) == (2, 4, (4, 5, 6, 7))
    assert mesh.replica is not None
    assert (mesh.replica.rank, mesh.replica.world_size, mesh.replica.members) == (1, 2, (2, 6))
    assert mesh.shard.peers_across_nodes() == 0 and mesh.replica.peers_across_nodes() == 1
    assert mesh.data_parallel_size == 8
    assert [g.name for g in mesh.groups] == ["shard", "replica"]


@pytest.mark.parametrize("size", [0, 8])
def test_no_or_whole_job_shard_groups_are_plain_zero(size: int) -> None:
    mesh = build_mesh(Topology(world_size=8, rank=3, local_world_size=4), shard_group_size=size, dry_run=True)
    assert mesh.replica is None
    assert (mesh.shard.name, mesh.shard.rank, mesh.shard.world_size) == ("world", 3, 8)


def test_a_shard_group_size_that_does_not_divide_the_job_is_refused() -> None:
    refusal = r"zero.shard_group_size is 3, which does not divide the 8 ranks.*divisor of 8"
    with pytest.raises(ValueError, match=refusal):
        build_mesh(Topology(world_size=8, rank=0, local_world_size=4), shard_group_size=3, dry_run=True)


def test_hybrid_sharding_needs_stage_3() -> None:
    with pytest.raises(ConfigError, match=r"zero.shard_group_size is 2, which needs zero.stage 3 \(got 2\)"):
        load_config({"zero": {"stage": 2, "shard_group_size": 2}})


def test_deepspeed_mics_shard_size_maps_to_the_shard_group_size() -> None:
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 4}}
    assert load_config(ds).zero.shard_group_size == 4
    ds["zero_optimization"]["mics_shard_size"] = -1
    assert load_config(ds).zero.shard_group_size == 0


def test_the_estimate_shards_over_the_shard_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 ranks in 2 groups of 2: each rank keeps half of every unit, as plain ZeRO at world size 2 does."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    raw = {"zero": {"stage": 3}, "model": MODEL, "train": {"seq_len": 8, "micro_batch_size": 1}}
    flat2 = dry_run(load_config(raw), world_size=2)
    raw["zero"]["shard_group_size"] = 2
    hybrid = dry_run(load_config(raw), world_size=4)
    assert [(s.kind, s.numel) for s in hybrid.plan.all()] == [(s.kind, s.numel) for s in flat2.plan.all()]


def test_hpz_group_is_the_node_and_zero_still_shards_over_all() -> None:
    mesh = build_mesh(Topology(world_size=8, rank=6, local_world_size=4), hpz_partition_size=4, dry_run=True)
    assert (mesh.shard.name, mesh.shard.world_size, mesh.replica) == ("world", 8, None)
    assert mesh.secondary is not None and mesh.secondary_parts == 4
    assert (mesh.secondary.name, mesh.secondary.rank, mesh.secondary.members) == ("hpz", 2, (4, 5, 6, 7))
    assert mesh.secondary.peers_across_nodes() == 0
    with pytest.raises(ValueError, match=r"zero.hpz_partition_size is 3, which does not divide the 8 ranks"):
        build_mesh(Topology(world_size=8, rank=0, local_world_size=4), hpz_partition_size=3, dry_run=True)


@pytest.mark.parametrize(
    ("zero", "refusal"),
    [
        ({"stage": 2, "hpz_partition_size": 2}, r"zero.hpz_partition_size is 2, which needs zero.stage 3 \(got 2\)"),
        ({"hpz_partition_size": 1}, r"zero.hpz_partition_size is 1, which would keep a whole copy"),
        ({"hpz_partition_size": 2, "shard_group_size": 2}, r"hybrid sharding already gathers inside its groups"),
        ({"stage": 1, "quantized_weights": True}, r"zero.quantized_weights is True, which needs zero.stage 3"),
        ({"quantized_gradients": "int4", "shard_group_size": 2}, r"zero.quantized_gradients is int4, which needs"),
        *[
            ({"quantization_block_size": bad}, rf"zero.quantization_block_size is {bad}, not a power of two from 64 "
             r"to 16384: set zero.quantization_block_size to one, such as 2048")
            for bad in (1000, 32, 32768, 0)
        ],  # fmt: skip
    ],
)
def test_hpz_settings_that_cannot_work_are_refused(zero: dict[str, int], refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal):
        load_config({"zero": zero})


def test_deepspeed_hpz_partition_size_and_quantized_weights_map() -> None:
    zero = {"stage": 3, "zero_hpz_partition_size": 8, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    cfg = load_config(ds)
    assert (cfg.zero.hpz_partition_size, cfg.zero.quantized_weights, cfg.zero.quantized_gradients) == (8, True, "int4")
    ds["zero_optimization"]["zero_hpz_partition_size"] = 1
    assert load_config(ds).zero.hpz_partition_size == 0


def test_the_estimate_counts_the_secondary_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 ranks, hpZ over 2: each unit's secondary slice is half of its parameters (twice its PARAM
    slice, a quarter), in the compute dtype at the parameters' home; without hpZ, no such kind."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    raw = {
        "zero": {"stage": 3, "hpz_partition_size": 2}, "offload": {"params": "cpu"},
        "model": MODEL, "train": {"seq_len": 8, "micro_batch_size": 1},
    }  # fmt: skip
    for specs in dry_run(load_config(raw), world_size=4).plan.specs.values():
        param, secondary = (next(s for s in specs if s.kind is k) for k in (Kind.PARAM, Kind.SECONDARY))
        assert (secondary.numel, secondary.home, secondary.dtype) == (2 * param.numel, Tier.CPU, param.dtype)
    kinds = to_json(estimate(load_config(raw), world_size=4))["kinds"]
    assert kinds["param_secondary"] == 2 * kinds["param"] > 0
    del raw["zero"]["hpz_partition_size"]
    assert "param_secondary" not in to_json(estimate(load_config(raw), world_size=4))["kinds"]


def test_a_dry_run_quantised_gather_counts_the_packed_bytes() -> None:
    """int8 and a fp32 scale per 2048 elements: 4096 + 8 bytes a shard of 4096, to each of 3 peers (2 across)."""
    comm = CommGroup(rank=0, world_size=4, counter=CommCounter(), dry_run=True, local_world_size=2)
    meta = {"device": "meta", "dtype": torch.float32}
    all_gather_quantized(torch.empty(4 * 4096, **meta), torch.empty(4096, **meta), comm=comm, block_size=2048)
    assert comm.counter.links()["all_gather"] == {"intra": 4104, "inter": 2 * 4104}
    comm.counter.reset()  # a scale per 256 elements: 16 scales a shard
    all_gather_quantized(torch.empty(4 * 4096, **meta), torch.empty(4096, **meta), comm=comm, block_size=256)
    assert comm.counter.links()["all_gather"] == {"intra": 4096 + 64, "inter": 2 * (4096 + 64)}


def test_a_dry_run_hierarchical_reduce_scatter_counts_both_hops() -> None:
    """8 ranks, 2 nodes of 4, int4: 3 node peers get 2 shards of 4096 fp32 each (32 KiB); 1 rank
    across gets the partial sum, 2048 bytes of int4 and 2 scales."""
    mesh = build_mesh(Topology(world_size=8, rank=5, local_world_size=4), node_hops=True, dry_run=True)
    assert mesh.intra is not None and mesh.inter is not None
    assert (mesh.intra.rank, mesh.intra.members, mesh.inter.rank, mesh.inter.members) == (1, (4, 5, 6, 7), 1, (1, 5))
    hops = mesh.grad_hops("int4", block_size=2048)
    assert hops is not None and hops.bits == 4 and mesh.grad_hops("none", block_size=2048) is None
    meta = {"device": "meta", "dtype": torch.float32}
    reduce_scatter_hierarchical([torch.empty(4096, **meta)], [torch.empty(8 * 4096, **meta)], hops=hops)
    assert mesh.intra.counter.links()["reduce_scatter"] == {"intra": 3 * 2 * 4096 * 4, "inter": 0}
    assert mesh.inter.counter.links()["reduce_scatter"] == {"intra": 0, "inter": 2048 + 2 * 4}


def test_a_dry_run_hierarchical_reduce_scatter_counts_the_block_it_is_given() -> None:
    """As above, a scale per 512 elements: the partial sum crosses as 2048 bytes of int4 and 8 scales."""
    mesh = build_mesh(Topology(world_size=8, rank=5, local_world_size=4), node_hops=True, dry_run=True)
    hops = mesh.grad_hops("int4", block_size=512)
    assert hops is not None and hops.block_size == 512
    meta = {"device": "meta", "dtype": torch.float32}
    reduce_scatter_hierarchical([torch.empty(4096, **meta)], [torch.empty(8 * 4096, **meta)], hops=hops)
    assert mesh.inter.counter.links()["reduce_scatter"] == {"intra": 0, "inter": 2048 + 8 * 4}


@pytest.mark.parametrize("block", [512, 8192])
def test_quantised_units_pad_every_shard_to_whole_blocks(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """The estimate's engine at 4 ranks: each PARAM slice (one rank's shard) is whole blocks and whole
    I/O alignments (2048 elements), with qwZ or qgZ; without them, the block pads nothing."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    raw = {"model": MODEL, "train": {"seq_len": 8, "micro_batch_size": 1}}
    for zero, multiple in [
        ({"quantized_weights": True}, max(block, 2048)),
        ({"quantized_gradients": "int8"}, max(block, 2048)),
        ({}, 2048),
    ]:
        cfg = load_config(raw | {"zero": {"stage": 3, "quantization_block_size": block, **zero}})
        specs = [spec for specs in dry_run(cfg, world_size=4).plan.specs.values() for spec in specs]
        shards = [spec.numel for spec in specs if spec.kind is Kind.PARAM]
        assert all(n % multiple == 0 for n in shards), (zero, shards)
        if block == 8192 and zero:
            assert min(shards) == 8192  # the smallest unit pads up to one block a rank
