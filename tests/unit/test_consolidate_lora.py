"""`consolidate --hf` on a LoRA run's checkpoint: refused in one line naming `<checkpoint>/adapter`, where the
adapters already are in peft's format, and what --hf does not do (merge them), instead of blaming the
checkpoint for peft's names; nothing is written. The adapters there load on the base as peft loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tierzero.checkpoint.find import find_checkpoint
from tierzero.cli.main import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_consolidate_hf_of_a_lora_run_names_its_adapter_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base", safe_serialization=True)
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "model": {"pretrained": str(tmp_path / "base"), "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "train": {"steps": 2, "micro_batch_size": 1, "seq_len": 16},
        "data": {"max_bytes": "16KiB"},
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 2},
    }))  # fmt: skip
    assert main(["train", "--config", str(run), "--no-progress"]) == 0
    step = find_checkpoint(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf"]) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: {step} is a LoRA run's checkpoint: --hf writes a plain model and does not merge adapters into it; "
        f"{step / 'adapter'} holds them in peft's format: load it with PeftModel.from_pretrained(base, that directory) "
        "and call merge_and_unload() for a merged model\n"
    )
    assert not (tmp_path / "out").exists()
    # what the line points at works: the base and the adapters merge as peft merges them
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    merged = peft.PeftModel.from_pretrained(base, step / "adapter").merge_and_unload()
    assert sorted(merged.state_dict()) == sorted(transformers.LlamaForCausalLM(config).state_dict())
