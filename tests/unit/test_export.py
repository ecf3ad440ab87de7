"""A trained model as a transformers directory: `engine` export (train --export) and `consolidate --hf`
give what `from_pretrained` loads, bit for bit the engine's weights, with its tokenizer."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import tierzero
import tierzero.cli.train as T
from tierzero.checkpoint import save_checkpoint
from tierzero.checkpoint.consolidate import consolidate_hf
from tierzero.checkpoint.engine_export import export_engine
from tierzero.checkpoint.export import check_export
from tierzero.checkpoint.stand_in import make_checkpoint
from tierzero.cli.consolidate import add_consolidate_command
from tierzero.config import load_config
from tierzero.models.builtin import build_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _hf(*, tie: bool = False) -> dict[str, Any]:
    return {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 32, "tie_word_embeddings": tie,
    }  # fmt: skip


def _config(hf: dict[str, Any], *, dtype: str = "fp32", stage: int = 3) -> Any:
    model = {"type": "transformers", "transformers_class": "LlamaForCausalLM", "transformers_config": hf}
    return load_config({"zero": {"stage": stage}, "precision": {"param_dtype": dtype}, "model": model, "optimizer": {"lr": 1e-2}})


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def _train(cfg: Any, checkpoint: Path, **export: Any) -> dict[str, torch.Tensor]:
    """A few steps, a checkpoint, an export from the live engine; the engine's full state dict."""
    torch.manual_seed(0)
    with tierzero.initialize(build_model(cfg.model), cfg) as engine:
        for step in range(3):
            x = _tokens(step)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        save_checkpoint(engine, checkpoint)
        state = engine.full_state_dict()
        if export:
            export_engine(engine, **export)
    assert state is not None
    return state


def _reference(hf: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).eval()
    model.load_state_dict(state)
    return model


def _tokenizer(directory: Path) -> Path:
    """A tiny byte-level BPE saved as save_pretrained saves it."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["def f(x):\n    return x + 1\n" * 50], trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    return directory


def _keys(directory: Path) -> set[str]:
    names = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_both_exports_load_with_from_pretrained_bit_for_bit(tmp_path: Path, tie: bool) -> None:
    hf = _hf(tie=tie)
    state = _train(_config(hf), tmp_path / "ckpt", out=tmp_path / "live")
    consolidate_hf(tmp_path / "ckpt", tmp_path / "hf", tokenizer=_tokenizer(tmp_path / "tok"))
    reference = _reference(hf, state)
    reference.save_pretrained(tmp_path / "saved")
    x = _tokens(99)
    with torch.no_grad():
        expected = reference(input_ids=x).logits
    for out in ("live", "hf"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
        assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
        assert _keys(tmp_path / out) == _keys(tmp_path / "saved")  # the names save_pretrained stores, tied ones once
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, expected)
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
        assert (tmp_path / out / "generation_config.json").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.decode(tokenizer("def f(x):").input_ids) == "def f(x):"
    assert not (tmp_path / "live" / "tokenizer.json").exists()  # the run named none


def test_a_bf16_run_exports_bf16_and_fp32_on_request(tmp_path: Path) -> None:
    hf = _hf()
    state = _train(_config(hf, dtype="bf16", stage=1), tmp_path / "ckpt", out=tmp_path / "live")
    consolidate_hf(tmp_path / "ckpt", tmp_path / "hf")
    consolidate_hf(tmp_path / "ckpt", tmp_path / "hf32", dtype=torch.float32)
    _reference(hf, state).save_pretrained(tmp_path / "saved")
    x = _tokens(99)
    for out, dtype in (("live", torch.bfloat16), ("hf", torch.bfloat16), ("hf32", torch.float32)):
        assert json.loads((tmp_path / out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()  # in the dtype config.json names
        assert all(value.dtype == dtype and torch.equal(value, state[name].to(dtype)) for name, value in model.state_dict().items())
        # transformers' own save of the engine's weights, loaded in that dtype (its rotary table stays fp32)
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=dtype).eval()
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, reference(input_ids=x).logits)


def test_a_small_max_shard_size_writes_shards_and_an_index_that_load(tmp_path: Path) -> None:
    hf = _hf()
    state = _train(_config(hf), tmp_path / "ckpt", out=tmp_path / "live", max_shard_size="20KB")
    consolidate_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="20KB")
    for out in ("live", "hf"):
        index = json.loads((tmp_path / out / "model.safetensors.index.json").read_text())
        files = sorted({p.name for p in (tmp_path / out).glob("*.safetensors")})
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
        assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        assert all(p.stat().st_size <= 20_000 + 1024 for p in (tmp_path / out).glob("*.safetensors"))
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in state.values())
        assert set(index["weight_map"]) == _keys(tmp_path / out) == set(state)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out)
        assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    # Exported again into the same directory as one file: the shards and the index go.
    consolidate_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_train_export_fine_tunes_a_made_checkpoint_and_keeps_its_tokenizer(tmp_path: Path) -> None:
    """`tierzero train --export` from a make-checkpoint directory: the export equals the run's last checkpoint."""
    make_checkpoint(tmp_path / "base", size="tiny")
    cfg = {
        "zero": {"stage": 3, "unit_classes": ["LlamaDecoderLayer"]},
        "model": {"pretrained": str(tmp_path / "base")},
        "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 16, "log_every": 1},
        "data": {"max_bytes": "64KiB"},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    parser = argparse.ArgumentParser()
    T.add_train_command(parser.add_subparsers())
    args = parser.parse_args(["train", "--config", str(tmp_path / "run.json"), "--export", str(tmp_path / "out"), "--no-progress"])
    printed = io.StringIO()
    assert args.func(args, out=printed) == 0
    assert f"exported 21 tensors (617.2 KiB, float32) in 1 safetensors file to {tmp_path / 'out'}" in printed.getvalue()
    consolidate_hf(tmp_path / "ckpt", tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    consolidated = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    assert all(torch.equal(exported[n], consolidated[n]) for n in base)
    assert not torch.equal(exported["model.norm.weight"], base["model.norm.weight"])  # it trained
    for out in ("out", "hf"):
        assert (tmp_path / out / "tokenizer.json").read_bytes() == (tmp_path / "base" / "tokenizer.json").read_bytes()
        assert transformers.AutoTokenizer.from_pretrained(tmp_path / out).eos_token == "</s>"


def test_a_built_in_model_is_refused_in_one_line(tmp_path: Path) -> None:
    cfg = load_config({"model": {"type": "llama"}, "train": {"steps": 1}})
    with pytest.raises(ValueError, match=r"^--export writes a transformers model directory, and this run trains tierzero's built-in 'llama'") as info:
        T.train(cfg, export=tmp_path / "out", progress=False, out=io.StringIO())
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
    with tierzero.initialize(build_model(cfg.model, device="meta"), cfg) as engine:
        save_checkpoint(engine, tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_consolidate_command(parser.add_subparsers())
    args = parser.parse_args(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf"])
    with pytest.raises(ValueError, match=r"^--hf writes a transformers model directory"):
        args.func(args)
    args = parser.parse_args(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bf16"])
    with pytest.raises(ValueError, match=r"^--dtype shapes a transformers directory: add --hf$"):
        args.func(args)


def test_the_tokenizer_comes_from_data_tokenizer_or_the_pretrained_directory(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path / "tok")
    run = {"model": {"type": "transformers"}, "data": {"tokenizer": str(tok)}}
    assert check_export(run, tmp_path / "out", what="--export") == tok
    assert check_export({"model": {"pretrained": str(tok)}}, tmp_path / "out", what="--export") == tok
    (tmp_path / "bare").mkdir()
    assert check_export({"model": {"pretrained": str(tmp_path / "bare")}}, tmp_path / "out", what="--export") is None
    with pytest.raises(ValueError, match=f"^data.tokenizer {tmp_path / 'bare'} holds no tokenizer files"):
        check_export({"model": {"type": "transformers"}, "data": {"tokenizer": str(tmp_path / "bare")}}, tmp_path / "out", what="--export")
    with pytest.raises(ValueError, match="lies inside the run's checkpoint.dir"):
        check_export({"model": {"type": "transformers"}, "checkpoint": {"dir": str(tmp_path)}}, tmp_path / "o", what="--export")


def test_the_live_model_decides_what_an_engine_exports() -> None:
    """An engine given `pretrained=DIR` trains a transformers model its config does not name."""
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf()))
    assert check_export({"model": {"type": "gpt"}}, Path("out"), what="--export", module=llama) is None
    with pytest.raises(ValueError, match="this run trains a Linear, not a transformers PreTrainedModel: train a transformers"):
        check_export({"model": {"type": "transformers"}}, Path("out"), what="--export", module=nn.Linear(2, 2))
