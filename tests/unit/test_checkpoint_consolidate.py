"""`tierzero consolidate`: a checkpoint becomes one fp32 safetensors file the plain model loads."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_model
from test_checkpoint import TinyLM, batch, config, make_model, train

import tierzero
from tierzero.checkpoint import save_checkpoint
from tierzero.checkpoint.consolidate import consolidate, load_consolidated
from tierzero.checkpoint.shards import ShardReader
from tierzero.cli.consolidate import add_consolidate_command


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_consolidated_file_is_the_full_state_dict_and_loads_into_the_plain_model(tmp_path: Path, dtype: str) -> None:
    model = make_model()
    model.register_buffer("seen", torch.arange(3.0))
    with tierzero.initialize(model, config(3, dtype=dtype)) as engine:
        train(engine, 0, 3)
        save_checkpoint(engine, tmp_path / "ckpt")
        expected = engine.full_state_dict()
        with torch.no_grad():
            loss = engine(*batch(9)).item()
    done = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert (done.step, done.tensors) == (3, 10)  # 9 parameters (the head is the embedding) and a buffer
    with safe_open(str(done.path), framework="pt") as f:
        # the tied LM head is stored once, under the embedding's name
        assert sorted(f.keys()) == sorted(n for n in expected if n != "head.weight") + ["seen"]
        assert json.loads(f.metadata()["tierzero.aliases"]) == {"head.weight": "embed.weight"}
    state = load_consolidated(done.path)
    assert state.keys() == expected.keys() | {"seen"}
    assert all(state[n].dtype == torch.float32 and torch.equal(state[n], expected[n]) for n in expected)
    assert torch.equal(state["seen"], torch.arange(3.0))
    plain = TinyLM()
    plain.register_buffer("seen", torch.zeros(3))
    plain.load_state_dict(state)
    assert plain.head.weight is plain.embed.weight
    assert all(torch.equal(plain.state_dict()[n], expected[n]) for n in expected)
    with torch.no_grad():
        # the engine computes in its param dtype: so does the plain model here
        compute = plain.to(torch.bfloat16) if dtype == "bf16" else plain
        assert compute(*batch(9)).item() == pytest.approx(loss, rel=1e-6)
    again = TinyLM()
    again.register_buffer("seen", torch.zeros(3))
    missing, unexpected = load_model(again, str(done.path))
    assert (set(missing), set(unexpected)) == (set(), set())
    assert all(torch.equal(again.state_dict()[n], expected[n]) for n in expected)


def test_consolidation_holds_one_unit_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        train(engine, 0, 1)
        save_checkpoint(engine, tmp_path / "ckpt")
        units = {u.name: u.numel for u in engine.units}
    reads: list[tuple[str, int]] = []
    real_read = ShardReader.read

    def record(self: ShardReader, layout: object, kind: str, start: int, end: int, *, out: torch.Tensor) -> torch.Tensor:
        reads.append((layout.name, end - start))  # type: ignore[attr-defined]
        return real_read(self, layout, kind, start, end, out=out)  # type: ignore[arg-type]

    monkeypatch.setattr(ShardReader, "read", record)
    done = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    assert reads == list(units.items())
    assert done.largest_unit_bytes == 4 * max(units.values()) < 4 * sum(units.values())


def test_the_command_writes_the_file_and_refuses_other_suffixes(tmp_path: Path) -> None:
    with tierzero.initialize(make_model(), config(2)) as engine:
        train(engine, 0, 1)
        save_checkpoint(engine, tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_consolidate_command(parser.add_subparsers())
    out = io.StringIO()
    args = parser.parse_args(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors")])
    assert args.func(args, out=out) == 0
    assert out.getvalue().startswith("wrote 9 tensors (") and f"of step 1 to {tmp_path / 'm.safetensors'}" in out.getvalue()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    args = parser.parse_args(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "m.pt")])
    with pytest.raises(ValueError, match=f"consolidate writes safetensors, got output {tmp_path / 'm.pt'}: name it <something>.safetensors, or give a directory"):
        args.func(args)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under"):
        consolidate(tmp_path / "nothing", tmp_path / "x.safetensors")


def test_a_transformers_run_consolidates_for_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tierzero.config import load_config
    from tierzero.models.builtin import build_model

    hf = {"vocab_size": 48, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 2}
    cfg = load_config(config(3, dtype="bf16") | {"model": {"type": "transformers", "transformers_class": "GPT2LMHeadModel", "transformers_config": hf}})
    torch.manual_seed(0)
    with tierzero.initialize(build_model(cfg.model), cfg) as engine:
        for step in range(2):
            tokens = torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(step))
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()
        save_checkpoint(engine, tmp_path / "ckpt")
        expected = engine.full_state_dict()
    parser = argparse.ArgumentParser()
    add_consolidate_command(parser.add_subparsers())
    args = parser.parse_args(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert args.func(args, out=io.StringIO()) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    state = model.state_dict()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(state[name], expected[name]) for name in expected)
