"""LoRA on a pretrained base built on meta: the base streamed from its files, the adapters made
by peft's init, saved in peft's format; `model.lora` for `tierzero train`."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_llama

import tierzero
import tierzero.cli.train as T
from tierzero.config import ConfigError, load_config
from tierzero.data import ByteBatches
from tierzero.pretrained import build_meta_model
from tierzero.pretrained.lora import apply_lora, save_adapters

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _saved_llama(directory: Path, *, vocab: int = 64) -> transformers.LlamaForCausalLM:
    model = tiny_llama(vocab=vocab).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def test_a_meta_base_streams_from_its_files_and_the_adapters_save_as_peft_loads_them(tmp_path: Path) -> None:
    reference = _saved_llama(tmp_path / "base")
    (tmp_path / "swap").mkdir()
    model = apply_lora(build_meta_model(tmp_path / "base"), r=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=3)
    cfg = {
        "zero": {"stage": 3},
        "optimizer": {"lr": 1e-2},
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
    }
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with tierzero.initialize(model, cfg, pretrained=tmp_path / "base") as engine:
        start = engine.full_state_dict()
        saved = reference.state_dict()
        base = {n: v for n, v in start.items() if "lora_" not in n}
        assert len(base) == len(dict(reference.named_parameters()))
        for name, value in base.items():  # the base bit for bit, under peft's names
            assert torch.equal(value, saved[name.removeprefix("base_model.model.").replace(".base_layer.", ".")]), name
        # peft's init: A random (the same on every rank, from the seed), B zero: the model starts as the base
        assert all(start[n].abs().sum() > 0 for n in start if "lora_A" in n)
        assert all(torch.equal(start[n], torch.zeros_like(start[n])) for n in start if "lora_B" in n)
        for step in range(3):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        trained = engine.full_state_dict()
        with torch.no_grad():
            logits = engine(input_ids=x).logits
        out = save_adapters(engine, tmp_path / "adapter")
        saved = engine.save_checkpoint(tmp_path / "ckpt")  # the checkpoint holds them in peft's format too
    assert (saved / "adapter" / "adapter_model.safetensors").read_bytes() == (out / "adapter_model.safetensors").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"), out).eval()
    for name, value in loaded.named_parameters():
        assert torch.equal(value, trained[name]), name
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, logits)
    assert any(not torch.equal(trained[n], start[n]) for n in trained if "lora_B" in n)


def test_model_lora_in_a_config_trains_only_the_adapters(tmp_path: Path) -> None:
    reference = _saved_llama(tmp_path / "llama", vocab=256)
    (tmp_path / "swap").mkdir()
    cfg = load_config(
        {
            "zero": {"stage": 3},
            "model": {"pretrained": str(tmp_path / "llama"), "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
            "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 16, "log_every": 1},
            "data": {"max_bytes": "64KiB"},
            "optimizer": {"lr": 1e-2},
            "offload": {"params": "nvme", "optimizer": "cpu"},
            "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
        }
    )
    summary = T.train(cfg, progress=False, out=io.StringIO(), export=tmp_path / "adapters")
    x, y = ByteBatches.from_config(cfg, rank=0, world_size=1).batch(0)
    with torch.no_grad():
        expected = F.cross_entropy(reference(input_ids=x).logits.float().flatten(0, 1), y.flatten()).item()
    # B starts at zero: the first loss is the base model's own
    assert summary.steps == 3 and summary.losses[0] == pytest.approx(expected, rel=1e-6)
    assert summary.losses[-1] < summary.losses[0]
    # --export of a LoRA run: the adapters, in peft's format, on the saved base
    tuned = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama"), tmp_path / "adapters")
    moved = [n for n, p in tuned.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert len(moved) == 4  # q_proj and v_proj of both layers


def test_lora_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: expected a list of module names"):
        load_config({"zero": {"stage": 3}, "model": {"lora": {"r": 4, "target_modules": []}}})
    with pytest.raises(ConfigError, match=r"model.lora.alpha"):
        load_config({"zero": {"stage": 3}, "model": {"lora": {"r": 4, "alpha": 0}}})


def test_the_estimate_counts_the_frozen_base_as_the_run_holds_it(tmp_path: Path) -> None:
    from tierzero.common.slices import MODEL_STATE_KINDS
    from tierzero.estimate import estimate

    _saved_llama(tmp_path / "llama")
    (tmp_path / "swap").mkdir()
    raw = {
        "zero": {"stage": 3},
        "model": {"pretrained": str(tmp_path / "llama"), "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "offload": {"params": "nvme", "optimizer": "cpu"},
        "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
    }
    cfg = load_config(raw)
    predicted = estimate(cfg)
    model = apply_lora(build_meta_model(tmp_path / "llama"), r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    with tierzero.initialize(model, cfg) as engine:
        measured = engine.memory_report()["kinds"]
        frozen = sum(u.shard_numel * 4 for u in engine.units if not u.trainable)
        adapters = sum(u.shard_numel * 4 for u in engine.units if u.trainable)
    assert {k.value: sum(t.homes[k] for t in predicted.tiers.values()) for k in MODEL_STATE_KINDS} == measured
    # the frozen base is in the parameters but has no optimizer state: the adapters' alone
    assert measured["param"] == frozen + adapters and measured["exp_avg"] == adapters < frozen
