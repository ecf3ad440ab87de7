"""`tierzero estimate` on quantized state: the saving beside the same config unquantized, and a 7B-class
Llama with an NF4 base planned onto a 24 GiB GPU with 32 GiB of host memory.

The byte counts are checked against the formulas written here: an NF4 base keeps half a byte an
element and a 4-byte absmax per 64-element block (double-quantized: a 1-byte code a block, a 4-byte
scale per 256 blocks and a 4-byte offset); int8 moments keep a byte an element and a 4-byte absmax
per 2048 elements, twice. The elements are the unquantized plan's (its bf16 and fp32 slices' bytes
over their itemsize), so the formulas see the same padded units the engine registers.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierzero.cli import estimate as cli_estimate
from tierzero.common.slices import Kind, Tier
from tierzero.config import load_config
from tierzero.estimate import estimate
from tierzero.estimate.saving import compare_unquantized, unquantized_overrides

GiB = 1 << 30


def _raw(swap: Path, *, base: str = "nf4", state: str = "int8", double_quant: bool = False) -> dict[str, Any]:
    lora = {"r": 8, "base_dtype": base, "double_quant": double_quant, "target_modules": ["wq", "wv"]}
    return {
        "model": {"type": "llama", "n_layer": 2, "d_model": 128, "d_ff": 256, "n_head": 4, "vocab_size": 256, "lora": lora},
        "zero": {"stage": 3}, "precision": {"param_dtype": "bf16"}, "optimizer": {"state_dtype": state},
        "train": {"micro_batch_size": 1, "seq_len": 16},
        "offload": {"params": "nvme", "optimizer": "cpu", "gradients": "cpu"}, "tiers": {"nvme": {"path": str(swap)}},
    }  # fmt: skip


def _nf4_bytes(n: int, *, double_quant: bool) -> int:
    blocks = -(-n // 64)
    if double_quant:
        return n // 2 + blocks + 4 * (-(-blocks // 256) + 1)
    return n // 2 + 4 * blocks


def _int8_moment_bytes(n: int) -> int:
    return n + 4 * -(-n // 2048)


def _specs(result: Any) -> dict[tuple[str, Kind], Any]:
    return {(unit, spec.kind): spec for unit, specs in result.plan.specs.items() for spec in specs}


@pytest.mark.parametrize("double_quant", [False, True])
def test_the_two_plans_bytes_are_the_formulas(tmp_path: Path, double_quant: bool) -> None:
    cfg = load_config(_raw(tmp_path, double_quant=double_quant))
    result = estimate(cfg)
    saving = compare_unquantized(cfg, result)
    assert saving is not None and saving.unquantized is not result
    quantized, plain = _specs(result), _specs(saving.unquantized)
    assert quantized.keys() == plain.keys()
    frozen = trained = 0
    expected = {tier: 0 for tier in Tier}
    for (unit, kind), spec in plain.items():
        q = quantized[unit, kind]
        assert q.home is spec.home
        if kind is Kind.PARAM and q.codec is not None:  # a frozen unit: its base bf16 unquantized, NF4 here
            n = spec.nbytes // 2
            assert spec.dtype.itemsize == 2 and q.nbytes == _nf4_bytes(n, double_quant=double_quant)
            frozen += n
        elif kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ):
            n = spec.nbytes // 4
            assert spec.dtype.itemsize == 4 and q.nbytes == _int8_moment_bytes(n)
            trained += n
        else:
            assert q.nbytes == spec.nbytes
        expected[q.home] += q.nbytes
    assert frozen > 100_000 and trained > 0
    # 0.5625 B an element (4.5 bits) against bf16's 2; 2 x 1.002 B against fp32's 8
    per_element = sum(_nf4_bytes(s.nbytes // 2, double_quant=double_quant) for (u, k), s in plain.items()
                      if k is Kind.PARAM and quantized[u, k].codec is not None) / frozen  # fmt: skip
    assert per_element == pytest.approx(0.5 + (1 + 8 / 256) / 64 if double_quant else 0.5625, rel=1e-3)
    data = saving.to_json()
    assert {t: e["homes"] for t, e in data["quantized"]["tiers"].items()} == {t.value: n for t, n in expected.items()}
    assert data["changed"]["model.lora.base_dtype"] == {"config": "nf4", "unquantized": "bf16"}
    assert data["changed"]["optimizer.state_dtype"] == {"config": "int8", "unquantized": "fp32"}
    assert data["base_homes"] == {"device": 0, "cpu": 0, "nvme": sum(q.nbytes for (u, k), q in quantized.items()
                                  if k is Kind.PARAM and q.codec is not None)}  # fmt: skip
    saved = saving.unquantized.tiers[Tier.NVME].home_total - result.tiers[Tier.NVME].home_total
    assert saved == sum(plain[u, k].nbytes - q.nbytes for (u, k), q in quantized.items() if q.codec is not None)
    assert saving.unquantized.nvme_read > result.nvme_read


def test_nothing_quantized_has_no_comparison(tmp_path: Path) -> None:
    cfg = load_config(_raw(tmp_path, base="param", state="fp32"))
    assert unquantized_overrides(cfg) == {}
    assert compare_unquantized(cfg, estimate(cfg)) is None
    moments_only = load_config(_raw(tmp_path, base="param", state="bf16"))
    assert unquantized_overrides(moments_only) == {"optimizer.state_dtype": "fp32"}


def _cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tierzero")
    cli_estimate.add_estimate_command(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    return cli_estimate.run_estimate(parser.parse_args(["estimate", *argv]), out=out), out.getvalue()


def test_the_command_prints_and_writes_both_plans(tmp_path: Path) -> None:
    config = tmp_path / "q.yaml"
    config.write_text(yaml.safe_dump(_raw(tmp_path, state="bf16")))
    rc, text = _cli("--config", str(config), "--json")
    data = json.loads(text)
    assert rc == 0 and data["fits"]
    plain = data["unquantized"]["unquantized"]
    assert data["unquantized"]["quantized"]["tiers"]["nvme"]["homes"] == data["tiers"]["nvme"]["homes"]["param"] > 0
    assert plain["tiers"]["nvme"]["homes"] > 3 * data["tiers"]["nvme"]["homes"]["param"]
    # bf16 moments: half of fp32's bytes, in the cpu tier where they live
    cpu = {k: n for k, n in data["tiers"]["cpu"]["homes"].items()}
    assert plain["tiers"]["cpu"]["homes"] - sum(cpu.values()) == cpu["exp_avg"] + cpu["exp_avg_sq"]
    rc, text = _cli("--config", str(config))
    lines = text.splitlines()
    head = lines.index(
        "quantized state beside the same config unquantized: model.lora.base_dtype nf4 (unquantized: bf16), "
        "optimizer.state_dtype bf16 (unquantized: fp32)"
    )
    assert lines[head + 1].split() == ["per", "rank", "quantized", "unquantized", "saved"]
    rows = ["device homes", "device peak", "cpu homes", "cpu peak", "nvme homes", "nvme read/step", "nvme write/step"]
    assert [" ".join(line.split()[:2]) for line in lines[head + 2 : head + 11]] == [*rows, "step-time floor", "fits yes"]
    assert lines[-1].startswith("the frozen base, nf4: ") and lines[-1].endswith("on nvme")


LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip
BASE_7B = 6_738_415_616
"""Llama-2-7B's parameters: the frozen base."""
#: A 24 GiB GPU beside 32 GiB of host memory, the issue's QLoRA machine.
MACHINE = {
    "name": "qlora-24", "gpu_memory": "24GiB", "bf16_tflops": 165.2, "gpu_memory_bandwidth": 1008, "pcie": 32,
    "host_memory": "32GiB", "cores": 16, "nvme_read": 3.0, "nvme_write": 2.0, "disk_free": "200GiB",
}  # fmt: skip


def test_a_7b_llama_with_an_nf4_base_fits_24_gib_with_the_base_in_memory(tmp_path: Path) -> None:
    """The plan fits the budgets, and keeps the whole NF4 base (its 6.5B frozen elements at 0.5625 B)
    on the device or in host memory; its table says where."""
    pytest.importorskip("transformers")
    model = tmp_path / "llama-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_7B))
    (tmp_path / "data.txt").write_text("text")
    raw = {
        "model": {"pretrained": str(model), "lora": {"r": 16, "base_dtype": "nf4", "target_modules": ["q_proj", "v_proj"]}},
        "data": {"path": str(tmp_path / "data.txt")}, "zero": {"stage": 3}, "precision": {"param_dtype": "bf16"},
        "train": {"micro_batch_size": 1, "seq_len": 512}, "offload": "auto", "tiers": {"nvme": {"path": str(tmp_path)}},
    }  # fmt: skip
    config, machine = tmp_path / "7b.yaml", tmp_path / "machine.yaml"
    config.write_text(yaml.safe_dump(raw))
    machine.write_text(yaml.safe_dump(MACHINE))
    rc, text = _cli("--config", str(config), "--machine", str(machine), "--json")
    data = json.loads(text)
    assert rc == 0 and data["fits"]
    base = data["unquantized"]["base_homes"]
    adapters = 32 * 2 * 2 * 16 * 4096  # A and B of q_proj and v_proj in each of the 32 layers
    assert data["parameters"] == BASE_7B + adapters
    assert base["nvme"] == 0 and 0.5625 * BASE_7B <= base["device"] + base["cpu"] < 0.5625 * BASE_7B * 1.001
    budget = {tier: b["bytes"] for tier, b in data["budgets"].items()}
    for tier in ("device", "cpu"):
        assert data["tiers"][tier]["need"] <= budget[tier]
    assert budget["device"] < 24 * GiB and budget["cpu"] < 32 * GiB
    # unquantized, the same homes hold 2 B an element instead
    plain = data["unquantized"]["unquantized"]["tiers"]
    assert sum(plain[t]["homes"] for t in ("device", "cpu")) - sum(data["unquantized"]["quantized"]["tiers"][t]["homes"]
               for t in ("device", "cpu")) > 1.4 * BASE_7B  # fmt: skip
    rc, text = _cli("--config", str(config), "--machine", str(machine))
    assert rc == 0 and "\nfits: yes\n" in text
    assert "the frozen base, nf4: " in text
