"""`tierzero make-checkpoint`: a random-weight Llama directory that transformers and tierzero both load."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tierzero.checkpoint.stand_in import SIZES, make_checkpoint
from tierzero.cli.make_checkpoint import add_make_checkpoint_command
from tierzero.pretrained import PretrainedWeights, build_meta_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _run(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_make_checkpoint_command(parser.add_subparsers())
    args = parser.parse_args(["make-checkpoint", *argv])
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    return out.getvalue()


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}
    return out


def test_tiny_loads_in_transformers_and_tierzero(tmp_path: Path) -> None:
    printed = _run(str(tmp_path / "m"), "--size", "tiny", "--max-shard-size", "200KB")
    spec = SIZES["tiny"]
    assert printed.startswith(f"wrote a llama of {spec.parameters:,} parameters (") and "peak RSS" in printed
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m")
    assert sum(p.numel() for p in model.parameters()) == spec.parameters == 158_016
    assert model.dtype == torch.float32 and model.config.vocab_size == spec.vocab_size
    state = model.state_dict()
    assert torch.equal(state["model.norm.weight"], torch.ones(spec.hidden_size))
    assert torch.equal(state["model.embed_tokens.weight"][3], torch.zeros(spec.hidden_size))  # the pad row, as _init_weights
    assert state["model.layers.1.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tokenizer) == spec.vocab_size
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2, 3)
    ids = tokenizer("import os\nprint(os.getcwd())").input_ids
    assert ids[0] == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "import os\nprint(os.getcwd())"
    with torch.no_grad():
        assert model(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), spec.vocab_size)
    # The index lists every tensor once, in files that hold it, and the bytes they take.
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    tensors = _tensors(tmp_path / "m")
    assert set(index["weight_map"]) == set(tensors) == set(state)
    assert len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / "m" / file), framework="pt") as f:
            assert name in f.keys()
    # tierzero's own reader takes it as a pretrained directory.
    PretrainedWeights.open(tmp_path / "m").check(build_meta_model(tmp_path / "m"))


def test_the_same_seed_gives_the_same_bits_at_any_shard_size(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "a", seed=7)
    make_checkpoint(tmp_path / "b", seed=7, max_shard_size="100KB")
    make_checkpoint(tmp_path / "c", seed=8)
    make_checkpoint(tmp_path / "h", seed=7, dtype=torch.bfloat16)
    a, b, c, h = (_tensors(tmp_path / name) for name in "abch")
    assert (tmp_path / "a" / "model.safetensors").is_file() and not (tmp_path / "b" / "model.safetensors").exists()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert all(h[n].dtype == torch.bfloat16 and torch.equal(h[n], a[n].to(torch.bfloat16)) for n in a)  # fp32, rounded
    assert json.loads((tmp_path / "h" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_a_non_empty_directory_is_refused_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"make-checkpoint output .*/m is not empty: name a new directory, or pass --force"):
        make_checkpoint(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["notes.txt"]
    make_checkpoint(tmp_path / "m", max_shard_size="100KB", force=True)
    make_checkpoint(tmp_path / "m", force=True)  # one file now: the earlier shards and index go
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "notes.txt", "tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(ValueError, match="--size '7b' is not a size of llama"):
        make_checkpoint(tmp_path / "n", size="7b")


def test_the_2b_size_is_over_two_billion_parameters_as_transformers_builds_it() -> None:
    spec = SIZES["2b"]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(spec.config())
    assert sum(p.numel() for p in model.parameters()) == spec.parameters == 2_225_738_240
