"""DPO (train.objective: dpo): the loss against TRL and against plain PyTorch, the prompt mask, 50 steps
against a reference loop, stage 3 and two ranks against one, `tierzero train`, and what is refused.

The policy is a tiny transformers Llama with peft's LoRA on q_proj and v_proj (lora_B drawn
away from zero, so that the policy and its reference differ at step 0); the reference is the
same model with its adapters switched off: through the engine by tierzero's `adapters_off`,
in the references here by peft's own `disable_adapter`.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from test_data_tokens import tiny_tokenizer

import tierzero
from tierzero.align import dpo_loss, dpo_micro_step, dpo_train_step, sequence_logps
from tierzero.cli.main import main
from tierzero.config import ConfigError, load_config
from tierzero.config.sections import DpoConfig
from tierzero.data.preference import IGNORE, PreferenceBatches, PreferencePair, read_preferences, tokenize_pairs
from tierzero.data.tokenizer import load_tokenizer
from tierzero.pretrained.lora import adapters_off

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_ranks  # noqa: E402
from tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BETA = 0.1
RECORDS = [
    {"prompt": "the cat sat", "chosen": " on the mat", "rejected": " far"},
    {"prompt": "a dog", "chosen": " ran far", "rejected": " sat on a cat end"},
    {"prompt": "the end of", "chosen": " the story", "rejected": " a dog"},
    {"prompt": "cat dog cat", "chosen": " sat on a mat", "rejected": " ran"},
    {"prompt": "the story of a", "chosen": " cat", "rejected": " dog ran far far"},
    {"prompt": "a mat", "chosen": " of the cat", "rejected": " the end"},
    {"prompt": "dog", "chosen": " sat", "rejected": " ran on the mat"},
    {"prompt": "the dog ran on the", "chosen": " mat", "rejected": " story of the end"},
]


def _data(tmp_path: Path) -> tuple[Path, Path]:
    """(the tokenizer directory, the records' jsonl), written once per directory."""
    path = tmp_path / "prefs.jsonl"
    if not path.exists():
        tiny_tokenizer(tmp_path / "tok")
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return tmp_path / "tok", path


def _batches(tmp_path: Path, *, micro: int, rank: int = 0, world: int = 1, seq_len: int = 16, max_prompt: int = 8) -> PreferenceBatches:
    tok, path = _data(tmp_path)
    tokenizer = load_tokenizer(tok)
    pairs = tokenize_pairs(list(read_preferences(path)), tokenizer)
    return PreferenceBatches(
        pairs=pairs, pad_id=tokenizer.eos_id, max_prompt_len=max_prompt, seq_len=seq_len, micro_batch_size=micro, seed=0,
        rank=rank, world_size=world,
    )  # fmt: skip


def _llama() -> Any:
    return tiny_llama(vocab=16, positions=64)


def _lora(model: Any) -> Any:
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    _draw_lora_b(model)
    return model


def _draw_lora_b(model: Any) -> None:
    """lora_B away from zero (peft starts it at zero), so that the policy is not its reference at step 0."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


def _engine(model: Any, *, stage: int = 1, offload: dict[str, str] | None = None, clip: float = 0.0) -> Any:
    config = {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0}, "gradient_clipping": clip}
    return tierzero.initialize(model, config | {"offload": offload or {}})


# ---------------------------------------------------------------- the references, written here


def _trl_rows(pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows as TRL's collator makes them: prompt + completion, padded right, and the completion mask."""
    seqs = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    masks = [[0] * len(p.prompt) + [1] * len(p.chosen) for p in pairs] + [[0] * len(p.prompt) + [1] * len(p.rejected) for p in pairs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [1] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    return ids, mask


def _reference_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the DPO loss, each pair's margin): log_softmax, gather, sum over the completion; the reference with peft's adapters off."""

    def logps(logits: torch.Tensor) -> torch.Tensor:
        picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]
        return (picked * mask[:, 1:]).sum(dim=1)

    with torch.no_grad(), model.disable_adapter():
        reference = logps(model(input_ids=ids).logits)
    policy = logps(model(input_ids=ids).logits)
    b = len(ids) // 2
    margins = BETA * ((policy[:b] - reference[:b]) - (policy[b:] - reference[b:]))
    return -F.logsigmoid(margins).mean(), margins.detach()


# ---------------------------------------------------------------- the loss and the mask


def test_the_batch_is_prompt_then_completion_and_only_the_completion_counts(tmp_path: Path) -> None:
    data = _batches(tmp_path, micro=2)
    pairs = [data.pairs[int(i)] for i in data.order(0)[:2]]
    # the word-level tokenizer: "the cat sat" -> 2 3 4, " on the mat" -> 5 2 6, then EOS (1)
    assert data.pairs[0] == PreferencePair(prompt=[2, 3, 4], chosen=[5, 2, 6, 1], rejected=[10, 1])
    batch = data.batch(0)
    ids, mask = _trl_rows(pairs)
    assert torch.equal(batch.tokens, ids[:, :-1])
    # a target counts exactly where TRL's completion mask (shifted by one) is set: never a prompt token, never padding
    assert torch.equal(batch.targets != IGNORE, mask[:, 1:].bool())
    assert torch.equal(batch.targets[mask[:, 1:].bool()], ids[:, 1:][mask[:, 1:].bool()])
    # so the logits at the prompt's and the padding's positions do not reach the log-probs
    logits = torch.randn(*batch.tokens.shape, 16, generator=torch.Generator().manual_seed(3))
    moved = logits.clone()
    moved[batch.targets == IGNORE] += 5 * torch.randn(int((batch.targets == IGNORE).sum()), 16)
    assert torch.equal(sequence_logps(logits, batch.targets), sequence_logps(moved, batch.targets))


def test_long_prompts_keep_their_end_and_every_completion_keeps_a_token(tmp_path: Path) -> None:
    data = _batches(tmp_path, micro=1, seq_len=4, max_prompt=3)
    assert data.window([9, 8, 7, 6, 5], [4, 3, 1]) == ([7, 6, 5, 4, 3], 3)  # the prompt's last 3, then cut to seq_len + 1
    assert data.window([9], [4, 3, 2, 5, 1]) == ([9, 4, 3, 2, 5], 1)
    rows = data.rows([([7, 6, 5, 4, 3], 3), ([9, 4, 1], 1)])
    assert rows.tokens.tolist() == [[7, 6, 5, 4], [9, 4, 1, 1]]
    assert rows.targets.tolist() == [[IGNORE, IGNORE, 4, 3], [4, 1, IGNORE, IGNORE]]


def test_the_loss_at_step_0_is_the_reference_written_here_through_the_engine_at_stage_3(tmp_path: Path) -> None:
    data = _batches(tmp_path, micro=4)
    model = _lora(_llama())
    expected, margins = _reference_loss(copy.deepcopy(model), *_trl_rows([data.pairs[int(i)] for i in data.order(0)[:4]]))
    assert margins.abs().min() > 1e-4  # the policy is not its reference
    with _engine(model, stage=3, offload={"params": "cpu"}) as engine:
        terms = dpo_micro_step(engine, data.batch(0), beta=BETA, is_hf=True)
    assert abs(terms.loss.item() - expected.item()) <= 1e-6
    assert abs(terms.margin.item() - margins.mean().item()) <= 1e-6
    assert terms.accuracy.item() == (margins > 0).float().mean().item()


def test_the_loss_at_step_0_is_trls(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tok, _ = _data(tmp_path)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, report_to=[], per_device_train_batch_size=4, use_cpu=True, max_length=None)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = trl.DPOTrainer(
        model=_llama(), args=args, train_dataset=datasets.Dataset.from_list(RECORDS[:4]),
        processing_class=transformers.AutoTokenizer.from_pretrained(tok), peft_config=lora,
    )  # fmt: skip
    _draw_lora_b(trainer.model)
    ours = _lora(_llama())  # not a deepcopy: TRL's patched forward would still reach its own model's modules
    ours.load_state_dict(trainer.model.state_dict())
    rows = [trainer.train_dataset[i] for i in range(4)]
    expected = trainer.compute_loss(trainer.model, trainer.data_collator(rows)).item()
    data = _batches(tmp_path, micro=4, seq_len=32, max_prompt=32)
    # TRL tokenizes the records as tierzero does
    assert [[r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]] for r in rows] == [[p.prompt, p.chosen, p.rejected] for p in data.pairs[:4]]
    batch = data.rows([data.window(p.prompt, p.chosen) for p in data.pairs[:4]] + [data.window(p.prompt, p.rejected) for p in data.pairs[:4]])
    with _engine(ours) as engine:
        terms = dpo_micro_step(engine, batch, beta=BETA, is_hf=True)
    assert abs(terms.loss.item() - expected) <= 1e-6


def test_the_loss_is_the_sigmoid_of_the_margin() -> None:
    policy, reference = torch.tensor([-3.0, -5.0, -4.0, -2.0]), torch.tensor([-4.0, -4.0, -4.0, -4.0])
    terms = dpo_loss(policy, reference, beta=0.5)
    # pair 0: 0.5 x ((-3 + 4) - (-4 + 4)) = 0.5; pair 1: 0.5 x ((-5 + 4) - (-2 + 4)) = -1.5
    expected = (-math.log(1 / (1 + math.exp(-0.5))) - math.log(1 / (1 + math.exp(1.5)))) / 2
    assert terms.loss.item() == pytest.approx(expected, abs=1e-7)
    assert terms.margin.item() == pytest.approx(-0.5) and terms.accuracy.item() == 0.5


# ---------------------------------------------------------------- training


def test_fifty_steps_follow_the_reference_loop_and_the_margin_rises(tmp_path: Path) -> None:
    data = _batches(tmp_path, micro=4)
    model = _lora(_llama())
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    losses, margins = [], []
    with _engine(model, stage=2) as engine:
        for step in range(50):
            stats = dpo_train_step(engine, data, DpoConfig(beta=BETA), step=step, accumulation=1, device=torch.device("cpu"), is_hf=True)
            pairs = [data.pairs[int(data.order((step * 4 + i) // 8)[(step * 4 + i) % 8])] for i in range(4)]
            loss, margin = _reference_loss(reference, *_trl_rows(pairs))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            assert abs(stats.loss - loss.item()) <= 1e-5, step
            assert abs(stats.margin - margin.mean().item()) <= 1e-5, step
            losses.append(stats.loss)
            margins.append(stats.margin)
    # from -0.020 at step 0 to 0.117 at step 49 (the batches differ from step to step, so the rise is not smooth)
    assert margins[0] < 0 < margins[-1] - 0.1 and sum(margins[-10:]) / 10 > sum(margins[:10]) / 10 + 0.05
    assert losses[-1] < losses[0] - 0.05


def _rank_run(rank: int, world_size: int, payload: tuple[str, int, dict[str, str], float]) -> tuple[list[float], list[float]]:
    directory, stage, offload, clip = payload
    data = _batches(Path(directory), micro=4 // world_size, rank=rank, world=world_size)
    losses, margins = [], []
    with _engine(_lora(_llama()), stage=stage, offload=offload, clip=clip) as engine:
        for step in range(6):
            stats = dpo_train_step(engine, data, DpoConfig(beta=BETA), step=step, accumulation=1, device=torch.device("cpu"), is_hf=True)
            losses.append(stats.loss)
            margins.append(stats.margin)
    return losses, margins


def test_stage_3_and_two_ranks_train_as_one_rank(tmp_path: Path) -> None:
    _data(tmp_path)
    one, one_clipped = _rank_run(0, 1, (str(tmp_path), 1, {}, 0.0)), _rank_run(0, 1, (str(tmp_path), 1, {}, 0.005))
    # clipped, stage 3 steps each unit in the next forward: here the reference's, without gradients
    stage3 = _rank_run(0, 1, (str(tmp_path), 3, {"params": "cpu", "optimizer": "cpu"}, 0.005))
    two = run_ranks(_rank_run, world_size=2, payload=(str(tmp_path), 3, {"params": "cpu"}, 0.0))
    assert two[0] == two[1]  # the figures are reduced over the ranks
    # the clipping bites, if little (Adam undoes most of a uniform scale): 3e-5, past the 1e-6 asked below
    assert max(abs(a - b) for a, b in zip(one[0], one_clipped[0], strict=True)) > 1e-5
    for run, one in ((stage3, one_clipped), (two[0], one)):
        assert max(abs(a - b) for a, b in zip(run[0], one[0], strict=True)) <= 1e-6
        assert max(abs(a - b) for a, b in zip(run[1], one[1], strict=True)) <= 1e-6


def test_tierzero_train_logs_the_margin_and_writes_it_to_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok, path = _data(tmp_path)
    config = {
        "zero": {"stage": 3},
        "model": {"type": "llama", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32,
                  "lora": {"r": 4, "alpha": 8, "target_modules": ["wq", "wv"]}},
        "train": {"steps": 4, "micro_batch_size": 2, "seq_len": 16, "log_every": 2, "objective": "dpo"},
        "data": {"path": str(path), "tokenizer": str(tok)},
        "dpo": {"beta": BETA},
        "optimizer": {"lr": 1e-2},
    }  # fmt: skip
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(config))
    summary = tmp_path / "summary.json"
    assert main(["train", "--config", str(tmp_path / "dpo.yaml"), "--no-progress", "--summary-json", str(summary)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    written = json.loads(summary.read_text())
    # peft starts lora_B at zero: at step 0 the policy is its reference, margin 0 and loss log 2
    assert written["losses"][0] == pytest.approx(math.log(2), abs=1e-7) and written["margins"][0] == 0.0
    assert len(written["margins"]) == len(written["accuracies"]) == 4 and all(m != 0.0 for m in written["margins"][1:])
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert f"margin={written['margins'][-1]:.4f} acc={written['accuracies'][-1]:.2f}" in lines[-1]


# ---------------------------------------------------------------- refusals


def test_a_record_without_chosen_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"prompt": "a", "rejected": "b"}) + "\n")
    with pytest.raises(ValueError) as refused:
        list(read_preferences(path))
    assert str(refused.value) == (
        f"data.path file {path} line 2 has no 'chosen' field (its keys: 'prompt', 'rejected'): "
        "each record needs prompt, chosen and rejected strings"
    )


def test_dpo_without_lora_and_a_beta_not_above_zero_are_refused(tmp_path: Path) -> None:
    tok, path = _data(tmp_path)
    raw = {"train": {"objective": "dpo"}, "data": {"path": str(path), "tokenizer": str(tok)}}
    with pytest.raises(ConfigError) as refused:
        load_config(raw | {"dpo": {"reference": "adapters_off"}})
    assert str(refused.value) == (
        "dpo.reference is adapters_off but model.lora.r is 0 (full fine-tuning): there are no adapters to switch "
        "off; set dpo.reference to precomputed (or auto), or model.lora.r (e.g. 8)"
    )
    for beta in (0, -0.1):
        with pytest.raises(ConfigError, match=rf"^dpo.beta: expected a positive number, got {beta}$"):
            load_config(raw | {"model": {"lora": {"r": 4}}, "dpo": {"beta": beta}})
    with pytest.raises(ConfigError, match=r"^dpo.max_prompt_len 17 is above train.seq_len 16"):
        load_config(raw | {"model": {"lora": {"r": 4}}, "train": {"objective": "dpo", "seq_len": 16}, "dpo": {"max_prompt_len": 17}})
    with pytest.raises(ValueError, match=r"^adapters_off needs a model with LoRA adapters, got LlamaForCausalLM"):
        with adapters_off(_llama()):
            pass
