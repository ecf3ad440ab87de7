"""`tierzero estimate` against measured runs of `tierzero train`, its not-fit advice, and its command."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

import tierzero.cli.train as T
from tierzero.cli.estimate import add_estimate_command, format_estimate, run_estimate, to_json
from tierzero.common.sizes import format_size
from tierzero.common.slices import MODEL_STATE_KINDS, Kind, Tier
from tierzero.config import load_config
from tierzero.engine.engine import Engine
from tierzero.estimate import Bandwidth, estimate, estimator
from tierzero.estimate import dry_run as dry_runs
from tierzero.models.builtin import GPT, ModelSpec, count_parameters
from tierzero.offload.base import TierCapacityError
from tierzero.placement import machine_budgets
from tierzero.stages import Stage3

REPO = Path(__file__).resolve().parents[2]
# A run's measured peaks are held to 10% of the estimate both ways, and how near the bound a
# run comes hangs on how far its I/O threads get ahead: `make test` runs these alone on the cores.
pytestmark = pytest.mark.serial


def _raw(
    tmp_path: Path,
    *,
    stage: int,
    params: str,
    grads: str,
    optimizer: str,
    dtype: str = "fp32",
    n_layer: int = 3,
    unit_classes: tuple[str, ...] = (),
) -> dict[str, Any]:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return {
        "zero": {"stage": stage, "unit_classes": list(unit_classes)},
        "precision": {"param_dtype": dtype},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "gradient_clipping": 1.0,
        "model": {"type": "gpt", "n_layer": n_layer, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 32},
        "data": {"max_bytes": "256KiB"},
        "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 32, "log_every": 1},
        "offload": {"params": params, "gradients": grads, "optimizer": optimizer},
        "tiers": {"nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
    }


def _train(raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[T.RunSummary, dict[str, Any]]:
    """`tierzero train` on `raw`; the summary, and the engine's last memory report (kinds included)."""
    reports: list[dict[str, Any]] = []
    real = Engine.memory_report

    def recording(engine: Engine) -> dict[str, Any]:
        reports.append(real(engine))
        return reports[-1]

    monkeypatch.setattr(Engine, "memory_report", recording)
    summary = T.train(load_config(raw), progress=False, out=io.StringIO())
    assert summary.steps == raw["train"]["steps"] and all(loss == loss for loss in summary.losses)
    return summary, reports[-1]


PLACEMENTS = [
    (2, "device", "cpu", "cpu", "fp32", ()),
    (2, "device", "cpu", "nvme", "bf16", ()),
    (3, "nvme", "cpu", "nvme", "fp32", ()),
    (3, "nvme", "nvme", "nvme", "bf16", ()),
    (3, "cpu", "cpu", "cpu", "bf16", ()),
    (3, "device", "device", "device", "fp32", ()),
    (3, "nvme", "nvme", "nvme", "fp32", ("Linear",)),  # configs/oversized.yaml's layout, small
]
# Without clipping, stage 3 steps each unit during the backward (Engine._steps_in_backward).
# Its write-backs may land before the next unit's states are read, or not: with states on
# NVMe a run peaks one step group below the estimate's bound or at it, so these cases keep
# the states in host memory, where the step fetches nothing.
IN_BACKWARD = [(3, "nvme", "cpu", "cpu", "bf16", ("Linear",)), (3, "cpu", "cpu", "cpu", "fp32", ())]


# The oversized layout with 96 KiB of its NVMe slices cached in host memory (tiers.nvme.cache).
CACHED = (3, "nvme", "nvme", "nvme", "fp32", ("Linear",), 1.0, 96 << 10)


@pytest.mark.parametrize(
    ("stage", "params", "grads", "optimizer", "dtype", "unit_classes", "clipping", "cache"),
    [(*p, 1.0, 0) for p in PLACEMENTS] + [(*p, 0.0, 0) for p in IN_BACKWARD] + [CACHED],
)
def test_estimate_matches_measured_run(
    stage: int,
    params: str,
    grads: str,
    optimizer: str,
    dtype: str,
    unit_classes: tuple[str, ...],
    clipping: float,
    cache: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = _raw(
        tmp_path, stage=stage, params=params, grads=grads, optimizer=optimizer, dtype=dtype, unit_classes=unit_classes
    )
    raw["gradient_clipping"] = clipping
    raw["tiers"]["nvme"]["cache"] = cache
    _check_estimate(raw, monkeypatch, cache=cache)


@pytest.mark.parametrize("stage", [1, 3])
def test_estimate_matches_an_autocast_run(stage: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 linear layers beside fp32 embeddings and norms: the dry run casts as autocast does (MetaAutocast)."""
    offload = ("nvme", "nvme", "nvme") if stage == 3 else ("device", "device", "cpu")
    raw = _raw(tmp_path, stage=stage, params=offload[0], grads=offload[1], optimizer=offload[2], dtype="bf16")
    raw["precision"]["autocast"] = True
    _check_estimate(raw, monkeypatch, cache=0)


def _check_estimate(raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch, *, cache: int) -> None:
    predicted = estimate(load_config(raw))
    summary, report = _train(raw, monkeypatch)

    kinds = {k.value: sum(t.homes[k] for t in predicted.tiers.values()) for k in MODEL_STATE_KINDS}
    assert kinds == report["kinds"]
    assert summary.state_bytes == sum(kinds.values())
    for tier, est in predicted.tiers.items():
        measured = summary.peak_tier_bytes.get(tier.value, 0)
        assert abs(est.peak - measured) <= 0.10 * measured, (tier, est.peak, measured, est.working)
        if tier is Tier.NVME:
            assert est.peak == measured  # the NVMe ledger holds homes only: exact
    # The cache keeps the set set-up filled: the estimate's bytes are the run's, exactly.
    assert predicted.tiers[Tier.CPU].working.get("cache", 0) == report["nvme_cache"] == (81920 if cache else 0)


def test_cpu_too_small_says_so_and_its_fixes_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Eight blocks: the NVMe step pipeline holds three units' states in host memory, a fraction of all.
    raw = _raw(tmp_path, stage=2, params="device", grads="device", optimizer="cpu", n_layer=8)
    unbounded = estimate(load_config(raw))
    need = unbounded.tiers[Tier.CPU].need
    raw["tiers"]["cpu"] = {"capacity": need // 2}
    cfg = load_config(raw)
    result = estimate(cfg)

    assert not result.fits
    assert result.problems == [
        f"cpu tier needs {format_size(need)} per rank at peak, tiers.cpu.capacity is {format_size(need // 2)}"
    ]
    moved = estimate(load_config(cfg, overrides={"offload.optimizer": "nvme"}))
    assert moved.tiers[Tier.CPU].need <= need // 2
    assert (
        f"move optimizer states to nvme (offload.optimizer: nvme): cpu need drops from {format_size(need)} "
        f"to {format_size(moved.tiers[Tier.CPU].need)}"
    ) in result.fixes
    assert result.fixes[-1] == f"raise tiers.cpu.capacity to {format_size(need)} ({need} bytes)"

    # The engine agrees: as configured it does not fit; each suggested change trains.
    with pytest.raises(TierCapacityError, match="^cpu tier is full"):
        _train(raw, monkeypatch)
    _train({**raw, "offload": {**raw["offload"], "optimizer": "nvme"}}, monkeypatch)
    _train({**raw, "tiers": {**raw["tiers"], "cpu": {"capacity": need}}}, monkeypatch)


def test_a_cache_the_cpu_tier_cannot_hold_says_how_much_to_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = _raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme", unit_classes=("Linear",))
    nvme = raw["tiers"]["nvme"]
    # A capacity throughout, as below: an open one would also hold gradients for the clipped step beside
    # their homes where the host has room ([Note: held gradient pieces]), which a capacity never does.
    raw["tiers"]["cpu"] = {"capacity": 1 << 40}
    plain = estimate(load_config(raw)).tiers[Tier.CPU]
    raw["tiers"]["nvme"] = {**nvme, "cache": 96 << 10}
    cached = estimate(load_config(raw)).tiers[Tier.CPU]
    # The slices set-up wrote first fill 80 KiB of the 96, kept all run: the peak grows by them.
    assert cached.working["cache"] == cached.need - plain.need == 80 << 10
    raw["tiers"]["cpu"] = {"capacity": plain.need + (40 << 10)}
    result = estimate(load_config(raw))
    assert result.problems == [
        f"cpu tier needs {format_size(cached.need)} per rank at peak, tiers.cpu.capacity is "
        f"{format_size(plain.need + (40 << 10))}"
    ]
    assert result.fixes[0] == (
        f"lower tiers.nvme.cache to 40.0 KiB (40960 bytes): cpu need drops from {format_size(cached.need)} "
        f"to {format_size(plain.need + (40 << 10))}"
    )
    _train({**raw, "tiers": {**raw["tiers"], "nvme": {**nvme, "cache": 40 << 10}}}, monkeypatch)


def test_the_estimate_steps_until_the_cache_settles_and_gives_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 block units: the cache trades a few slices set-up took in the first steps."""
    raw = _raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme", dtype="bf16")
    raw["tiers"]["nvme"]["cache"] = 256 << 10
    raw["train"]["steps"] = 5
    result = estimate(load_config(raw))
    assert result.steps == 3
    assert "nvme per step: read 1.8 MiB, write 2.1 MiB (step 3, once the nvme cache has settled)" in format_estimate(
        result
    )
    summary, _ = _train(raw, monkeypatch)
    # The run's second step still reads 200 KiB more; from the third on, each step is the estimate's.
    for read, written in summary.nvme_steps[2:]:
        assert written == result.nvme_written
        assert result.nvme_read <= read <= 1.10 * result.nvme_read


@pytest.mark.parametrize("cache", [0, 96 << 10], ids=["uncached", "cached"])
@pytest.mark.parametrize("grads", ["cpu", "nvme"])
@pytest.mark.parametrize("clipping", [1.0, 0.0], ids=["step-after-backward", "step-in-backward"])
def test_nvme_traffic_and_step_floor(
    clipping: float, grads: str, cache: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierzero.offload.nvme import NvmeTier

    # Linear units, as configs/oversized.yaml: many small steps, each one's write-back still
    # pending when the next backward asks the pipeline for room.
    raw = _raw(tmp_path, stage=3, params="nvme", grads=grads, optimizer="nvme", unit_classes=("Linear",))
    raw["gradient_clipping"] = clipping
    raw["tiers"]["nvme"]["cache"] = cache
    disk = Bandwidth(read=2.0e9, write=1.0e9, source="test")
    flops = Bandwidth(read=1.0e11, write=1.0e11, source="test")
    result = estimate(load_config(raw), disk=disk, flops=flops)

    moved = {"read": 0, "write": 0}
    real_read, real_write = NvmeTier.submit_read, NvmeTier.submit_write

    def read(tier: NvmeTier, region: Any, dst: Any, **kw: Any) -> Any:
        moved["read"] += dst.numel() * dst.element_size()
        return real_read(tier, region, dst, **kw)

    def write(tier: NvmeTier, region: Any, src: Any, **kw: Any) -> Any:
        moved["write"] += src.numel() * src.element_size()
        return real_write(tier, region, src, **kw)

    monkeypatch.setattr(NvmeTier, "submit_read", read)
    monkeypatch.setattr(NvmeTier, "submit_write", write)
    _train(raw, monkeypatch)
    # Writes: every NVMe-homed slice once when the engine registers it, then each step's (the
    # first step's part that ran before the second forward, then a whole step's per step:
    # with clipping, the step waits for the next forward, and close drops what none reached).
    # Reads follow the prefetcher: the learning step reads each shard on demand, later ones
    # keep a shard resident for its next use; the step in backward takes the backward's
    # parameters as its master where the pipeline has room, which the estimate takes it always has.
    assert moved["write"] == result.nvme_written_setup + result.nvme_written_first + 2 * result.nvme_written
    kept = result.tiers[Tier.NVME].home_total - result.nvme_written_setup  # first values the cache took
    assert kept == 0 if cache == 0 else 0 < kept <= cache
    assert result.tiers[Tier.CPU].working.get("cache", 0) <= cache  # evictions land before their successors enter
    if cache:
        # Each slice the cache took at set-up is read and written once a step, in memory now.
        plain = estimate(load_config({**raw, "tiers": {**raw["tiers"], "nvme": {**raw["tiers"]["nvme"], "cache": 0}}}))
        assert (plain.nvme_read - result.nvme_read, plain.nvme_written - result.nvme_written) == (kept, kept)
    if clipping == 0.0:
        assert result.nvme_written_first == result.nvme_written  # the step ran in backward: whole
        assert result.nvme_read_first > result.nvme_read  # the forward's shards kept for the backward
    expected_read = result.nvme_read_first + 2 * result.nvme_read
    # A write-back still landing when the pipeline is asked for room costs the real run a read
    # (a loaded machine): never fewer bytes than the estimate, a few percent more at most.
    assert expected_read <= moved["read"] <= 1.10 * expected_read, (moved, result.nvme_read_first, result.nvme_read)

    assert result.io_floor_s == pytest.approx(result.nvme_read / 2.0e9 + result.nvme_written / 1.0e9)
    params = count_parameters(GPT(ModelSpec(n_layer=3, n_head=2, d_model=64, d_ff=256, max_seq_len=32)))
    assert result.compute_floor_s == pytest.approx(6 * params * 2 * 32 / 1.0e11)
    assert result.step_floor_s == max(result.io_floor_s, result.compute_floor_s)


def _cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tierzero")
    add_estimate_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["estimate", *argv])
    out = io.StringIO()
    return run_estimate(args, out=out), out.getvalue()


def test_command_json_table_and_bench_file(tmp_path: Path) -> None:
    raw = _raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"best": {"read_GBps": 2.5, "write_GBps": 1.25}}))

    rc, text = _cli(["--config", str(config), "--nvme-bench", str(bench), "--json", "--flops", "50"])
    data = json.loads(text)
    expected = estimate(load_config(raw), world_size=1)
    assert rc == 0 and data["fits"] is True
    assert {t: v["peak"] for t, v in data["tiers"].items()} == {t.value: e.peak for t, e in expected.tiers.items()}
    assert data["disk"]["read_Bps"] == 2.5e9 and data["disk"]["write_Bps"] == 1.25e9
    assert data["time"]["io_floor_s"] == pytest.approx(expected.nvme_read / 2.5e9 + expected.nvme_written / 1.25e9)
    assert data["flops"]["rate"] == 50e9

    rc, table = _cli(["--config", str(config), "--set", "tiers.device.capacity=64KiB", "--world-size", "2"])
    assert rc == 1
    assert "zero stage 3, world size 2" in table and "DOES NOT FIT:" in table
    assert "  - raise tiers.device.capacity to " in table

    bench.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match=r"^--nvme-bench .*bench\.json: expected `tierzero bench nvme --json` results"):
        _cli(["--config", str(config), "--nvme-bench", str(bench)])


def test_a_bench_file_gives_the_rates_at_the_config_s_own_setting(tmp_path: Path) -> None:
    """A sweep that ran the config's I/O setting gives its rates there; else its best point's."""
    from tierzero.cli.estimate import load_bench

    def run(direction: str, queue_depth: int, gbps: float) -> dict[str, object]:
        return {"direction": direction, "block_size": 8 << 20, "queue_depth": queue_depth, "threads": 8,
                "backend": "pread", "GBps": gbps}

    bench = tmp_path / "bench.json"
    runs = [run("read", 16, 3.0), run("write", 16, 2.0), run("read", 4, 4.0), run("write", 4, 5.0)]
    bench.write_text(json.dumps({"best": {"read_GBps": 4.0, "write_GBps": 5.0}, "runs": runs}))
    nvme = load_config({}).tiers.nvme  # 8 MiB blocks, queue depth 16, 8 threads, pread
    own = load_bench(str(bench), nvme=nvme)
    assert own is not None and (own.read, own.write) == (3.0e9, 2.0e9)
    assert own.source.startswith(f"bench nvme {bench} at 8.0 MiB qd16 t8 pread: 3.00 GB/s read")
    elsewhere = load_bench(str(bench), nvme=load_config({"tiers": {"nvme": {"threads": 2}}}).tiers.nvme)
    assert elsewhere is not None and (elsewhere.read, elsewhere.write) == (4.0e9, 5.0e9)
    assert elsewhere.source.startswith(f"bench nvme {bench} at best point: ")


def test_oversized_preset_is_a_2b_model_with_32gb_of_state(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "oversized.yaml", overrides={"tiers.nvme.path": str(tmp_path)})
    result = estimate(cfg, suggest=False)
    assert result.parameters >= 2_000_000_000
    total = sum(sum(t.homes.values()) for t in result.tiers.values())
    assert total >= 16 * result.parameters  # fp32 param, grad, exp_avg, exp_avg_sq: 32 GB and more
    assert (cfg.zero.stage, cfg.offload.params, cfg.offload.optimizer) == (3, Tier.NVME, Tier.NVME)
    assert result.tiers[Tier.DEVICE].homes == dict.fromkeys(MODEL_STATE_KINDS, 0)


@pytest.mark.parametrize("preset", ["cpu-offload", "multi-gpu-zero3", "single-gpu-nvme"])
def test_every_preset_is_estimated(preset: str, tmp_path: Path) -> None:
    """Llama's rotary tables included: on the meta device they have their shapes, not zero elements."""
    cfg = load_config(REPO / "configs" / f"{preset}.yaml", overrides={"tiers.nvme.path": str(tmp_path)})
    result = estimate(cfg, suggest=False)
    assert result.parameters > 0 and result.tiers[Tier.DEVICE].peak > 0 and result.fits


def test_estimate_follows_a_changed_step_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate runs the engine's own step: change its order and the estimate follows, unedited."""
    raw = {**_raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme"), "gradient_clipping": 0.0}
    in_backward = estimate(load_config(raw))
    # Stage 3 without clipping steps each unit inside backward; make it step after backward instead.
    monkeypatch.setattr(Engine, "_steps_in_backward", lambda self: False)
    # ... reading nothing ahead, and sending the new parameters home only (read back by the forward).
    monkeypatch.setattr(Stage3, "begin_step_ahead", lambda self, **_: None)
    monkeypatch.setattr(Stage3, "_wants_new_param", lambda self, unit: False)
    dry_runs._kept.clear()  # the same arguments: the kept dry run would not see the engine changed
    after_backward = estimate(load_config(raw))
    figures = [(t.peak, t.working) for t in after_backward.tiers.values()], after_backward.nvme_read
    assert figures != ([(t.peak, t.working) for t in in_backward.tiers.values()], in_backward.nvme_read)

    summary, _ = _train(raw, monkeypatch)
    for tier, est in after_backward.tiers.items():
        measured = summary.peak_tier_bytes.get(tier.value, 0)
        assert abs(est.peak - measured) <= 0.10 * measured, (tier, est.peak, measured, est.working)

def test_estimate_counts_units_kept_gathered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zero.param_persistence_threshold keeps small units gathered through backward: the device peak grows, and the
    estimate, which runs the engine's own stage, says by how much."""
    raw = _raw(tmp_path, stage=3, params="cpu", grads="cpu", optimizer="cpu")
    released = estimate(load_config(raw))
    raw["zero"]["param_persistence_threshold"] = 10**9
    kept = estimate(load_config(raw))
    # Released units lend their shard at world size 1 (no gathered buffer); kept ones are gathered copies.
    assert kept.tiers[Tier.DEVICE].working["gathered"] > released.tiers[Tier.DEVICE].working.get("gathered", 0)
    summary, _ = _train(raw, monkeypatch)
    measured = summary.peak_tier_bytes["device"]
    assert abs(kept.tiers[Tier.DEVICE].peak - measured) <= 0.10 * measured, (kept.tiers[Tier.DEVICE].peak, measured)


def test_a_disk_too_small_for_the_swap_file_marks_the_nvme_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's nvme row says NO when the swap file does not fit the disk, as the verdict below it does."""
    monkeypatch.setattr(estimator, "_free_space", lambda path: 4096)
    result = estimate(load_config(_raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme")))
    assert not result.fits and not result.tiers[Tier.NVME].fits
    assert result.tiers[Tier.DEVICE].fits and result.tiers[Tier.CPU].fits
    nvme_row = next(line for line in format_estimate(result).splitlines() if line.startswith("nvme "))
    assert nvme_row.split()[-1] == "NO"
    assert "DOES NOT FIT:" in format_estimate(result)


def test_estimate_follows_the_reduce_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 compute with fp32 gradients: the GRAD slices and their NVMe traffic double, as a run measures."""
    raw = _raw(tmp_path, stage=3, params="nvme", grads="nvme", optimizer="nvme", dtype="bf16")
    bf16 = estimate(load_config(raw))
    raw["precision"]["reduce_dtype"] = "fp32"
    fp32 = estimate(load_config(raw))
    grad = fp32.tiers[Tier.NVME].homes[Kind.GRAD]
    assert grad == 2 * bf16.tiers[Tier.NVME].homes[Kind.GRAD]
    assert fp32.nvme_written > bf16.nvme_written
    summary, report = _train(raw, monkeypatch)
    assert report["kinds"]["grad"] == grad
    for tier, est in fp32.tiers.items():
        measured = summary.peak_tier_bytes.get(tier.value, 0)
        assert abs(est.peak - measured) <= 0.10 * measured, (tier, est.peak, measured, est.working)


def test_the_command_prints_the_tier_budgets_under_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The budgets and their sources stand between the tier table and the lines after it, which stay as they were;
    the JSON carries them under "budgets"."""
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=1 << 40, used=0, free=64 << 30))
    raw = _raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme")
    raw["tiers"] |= {"device": {"capacity": "1GiB"}, "cpu": {"capacity": "2GiB"}}
    cfg = load_config(raw)
    result, budgets = estimate(cfg), machine_budgets(cfg.tiers)
    assert [(b.nbytes, b.source) for b in budgets.by_tier().values()] == [
        (1 << 30, "tiers.device.capacity"),
        (2 << 30, "tiers.cpu.capacity"),
        (64 << 30, f"free space of {cfg.tiers.nvme.path}"),
    ]
    plain, lines = format_estimate(result).splitlines(), format_estimate(result, budgets=budgets).splitlines()
    start = lines.index(budgets.lines()[0])
    assert lines[start : start + 6] == [*budgets.lines(), ""]
    assert lines[:start] + lines[start + 6 :] == plain and lines[start - 2].startswith("nvme ")
    assert to_json(result, budgets=budgets) == to_json(result) | {"budgets": budgets.to_json()}

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    rc, table = _cli(["--config", str(config), "--flops", "50"])
    assert rc == 0 and "\n".join(budgets.lines()) in table


def test_the_command_splits_each_collective_inside_and_across_nodes(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(_raw(tmp_path, stage=3, params="cpu", grads="cpu", optimizer="cpu")))
    _, table = _cli(["--config", str(config), "--world-size", "4", "--nodes", "2"])
    _, text = _cli(["--config", str(config), "--world-size", "4", "--local-world-size", "2", "--json"])
    comm = json.loads(text)["comm"]
    assert comm["local_world_size"] == 2
    gather = comm["per_step"]["world"]["all_gather"]
    assert gather["inter"] == 2 * gather["intra"] > 0  # 2 of a rank's 3 peers are on the other node
    assert "collectives per step, 2 nodes x 2 ranks (inside the node / across):" in table
    assert f"  world all_gather: {format_size(gather['intra'])} / {format_size(gather['inter'])}" in table
    for bad in (["--nodes", "3"], ["--local-world-size", "3"]):
        with pytest.raises(ValueError, match=f"^{bad[0]} 3 does not divide --world-size 4: give a divisor of 4"):
            _cli(["--config", str(config), "--world-size", "4", *bad])


def test_a_dry_run_asked_again_is_kept_not_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same config, world and homes give the kept dry run, with the same bytes; other homes or
    another world replay; past `_KEPT` runs the oldest is let go."""
    from tierzero.stages.plan import Homes

    module = dry_runs

    replays: list[bool] = []
    real = module._replay
    monkeypatch.setattr(module, "_replay", lambda *a, **kw: replays.append(True) or real(*a, **kw))
    cfg = load_config(_raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme"))
    first = module.dry_run(cfg, world_size=1)
    assert len(replays) == 2  # one replay for the traffic, one for the memory peaks
    assert module.dry_run(load_config(_raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme")),
                          world_size=1) is first and len(replays) == 2  # fmt: skip
    assert estimate(cfg).nvme_read == first.nvme_read > 0 and len(replays) == 2
    cpu = module.dry_run(cfg, world_size=1, homes=Homes(params=Tier.CPU, grads=Tier.CPU, optimizer=Tier.CPU))
    assert len(replays) == 4 and cpu.nvme_read == 0
    module.dry_run(cfg, world_size=2)
    assert len(replays) == 6
    monkeypatch.setattr(module, "_KEPT", 2)
    module.dry_run(cfg, world_size=3)  # the first is the oldest of four kept: let go
    assert len(module._kept) == 2 and module.dry_run(cfg, world_size=1) is not first and len(replays) == 10
