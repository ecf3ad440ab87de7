"""The three checkpoint formats behind one interface: each written through it gives the bytes its
own function writes, and the sharded one read back through it restores the run bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import config, make_model, train
from test_export import _config, _hf, _tokens

import tierzero
from tierzero.checkpoint import (
    CheckpointReader,
    CheckpointWriter,
    PeftAdapters,
    ShardedCheckpoint,
    TransformersDirectory,
    save_checkpoint,
)
from tierzero.checkpoint.consolidate import consolidate_hf
from tierzero.checkpoint.engine_export import export_engine
from tierzero.checkpoint.protocol import Exportable, GatheringStage
from tierzero.models.builtin import build_model
from tierzero.pretrained import build_meta_model
from tierzero.pretrained.lora import apply_lora, save_adapters

transformers = pytest.importorskip("transformers")


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` by its relative path: what a format wrote, byte for byte."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _llama_steps(engine: Any, steps: int) -> None:
    for step in range(steps):
        x = _tokens(step)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def test_the_formats_name_themselves_and_only_the_sharded_one_reads() -> None:
    formats = [ShardedCheckpoint(), TransformersDirectory(), PeftAdapters()]
    assert [f.name for f in formats] == ["tierzero", "transformers", "peft"]
    assert all(isinstance(f, CheckpointWriter) for f in formats)
    assert [isinstance(f, CheckpointReader) for f in formats] == [True, False, False]


def test_the_sharded_format_writes_save_checkpoints_bytes_and_reads_back_the_exact_run(tmp_path: Path) -> None:
    cfg = config(3, dtype="bf16", offload={"optimizer": "cpu"})
    with tierzero.initialize(make_model(), cfg) as engine:
        train(engine, 0, 2)
        written = ShardedCheckpoint(keep=1).write(engine, tmp_path / "through")
        direct = save_checkpoint(engine, tmp_path / "direct", keep=1)
        by_engine = engine.save_checkpoint(tmp_path / "engine")  # Engine.save_checkpoint goes through it too
        train(engine, 2, 4)
        uninterrupted = engine.full_state_dict()
    assert written == tmp_path / "through" / "2" and direct.name == by_engine.name == "2"
    assert _files(written) == _files(direct) == _files(by_engine)
    assert (tmp_path / "through" / "latest").read_text() == "2\n"
    for reader in (lambda e: ShardedCheckpoint().read(e, tmp_path / "through"), lambda e: e.load_checkpoint(tmp_path / "direct")):
        torch.manual_seed(123)  # other initial weights: everything must come from the checkpoint
        with tierzero.initialize(make_model(), cfg) as engine:
            assert reader(engine).name == "2" and engine.global_step == 2
            train(engine, 2, 4)  # optimizer states, scalars and RNG restored too, or this drifts
            resumed = engine.full_state_dict()
        assert uninterrupted is not None and resumed is not None and resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)


def test_the_transformers_format_writes_what_export_and_consolidate_write(tmp_path: Path) -> None:
    hf = _hf(tie=True)
    cfg = _config(hf)
    torch.manual_seed(0)
    with tierzero.initialize(build_model(cfg.model), cfg) as engine:
        assert isinstance(engine, Exportable) and isinstance(engine.stage, GatheringStage)
        _llama_steps(engine, 2)
        done = TransformersDirectory(max_shard_size="20KB").write(engine, tmp_path / "through")
        export_engine(engine, tmp_path / "direct", max_shard_size="20KB")
        save_checkpoint(engine, tmp_path / "ckpt")
        state = engine.full_state_dict()
        with pytest.raises(ValueError, match="save_adapters needs a peft model, got LlamaForCausalLM"):
            PeftAdapters().write(engine, tmp_path / "adapters")
    assert done is not None and done.directory == tmp_path / "through" and len(done.files) > 1
    assert _files(tmp_path / "through") == _files(tmp_path / "direct")
    converted = TransformersDirectory(dtype=torch.bfloat16).convert(tmp_path / "ckpt", tmp_path / "converted")
    reference = consolidate_hf(tmp_path / "ckpt", tmp_path / "consolidated", dtype=torch.bfloat16)
    assert (converted.step, converted.tensors, converted.nbytes) == (reference.step, reference.tensors, reference.nbytes)
    assert _files(tmp_path / "converted") == _files(tmp_path / "consolidated")
    # No reader in the interface: the directory is read when an engine is built from it, and that
    # engine starts from exactly the weights written.
    assert state is not None
    with tierzero.initialize(build_meta_model(tmp_path / "through"), cfg, pretrained=tmp_path / "through") as engine:
        loaded = engine.full_state_dict()
    assert loaded is not None and loaded.keys() == state.keys()
    assert all(torch.equal(loaded[n], state[n]) for n in state)


def test_the_peft_format_writes_save_adapters_files_holding_the_trained_adapters(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(**_hf())
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "base")
    model = apply_lora(build_meta_model(tmp_path / "base"), r=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=3)
    with tierzero.initialize(model, {"zero": {"stage": 3}, "optimizer": {"lr": 1e-2}}, pretrained=tmp_path / "base") as engine:
        _llama_steps(engine, 2)
        written = PeftAdapters().write(engine, tmp_path / "through")
        direct = save_adapters(engine, tmp_path / "direct")
        trained = engine.full_state_dict()
    assert written == tmp_path / "through" and direct is not None and trained is not None
    assert _files(written) == _files(direct)
    assert sorted(_files(written)) == ["adapter_config.json", "adapter_model.safetensors"]
    stored = load_file(written / "adapter_model.safetensors")
    adapters = {n.replace(".default.", "."): t for n, t in trained.items() if "lora_" in n}
    assert stored.keys() == adapters.keys() and len(stored) == 8  # A and B of q_proj and v_proj in both layers
    assert all(torch.equal(stored[n], adapters[n]) for n in adapters)
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in adapters.items() if "lora_B" in n)  # they trained
    assert peft.PeftConfig.from_pretrained(written).r == 4
