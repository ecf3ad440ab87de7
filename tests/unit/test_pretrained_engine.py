"""tierzero.initialize(..., pretrained=DIR): a meta-built transformers model starts from its files, unit by unit."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_llama
from torch import nn

import tierzero
import tierzero.cli.train as T
from tierzero.config import load_config
from tierzero.data import ByteBatches
from tierzero.pretrained import PretrainedError, build_meta_model

transformers = pytest.importorskip("transformers")


def _llama(*, vocab: int = 64) -> nn.Module:
    return tiny_llama(vocab=vocab, seed=None)


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32))


MODELS = {"llama": (_llama, "LlamaDecoderLayer"), "gpt2": (_gpt2, "GPT2Block")}


def _saved(kind: str, directory: Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[kind][0]().eval()
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    return model.to(dtype)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_engine_starts_from_the_files_bit_for_bit(kind: str, stage: int, tmp_path: Path) -> None:
    reference = _saved(kind, tmp_path)
    model = build_meta_model(tmp_path).eval()
    cfg = {"zero": {"stage": stage, "unit_classes": [MODELS[kind][1]]}, "offload": {"optimizer": "cpu"}}
    with tierzero.initialize(model, cfg, pretrained=tmp_path) as engine:
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(engine(input_ids=x).logits, reference(input_ids=x).logits)
        state = engine.full_state_dict()
        expected = reference.state_dict()
        for name, value in expected.items():
            if name in state:
                assert torch.equal(state[name], value.float()), name
        assert set(state) == {n for n, _ in reference.named_parameters(remove_duplicate=False)}
        engine.module.train()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss) and engine.global_step == 1


def test_bf16_files_are_widened_to_fp32_master_weights(tmp_path: Path) -> None:
    reference = _saved("llama", tmp_path, dtype=torch.bfloat16)
    with tierzero.initialize(build_meta_model(tmp_path), {"zero": {"stage": 3}}, pretrained=tmp_path) as engine:
        state = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        if name in state:
            assert state[name].dtype == torch.float32 and torch.equal(state[name], value.float()), name


def test_files_that_do_not_fit_the_model_are_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    _saved("gpt2", tmp_path)
    wider = transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=2, n_positions=32)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(wider)
    with pytest.raises(PretrainedError, match=r"model\.safetensors: tensor .* has shape \[") as info:
        tierzero.initialize(model, {"zero": {"stage": 3}}, pretrained=tmp_path)
    assert "\n" not in str(info.value)


def test_a_meta_built_transformers_model_without_files_is_initialised_by_its_own_init(tmp_path: Path) -> None:
    _saved("llama", tmp_path)
    with tierzero.initialize(build_meta_model(tmp_path), {"zero": {"stage": 3}}) as engine:
        state = engine.full_state_dict()
        x = torch.randint(0, 64, (2, 16))
        loss = engine(input_ids=x, labels=x).loss
    assert torch.isfinite(loss)
    # transformers' own init: norms at one, the rotary frequencies computed, weights random.
    assert torch.equal(state["model.norm.weight"], torch.ones(32))
    assert state["model.layers.0.mlp.up_proj.weight"].std() > 0


def test_tierzero_train_starts_from_model_pretrained(tmp_path: Path) -> None:
    """`model.pretrained` in a config: the loop's first loss is the saved model's loss on the first batch."""
    torch.manual_seed(0)
    reference = _llama(vocab=256).eval()  # the byte-level data's vocabulary
    reference.save_pretrained(tmp_path / "llama", safe_serialization=True)
    cfg = load_config(
        {
            "zero": {"stage": 3, "unit_classes": ["LlamaDecoderLayer"]},
            "model": {"pretrained": str(tmp_path / "llama")},
            "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 16, "log_every": 1},
            "data": {"max_bytes": "64KiB"},
            "offload": {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"},
        }
    )
    summary = T.train(cfg, progress=False, out=io.StringIO())
    x, y = ByteBatches.from_config(cfg, rank=0, world_size=1).batch(0)
    with torch.no_grad():
        expected = F.cross_entropy(reference(input_ids=x).logits.float().flatten(0, 1), y.flatten()).item()
    assert summary.steps == 2 and summary.losses[0] == pytest.approx(expected, rel=1e-6)
