"""TRL's DPOTrainer training a tierzero engine (tierzero.integrations.trl.TierzeroDPOTrainer) against the
same engine driven by hand with tierzero's own DPO step (tierzero/align/step.py) on the Trainer's batches.

The policy is a tiny transformers Llama with peft's LoRA on q_proj and v_proj (lora_B drawn away
from zero, so that the policy and its reference differ from step 0); the reference, in both runs,
is the same model with its adapters off, through the engine.

Not bit for bit, within 1e-6: the two compute the same loss by different arithmetic. TRL sums the
completion's log-probabilities from its fused LM head (the LM head and log-softmax in tiles of the
completion's positions only), over the whole padded rows with their attention mask; tierzero takes
a cross-entropy over the full logits of the rows one token shorter, without a mask (right padding
changes no completion position under causal attention). The rounding differs in the last bits of
the log-probs, hence of the gradients and the margins; after 3 steps of Adam at lr 1e-2 the weights
differ by 7.5e-8 at most and the margins by 5e-8 (the losses logged happen to round to the same float).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_tokens import tiny_tokenizer

import tierzero
from tierzero.align import dpo_micro_step
from tierzero.data.preference import IGNORE, PreferenceBatch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
integration = pytest.importorskip("tierzero.integrations.trl")

BETA, GA, STEPS, TOLERANCE = 0.1, 2, 3, 1e-6
CONFIG = {
    "zero": {"stage": 3},
    "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
    "gradient_clipping": 0.5,
    "gradient_accumulation_steps": GA,
    "dpo": {"beta": BETA},
}
"""Stage 3 with clipping: each unit's step is deferred to the next forward, the policy's in TRL's order
(policy, then reference) and the reference's in tierzero's; the weights must not care."""
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
"""8 pairs: 4 micro-batches of 2 an epoch, so that 3 steps at GA 2 cross into the second epoch."""


def _policy() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
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


def _trainer(tmp_path: Path, model: Any, **given: Any) -> Any:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer(tmp_path / "tok"))
    args = _dpo_args(tmp_path / "dpo", **given)
    return integration.TierzeroDPOTrainer(
        model, CONFIG, args=args, train_dataset=datasets.Dataset.from_list(RECORDS), processing_class=tokenizer
    )


def _as_preference_batch(batch: dict[str, torch.Tensor]) -> PreferenceBatch:
    """TRL's rows (prompt + completion, chosen rows first, padded right) as tierzero's: inputs and next-token targets,
    `IGNORE` wherever TRL's completion mask, shifted by one, is not set (the prompt and the padding)."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    return PreferenceBatch(tokens=ids[:, :-1], targets=ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE))


def _by_hand(engine: Any, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """tierzero's own DPO step on each batch; what the Trainer logs each step, computed as it computes it."""
    logs = []
    for start in range(0, len(batches), GA):
        loss, margins = torch.tensor(0.0), []
        for batch in batches[start : start + GA]:
            terms = dpo_micro_step(engine, _as_preference_batch(batch), beta=BETA, is_hf=True)
            loss += terms.loss / GA  # the Trainer's running sum of micro-batch losses over GA
            margins.append(terms.margin.item())
        logs.append({"loss": loss.item(), "rewards/margins": sum(margins) / len(margins), "grad_norm": engine.grad_norm})
    return logs


def test_trls_dpo_trainer_trains_as_tierzeros_own_dpo_step(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, _policy())
    recording = trainer.data_collator = _Recording(trainer.data_collator)
    with trainer.engine:
        before = trainer.engine.full_state_dict()
        trainer.train()
        trained = trainer.engine.full_state_dict()
        logged = [
            {key: entry[key] for key in ("loss", "rewards/margins", "grad_norm")} for entry in trainer.state.log_history if "loss" in entry
        ]
    batches = recording.batches[: STEPS * GA]  # past an epoch's end the loader collates one batch ahead
    assert len(batches) == STEPS * GA and trainer.beta == BETA

    with tierzero.initialize(_policy(), CONFIG) as engine:
        expected = _by_hand(engine, batches)
        by_hand = engine.full_state_dict()
    assert trained.keys() == by_hand.keys()
    moved = [name for name in trained if not torch.equal(trained[name], before[name])]
    assert moved and all("lora_" in name for name in moved)  # the adapters train, the base is frozen
    gap = max((trained[name] - by_hand[name]).abs().max().item() for name in trained)
    assert gap <= TOLERANCE
    assert len(logged) == STEPS
    for ours, theirs in zip(logged, expected, strict=True):
        assert all(abs(ours[key] - theirs[key]) <= TOLERANCE for key in ours), (ours, theirs)
    assert expected[0]["rewards/margins"] != 0.0  # the reference is not the policy: the adapters were off


REFUSED = [
    ({"beta": 0.5}, "DPOConfig.beta 0.5 differs from the tierzero config's dpo.beta 0.1: set dpo.beta there and leave beta at its default"),
    ({"precompute_ref_log_probs": True}, "DPOConfig.precompute_ref_log_probs=True with a tierzero engine: the reference runs beside"),
    (
        {"activation_offloading": True},
        "DPOConfig.activation_offloading=True with a tierzero engine: the config's activations.offload offloads them",
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
