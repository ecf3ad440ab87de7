"""`offload: auto`: the planner's choices against every whole-kind placement, its budgets and
refusals, and runs of its split placements bitwise equal to a placement of whole kinds."""

from __future__ import annotations

import io
import itertools
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tierzero.cli import train as T
from tierzero.comm import dist as D
from tierzero.common.slices import Kind, SliceKey, Tier, align_up
from tierzero.config import ConfigError, load_config
from tierzero.engine.engine import Engine
from tierzero.engine.micro_step import micro_step
from tierzero.estimate.counting import Traffic
from tierzero.estimate.estimator import Bandwidth, estimate
from tierzero.models.builtin import build_model
from tierzero.placement import MachineBudgets, TierBudget
from tierzero.placement.planner import PlacementError, RankBudgets, plan_placement
from tierzero.placement.prediction import Part, predict
from tierzero.stages.plan import KIND_HOMES as KIND_FIELD
from tierzero.stages.plan import Homes

DISK = Bandwidth(read=2.0e9, write=3.0e9, source="test")
FLOPS = Bandwidth(read=1.0e11, write=1.0e11, source="test")
COPY = 5.0e9
STEP = 1.0e9
ALL_CPU = {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}


@pytest.fixture
def _fresh_dry_runs() -> None:
    """No test here patches what a dry run does: the module's tests share the dry runs kept
    (tests/conftest.py clears them before each test elsewhere)."""


@pytest.fixture(scope="module")
def swap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One swap directory for the module: its configs are then alike, and a dry run asked again is
    not re-run (estimate/dry_run.py keeps them)."""
    return tmp_path_factory.mktemp("swap")


def _raw(swap: Path, *, offload: Any = "auto", stage: int = 3, clipping: float = 0.0) -> dict[str, Any]:
    return {
        "zero": {"stage": stage, "unit_classes": ["Linear"]},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "gradient_clipping": clipping,
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "max_seq_len": 32},
        "data": {"max_bytes": "256KiB"},
        "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 32, "log_every": 1},
        "offload": offload,
        # No heap kept freed, whose room would cover this small model's state (tested on its own below).
        "tiers": {"nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}, "cpu": {"keep_freed": 0}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
    }


def _budgets(*, cpu: int | None, device: int | None = None, nvme: int | None = 1 << 40) -> MachineBudgets:
    return MachineBudgets(
        device=TierBudget(tier=Tier.DEVICE, nbytes=device, source="test"),
        cpu=TierBudget(tier=Tier.CPU, nbytes=cpu, source="test"),
        nvme=TierBudget(tier=Tier.NVME, nbytes=nvme, source="test"),
    )


def _plan(cfg: Any, budgets: MachineBudgets) -> Any:
    return plan_placement(cfg, budgets=budgets, disk=DISK, flops=FLOPS, copy_rate=COPY, step_rate=STEP)


def _host_budget(swap: Path, share: int) -> int:
    """What `_raw` needs of host memory with all its state on NVMe (the store's peaks, the
    activations and the heap kept freed), plus 1/`share` of its state's bytes."""
    raw = load_config(_raw(swap, offload={"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}))
    result = estimate(raw, disk=DISK, flops=FLOPS, suggest=False)
    assert result.activations
    device, cpu = RankBudgets.of(_budgets(cpu=None), raw).host_needs(result)
    return device + cpu + result.tiers[Tier.NVME].home_total // share


def test_auto_is_a_tier_choice_and_a_section_shorthand(swap: Path) -> None:
    cfg = load_config(_raw(swap))
    assert (cfg.offload.params, cfg.offload.gradients, cfg.offload.optimizer) == ("auto",) * 3
    assert cfg.offload.planned
    one = load_config(_raw(swap, offload={"params": "nvme", "optimizer": "AUTO"}))
    assert (one.offload.params, one.offload.gradients, one.offload.optimizer) == (Tier.NVME, Tier.DEVICE, "auto")
    with pytest.raises(ConfigError, match="offload.params: expected one of device, cpu, nvme, auto, got 'gpu'"):
        load_config(_raw(swap, offload={"params": "gpu"}))
    with pytest.raises(ConfigError, match="offload: expected a mapping of keys or auto, got 'cpu'"):
        load_config(_raw(swap, offload="cpu"))
    # The engine refuses to guess: auto is planned before it is built.
    model = build_model(cfg.model, device="meta", seed=0)
    ctx = D.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), created_group=False)
    with pytest.raises(ConfigError, match="offload is auto but no placement was planned"):
        Engine(model, cfg, ctx=ctx)


def test_a_units_home_may_differ_from_its_kinds_on_any_tier() -> None:
    homes = Homes(params=Tier.NVME, optimizer=Tier.NVME, units={("h.0", "optimizer"): Tier.DEVICE})
    assert homes.of("h.0", Kind.EXP_AVG) is Tier.DEVICE and homes.of("h.1", Kind.EXP_AVG) is Tier.NVME
    assert homes.tiers("optimizer") == {Tier.DEVICE, Tier.NVME} and homes.tiers("params") == {Tier.NVME}
    with pytest.raises(ValueError, match="no kind of state called 'states'"):
        Homes(units={("h.0", "states"): Tier.CPU})


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.CPU])
def test_every_units_slices_moved_by_overrides_replay_as_that_whole_kind_placement(tier: Tier, swap: Path) -> None:
    """Byte for byte: where the step runs, what it copies, each tier's peak. Optimizer states
    moved to the device step there, taking no copy of them to the host."""
    cfg = load_config(_raw(swap, offload=ALL_CPU))
    units = list(estimate(cfg, disk=DISK, flops=FLOPS).plan.specs)
    whole = Homes(params=tier, grads=tier, optimizer=tier)
    moved = Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.NVME, units={
        (u, what): tier for u in units for what in ("params", "grads", "optimizer")
    })  # fmt: skip
    a, b = (estimate(cfg, disk=DISK, flops=FLOPS, suggest=False, homes=h) for h in (whole, moved))
    assert (a.memory_copied, a.nvme_read, a.nvme_written) == (b.memory_copied, b.nvme_read, b.nvme_written)
    assert {t: e.peak for t, e in a.tiers.items()} == {t: e.peak for t, e in b.tiers.items()}


def test_a_stage_that_keeps_parameters_whole_refuses_one_units_parameters_elsewhere(swap: Path) -> None:
    cfg = load_config(_raw(swap, offload=ALL_CPU | {"params": "device"}, stage=2))
    model = build_model(cfg.model, device="meta", seed=0)
    ctx = D.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), created_group=False)
    homes = Homes(grads=Tier.CPU, optimizer=Tier.CPU, units={("blocks.0", "params"): Tier.CPU})
    with pytest.raises(ValueError, match="keeps full parameters on the device, got offload.params cpu"):
        Engine(model, cfg, ctx=ctx, homes=homes)


def _replayed(
    *, forward: Traffic, backward: Traffic, step: Traffic | None = None, units: int = 0, stepped_on_device: int = 0
) -> Any:
    """An estimate's fields `predict` reads: 3 s of compute (1 s forward, 2 s backward), 2,000
    elements stepped, a disk of 1,000 bytes/s both ways, the traffic by part as given; `units`
    units "u0", "u1"... of 1,000 parameters each."""
    from types import SimpleNamespace

    phases = {"forward": forward, "backward": backward, "step": step or Traffic()}
    read, written = (sum(getattr(t, what) for t in phases.values()) for what in ("read", "written"))
    specs = {f"u{i}": [SimpleNamespace(kind=Kind.PARAM, numel=1_000)] for i in range(units)}

    def stepped(*, on_device: bool | None = None) -> int:
        return {None: 2_000, True: stepped_on_device, False: 2_000 - stepped_on_device}[on_device]

    return SimpleNamespace(
        plan=SimpleNamespace(stepped_elements=stepped, specs=specs), compute_floor_s=3.0,
        io_floor_s=(read + written) / 1_000,
        memory_copied=sum(t.copied for t in phases.values()), disk=Bandwidth(read=1_000.0, write=1_000.0, source=""),
        phases=phases,
    )  # fmt: skip


def test_each_part_of_the_step_is_its_disk_beside_the_rest_which_adds_up_without_a_gpu() -> None:
    """4 s of disk in backward, beside 2 s of its compute, 1 s of optimizer and 0.5 s of copies:
    without a GPU those share the cores (3.5 s), so backward takes the disk's 4 s, after a forward
    of 1 s: 5 s, where the whole step's disk beside its whole rest (4.5 s) would say 4.5. With a
    GPU every part overlaps: the same here. The same disk in forward: 4 s beside 1 s, then 3.5 s."""
    result = _replayed(forward=Traffic(), backward=Traffic(read=3_000, written=1_000, copied=500, stepped=2_000))
    host = predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=False)
    assert (host.step_s, host.serial, host.io_s, host.optimizer_s, host.copy_s) == (5.0, True, 4.0, 1.0, 0.5)
    assert host.by_part() == "forward 1.00 s (compute), backward 4.00 s (disk), step 0.00 s (compute)"
    assert predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=True).step_s == 5.0
    result = _replayed(forward=Traffic(read=4_000), backward=Traffic(copied=500, stepped=2_000))
    assert predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=False).step_s == 7.5
    # A forward measured at a quarter of the compute: 0.75 s of it, beside 4 s of disk; backward 2.25 + 1.5.
    quarter = predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=False, forward_share=0.25)
    assert quarter.part_seconds() == {"forward": 4.0, "backward": 3.75, "step": 0.0}


def test_a_units_disk_hides_behind_the_work_before_it_in_the_part() -> None:
    """Backward's 3.5 s of rest is two units' work, 1.75 s each, and backward runs u1 then u0.
    2 s of disk for u1 come before any work: 2 + 1.75 + 1.75 = 5.5 s, where the whole part's disk
    beside its rest would say 3.5. The same 2 s for u0 run beside u1's work: u0 works from 2 s
    on, 3.75 s. Split, 1 s each: u1 works from 1 s to 2.75, u0's second ends at 2: 4.5 s."""
    kw = {"copy_rate": 1_000.0, "step_rate": 2_000.0, "cuda": False}
    for unit, backward in (("u1", 5.5), ("u0", 3.75)):
        one = Traffic(read=2_000, copied=500, stepped=2_000, by_unit={unit: [2_000, 0]})
        predicted = predict(_replayed(forward=Traffic(), backward=one, units=2), **kw)
        assert predicted.step_s == pytest.approx(1.0 + backward)
    both = Traffic(read=2_000, copied=500, stepped=2_000, by_unit={"u0": [1_000, 0], "u1": [1_000, 0]})
    assert predict(_replayed(forward=Traffic(), backward=both, units=2), **kw).step_s == pytest.approx(1.0 + 4.5)


def test_the_disk_runs_ahead_only_as_far_as_the_pipeline_holds() -> None:
    """(disk, work, bytes) per unit in order. Units in memory between disk-bound ones hide the disk
    of the next ones; the disk may read a unit only while the bytes read and not yet worked on
    leave room for it within the `ahead` largest units' bytes."""
    from tierzero.placement.prediction import pipelined

    assert pipelined([(1.0, 0.5, 10)] * 3) == 3.5  # disk-bound: the disk, then the last work
    assert pipelined([(0.0, 2.0, 0), (1.0, 0.5, 10)]) == 2.5  # its disk ran beside the first unit's work
    assert pipelined([(0.5, 1.0, 10)] * 3) == 3.5  # compute-bound: the first read, then the work
    # Room for one unit: each unit's disk waits for the work of the one before: (1 + 2) + (1 + 2) + (1 + 1).
    assert pipelined([(1.0, 2.0, 10), (1.0, 2.0, 10), (1.0, 1.0, 10)], ahead=1) == 8.0
    # Room for two: the second unit's disk runs beside the first's work, the third's once it is done (3 s):
    # then 4 s, while the second works until 5; the third works 5 to 6.
    assert pipelined([(1.0, 2.0, 10), (1.0, 2.0, 10), (1.0, 1.0, 10)], ahead=2) == 6.0
    # Room for one large unit holds three small ones: they are all read while the first works (to 3.5);
    # the large one waits until they are done, at 4.5: 5.5, then its work.
    assert pipelined([(0.5, 3.0, 10), (0.5, 0.5, 10), (0.5, 0.5, 10), (1.0, 1.0, 100)], ahead=1) == 6.5


def test_the_optimizer_counts_in_the_step_part_when_no_element_was_counted() -> None:
    """No stepped elements counted (an estimate without parts): the optimizer's 1 s is the step's own part."""
    result = _replayed(forward=Traffic(), backward=Traffic(read=2_000))
    host = predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=False)
    assert [part.optimizer_s for part in host.parts] == [0.0, 0.0, 1.0]
    assert host.step_s == 1.0 + 2.0 + 1.0


def test_with_a_gpu_the_units_whose_states_live_on_the_device_step_at_its_rate(swap: Path) -> None:
    """Of 2,000 elements, 500 step on the device at 20,000/s and 1,500 on the host at 2,000/s:
    0.775 s. Without a GPU every unit steps on the host. The counts are the plan's: the units whose
    optimizer states `Homes` puts on the device."""
    result = _replayed(forward=Traffic(), backward=Traffic(), stepped_on_device=500)
    gpu = predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=True, device_step_rate=20_000.0)
    assert gpu.optimizer_s == pytest.approx(1_500 / 2_000 + 500 / 20_000)
    host = predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=False, device_step_rate=20_000.0)
    assert host.optimizer_s == 1.0
    cfg = load_config(_raw(swap, offload=ALL_CPU))
    units = list(estimate(cfg, disk=DISK, flops=FLOPS).plan.specs)
    homes = Homes(params=Tier.CPU, grads=Tier.CPU, optimizer=Tier.CPU, units={(units[0], "optimizer"): Tier.DEVICE})
    plan = estimate(cfg, disk=DISK, flops=FLOPS, suggest=False, homes=homes).plan
    first = next(spec.numel for spec in plan.specs[units[0]] if spec.kind is Kind.EXP_AVG)
    assert plan.stepped_elements(on_device=True) == first
    assert plan.stepped_elements(on_device=False) == plan.stepped_elements() - first


def test_the_rest_slows_for_as_long_as_the_disk_works_beside_it() -> None:
    """Measured 1.2x slower beside the disk: backward's 3.5 s of rest does 2.5 s of its work in
    the 3 s the disk works beside it, the last 1 s after (4.0 s), after 1 s of forward with no
    disk beside it; under 9 s of disk, all of it (4.2 s, and the disk bounds backward); with no
    disk, none. A GPU's compute does not share the host's cores."""
    kw = {"copy_rate": 1_000.0, "step_rate": 2_000.0, "slowdown": 1.2}
    result = _replayed(forward=Traffic(), backward=Traffic(read=3_000, copied=500, stepped=2_000))
    assert predict(result, cuda=False, **kw).step_s == pytest.approx(5.0)
    assert predict(result, cuda=False, **{**kw, "slowdown": 3.5}).step_s == pytest.approx(1.0 + 3.5 + 3 * (1 - 1 / 3.5))
    # A disk that outlasts the rest slows all of it, and no more: 3.5 s of work at 1/1.2 speed take
    # 4.2 s, here after the one unit's 9 s of disk (the rest's work waits for its unit's bytes).
    part = Part(name="backward", io_s=9.0, compute_s=2.0, optimizer_s=1.0, copy_s=0.5, units=((9.0, 1.0, 10),))
    assert part.seconds(cuda=False, slowdown=1.2) == pytest.approx(9.0 + 4.2)
    gpu = predict(result, cuda=True, **kw)
    assert (gpu.step_s, gpu.slowdown) == (4.0, 1.0)
    result = _replayed(forward=Traffic(), backward=Traffic(read=9_000, copied=500, stepped=2_000))
    host = predict(result, cuda=False, **kw)
    assert (host.step_s, host.bound) == (10.0, "disk")
    result = _replayed(forward=Traffic(), backward=Traffic(copied=500, stepped=2_000))
    assert predict(result, cuda=False, **kw).step_s == 4.5


def test_a_step_part_that_steps_nothing_is_the_next_forwards_prefetch() -> None:
    """2 s of reads issued by the step part, which steps no element (all 2,000 in backward): the
    disk serves them while the next forward's 1 s computes, so the forward takes 2 s."""
    result = _replayed(forward=Traffic(), backward=Traffic(stepped=2_000), step=Traffic(read=2_000))
    host = predict(result, copy_rate=1_000.0, step_rate=2_000.0, cuda=False)
    assert [(p.name, p.io_s) for p in host.parts] == [("forward", 2.0), ("backward", 0.0), ("step", 0.0)]
    assert host.step_s == 2.0 + 3.0


@pytest.mark.parametrize(
    ("stage", "clipping", "stepped_in"),
    [(3, 0.0, ("backward",)), (3, 1.0, ("forward", "step")), (1, 0.0, ("step",))],
    ids=["stage3-in-backward", "stage3-clipped", "stage1"],
)
def test_the_replay_counts_each_byte_in_the_part_of_the_step_that_issues_it(
    stage: int, clipping: float, stepped_in: tuple[str, ...], swap: Path
) -> None:
    """Each unit is stepped where its stage steps it: stage 3 without clipping inside backward,
    writing every NVMe byte there; with clipping in the next forward's order (the first units
    when the step is asked for); stage 1 in the step, which reads and writes all the states
    there. The parts add up to the step's totals, and each part's units to the part's."""
    offload = {"optimizer": "nvme"} if stage == 1 else {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
    cfg = load_config(_raw(swap, offload=offload, stage=stage, clipping=clipping))
    result = estimate(cfg, disk=DISK, flops=FLOPS, suggest=False)
    phases, plan = result.phases, result.plan
    assert plan is not None and list(phases) == ["forward", "backward", "step"]
    # Stepped in backward, each unit's gradient is taken as autograd left it and each parameter
    # stepped as a slice of its own ([Note: gradient pieces]): the padding is not stepped.
    stepped = result.parameters if stepped_in == ("backward",) else plan.stepped_elements()
    assert sum(phases[name].stepped for name in stepped_in) == stepped
    assert result.parameters < plan.stepped_elements()
    assert all(phases[name].stepped > 0 for name in stepped_in)
    assert sum(t.read for t in phases.values()) == result.nvme_read
    assert sum(t.written for t in phases.values()) == result.nvme_written
    assert sum(t.copied for t in phases.values()) == result.memory_copied
    for traffic in phases.values():  # each NVMe byte also by the unit whose slice moved
        by_unit = [sum(column) for column in zip(*traffic.by_unit.values())] or [0, 0]
        assert by_unit == [traffic.read, traffic.written]
        assert set(traffic.by_unit) <= set(plan.specs)
    if stepped_in == ("backward",):
        assert phases["backward"].written == result.nvme_written > 0
    if stage == 1:
        assert (phases["step"].read, phases["step"].written) == (result.nvme_read, result.nvme_written)


@pytest.mark.parametrize("share", [8, 4, 1], ids=["eighth", "quarter", "whole"])
def test_the_plan_is_never_worse_than_any_whole_kind_placement(share: int, swap: Path) -> None:
    """Brute force over the 27 whole-kind placements, each replayed and predicted as the planner does:
    the plan fits the budget and predicts a step no longer than the best of those that fit."""
    cfg = load_config(_raw(swap))
    budgets = _budgets(cpu=_host_budget(swap, share))
    plan = _plan(cfg, budgets)
    rank = RankBudgets.of(budgets, cfg)
    assert not rank.shortfalls(plan.estimate)
    free = load_config(cfg, overrides={"tiers.cpu.capacity": None})
    best = float("inf")
    for p, g, o in itertools.product(Tier, repeat=3):
        result = estimate(free, disk=DISK, flops=FLOPS, suggest=False, homes=Homes(params=p, grads=g, optimizer=o))
        if not rank.shortfalls(result):
            best = min(best, predict(result, copy_rate=COPY, step_rate=STEP, cuda=False).step_s)
    assert plan.prediction.step_s <= best
    if share == 1:  # everything fits in memory (the working set shrinks with nothing on NVMe): no disk, no copies
        assert plan.homes == Homes(params=Tier.DEVICE, grads=Tier.DEVICE, optimizer=Tier.DEVICE)
    else:  # below what the whole state needs in memory: some of it lives on NVMe
        assert plan.estimate.tiers[Tier.NVME].home_total > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_slices_moved_into_memory_leave_room_for_the_heap_kept_freed(swap: Path) -> None:
    """`tiers.cpu.keep_freed` keeps freed heap resident: the slices the planner moves into memory leave
    room for it, at most the step's transient host bytes (store peaks beyond homes, and activations);
    a whole-kind placement still fits as the store counts."""
    raw = _raw(swap, offload={"params": "nvme", "gradients": "nvme", "optimizer": "nvme"})
    result = estimate(load_config(raw), disk=DISK, flops=FLOPS, suggest=False)
    device, cpu = result.tiers[Tier.DEVICE], result.tiers[Tier.CPU]
    transient = (device.peak - device.home_total) + (cpu.peak - cpu.uncounted - cpu.home_total) + result.activations
    assert transient > 8 << 10
    counted = (device.need + result.activations, cpu.need)
    for kept, more in [(0, 0), (4 << 10, 4 << 10), (1 << 30, transient)]:
        rank = RankBudgets.of(_budgets(cpu=1 << 30), load_config(raw, overrides={"tiers.cpu.keep_freed": kept}))
        assert rank.host_needs(result) == counted
        assert rank.host_needs(result, kept=True) == (counted[0], counted[1] + more)
        assert ("freed heap kept" in rank.sources[Tier.CPU]) == (kept > 0)
    # With it, less state moves into memory within the same budget, and the moves keep its room.
    budget = _budgets(cpu=_host_budget(swap, 16))
    plain, kept = (_plan(load_config(_raw(swap), overrides={"tiers.cpu.keep_freed": k}), budget) for k in (0, 1 << 20))
    assert "unit slices of optimizer in cpu" in plain.label
    assert kept.estimate.tiers[Tier.NVME].home_total > plain.estimate.tiers[Tier.NVME].home_total
    assert kept.budgets.shortfalls(plain.estimate, kept=True)  # the moves made without it are over with it
    # A budget of all on NVMe as the store counts it, with no room for the kept heap: still a plan.
    tight = _plan(load_config(_raw(swap), overrides={"tiers.cpu.keep_freed": 1 << 30}), _budgets(cpu=sum(counted)))
    assert not tight.homes.units and not tight.budgets.shortfalls(tight.estimate)
    assert tight.budgets.shortfalls(tight.estimate, kept=True)
    # Nor does it stop the moves into a device with a budget of its own (a GPU's memory).
    state = result.tiers[Tier.NVME].home_total
    gpu = _budgets(cpu=cpu.need, device=device.need + state // 4)
    moved = [
        _plan(load_config(raw, overrides={"offload": "auto", "tiers.cpu.keep_freed": k, "tiers.device.capacity": 1}), gpu)
        for k in (0, 1 << 30)
    ]
    assert " in device (" in moved[1].label and " in cpu (" not in moved[1].label
    assert moved[0].label.startswith(moved[1].label) and " in cpu (" in moved[0].label


def test_a_plan_that_cannot_fit_names_the_short_tier(swap: Path) -> None:
    cfg = load_config(_raw(swap))
    with pytest.raises(PlacementError, match=r"no placement fits .* cpu short by .*raise tiers.cpu.capacity by"):
        _plan(cfg, _budgets(cpu=1 << 20))
    with pytest.raises(PlacementError, match=r"nvme short by .*point tiers.nvme.path at a disk"):
        _plan(cfg, _budgets(cpu=1 << 20, nvme=1 << 20))


def test_budgets_are_split_among_a_machines_ranks(swap: Path) -> None:
    cfg = load_config(_raw(swap))
    two = RankBudgets.of(_budgets(cpu=8 << 30, device=4 << 30), cfg, local_world_size=2)
    assert (two.cpu, two.device, two.nvme) == (4 << 30, 2 << 30, 1 << 40)  # the disk's space is each rank's file
    given = load_config(cfg, overrides={"tiers.cpu.capacity": "3GiB"})
    assert RankBudgets.of(_budgets(cpu=3 << 30), given, local_world_size=2).cpu == 3 << 30  # a capacity is a rank's


def _trained(cfg: Any, homes: Homes) -> dict[str, torch.Tensor]:
    """Three steps of `cfg` placed by `homes`, on fixed batches; the weights after."""
    torch.manual_seed(0)
    model = build_model(cfg.model, device="meta", seed=0)
    ctx = D.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), created_group=False)
    batches = torch.randint(0, cfg.model.vocab_size, (3, 2, 2, 32))
    with Engine(model, cfg, ctx=ctx, homes=homes) as engine:
        for x, y in batches:
            micro_step(engine, x, y, is_hf=False)
        state = engine.full_state_dict()
    assert state is not None
    return state


@pytest.mark.parametrize("clipping", [0.0, 1.0], ids=["step-in-backward", "step-after-backward"])
@pytest.mark.parametrize("moved", [Tier.CPU, Tier.DEVICE])
def test_a_split_placement_trains_bitwise_as_whole_kinds(moved: Tier, clipping: float, swap: Path) -> None:
    """Every other unit's slices on `moved`, the rest on NVMe; on the device, those units step there."""
    cfg = load_config(_raw(swap, clipping=clipping))
    units = list(estimate(load_config(_raw(swap, offload=ALL_CPU)), disk=DISK, flops=FLOPS).plan.specs)
    half = {(u, what): moved for u in units[::2] for what in ("params", "grads", "optimizer")}
    split = Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.NVME, units=half)
    whole = _trained(cfg, Homes(params=Tier.CPU, grads=Tier.CPU, optimizer=Tier.CPU))
    mixed = _trained(cfg, split)
    assert whole.keys() == mixed.keys()
    for name in whole:
        assert torch.equal(whole[name], mixed[name]), name


def test_a_checkpoint_resumes_bitwise_under_another_plan(tmp_path: Path, swap: Path) -> None:
    """The planner may place a resumed run otherwise (the machine's free memory, the disk's rates):
    saved with everything on NVMe, loaded with units split over the three tiers, the run goes on
    as it would have."""
    cfg = load_config(_raw(swap))
    units = list(estimate(load_config(_raw(swap, offload=ALL_CPU)), disk=DISK, flops=FLOPS).plan.specs)
    nvme = Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.NVME)
    fields = ("params", "grads", "optimizer")
    moved = {(u, what): tier for u, tier in zip(units, itertools.cycle(Tier)) for what in fields}
    split = Homes(params=Tier.CPU, grads=Tier.CPU, optimizer=Tier.CPU, units=moved)
    ctx = D.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), created_group=False)
    batches = torch.randint(0, cfg.model.vocab_size, (4, 2, 2, 32), generator=torch.Generator().manual_seed(0))

    def run(homes: Homes, steps: slice, *, save: bool = False, load: bool = False) -> dict[str, torch.Tensor]:
        with Engine(build_model(cfg.model, device="meta", seed=1 if load else 0), cfg, ctx=ctx, homes=homes) as engine:
            if load:
                engine.load_checkpoint(tmp_path / "ckpt")
            for x, y in batches[steps]:
                micro_step(engine, x, y, is_hf=False)
            if save:
                engine.save_checkpoint(tmp_path / "ckpt")
            state = engine.full_state_dict()
        assert state is not None
        return state

    run(nvme, slice(0, 2), save=True)
    uninterrupted = run(nvme, slice(0, 4))
    resumed = run(split, slice(2, 4), load=True)
    for name, value in uninterrupted.items():
        assert torch.equal(value, resumed[name]), name


def test_tierzero_train_plans_logs_and_reports_the_placement(swap: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierzero import api

    budget = _host_budget(swap, 4)
    monkeypatch.setattr(api, "plan_placement", lambda cfg, **kw: _plan(cfg, _budgets(cpu=budget)))
    reports: list[dict[str, Any]] = []
    real = Engine.memory_report
    monkeypatch.setattr(Engine, "memory_report", lambda engine: reports.append(real(engine)) or reports[-1])
    out = io.StringIO()
    summary = T.train(load_config(_raw(swap)), progress=False, out=out)
    assert summary.steps == 3
    text = out.getvalue()
    assert "placement (offload: auto), per rank:" in text and "predicted step" in text
    assert summary.predicted_step_s == reports[-1]["planned"]["predicted_step_s"]
    assert f"planned step         predicted {summary.predicted_step_s:.2f} s, measured " in text
    assert f"  by part              forward {summary.predicted_parts['forward']:.2f} s predicted, " in text
    # Each step's parts (forward, backward, step) lie within it, and take most of it.
    for parts, step in zip(summary.part_seconds, summary.step_seconds, strict=True):
        assert list(parts) == ["forward", "backward", "step"]
        assert 0.5 * step < sum(parts.values()) <= step
    planned = reports[-1]["planned"]
    placed = reports[-1]["placement"]
    assert planned["predicted_step_s"] > 0 and planned["nvme_home"] > 0
    # The report's bytes by home are the plan's homes: what lives on nvme is what the plan put there.
    assert sum(placed["nvme"].values()) == planned["nvme_home"]


def test_tierzero_estimate_prints_the_plan(tmp_path: Path, swap: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json

    import yaml

    from tierzero.cli.estimate import add_estimate_command, run_estimate

    config = tmp_path / "auto.yaml"
    config.write_text(yaml.safe_dump(_raw(swap)))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"best": {"read_GBps": 2.0, "write_GBps": 3.0}}))

    def cli(*argv: str) -> tuple[int, str]:
        parser = argparse.ArgumentParser(prog="tierzero")
        add_estimate_command(parser.add_subparsers(dest="command", required=True))
        out = io.StringIO()
        given = ["--config", str(config), "--nvme-bench", str(bench), "--flops", "100"]
        args = parser.parse_args(["estimate", *given, *argv])
        return run_estimate(args, out=out), out.getvalue()

    rc, table = cli()
    assert rc == 0 and "placement (offload: auto), per rank:" in table and "predicted step" in table
    assert "by part, each its disk beside the rest: forward " in table
    # What the planner does meanwhile goes to stderr, beside the report: the rates are given, so only the
    # replays, a line each as it ends (its time, the placement, its prediction or shortfall), then the total.
    said = capsys.readouterr().err.splitlines()
    assert said[0] == "planning: replaying the step for each candidate placement" and len(said) >= 3
    assert all(re.fullmatch(r"planning: replay \d+, \d+\.\d s: params .*: .*(predicted|short by .*)", s) for s in said[1:-1])
    assert re.fullmatch(rf"planning: {len(said) - 2} replays of \d+ placements in \d+\.\d s", said[-1])
    rc, text = cli("--json")
    placement = json.loads(text)["placement"]
    assert rc == 0 and placement["predicted_step_s"] > 0
    assert list(placement["parts_s"]) == ["forward", "backward", "step"]
    assert sum(placement["parts_s"].values()) == pytest.approx(placement["predicted_step_s"])
    assert placement["homes"].keys() == {"params", "grads", "optimizer"}
    # None fits: DOES NOT FIT, what the nearest lacks and what would fit, and exit 1.
    rc, text = cli("--set", "tiers.cpu.capacity=2MiB", "--set", "tiers.device.capacity=1MiB")
    assert rc == 1 and "DOES NOT FIT:\n  the nearest placement (" in text and " short by " in text
    assert "\nto make it fit:\n  - raise tiers." in text


def test_the_rates_are_measured_on_this_machine(swap: Path) -> None:
    from tierzero.placement.compute import measure_block_flops
    from tierzero.placement.prediction import measure_copy_rate, measure_step_rate

    cfg = load_config(_raw(swap))
    flops = measure_block_flops(cfg, seconds=0.03)
    assert flops is not None and flops.read > 1e8
    assert "one gpt block's forward and backward at 2x32 tokens" in flops.source  # a micro-batch at train.seq_len
    assert measure_copy_rate(1 << 20) > 1e8  # bytes/s of a host copy
    assert measure_step_rate(cfg, numel=1 << 16) > 1e6  # elements/s of the engine's AdamW kernel


def test_the_compute_rate_is_one_block_of_the_model_trained_at_the_training_shape(
    swap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierzero.models.builtin import LlamaBlock, spec_from_config
    from tierzero.placement import compute

    raw = _raw(swap)
    cfg = load_config({**raw, "model": {**raw["model"], "type": "llama"}})
    passes: list[tuple[int, ...]] = []

    def timed(
        block: torch.nn.Module, x: torch.Tensor, extra: tuple[torch.Tensor, ...], device: torch.device
    ) -> tuple[float, float]:
        passes.append((*x.shape, len(extra)))
        return 0.2, 0.5

    monkeypatch.setattr(compute, "_timed_pass", timed)
    flops = compute.measure_block_flops(cfg, seconds=0.0)
    block = sum(p.numel() for p in LlamaBlock(spec_from_config(cfg.model)).parameters())
    assert flops is not None and flops.read == 6.0 * block * 2 * 32 / 0.5  # 6 x a block's parameters x tokens / median
    assert passes == [(2, 32, 128, 2)] * 4  # a warm-up and three timed passes, with the rotary tables
    transformers = {"type": "transformers", "transformers_class": "GPT2LMHeadModel", "transformers_config": {}}
    assert compute.measure_block_flops(load_config({**raw, "model": transformers})) is None


def test_a_tight_device_lowers_the_prefetchers_budgets_and_the_run_keeps_within_it(
    swap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierzero import api

    nvme = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
    result = estimate(load_config(_raw(swap, offload=nvme)), disk=DISK, flops=FLOPS, suggest=False)
    device = result.tiers[Tier.DEVICE]
    # Under what the default prefetcher keeps; the fetched peak also holds slices that forward
    # gathers lend (world size 1), which no prefetch budget lowers: a third of it, not half.
    capacity = device.need - device.working["fetched"] // 3
    # Parameters on NVMe: in host memory, a forward's gather would be the home itself, no device byte.
    partly = _raw(swap, offload={"params": "nvme", "gradients": "auto", "optimizer": "auto"})
    raw = {**partly, "tiers": {**partly["tiers"], "device": {"capacity": capacity}}}
    budgets = _budgets(cpu=1 << 30, device=capacity)
    plan = _plan(load_config(raw), budgets)
    # The kind the config places stays there, every unit of it: no slice of it is moved to cpu.
    assert plan.homes.params is Tier.NVME and [what for _, what in plan.homes.units if what == "params"] == []
    assert plan.overrides["prefetch.max_live_bytes"] < load_config(raw).prefetch.max_live_bytes
    assert plan.estimate.tiers[Tier.DEVICE].need <= capacity
    assert "the prefetcher's budgets lowered to fit the device" in "\n".join(plan.lines())
    # The run takes the lowered budgets: its device tier (capacity enforced) never refuses a byte.
    monkeypatch.setattr(api, "plan_placement", lambda cfg, **kw: _plan(cfg, budgets))
    summary = T.train(load_config(raw), progress=False, out=io.StringIO())
    assert summary.steps == 3 and summary.peak_tier_bytes["device"] <= capacity


def test_nvme_slices_fill_the_device_first_then_host_memory_and_a_shortfall_shrinks_its_tier(swap: Path) -> None:
    """`fill` moves the slices that save most disk time per byte (the replay's reads and writes of
    them) first, each to the first memory tier with room: the device's, then the host's. The
    replay's shortfall of one tier shrinks that tier's share alone."""
    from tierzero.placement.candidates import FIELDS, Candidate, fill

    nvme = Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.NVME)
    result = estimate(load_config(_raw(swap, offload=ALL_CPU)), disk=DISK, flops=FLOPS, suggest=False, homes=nvme)
    base = Candidate(homes=nvme, label="nvme", result=result)
    sizes: dict[tuple[str, str], int] = {}
    saves: dict[tuple[str, str], float] = {}
    for unit, specs in result.plan.specs.items():
        for spec in specs:
            key = (unit, KIND_FIELD[spec.kind])
            read, written = result.nvme_by_slice.get(SliceKey(unit, spec.kind), (0, 0))
            sizes[key] = sizes.get(key, 0) + align_up(spec.nbytes)
            saves[key] = saves.get(key, 0.0) + read / DISK.read + written / DISK.write
    judged: list[Candidate] = []

    def judge(candidate: Candidate) -> Candidate:
        judged.append(candidate)
        candidate.short = {Tier.DEVICE: 1} if shorts and len(judged) == 1 else {}
        return candidate

    def held(candidate: Candidate, tier: Tier) -> list[tuple[str, str]]:
        return [key for key, to in candidate.homes.units.items() if to is tier]

    def per_byte(keys: list[tuple[str, str]]) -> list[float]:
        return [saves[key] / sizes[key] for key in keys]

    total, shorts = sum(sizes.values()), False
    (first,) = fill(base, {Tier.DEVICE: total // 3, Tier.CPU: total // 4}, judge, disk=DISK, auto=set(FIELDS))
    device, cpu = held(first, Tier.DEVICE), held(first, Tier.CPU)
    rest = [key for key in sizes if key not in first.homes.units]
    assert device and cpu and sum(sizes[k] for k in device) <= total // 3 and sum(sizes[k] for k in cpu) <= total // 4
    # The device took the dearest bytes; no gradient moves (handed to the step, they cost no disk time).
    assert min(per_byte(device)) >= max(per_byte(cpu + rest)) * 0.999
    assert "grads" not in {what for _, what in first.homes.units} and any(saves[k] == 0 for k in rest)
    assert first.label.startswith("nvme; ") and " in device (" in first.label and " in cpu (" in first.label
    # Room on the device for every slice that saves, short by a byte once replayed: the second try
    # holds less there than the first did, however much room was left over; the cpu tier's room stays.
    judged.clear()
    shorts = True
    rooms = {Tier.DEVICE: total, Tier.CPU: total // 4}
    first, second = fill(base, rooms, judge, disk=DISK, auto=set(FIELDS))
    assert held(first, Tier.CPU) == [] and sum(sizes[k] for k in held(first, Tier.DEVICE)) < total
    assert 0 < sum(sizes[k] for k in held(second, Tier.DEVICE)) < sum(sizes[k] for k in held(first, Tier.DEVICE))
    assert sum(sizes[k] for k in held(second, Tier.CPU)) <= total // 4


def test_a_device_budget_of_its_own_is_filled_too_and_the_run_keeps_within_it(
    swap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device tier with its own capacity (as a GPU's): the planner weighs placements that move units'
    NVMe slices into it, and its plan predicts no worse than any whole-kind placement that fits
    and trains within it."""
    from tierzero import api

    state = estimate(load_config(_raw(swap, offload=ALL_CPU)), disk=DISK, flops=FLOPS).tiers[Tier.CPU].home_total
    raw = _raw(swap)
    raw["tiers"]["device"] = {"capacity": state // 4}
    cfg = load_config(raw)
    # Host memory for the working set with everything on NVMe, and a sixth of the state: room
    # for a whole kind's homes and the gradients a step in backward holds beside them.
    nvme = Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.NVME)
    working = estimate(cfg, disk=DISK, flops=FLOPS, suggest=False, homes=nvme).tiers[Tier.CPU].need
    budgets = _budgets(cpu=working + state // 6, device=state // 4)
    plan = _plan(cfg, budgets)
    rank = RankBudgets.of(budgets, cfg)
    assert not rank.shortfalls(plan.estimate) and not rank.shared_host
    assert any(" in device (" in label and "predicted" in why for label, why in plan.considered)
    best = min(
        predict(result, copy_rate=COPY, step_rate=STEP, cuda=False).step_s
        for p, g, o in itertools.product(Tier, repeat=3)
        if not rank.shortfalls(result := estimate(cfg, disk=DISK, flops=FLOPS, suggest=False, homes=Homes(p, g, o)))
    )
    assert plan.prediction.step_s <= best
    monkeypatch.setattr(api, "plan_placement", lambda cfg, **kw: _plan(cfg, budgets))
    summary = T.train(cfg, progress=False, out=io.StringIO())
    assert summary.steps == 3 and summary.peak_tier_bytes["device"] <= state // 4


def test_units_that_save_alike_are_moved_spread_over_the_step() -> None:
    """Among slices that save as much disk time per byte, the first n moved to memory are spread
    evenly over the units' order, so that the step pipeline reads the others while they compute."""
    from tierzero.placement.candidates import spread_order

    units = [f"u{i}" for i in range(10)]
    rank = spread_order(units)
    order = sorted(units, key=rank.__getitem__)
    assert sorted(rank.values()) == list(range(10))
    assert order[:2] == ["u0", "u5"] and set(order[:4]) == {"u0", "u2", "u5", "u7"}
    assert spread_order(["only"]) == {"only": 0} and spread_order([]) == {}


def test_the_plan_takes_the_measured_compute_its_slowdown_and_forward_share(
    swap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unless a rate is given, the planner measures the block (`measure_compute`) and predicts with
    all three of its figures: the forward then takes its measured share of the compute."""
    from tierzero.placement import planner
    from tierzero.placement.compute import Compute

    monkeypatch.setattr(planner, "measure_compute", lambda cfg: Compute(flops=FLOPS, slowdown=1.5, forward_share=0.2))
    cfg = load_config(_raw(swap, offload="auto"))
    plan = plan_placement(cfg, budgets=_budgets(cpu=1 << 40), disk=DISK, copy_rate=COPY, step_rate=STEP)
    given = _plan(cfg, _budgets(cpu=1 << 40))  # a given rate: a third, and no slowdown
    assert plan.homes == given.homes and plan.prediction.slowdown == 1.5 and given.prediction.slowdown == 1.0
    forward = plan.prediction.parts[0]
    assert forward.name == "forward" and forward.compute_s == pytest.approx(0.2 * plan.prediction.compute_s)
    assert given.prediction.parts[0].compute_s == pytest.approx(given.prediction.compute_s / 3)
