"""`tierzero estimate --generate`: a generate run's batch, weight bytes per decoding step, step time and tokens/s."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import tierzero.cli.estimate as E
from tierzero.common.slices import Kind, Tier
from tierzero.config import load_config
from tierzero.estimate import Bandwidth, estimate
from tierzero.estimate.dry_run import dry_run

COPY_RATE = 5.0e9
CAPACITY = 8 << 20
LAYERS, HEADS, D_MODEL, VOCAB = 2, 2, 64, 256


def _config(tmp_path: Path, *, params: str) -> Path:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    raw = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "model": {"type": "gpt", "n_layer": LAYERS, "n_head": HEADS, "d_model": D_MODEL, "d_ff": 256, "max_seq_len": 64},
        "train": {"steps": 1, "micro_batch_size": 2, "seq_len": 32},
        "offload": {"params": params, "gradients": "cpu", "optimizer": "cpu"},
        "tiers": {"device": {"capacity": CAPACITY}, "nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tierzero")
    E.add_estimate_command(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    return E.run_estimate(parser.parse_args(["estimate", *argv]), out=out), out.getvalue()


@pytest.fixture(autouse=True)
def _copy_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(E, "measure_copy_rate", lambda: COPY_RATE)


def _reference(path: Path, *, prompt: int, new: int, batch: int | None) -> dict[str, Any]:
    """The prediction written out from the estimate's own per-tier bytes and rates."""
    cfg = load_config(str(path))
    disk = Bandwidth(read=2.0e9, write=1.0e9, source="test")
    result = estimate(cfg, disk=disk, flops=Bandwidth(read=1e11, write=1e11, source="test"))
    params = [s for s in result.plan.all() if s.kind is Kind.PARAM]
    nvme = sum(s.nbytes for s in params if s.home is Tier.NVME)
    cpu = sum(s.nbytes for s in params if s.home is Tier.CPU)
    if batch is None:  # auto: [Note: what a batch costs], fp32, every position's logits, stage 3 gathers
        run = dry_run(cfg, world_size=1, cuda=result.cuda)
        row = 2 * LAYERS * (prompt + new) * HEADS * (D_MODEL // HEADS) * 4 + prompt * VOCAB * 4
        gathered = (1 + cfg.zero.gather_ahead) * max(u.padded_numel for u in run.units) * 4
        room = CAPACITY - result.tiers[Tier.DEVICE].home_total
        batch = (room - gathered) // row
    step = max(nvme / disk.read if nvme else 0.0, (nvme + cpu) / COPY_RATE, 2.0 * result.parameters * batch / 1e11)
    return {"batch": batch, "nvme": nvme, "cpu": cpu, "step": step, "tokens": batch / step}


@pytest.mark.parametrize(("params", "batch"), [("nvme", None), ("cpu", 4)])
def test_generate_json_is_the_formula_on_the_estimates_bytes(tmp_path: Path, params: str, batch: int | None) -> None:
    path = _config(tmp_path, params=params)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"best": {"read_GBps": 2.0, "write_GBps": 1.0}}))
    argv = ["--config", str(path), "--flops", "100", "--nvme-bench", str(bench), "--json", "--generate",
            "--prompt-len", "16", "--new-tokens", "8"] + ([] if batch is None else ["--batch-size", str(batch)])
    code, text = _cli(argv)
    assert code == 0, text
    got = json.loads(text)["generate"]
    want = _reference(path, prompt=16, new=8, batch=batch)
    assert got["batch_size"] == want["batch"] and got["auto"] is (batch is None)
    assert want["batch"] > 1
    assert got["read_per_step"] == {"nvme": want["nvme"], "cpu": want["cpu"]}
    assert (want["nvme"] > 0) is (params == "nvme") and (want["cpu"] > 0) is (params == "cpu")
    assert got["copied_per_step"] == want["nvme"] + want["cpu"]
    assert got["step_s"] == pytest.approx(want["step"], rel=1e-12)
    assert got["tokens_per_s"] == pytest.approx(want["tokens"], rel=1e-12)
    assert got["rates"]["copy_Bps"] == COPY_RATE


def test_generate_table_and_refusals(tmp_path: Path) -> None:
    path = _config(tmp_path, params="nvme")
    code, text = _cli(["--config", str(path), "--flops", "100", "--generate", "--batch-size", "2"])
    assert code == 0
    assert "generate: batch 2 (given), prompt 128 + 32 new tokens a row" in text
    assert "predicted " in text and " tokens/s" in text
    with pytest.raises(ValueError, match=r"^--batch-size 0 is not auto or a whole number"):
        _cli(["--config", str(path), "--generate", "--batch-size", "0"])
    with pytest.raises(ValueError, match=r"^generate.batch_size auto: the device budget"):
        _cli(["--config", str(path), "--generate", "--set", "tiers.device.capacity=64KiB", "--prompt-len", "60"])


def test_generate_with_offload_auto_predicts_the_planned_placement(tmp_path: Path) -> None:
    """The plan puts the parameters in host memory (the device budget holds only the optimizer states):
    the decoding step reads them from there, the bytes the plan's estimate homes on the cpu tier."""
    path = _config(tmp_path, params="nvme")
    raw = yaml.safe_load(path.read_text())
    raw["offload"] = "auto"
    raw["tiers"]["device"]["capacity"], raw["tiers"]["cpu"] = 1 << 20, {"capacity": 8 << 20}
    path.write_text(yaml.safe_dump(raw))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"best": {"read_GBps": 2.0, "write_GBps": 1.0}}))
    code, text = _cli(["--config", str(path), "--flops", "100", "--nvme-bench", str(bench), "--json", "--generate",
                       "--batch-size", "2", "--prompt-len", "16", "--new-tokens", "8"])  # fmt: skip
    assert code == 0, text
    got = json.loads(text)
    assert got["placement"]["homes"]["params"] == {"cpu": LAYERS + 1}
    cpu_params = got["tiers"]["cpu"]["homes"]["param"]
    assert cpu_params > 0 and got["generate"]["read_per_step"] == {"nvme": 0, "cpu": cpu_params}
    assert got["generate"]["batch_size"] == 2
