"""`generate.batch_size: auto`: the batch cost counted as the KV cache's real bytes, the largest batch that fits
the budget, a budget too small refused in one line, the KV cache booked in the device tier; the config key and
the command's flag."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import tierzero
from tierzero.cli.main import main
from tierzero.common.slices import Kind, Tier
from tierzero.config import ConfigError, load_config
from tierzero.inference.batch import BatchCost, auto_batch, batch_cost
from tierzero.models.builtin import Llama, ModelSpec, build_model

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from generate_cases import hf_model  # noqa: E402

SPEC = ModelSpec(vocab_size=64, n_layer=3, n_head=4, d_model=32, d_ff=64, max_seq_len=64)
PROMPT, NEW = 7, 5


def _stage3(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"zero": {"stage": 3, **extra}, "offload": {"params": "cpu"}, "tiers": {"nvme": {"path": str(tmp_path)}}}


def test_the_builtin_cost_is_the_formula(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with tierzero.initialize(Llama(SPEC), _stage3(tmp_path, gather_ahead=2)) as engine:
        cost = batch_cost(engine, prompt=PROMPT, new=NEW)
        largest = max(unit.padded_numel for unit in engine.units) * 4
    # 2 (keys, values) x layers x (prompt + new) x kv heads x head size x fp32; every prompt position's logits
    assert cost == BatchCost(kv_row=2 * 3 * (PROMPT + NEW) * 4 * 8 * 4, logits_row=PROMPT * 64 * 4, gathered=3 * largest)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_transformers_row_costs_its_cache_s_real_bytes(tmp_path: Path, name: str) -> None:
    pytest.importorskip("transformers")
    model = hf_model(name)  # the llama has grouped-query attention: 1 KV head for 2 query heads
    with torch.no_grad():
        cache = model(torch.zeros(3, PROMPT + NEW, dtype=torch.long), use_cache=True).past_key_values
    real = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    with tierzero.initialize(copy.deepcopy(model), {"zero": {"stage": 1}}) as engine:
        cost = batch_cost(engine, prompt=PROMPT, new=NEW)
    assert 3 * cost.kv_row == real
    assert (cost.logits_row, cost.gathered) == (64 * 4, 0)  # logits_to_keep: the last position only; stage 1 gathers nothing


@pytest.mark.parametrize(("budget", "prompts"), [(10_000, 100), (10_000, 3), (1000 + 300 * 7 + 299, 50), (1300, 1)])
def test_auto_takes_the_largest_batch_that_fits(budget: int, prompts: int) -> None:
    cost = BatchCost(kv_row=200, logits_row=100, gathered=1000)
    assert auto_batch(cost, budget=budget, prompts=prompts, source="test") == min((budget - 1000) // 300, prompts)


@pytest.mark.parametrize(("budget", "shown"), [(6 * 1024, "6.0 KiB"), (4096, "4.0 KiB"), (999, "999 B")])
def test_a_budget_below_one_row_is_refused_in_one_line(budget: int, shown: str) -> None:
    cost = BatchCost(kv_row=2048, logits_row=1024, gathered=4096)
    message = (
        f"generate.batch_size auto: the device budget {shown} (tiers.device.capacity) is below batch 1's "
        "7.0 KiB: 3.0 KiB a row (KV cache 2.0 KiB, logits 1.0 KiB) + 4.0 KiB of gathered weights; raise tiers.device.capacity "
        "or shorten the prompts and --max-new-tokens"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        auto_batch(cost, budget=budget, prompts=4, source="tiers.device.capacity")


def test_the_kv_cache_is_booked_in_the_device_tier_while_generating(tmp_path: Path) -> None:
    torch.manual_seed(0)
    seen: list[int] = []
    with tierzero.initialize(Llama(SPEC), _stage3(tmp_path)) as engine:
        engine.module.blocks[0].register_forward_hook(
            lambda *_: seen.append(engine.store.report().tiers[Tier.DEVICE].current_by_kind[Kind.ACTIVATION])
        )
        engine.generate(torch.randint(0, 64, (2, PROMPT)), max_new_tokens=NEW)
        device = engine.store.report().tiers[Tier.DEVICE]
    kv = 2 * 2 * 3 * (PROMPT + NEW) * 4 * 8 * 4
    assert seen == [kv] * NEW  # the prompts' forward and each step but the last's: the whole cache, booked
    assert (device.peak_by_kind[Kind.ACTIVATION], device.current_by_kind[Kind.ACTIVATION]) == (kv, 0)


def test_the_config_key_takes_auto_or_a_batch() -> None:
    assert (load_config({}).generate.batch_size, load_config({"generate": {"batch_size": "Auto"}}).generate.batch_size) == ("auto", "auto")
    assert load_config({"generate": {"batch_size": 16}}).generate.batch_size == 16
    with pytest.raises(ConfigError, match="^generate.batch_size: expected a positive integer or auto, got 0$"):
        load_config({"generate": {"batch_size": 0}})


def _cli_config(tmp_path: Path, capacity: int) -> Path:
    """A 2-layer GPT at stage 3, its weights in host memory, the device tier `capacity` bytes."""
    raw = {
        "zero": {"stage": 3},
        "offload": {"params": "cpu", "optimizer": "cpu", "gradients": "cpu"},
        "tiers": {"device": {"capacity": capacity}},
        "model": {"type": "gpt", "vocab_size": 256, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64},
        "train": {"seq_len": 32},
    }
    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_command_splits_the_prompts_by_the_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.jsonl").write_text("".join(f'{{"prompt": "prompt {i}"}}\n' for i in range(5)))  # 8 bytes each
    # a row: KV cache 2 x 2 layers x (8 + 4) x 2 heads x 16 x 4 bytes, logits 8 x 256 x 4; the largest unit, gathered twice
    cfg = load_config(_cli_config(tmp_path, 1 << 20))
    row = 2 * 2 * 12 * 2 * 16 * 4 + 8 * 256 * 4
    with tierzero.initialize(build_model(cfg.model, seed=0), cfg) as engine:
        gathered = 2 * max(unit.padded_numel for unit in engine.units) * 4
        held = engine.store.report().tiers[Tier.DEVICE].current
    capacity = held + gathered + 2 * row + row // 2  # room for two rows and a half
    argv = ["generate", "--config", str(_cli_config(tmp_path, capacity)), "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch size 2 for 5 prompts (auto: ")
    assert re.search(r"^generated 20 tokens for 5 prompt\(s\)", out, flags=re.M)
    assert main([*argv[:-4], "--batch-size", "0"]) == 2
    assert capsys.readouterr().err == "tierzero: error: --batch-size 0 is not auto or a whole number in 1..65536: give auto or a positive batch size\n"
