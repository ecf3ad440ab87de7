"""`tierzero estimate --machine`: presets and machine files, plans for a machine that is not this one
with nothing of this host measured, splits built from the budgets, and what a plan that cannot fit says."""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierzero.cli import estimate as cli_estimate
from tierzero.cli.main import main
from tierzero.common.slices import IO_ALIGNMENT, Kind, Tier
from tierzero.config import ConfigError, load_config
from tierzero.estimate import estimator
from tierzero.estimate.estimator import Bandwidth
from tierzero.estimate.machines import LINK_SHARE, MATMUL_SHARE, OPTIMIZER_BYTES, PRESETS, Machine, load_machine
from tierzero.placement import CPU_MARGIN, DEVICE_MARGIN, MachineBudgets, TierBudget, planner
from tierzero.placement.planner import PlacementError, RankBudgets, plan_placement

GiB = 1 << 30
DISK = Bandwidth(read=2.0e9, write=3.0e9, source="test")
FLOPS = Bandwidth(read=1.0e11, write=1.0e11, source="test")
#: The issue's rented machine: a 24 GiB GPU, 64 GiB of host memory, 72.6 GiB free on its disk.
RENTED = {
    "name": "rented", "gpu_memory": "24GiB", "bf16_tflops": 165.2, "gpu_memory_bandwidth": 1008, "pcie": 32,
    "host_memory": "64GiB", "cores": 16, "nvme_read": 3.0, "nvme_write": 2.0, "disk_free": "72.6GiB",
}  # fmt: skip
LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip


def _raw(swap: Path) -> dict[str, Any]:
    return {
        "zero": {"stage": 3, "unit_classes": ["Linear"]},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "max_seq_len": 32},
        "data": {"max_bytes": "256KiB"},
        "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 32, "log_every": 1},
        "offload": "auto",
        "tiers": {"nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}, "cpu": {"keep_freed": 0}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
    }


def _written(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data))
    return path


def _cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tierzero")
    cli_estimate.add_estimate_command(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    return cli_estimate.run_estimate(parser.parse_args(["estimate", *argv]), out=out), out.getvalue()


def test_the_presets_carry_the_published_figures_and_their_rates() -> None:
    assert set(PRESETS) >= {"A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "RTX-4090"}
    h100 = load_machine("h100-80gb")  # a preset by name, in any case
    assert h100 is PRESETS["H100-80GB"]
    assert (h100.gpu_memory, h100.bf16_tflops, h100.fp32_tflops, h100.pcie) == (80 * GiB, 989, 67, 64)
    assert h100.flops("bf16").read == 989e12 * MATMUL_SHARE and h100.flops("fp32").read == 67e12 * MATMUL_SHARE
    assert h100.copy_rate == 64e9 * LINK_SHARE and h100.device_step_rate == 3350e9 / OPTIMIZER_BYTES
    # The host's memory bandwidth: the H200 host's as measured, else 6.3 GB/s a core.
    assert PRESETS["H200"].host_step_rate == 101e9 / OPTIMIZER_BYTES
    assert PRESETS["L4"].host_step_rate == 8 * 6.3e9 / OPTIMIZER_BYTES
    for machine in PRESETS.values():
        assert machine.disk().read > 0 and "datasheet" in machine.source


def test_a_machine_file_is_checked_as_a_config_is(tmp_path: Path) -> None:
    path = _written(tmp_path / "box.yaml", RENTED)
    box = load_machine(str(path))
    assert (box.name, box.gpu_memory, box.disk_free) == ("rented", 24 * GiB, int(72.6 * GiB))
    cases = {
        "gpu_mem": f"machine file {tmp_path}/bad.yaml: unknown key gpu_mem; did you mean gpu_memory?",
        "pcie": f"machine file {tmp_path}/bad.yaml: pcie: expected a positive number (or null), got 'fast'",
    }
    for key, message in cases.items():
        raw = {k: v for k, v in RENTED.items() if k != "gpu_memory"} | {"gpu_memory": "24GiB", key: "fast"}
        with pytest.raises(ConfigError) as refused:
            load_machine(str(_written(tmp_path / "bad.yaml", raw)))
        assert str(refused.value) == message
    missing = {k: v for k, v in RENTED.items() if k not in ("cores", "disk_free")}
    with pytest.raises(ConfigError, match=r"^machine file .*: cores, disk_free not given: a machine needs gpu_memory, "):
        load_machine(str(_written(tmp_path / "bad.yaml", missing)))
    with pytest.raises(ConfigError, match=r"^--machine 'T4' is neither a preset \(A100-40GB, .*\) nor a .yaml/.json"):
        load_machine("T4")
    with pytest.raises(ConfigError, match="gives no fp32_tflops for precision.param_dtype fp32: add fp32_tflops"):
        box.flops("fp32")


def test_the_command_refuses_a_bad_machine_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _written(tmp_path / "auto.yaml", _raw(tmp_path))
    bad = _written(tmp_path / "bad.json", {**RENTED, "host_mem": "64GiB"})
    assert main(["estimate", "--config", str(config), "--machine", str(bad)]) == 2
    assert capsys.readouterr().err == f"tierzero: error: machine file {bad}: unknown key host_mem; did you mean host_memory?\n"


def _no_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every measurement of this host raises: the disk, the compute, the copies, the optimizer, the budgets."""

    def probed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("this host was measured")

    from tierzero.placement import compute, disk, prediction

    for module, names in (
        (planner, ("disk_rates", "measure_compute", "measure_copy_rate", "measure_step_rate", "machine_budgets")),
        (cli_estimate, ("machine_budgets", "measure_flops")),
        (estimator, ("_free_space", "measure_flops")),
        (compute, ("measure_block_flops", "measure_compute")),
        (disk, ("probe", "disk_rates")),
        (prediction, ("measure_copy_rate", "measure_step_rate")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, probed)
    monkeypatch.setattr("psutil.virtual_memory", probed)
    monkeypatch.setattr("torch.cuda.mem_get_info", probed)


def test_with_a_machine_nothing_of_this_host_is_measured_and_the_device_is_its_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_probes(monkeypatch)
    config = _written(tmp_path / "auto.yaml", _raw(tmp_path))
    rc, text = _cli("--config", str(config), "--machine", "L4", "--json")
    data = json.loads(text)
    budgets = data["budgets"]
    l4 = PRESETS["L4"]
    assert l4.gpu_memory is not None and l4.host_memory is not None
    assert rc == 0 and budgets["device"]["bytes"] == l4.gpu_memory - DEVICE_MARGIN.of(l4.gpu_memory)
    assert budgets["cpu"]["bytes"] == l4.host_memory - CPU_MARGIN.of(l4.host_memory)
    assert budgets["nvme"]["bytes"] == l4.disk_free and data["tiers"]["device"]["capacity"] == l4.gpu_memory
    # The config trains in fp32: the L4's fp32 rate, at the share a step reaches.
    assert data["flops"]["rate"] == 30.3e12 * MATMUL_SHARE
    # A small model fits the GPU whole: it trains there, and the host holds only the store's bytes.
    assert data["placement"]["homes"] == dict.fromkeys(("params", "grads", "optimizer"), {"device": data["units"]})
    # A config that places its state itself is estimated on that machine too.
    placed = _written(tmp_path / "placed.yaml", {**_raw(tmp_path), "offload": {"optimizer": "cpu"}})
    rc, text = _cli("--config", str(placed), "--machine", "L4")
    assert rc == 0 and text.startswith("machine L4 (nothing of this host measured): GPU 24.0 GiB, 121 bf16 TFLOPS")


def test_a_7b_llama_fits_the_rented_machine_within_every_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: no kind fits any one tier whole (the optimizer's 75.3 GiB), the three
    tiers together do. The plan's bytes per tier are the estimate's byte formulas (bf16
    parameters and gradients, fp32 master and moments: 16 bytes a parameter, padded per unit)
    and within each budget; planning takes under 20 s on a quiet machine (60 here, loaded)."""
    pytest.importorskip("transformers")
    _no_probes(monkeypatch)
    model = tmp_path / "llama-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_7B))
    raw = {
        "model": {"pretrained": str(model)}, "data": {"path": str(_written(tmp_path / "data.txt", {}))},
        "zero": {"stage": 3}, "precision": {"param_dtype": "bf16"}, "train": {"micro_batch_size": 1, "seq_len": 512},
        "offload": "auto", "tiers": {"nvme": {"path": str(tmp_path)}},
    }  # fmt: skip
    config, machine = _written(tmp_path / "7b.yaml", raw), _written(tmp_path / "rented.yaml", RENTED)
    began = time.perf_counter()
    rc, text = _cli("--config", str(config), "--machine", str(machine), "--json")
    took = time.perf_counter() - began
    data = json.loads(text)
    assert rc == 0 and took < 60, took
    parameters = data["parameters"]
    assert parameters == 6_738_415_616
    homes = {tier: {Kind(k): n for k, n in e["homes"].items()} for tier, e in data["tiers"].items()}
    padded = sum(h[Kind.PARAM] for h in homes.values()) // 2
    assert 0 <= padded - parameters < data["units"] * IO_ALIGNMENT
    itemsize = {Kind.PARAM: 2, Kind.GRAD: 2, Kind.MASTER: 4, Kind.EXP_AVG: 4, Kind.EXP_AVG_SQ: 4}
    for kind, size in itemsize.items():
        assert sum(h[kind] for h in homes.values()) == size * padded
    budget = {tier: b["bytes"] for tier, b in data["budgets"].items()}
    assert budget == {"device": 24 * GiB - DEVICE_MARGIN.of(24 * GiB), "cpu": 64 * GiB - CPU_MARGIN.of(64 * GiB),
                      "nvme": int(72.6 * GiB)}  # fmt: skip
    for tier in ("device", "cpu"):
        assert sum(homes[tier].values()) <= data["tiers"][tier]["need"] <= budget[tier]
    assert sum(homes["nvme"].values()) == data["nvme"]["file"] <= budget["nvme"]
    # No kind fits one tier whole: the plan splits them.
    assert all(n > 0 for n in (sum(homes[t].values()) for t in ("device", "cpu", "nvme")))
    print(f"7B plan on the rented machine: {took:.1f} s; " + ", ".join(f"{t} {sum(h.values())}" for t, h in homes.items()))


def _budgets(device: int | None, cpu: int, nvme: int) -> MachineBudgets:
    return MachineBudgets(
        device=TierBudget(tier=Tier.DEVICE, nbytes=device, source="test"),
        cpu=TierBudget(tier=Tier.CPU, nbytes=cpu, source="test"),
        nvme=TierBudget(tier=Tier.NVME, nbytes=nvme, source="test"),
    )


def test_no_placement_listed_as_fitting_is_over_any_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random budgets, on this host and on a machine with a GPU: every placement the plan lists as
    fitting (those it ranks) holds, tier by tier, no more than the budget: the store's peak in
    memory (with the activations where the device is host memory), the NVMe homes' bytes on disk."""
    ranked: list[Any] = []
    rank = planner._rank
    monkeypatch.setattr(planner, "_rank", lambda c: ranked.append(c) or rank(c))
    cfg = load_config(_raw(tmp_path))
    gpu = Machine(**{**RENTED, "name": "gpu"})
    on_nvme = load_config(_raw(tmp_path), overrides={"offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}})
    state = estimator.estimate(on_nvme, disk=DISK, flops=FLOPS, suggest=False).tiers[Tier.NVME].home_total
    rng = random.Random(0)
    plans = refusals = 0
    for _ in range(14):
        machine = gpu if rng.random() < 0.5 else None
        device = rng.randrange(1, 2 * state) if machine else None
        budgets = _budgets(device, rng.randrange(state // 4, 4 * state), rng.randrange(0, 2 * state))
        ranked.clear()
        try:
            plan_placement(cfg, budgets=budgets, disk=DISK, flops=FLOPS, copy_rate=5e9, step_rate=1e9, machine=machine)
            plans += 1
        except PlacementError as refused:
            refusals += 1
            assert refused.fixes and not ranked
        for candidate in ranked:
            result = candidate.result
            nvme = sum(s.nbytes for specs in result.plan.specs.values() for s in specs if s.home is Tier.NVME)
            assert nvme <= budgets.nvme.nbytes, candidate.label
            device_need, cpu_need = result.tiers[Tier.DEVICE].need, result.tiers[Tier.CPU].need
            if machine is None:  # one memory: the device tier and the activations are host memory too
                assert device_need + cpu_need + result.activations <= budgets.cpu.nbytes, candidate.label
            else:
                assert device_need <= budgets.device.nbytes and cpu_need <= budgets.cpu.nbytes, candidate.label
    assert plans >= 3 and refusals >= 1


def test_nothing_fits_exits_non_zero_with_fixes_and_the_fix_makes_it_fit(tmp_path: Path) -> None:
    config = _written(tmp_path / "auto.yaml", _raw(tmp_path))
    tight = ("--set", "tiers.cpu.capacity=3MiB", "--set", "tiers.nvme.capacity=1MiB")
    rc, text = _cli("--config", str(config), "--machine", "L4", "--set", "tiers.device.capacity=1MiB", *tight)
    assert rc == 1 and "\nDOES NOT FIT:\n  the nearest placement (" in text
    fixes = re.findall(r"^  - (.*)$", text, flags=re.M)
    assert fixes and "more ranks: at zero.stage 3 each of --world-size N ranks holds 1/N of the state" in fixes
    raised = {m[1]: int(m[2]) for f in fixes if (m := re.match(r"raise tiers\.(\w+)\.capacity by .* \((\d+) bytes\)", f))}
    assert raised.keys() == {"device", "cpu"} and any(f.startswith("point tiers.nvme.path at a disk with ") for f in fixes)
    # The smallest increase it names for the device is enough, with the other budgets as they were.
    device = 1 * (1 << 20) + raised["device"]
    rc, _ = _cli("--config", str(config), "--machine", "L4", "--set", f"tiers.device.capacity={device}", *tight)
    assert rc == 0
    rc, text = _cli("--config", str(config), "--machine", "L4", "--set", "tiers.device.capacity=1MiB", *tight, "--json")
    refused = json.loads(text)
    assert rc == 1 and refused["fits"] is False and refused["fixes"] == fixes and refused["problems"]
    # `tierzero train` stops on the same refusal, in one line.
    with pytest.raises(PlacementError, match=r"^offload auto: no placement fits the budgets; the nearest .* short by"):
        plan_placement(load_config(config), budgets=_budgets(1 << 20, 3 << 20, 1 << 20), disk=DISK, flops=FLOPS,
                       copy_rate=5e9, step_rate=1e9, machine=PRESETS["L4"])  # fmt: skip


def test_rank_budgets_on_a_machine_keep_the_device_apart_from_the_host(tmp_path: Path) -> None:
    cfg = load_config(_raw(tmp_path))
    on_gpu = RankBudgets.of(_budgets(4 * GiB, 8 * GiB, GiB), cfg, cuda=True)
    here = RankBudgets.of(_budgets(None, 8 * GiB, GiB), cfg, cuda=False)
    assert not on_gpu.shared_host and here.shared_host
