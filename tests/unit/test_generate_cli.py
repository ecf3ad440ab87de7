"""`tierzero generate`: completions of a trained checkpoint's weights, printed or written as JSON Lines;
bad input refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_data_tokens import tiny_tokenizer
from tiny_models import tiny_llama

import tierzero
import tierzero.cli.generate as G
from tierzero.cli.main import main
from tierzero.common.slices import Kind
from tierzero.config import load_config
from tierzero.data import load_tokenizer
from tierzero.models.builtin import GPT, build_model, spec_from_config

NEW = 12


def _config(tmp_path: Path, *, vocab: int = 256, tokenizer: Path | None = None) -> Path:
    """A 2-layer GPT at stage 3 with its weights on NVMe (checkpoints under tmp_path/ckpt)."""
    (tmp_path / "swap").mkdir(exist_ok=True)
    raw: dict[str, Any] = {
        "zero": {"stage": 3},
        "offload": {"params": "nvme", "optimizer": "cpu"},
        "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "model": {"type": "gpt", "vocab_size": vocab, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64},
        "train": {"seq_len": 32, "seed": 3},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
    }
    if tokenizer is not None:  # the training text goes with it; generate only reads the tokenizer
        (tmp_path / "text.txt").write_text("the cat sat on the mat\n")
        raw["data"] = {"tokenizer": str(tokenizer), "path": str(tmp_path / "text.txt")}
    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _train_one_step(config: Path) -> dict[str, torch.Tensor]:
    """Wide random weights and one optimizer step, saved as a checkpoint: weights the command's freshly built
    model does not have, under which greedy decoding wanders over many tokens."""
    cfg = load_config(config)
    model = build_model(cfg.model, seed=cfg.train.seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(param.numel()))
    with tierzero.initialize(model, cfg) as engine:
        x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        engine.backward(engine(x, x.roll(-1, dims=1))[1])
        engine.step()
        engine.save_checkpoint()
        state = engine.full_state_dict()
    assert state is not None
    return state


def _greedy(state: dict[str, torch.Tensor], config: Path, prompt: list[int], *, eos: int | None = None) -> list[int]:
    """Plain PyTorch: the trained GPT run whole on the prompt at every step, the argmax appended."""
    model = GPT(spec_from_config(load_config(config).model)).eval()
    model.load_state_dict(state)
    tokens = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            tokens = torch.cat([tokens, model(tokens[None])[0, -1].argmax().reshape(1)])
            if eos is not None and int(tokens[-1]) == eos:
                break
    return tokens[len(prompt) :].tolist()


def test_the_trained_checkpoint_completes_a_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    state = _train_one_step(config)
    expected = bytes(_greedy(state, config, list(b"hello"))).decode(errors="replace")
    assert main(["generate", "--config", str(config), "--prompt", "hello", "--max-new-tokens", str(NEW), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    summary = out.rstrip("\n").rsplit("\n", 1)[1]
    assert out == f"weights from {tmp_path / 'ckpt' / '1'} (step 1)\nhello{expected}\n\n{summary}\n"
    # byte-level text has no EOS: every step runs, and each reads the NVMe-homed weights once
    found = re.fullmatch(r"generated 12 tokens for 1 prompt\(s\) in [0-9.]+ s: [0-9.]+ tokens/s, ([0-9.]+ KiB) read from nvme per token", summary)
    assert found is not None, summary


def test_prompts_file_with_a_tokenizer_writes_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = tiny_tokenizer(tmp_path / "tok")  # ids: [UNK] 0, <eos> 1, 12 words
    config = _config(tmp_path, vocab=14, tokenizer=tok)
    state = _train_one_step(config)
    prompts = ["the cat sat on", "a dog", "the end of the story"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts) + "\n")
    argv = ["generate", "--config", str(config), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--max-new-tokens", str(NEW), "--checkpoint", str(tmp_path / "ckpt"), "--batch-size", "2"]) == 0
    assert f"wrote 3 completion(s) to {tmp_path / 'o.jsonl'}\n" in capsys.readouterr().out
    codec = load_tokenizer(tok)
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    for prompt, row in zip(prompts, rows, strict=True):
        new = _greedy(state, config, codec.encode_batch([prompt])[0], eos=1)
        ids = codec.encode_batch([prompt])[0] + [t for t in new if t != 1]
        text = codec.backend.decode(ids, skip_special_tokens=True)
        assert text.startswith(f"{prompt} ") and row == {"prompt": prompt, "completion": text[len(prompt) :], "tokens": len(new)}
    assert len({word for row in rows for word in row["completion"].split()}) >= 3  # varied text, not one id over
    assert any(row["tokens"] < NEW for row in rows)  # a row stopped at its EOS


def test_a_pretrained_llama_completes_as_transformers_generate_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no checkpoint to load, nothing will train: the engine keeps the parameters alone (no fp32 master,
    gradient or optimizer state written to NVMe before the first token)."""
    made: list[Any] = []
    monkeypatch.setattr(G, "initialize", lambda model, cfg: made.append(tierzero.initialize(model, cfg)) or made[-1])
    tok = tiny_tokenizer(tmp_path / "tok")
    model = tiny_llama(
        vocab=14, kv_heads=1, positions=64, initializer_range=0.3, bos_token_id=None, eos_token_id=1, pad_token_id=None
    ).eval()
    model.save_pretrained(tmp_path / "llama")
    (tmp_path / "text.txt").write_text("the cat sat\n")
    raw = {
        "zero": {"stage": 3}, "offload": {"params": "nvme"}, "tiers": {"nvme": {"path": str(tmp_path)}},
        "model": {"pretrained": str(tmp_path / "llama")}, "train": {"seq_len": 32},
        "data": {"tokenizer": str(tok), "path": str(tmp_path / "text.txt")},
    }  # fmt: skip
    (tmp_path / "gen.yaml").write_text(yaml.safe_dump(raw))
    prompts = ["the cat sat on", "a dog", "the end of the story"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    argv = ["--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", str(NEW), "--out", str(tmp_path / "o.jsonl")]
    assert main(["generate", "--config", str(tmp_path / "gen.yaml"), *argv]) == 0
    capsys.readouterr()
    assert len(made) == 1 and {spec.kind for spec in made[0].plan.all()} == {Kind.PARAM}
    # transformers on the same left-padded batch (padded with the EOS id, as the command pads)
    codec = load_tokenizer(tok)
    encoded = codec.encode_batch(prompts)
    width = max(map(len, encoded))
    ids = torch.tensor([[1] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=1, pad_token_id=1)
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    for prompt, tokens, new, row in zip(prompts, encoded, expected[:, width:].tolist(), rows, strict=True):
        new = new[: new.index(1) + 1] if 1 in new else new
        text = codec.backend.decode(tokens + [t for t in new if t != 1])
        assert row == {"prompt": prompt, "completion": text[len(prompt) :], "tokens": len(new)}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no prompt: give --prompt TEXT or --prompts FILE.jsonl"),
        (["--prompts", "{tmp}/missing.jsonl"], '--prompts {tmp}/missing.jsonl: no such file; give a JSON Lines file with a "prompt" string a line'),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens 0 is outside 1..1048576: ask for at least one new token"),
        (["--prompt", ""], "--prompt is empty: give the text to complete"),
        (["--prompts", "{tmp}/bad.jsonl"], '--prompts {tmp}/bad.jsonl line 2: expected a JSON object with a non-empty "prompt" string'),
        (["--prompts", "{tmp}/empty.jsonl"], '--prompts {tmp}/empty.jsonl holds no prompts: write one JSON object with a "prompt" string a line'),
    ],
    ids=["no-prompt", "missing-file", "zero-tokens", "empty-prompt", "bad-line", "empty-file"],
)
def test_bad_input_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    (tmp_path / "empty.jsonl").write_text("\n\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["generate", "--config", str(_config(tmp_path)), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"tierzero: error: {message.format(tmp=tmp_path)}\n"
