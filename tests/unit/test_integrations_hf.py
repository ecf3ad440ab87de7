"""transformers' Trainer and TRL's SFTTrainer training a tierzero engine (tierzero/integrations/hf.py,
trl.py), against the same engine config driven by hand with `engine.backward` and `engine.step`:
the same weights bit for bit, the Trainer's logged loss, learning rate and gradient norm the
engine's, a resume through the Trainer's checkpoints bit-exact; and the silent no-op of a bare
`engine.module` in a plain Trainer now raises at its first step."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero.config import load_config
from tierzero.engine.engine import PARAMETERLESS_STEP

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("tierzero.integrations.hf")

VOCAB, GA, STEPS = 64, 2, 4
CONFIG = {
    "zero": {"stage": 3},
    "optimizer": {"type": "adamw", "lr": 1e-2},
    "scheduler": {"type": "cosine", "warmup_steps": 1, "total_steps": STEPS},
    "gradient_clipping": 0.5,
    "gradient_accumulation_steps": GA,
}
"""Clipping on, so that the engine measures the norm; a schedule, so that each step's rate differs."""


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _rows() -> list[dict[str, torch.Tensor]]:
    """8 rows: 4 micro-batches of 2 an epoch, 2 optimizer steps an epoch at GA 2."""
    ids = [torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(k)) for k in range(8)]
    return [{"input_ids": x, "labels": x} for x in ids]


class _Recording:
    """A data collator that keeps a copy of every batch it hands out, in order."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, Any]]) -> None:
        self.collate, self.batches = collate, []

    def __call__(self, rows: list[Any]) -> dict[str, Any]:
        batch = self.collate(rows)
        self.batches.append(dict(batch))
        return batch


def _stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def _args(out: Path, **given: Any) -> Any:
    kwargs = {
        "per_device_train_batch_size": 2, "max_steps": STEPS, "logging_steps": 1, "save_strategy": "no",
        "report_to": [], "use_cpu": True, "disable_tqdm": True, "seed": 7, **given,
    }  # fmt: skip
    return transformers.TrainingArguments(output_dir=str(out), **kwargs)


def _by_hand(engine: Any, batches: list[dict[str, Any]], loss_of: Callable[[Any, dict[str, Any]], torch.Tensor]) -> list[dict[str, float]]:
    """tierzero's own loop over `batches`; what the Trainer would log each step, computed as it computes it."""
    logs = []
    for start in range(0, len(batches), GA):
        lr, logged = engine.lr, torch.tensor(0.0)
        for batch in batches[start : start + GA]:
            loss = loss_of(engine, batch)
            engine.backward(loss)
            engine.step()
            logged += loss.detach() / GA  # the Trainer's running sum of micro-batch losses over GA
        logs.append({"loss": logged.item(), "learning_rate": lr, "grad_norm": engine.grad_norm})
    return logs


def _logged(trainer: Any) -> list[dict[str, float]]:
    return [{key: entry[key] for key in ("loss", "learning_rate", "grad_norm")} for entry in trainer.state.log_history if "loss" in entry]


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _lm_loss(engine: Any, batch: dict[str, Any]) -> torch.Tensor:
    return engine(**batch).loss


def test_the_trainer_trains_as_the_engines_own_loop_and_logs_the_engines_numbers(tmp_path: Path) -> None:
    recording = _Recording(_stack)
    trainer = hf.TierzeroTrainer(_gpt2(), CONFIG, args=_args(tmp_path / "run"), train_dataset=_rows(), data_collator=recording)
    with trainer.engine:
        trainer.train()
        trained, logged = trainer.engine.full_state_dict(), _logged(trainer)
    assert len(recording.batches) == STEPS * GA

    with tierzero.initialize(_gpt2(), CONFIG) as engine:
        expected = _by_hand(engine, recording.batches, _lm_loss)
        _assert_same_weights(trained, engine.full_state_dict())
    assert logged == expected
    assert len({entry["learning_rate"] for entry in logged}) > 1 and all(math.isfinite(e["grad_norm"]) for e in logged)


def test_a_resume_through_the_trainers_checkpoints_is_bit_exact(tmp_path: Path) -> None:
    """Saved mid-epoch (step 1 of 2 an epoch): the resumed run skips the batches already seen, restores the
    engine's checkpoint (parameters, optimizer states, step, rate) and ends where the whole run ends."""
    args = _args(tmp_path / "whole", save_strategy="steps", save_steps=1)
    whole = hf.TierzeroTrainer(_gpt2(), CONFIG, args=args, train_dataset=_rows(), data_collator=_stack)
    with whole.engine:
        whole.train()
        expected, expected_logs = whole.engine.full_state_dict(), _logged(whole)
    assert (tmp_path / "whole" / "checkpoint-1" / hf.CHECKPOINT_DIR / "1" / "manifest.json").is_file()

    resumed = hf.TierzeroTrainer(_gpt2(), CONFIG, args=_args(tmp_path / "resumed"), train_dataset=_rows(), data_collator=_stack)
    with resumed.engine:
        resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-1"))
        _assert_same_weights(resumed.engine.full_state_dict(), expected)
        assert resumed.engine.global_step == STEPS
    assert _logged(resumed) == expected_logs  # step 1's entry from the checkpoint's trainer_state.json, the rest run again


def test_save_model_writes_the_sharded_checkpoint_a_fresh_engine_loads_and_export_what_transformers_loads(tmp_path: Path) -> None:
    trainer = hf.TierzeroTrainer(_gpt2(), CONFIG, args=_args(tmp_path / "run", max_steps=1), train_dataset=_rows(), data_collator=_stack)
    with trainer.engine:
        trainer.train()
        trainer.save_model(str(tmp_path / "final"))
        trainer.export_pretrained(tmp_path / "exported")
        saved = trainer.engine.full_state_dict()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "exported").state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in saved.items())
    with tierzero.initialize(_gpt2(), CONFIG) as engine:
        engine.load_checkpoint(tmp_path / "final" / hf.CHECKPOINT_DIR)
        assert engine.global_step == 1
        _assert_same_weights(engine.full_state_dict(), saved)
    with pytest.raises(ValueError, match="holds no tierzero checkpoint"):
        hf._engine_checkpoint(tmp_path / "run")


def test_a_plain_trainer_or_optimizer_over_the_engines_module_raises_at_its_first_step(tmp_path: Path) -> None:
    """The issue's silent no-op: Trainer(model=engine.module) built AdamW over two empty groups and stepped nothing."""
    with tierzero.initialize(_gpt2(), CONFIG) as engine:
        assert list(engine.module.parameters()) == []
        trainer = transformers.Trainer(model=engine.module, args=_args(tmp_path / "plain"), train_dataset=_rows(), data_collator=_stack)
        with pytest.raises(ValueError) as raised:
            trainer.train()
        assert str(raised.value) == PARAMETERLESS_STEP
        grouped = torch.optim.AdamW([{"params": list(engine.module.parameters())}])
        with pytest.raises(ValueError) as raised:
            grouped.step()
        assert str(raised.value) == PARAMETERLESS_STEP
        with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
            torch.optim.AdamW(engine.module.parameters())  # torch refuses this one itself, at once
    torch.optim.AdamW([{"params": []}]).step()  # the guard goes with the engine


REFUSED = [
    ({"learning_rate": 3e-4}, "TrainingArguments.learning_rate 0.0003 differs from the tierzero config's optimizer.lr 0.01"),
    ({"gradient_accumulation_steps": 4}, "TrainingArguments.gradient_accumulation_steps 4 differs from the tierzero config's"),
    ({"warmup_steps": 5}, "TrainingArguments.warmup_steps 5 with a tierzero engine: its optimizer and schedule are its config's"),
    ({"bf16": True}, "TrainingArguments bf16=True but the tierzero config's precision.param_dtype is fp32"),
]


def test_training_arguments_the_config_decides_are_refused_before_the_engine_takes_the_model(tmp_path: Path) -> None:
    model = _gpt2()
    for given, message in REFUSED:
        with pytest.raises(ValueError) as raised:
            hf.TierzeroTrainer(model, CONFIG, args=_args(tmp_path, **given), train_dataset=_rows())
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), given
    assert len(list(model.parameters())) > 0
    adopted = hf.aligned_args(_args(tmp_path), load_config(CONFIG))
    assert (adopted.learning_rate, adopted.gradient_accumulation_steps, adopted.max_grad_norm) == (1e-2, GA, 0.5)


def _tokenizer() -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    words = {f"w{i}": i + 3 for i in range(VOCAB - 3)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab={"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **words}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def _sft_loss(engine: Any, batch: dict[str, Any]) -> torch.Tensor:
    """SFTTrainer's loss: the fused LM head's per-token log-probabilities, summed over the batch's label tokens."""
    outputs = engine(**batch, use_cache=False, fused_lm_head=True)
    return (-outputs.log_probs).sum() / outputs.label_mask.sum().clamp(min=1)


def test_trls_sft_trainer_trains_as_the_engines_own_loop(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl.trainer.utils import add_fused_lm_head

    from tierzero.integrations.trl import TierzeroSFTTrainer

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 12, (8,), generator=g).tolist()
    texts = [" ".join(f"w{j}" for j in torch.randint(0, VOCAB - 3, (n,), generator=g).tolist()) for n in lengths]
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, seed=7, bf16=False, max_length=12,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"text": texts})
    trainer = TierzeroSFTTrainer(_gpt2(), CONFIG, args=args, train_dataset=dataset, processing_class=_tokenizer())
    recording = trainer.data_collator = _Recording(trainer.data_collator)
    with trainer.engine:
        trainer.train()
        trained, logged = trainer.engine.full_state_dict(), _logged(trainer)

    reference = _gpt2()
    add_fused_lm_head(reference, outputs=("log_probs", "entropy", "is_top1"))
    with tierzero.initialize(reference, CONFIG) as engine:
        expected = _by_hand(engine, recording.batches, _sft_loss)
        _assert_same_weights(trained, engine.full_state_dict())
    assert logged == expected
