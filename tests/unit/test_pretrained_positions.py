"""`model.pretrained` takes its positions from the checkpoint's config.json: a `train.seq_len` past them
is refused in one line naming the checkpoint's limit; one within them trains, whatever model.max_seq_len,
the built-in models' key, says. The built-in models keep their own check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import tierzero.cli.train as T
from tierzero.cli.main import main
from tierzero.config import ConfigError, load_config
from tierzero.pretrained import PretrainedError
from tierzero.pretrained.files import check_positions, position_limit


def _config_only(directory: Path, **config: Any) -> Path:
    """A checkpoint directory as far as the position check reads it: config.json alone."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], pretrained: Path, *sets: str) -> tuple[int, str, str]:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"pretrained": str(pretrained)}, "train": {"steps": 1, "micro_batch_size": 1}}))
    rc = main(["train", "--config", str(config), "--no-progress", *(item for key in sets for item in ("--set", key))])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_the_limit_is_max_position_embeddings_else_n_positions(tmp_path: Path) -> None:
    assert position_limit(_config_only(tmp_path / "llama", model_type="llama", max_position_embeddings=512)) == (
        512, "max_position_embeddings"
    )
    assert position_limit(_config_only(tmp_path / "gpt2", model_type="gpt2", n_positions=1024, n_ctx=1024)) == (1024, "n_positions")
    assert position_limit(_config_only(tmp_path / "none", model_type="mamba")) is None
    check_positions(tmp_path / "none", seq_len=1 << 20)  # nothing to check against: left to the model
    check_positions(tmp_path / "llama", seq_len=512)


def test_a_longer_seq_len_is_refused_naming_the_checkpoint_s_limit_before_anything_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(T, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    checkpoint = _config_only(tmp_path / "llama", model_type="llama", max_position_embeddings=512)
    refusal = (
        f"tierzero: error: train.seq_len 1024 is above the 512 positions of model.pretrained {checkpoint} "
        "(max_position_embeddings 512 in its config.json): set train.seq_len to at most 512\n"
    )
    assert _run(tmp_path, capsys, checkpoint, "train.seq_len=1024") == (2, "", refusal)
    # model.max_seq_len is the built-in models' key: raising it no longer hides the checkpoint's limit
    assert _run(tmp_path, capsys, checkpoint, "train.seq_len=1024", "model.max_seq_len=4096") == (2, "", refusal)
    with pytest.raises(PretrainedError, match=r"^train.seq_len 1025 is above the 1024 positions of model.pretrained .*"
                       r"\(n_positions 1024 in its config.json\): set train.seq_len to at most 1024$"):
        check_positions(_config_only(tmp_path / "gpt2", model_type="gpt2", n_positions=1024), seq_len=1025)


def test_the_built_in_models_keep_their_own_limit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^train.seq_len 512 is above model.max_seq_len 128: lower train.seq_len or raise"):
        load_config({"model": {"type": "llama"}, "train": {"seq_len": 512}})
    # ... which says nothing of a pretrained model's positions
    assert load_config({"model": {"pretrained": str(tmp_path)}, "train": {"seq_len": 512}}).train.seq_len == 512


def test_a_pretrained_fine_tune_trains_past_the_built_in_default_of_128(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=256, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()  # what save_pretrained said
    rc, out, err = _run(tmp_path, capsys, tmp_path / "gpt2", "train.seq_len=200", "data.max_bytes=64KiB")
    assert (rc, err) == (0, "")
    assert f"  model            pretrained {tmp_path / 'gpt2'} (GPT2LMHeadModel), " in out
    assert "  tokens per step  200 (micro batch 1 x seq_len 200 x accumulation 1 x 1 rank)\n" in out
    assert "steps                1 of 1\n" in out
