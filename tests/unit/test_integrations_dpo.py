"""TRL's DPOTrainer training a tierzero engine (tierzero.integrations.trl.TierzeroDPOTrainer) against the
same engine driven by hand with tierzero's own DPO step (tierzero/align/step.py) on the Trainer's batches:
the same weights bit for bit, and the Trainer's logged loss, learning rate, gradient norm and reward
metrics the engine's and tierzero's DPO's.

The policy is a tiny transformers Llama with peft's LoRA on q_proj and v_proj (lora_B drawn away
from zero, so that the policy and its reference differ from step 0); the reference, in both runs,
is the same model with its adapters off, through the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_tokens import tiny_tokenizer
from test_dpo import RECORDS  # 8 pairs: 4 micro-batches of 2 an epoch, so that 3 steps at GA 2 cross into the second epoch
from tiny_models import tiny_llama

import tierzero
from tierzero.align import completion_logps, dpo_micro_step
from tierzero.data.preference import IGNORE, PreferenceBatch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
integration = pytest.importorskip("tierzero.integrations.trl")

BETA, GA, STEPS = 0.1, 2, 3
CONFIG = {
    "zero": {"stage": 3},
    "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
    "scheduler": {"type": "cosine", "warmup_steps": 1, "total_steps": STEPS},
    "gradient_clipping": 0.5,
    "gradient_accumulation_steps": GA,
    "dpo": {"beta": BETA},
}
"""Stage 3 with clipping (the engine measures the norm) and a schedule (each step's rate differs): each unit's
step is deferred to the next forward; the weights must not care whether the Trainer or a hand drives it."""
STAGE_1 = {**CONFIG, "zero": {"stage": 1}}
LOGGED = ("loss", "learning_rate", "grad_norm", "rewards/margins", "rewards/accuracies")
FIRST_STEP = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def _policy() -> Any:
    model = peft.get_peft_model(
        tiny_llama(vocab=16, positions=64),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return model


class _Recording:
    """The Trainer's data collator, keeping a copy of every batch it hands out, in order."""

    def __init__(self, collate: Any) -> None:
        self.collate, self.batches = collate, []

    def __call__(self, rows: list[Any]) -> dict[str, Any]:
        batch = self.collate(rows)
        self.batches.append({key: value.clone() for key, value in batch.items()})
        return batch


def _dpo_args(out: Path, **given: Any) -> Any:
    kwargs = {
        "per_device_train_batch_size": 2, "max_steps": STEPS, "logging_steps": 1, "save_strategy": "no", "report_to": [],
        "use_cpu": True, "disable_tqdm": True, "seed": 7, "bf16": False, "max_length": None, **given,
    }  # fmt: skip
    return trl.DPOConfig(output_dir=str(out), **kwargs)


def _trainer(tmp_path: Path, model: Any, config: dict[str, Any] = CONFIG, **given: Any) -> Any:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer(tmp_path / "tok"))
    args = _dpo_args(tmp_path / "dpo", **given)
    return integration.TierzeroDPOTrainer(
        model, config, args=args, train_dataset=datasets.Dataset.from_list(RECORDS), processing_class=tokenizer
    )


def _as_preference_batch(batch: dict[str, torch.Tensor]) -> PreferenceBatch:
    """TRL's rows (prompt + completion, chosen rows first, padded right) as tierzero's: inputs and next-token targets,
    `IGNORE` wherever TRL's completion mask, shifted by one, is not set (the prompt and the padding)."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    targets = ids[:, 1:].clone()
    targets[completion[:, 1:] == 0] = IGNORE
    return PreferenceBatch(tokens=ids[:, :-1], targets=targets)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)  # TRL's average of its per-micro-batch metrics between two logs


def _first_step_rewards(engine: Any, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The first step's reward and log-prob metrics, by hand: both of its micro-batches meet the initial weights."""
    rows: dict[str, list[float]] = {name: [] for name in FIRST_STEP}
    with torch.no_grad():
        for batch in batches[:GA]:
            policy, reference = completion_logps(engine, _as_preference_batch(batch), is_hf=True)
            pairs = policy.shape[0] // 2
            rewards = BETA * (policy - reference)
            for name, values in zip(FIRST_STEP, (rewards[:pairs], rewards[pairs:], policy[:pairs], policy[pairs:]), strict=True):
                rows[name].append(values.mean().item())
    return {name: _mean(values) for name, values in rows.items()}


def _by_hand(engine: Any, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """tierzero's own DPO step on each batch; what the Trainer logs each step, computed as it computes it."""
    logs = []
    for start in range(0, len(batches), GA):
        lr, loss, margins, accuracies = engine.lr, torch.tensor(0.0), [], []
        for batch in batches[start : start + GA]:
            terms = dpo_micro_step(engine, _as_preference_batch(batch), beta=BETA, is_hf=True)
            loss += terms.loss / GA  # the Trainer's running sum of micro-batch losses over GA
            margins.append(terms.margin.item())
            accuracies.append(terms.accuracy.item())
        logs.append(
            {"loss": loss.item(), "learning_rate": lr, "grad_norm": engine.grad_norm,
             "rewards/margins": _mean(margins), "rewards/accuracies": _mean(accuracies)}
        )  # fmt: skip
    return logs


@pytest.mark.parametrize("config", [CONFIG, STAGE_1], ids=["stage3", "stage1"])
def test_trls_dpo_trainer_trains_bit_for_bit_as_tierzeros_own_dpo_step(tmp_path: Path, config: dict[str, Any]) -> None:
    trainer = _trainer(tmp_path, _policy(), config)
    recording = trainer.data_collator = _Recording(trainer.data_collator)
    with trainer.engine:
        before = trainer.engine.full_state_dict()
        trainer.train()
        trained = trainer.engine.full_state_dict()
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    batches = recording.batches[: STEPS * GA]  # past an epoch's end the loader collates one batch ahead
    assert len(batches) == STEPS * GA and trainer.beta == BETA
    for batch in batches:  # the trainer's conversion is the one written above
        ours, theirs = integration.preference_batch(batch), _as_preference_batch(batch)
        assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.targets, theirs.targets)

    with tierzero.initialize(_policy(), config) as engine:
        first = _first_step_rewards(engine, batches)
        expected = _by_hand(engine, batches)
        by_hand = engine.full_state_dict()
    assert trained.keys() == by_hand.keys()
    moved = [name for name in trained if not torch.equal(trained[name], before[name])]
    assert moved and all("lora_" in name for name in moved)  # the adapters train, the base is frozen
    assert all(torch.equal(trained[name], by_hand[name]) for name in trained)
    assert [{key: entry[key] for key in LOGGED} for entry in logged] == expected
    assert {key: logged[0][key] for key in FIRST_STEP} == first
    assert len({entry["learning_rate"] for entry in logged}) == STEPS  # the schedule moved the rate each step
    assert expected[0]["rewards/margins"] != 0.0  # the reference is not the policy: the adapters were off


REFUSED = [
    ({"beta": 0.5}, "DPOConfig.beta 0.5 differs from the tierzero config's dpo.beta 0.1: set dpo.beta there and leave beta at its default"),
    ({"precompute_ref_log_probs": True}, "DPOConfig.precompute_ref_log_probs=True with a tierzero engine: the reference runs beside"),
    (
        {"activation_offloading": True},
        "DPOConfig.activation_offloading=True with a tierzero engine: the config's activations.offload offloads them",
    ),
    (
        {"loss_type": ["ipo"]},
        "DPOConfig.loss_type=['ipo'] with a tierzero engine: the loss is tierzero's sigmoid DPO (tierzero.align.dpo_loss); "
        "leave loss_type at its default ['sigmoid']",
    ),
]


def test_what_the_config_or_the_engine_decides_is_refused_in_one_line(tmp_path: Path) -> None:
    model = _policy()
    for given, message in REFUSED:
        with pytest.raises(ValueError) as raised:
            _trainer(tmp_path, model, **given)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), given
    assert len(list(model.parameters())) > 0  # refused before the engine took the model
    with pytest.raises(ValueError) as raised:
        integration.TierzeroDPOTrainer(model, CONFIG, ref_model=_policy())
    assert (
        str(raised.value)
        == "TierzeroDPOTrainer got ref_model: the reference is the engine's model with its LoRA adapters off; leave ref_model out"
    )
    with pytest.raises(ValueError) as raised:
        _trainer(tmp_path, _policy().get_base_model())
    assert str(raised.value).startswith("TierzeroDPOTrainer needs a peft LoRA model, got LlamaForCausalLM: the reference is")


def test_a_batch_tierzeros_dpo_step_cannot_read_is_refused_in_one_line() -> None:
    ids = torch.tensor([[0, 3, 4, 5], [0, 3, 6, 7]])
    right = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "completion_mask": torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]]),
    }
    assert integration.preference_batch(right).targets.tolist() == [[IGNORE, 4, 5], [IGNORE, 6, IGNORE]]
    with pytest.raises(ValueError) as raised:
        integration.preference_batch({**right, "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])})
    assert str(raised.value).startswith("TierzeroDPOTrainer got rows padded on the left: tierzero's DPO step reads them without")
    with pytest.raises(ValueError) as raised:
        integration.preference_batch({**right, "pixel_values": torch.zeros(2, 3)})
    assert str(raised.value).startswith("TierzeroDPOTrainer got a batch with ['pixel_values']: tierzero's DPO step reads text rows")
