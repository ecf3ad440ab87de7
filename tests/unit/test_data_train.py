"""Tokenized data in `tierzero train`: the data config, the vocabulary check, and a run resumed exactly."""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_data_tokens import WORDS, tiny_tokenizer

import tierzero.cli.train as T
from tierzero.config import ConfigError, load_config
from tierzero.data import TextTokenizer, check_vocab
from tierzero.models.builtin import build_model

VOCAB = len(WORDS) + 2


def test_data_config_keys_and_their_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = load_config({}).data
    assert (data.tokenizer, data.format, data.text_field, data.cache_dir) == (None, "auto", "text", None)
    monkeypatch.chdir(tmp_path)
    data = load_config({"data": {"path": "c.jsonl", "tokenizer": "tok", "format": "JSONL", "cache_dir": "~/tc"}}).data
    assert data.tokenizer == str(tmp_path / "tok") and data.format == "jsonl"
    assert data.cache_dir == os.path.expanduser("~/tc")
    refusals = {
        "data.format is jsonl but data.tokenizer is not set: byte-level data reads every file as raw bytes": {"format": "jsonl"},
        "data.tokenizer is set but data.path is not: point data.path at the text to tokenize": {"tokenizer": "tok"},
        "data.format: expected one of auto, text, jsonl, datasets, got 'csv'": {"format": "csv"},
        "data.text_field: expected a field name such as text, got ''": {"text_field": ""},
    }
    for message, raw in refusals.items():
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            load_config({"data": raw})


def _cfg(tmp_path: Path, **model: Any) -> Any:
    tok = tiny_tokenizer(tmp_path / "tok")
    return load_config({"model": model, "data": {"path": str(tmp_path / "c.jsonl"), "tokenizer": str(tok)}})


def test_a_model_that_cannot_embed_the_tokenizers_ids_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, type="gpt", vocab_size=8)
    with pytest.raises(ValueError) as info:
        check_vocab(cfg, build_model(cfg.model, device="meta"))
    assert str(info.value) == (
        f"data.tokenizer {tmp_path / 'tok'} has {VOCAB} ids but model.vocab_size is 8: set model.vocab_size to at least "
        f"{VOCAB} (a multiple of 64 such as 64 runs faster)"
    )
    fits = _cfg(tmp_path, type="llama", vocab_size=VOCAB)
    check_vocab(fits, build_model(fits.model, device="meta"))
    hf = _cfg(tmp_path, type="transformers", transformers_class="GPT2LMHeadModel",
              transformers_config={"vocab_size": 10, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 128})
    with pytest.raises(ValueError, match=rf"has {VOCAB} ids but the model \(model.transformers_config\) has vocab_size 10: "
                       "use the tokenizer that came with the model, or a model with vocab_size >= 14"):
        check_vocab(hf, build_model(hf.model))
    as_bytes = load_config({"model": {"vocab_size": 100}})
    with pytest.raises(ValueError, match=r"^byte-level data \(data.tokenizer null\) has 256 ids but model.vocab_size is 100"):
        check_vocab(as_bytes, build_model(as_bytes.model, device="meta"))


def test_train_refuses_the_mismatch_before_building_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "initialize", lambda *a, **k: pytest.fail("the engine was built"))
    with pytest.raises(ValueError, match="set model.vocab_size to at least 14"):
        T.train(_cfg(tmp_path, vocab_size=8), progress=False, out=io.StringIO())


# ---------------------------------------------------------------- end to end


def _corpus(path: Path) -> Path:
    """40 documents of 3 to 9 words: 283 tokens, 17 sequences of 16: the run below rolls into its second epoch at step 5."""
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(40)]
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def _config(tmp_path: Path, ckpt: Path) -> Path:
    raw: dict[str, Any] = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 3e-3},
        "model": {"type": "gpt", "vocab_size": VOCAB, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 16},
        "data": {"path": str(tmp_path / "corpus.jsonl"), "tokenizer": str(tmp_path / "tok"), "cache_dir": str(tmp_path / "cache")},
        "train": {"steps": 6, "micro_batch_size": 2, "seq_len": 16, "log_every": 1},
        "gradient_accumulation_steps": 2,
        "offload": {"optimizer": "cpu"},
        "checkpoint": {"dir": str(ckpt), "every": 2, "keep": 3},
    }
    path = tmp_path / f"config-{ckpt.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run(config: Path, *args: str) -> str:
    parser = argparse.ArgumentParser(prog="tierzero")
    T.add_train_command(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    assert T.run_train(parser.parse_args(["train", "--config", str(config), "--no-progress", *args]), out=out) == 0
    return out.getvalue()


def _losses(text: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+)/\d+ loss=([0-9.]+) ", text, flags=re.M)}


def test_train_on_tokenized_jsonl_resumes_with_the_unbroken_runs_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _corpus(tmp_path / "corpus.jsonl")
    tiny_tokenizer(tmp_path / "tok")
    calls = []
    real = TextTokenizer.encode_batch
    monkeypatch.setattr(TextTokenizer, "encode_batch", lambda tok, texts: calls.append(len(texts)) or real(tok, texts))
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    full = _run(_config(tmp_path, unbroken))
    assert calls == [40]  # tokenized once: the later runs read the cache
    first = _run(_config(tmp_path, broken), "--steps", "3")
    resumed = _run(_config(tmp_path, broken), "--resume")
    assert calls == [40]
    assert f"resumed from {broken / '3'} at step 3\n" in resumed
    assert sorted(_losses(full)) == [1, 2, 3, 4, 5, 6] and sorted(_losses(resumed)) == [4, 5, 6]
    assert {**_losses(first), **_losses(resumed)} == _losses(full)
    losses = [float(v) for v in _losses(full).values()]
    assert losses[-1] < losses[0] < 3.0  # ln 14 = 2.64: it learns the words' frequencies
