"""DPO with `dpo.reference: precomputed` (tierzero/align/reference.py): full fine-tuning against the initial
model's log-probs, computed once before the first step, held to a plain-PyTorch loop whose reference is a
frozen deep copy; two ranks' table against one rank's; `tierzero train --resume` against the unbroken run;
and a table that is missing, corrupt, another run's or of other records, refused in one line.

The policy is test_dpo.py's tiny transformers Llama, without LoRA. The 8 records are precomputed 3 a
forward (micro_batch_size 3): the last forward is short, and at two ranks one rank runs a forward it drops.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from test_dpo import BETA, _batches, _data, _llama

import tierzero
import tierzero.cli.train as T
from tierzero.align import ReferenceTable, dpo_micro_step, dpo_train_step, precompute_reference
from tierzero.align.reference import forwards_per_rank
from tierzero.align.table import REFERENCE_FILE
from tierzero.checkpoint.format import CheckpointError
from tierzero.config import ConfigError, load_config
from tierzero.config.sections import DpoConfig
from tierzero.data.preference import IGNORE, PreferenceBatch, PreferenceBatches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_ranks  # noqa: E402

MICRO = 3
RECORDS = 8
STEPS = 6


def _engine(model: Any, *, stage: int) -> Any:
    offload = {"params": "cpu"} if stage == 3 else {}
    config = {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0}, "offload": offload}
    return tierzero.initialize(model, config)


# ---------------------------------------------------------------- the reference, written here


def _logps(model: Any, batch: PreferenceBatch) -> torch.Tensor:
    """Each row's summed log-probability of its completion: log_softmax, gather, the prompt and padding masked out."""
    logits = model(input_ids=batch.tokens).logits.float()
    picked = torch.log_softmax(logits, dim=-1).gather(2, batch.targets.clamp(min=0)[..., None])[..., 0]
    return (picked * (batch.targets != IGNORE)).sum(dim=1)


def _frozen_table(model: Any, data: PreferenceBatches, *, batch: int = MICRO) -> torch.Tensor:
    """(records, 2): a frozen deep copy's chosen and rejected log-probs, `batch` records a forward in record order."""
    frozen = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        parts = [_logps(frozen, data.of_records(range(i, min(i + batch, RECORDS)))) for i in range(0, RECORDS, batch)]
    return torch.cat([p.view(2, -1).T for p in parts])


def _dpo_loss(policy: torch.Tensor, table: torch.Tensor, records: torch.Tensor) -> torch.Tensor:
    """The sigmoid DPO loss of the (2B,) policy log-probs against the table's rows of `records`."""
    b = len(records)
    ref_chosen, ref_rejected = table[records, 0], table[records, 1]
    margins = BETA * ((policy[:b] - ref_chosen) - (policy[b:] - ref_rejected))
    return -F.logsigmoid(margins).mean()


# ---------------------------------------------------------------- the table and the steps


def test_the_table_is_a_frozen_copys_log_probs_and_step_0_has_its_loss(tmp_path: Path) -> None:
    data = _batches(tmp_path, micro=MICRO)
    model = _llama()
    expected = _frozen_table(model, data)
    batch = data.batch(0)
    with torch.no_grad():
        expected_loss = _dpo_loss(_logps(copy.deepcopy(model), batch), expected, batch.records)
        # one record a forward: a batch's width changes the order of the sums, by 1e-6 at most (9.5e-7 measured)
        alone = _frozen_table(model, data, batch=1)
    with _engine(model, stage=1) as engine:
        table = precompute_reference(engine, data, is_hf=True)
        terms = dpo_micro_step(engine, batch, beta=BETA, is_hf=True, table=table)
    assert torch.equal(table.logps, expected)
    assert (table.logps - alone).abs().max() <= 2e-6
    assert table.records == RECORDS and table.fingerprint == data.fingerprint()
    # at step 0 the policy is its reference: the loss is log 2, to the last bit of the reference written here
    assert terms.loss.item() == expected_loss.item() and abs(expected_loss.item() - math.log(2)) <= 1e-7


@pytest.mark.parametrize("stage", [1, 3])
def test_full_fine_tuning_follows_a_plain_pytorch_loop_bit_for_bit(tmp_path: Path, stage: int) -> None:
    """The engine's AdamW is torch's fused AdamW bit for bit (test_optim.py), and the reference here is the
    frozen copy's log-probs batched as the precompute batches them: the same arithmetic, so the same bits."""
    data = _batches(tmp_path, micro=MICRO)
    model = _llama()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    policy, reference = copy.deepcopy(model), _frozen_table(model, data)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    with _engine(model, stage=stage) as engine:
        table = precompute_reference(engine, data, is_hf=True)
        for step in range(STEPS):
            stats = dpo_train_step(engine, data, DpoConfig(beta=BETA), step=step, accumulation=1, device=torch.device("cpu"),
                                   is_hf=True, table=table)  # fmt: skip
            batch = data.batch(step)
            loss = _dpo_loss(_logps(policy, batch), reference, batch.records)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            assert stats.loss == loss.item(), step
        trained = engine.full_state_dict()
    assert all(torch.equal(trained[name], p.detach()) for name, p in policy.named_parameters())
    assert all(not torch.equal(trained[name], initial[name]) for name in initial)


def _rank_table(rank: int, world_size: int, directory: str) -> tuple[torch.Tensor, int]:
    data = _batches(Path(directory), micro=MICRO, rank=rank, world=world_size)
    model = _llama()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with _engine(model, stage=3) as engine:
        table = precompute_reference(engine, data, is_hf=True)
    return table.logps, len(forwards)


def test_two_ranks_at_stage_3_compute_the_one_rank_table(tmp_path: Path) -> None:
    _data(tmp_path)
    one, forwards = _rank_table(0, 1, str(tmp_path))
    two = run_ranks(_rank_table, world_size=2, payload=str(tmp_path))
    # forwards 0 and 2 on rank 0, forward 1 and one it drops on rank 1: two each, or stage 3's gathers would hang
    assert forwards == 3 and [n for _, n in two] == [2, 2] == [forwards_per_rank(_batches(tmp_path, micro=MICRO, world=2))] * 2
    assert torch.equal(two[0][0], one) and torch.equal(two[1][0], one)


# ---------------------------------------------------------------- tierzero train and --resume


def _run(config: Path, *args: str) -> tuple[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="tierzero")
    T.add_train_command(parser.add_subparsers(dest="command", required=True))
    out, summary = io.StringIO(), config.parent / "summary.json"
    argv = ["train", "--config", str(config), "--no-progress", "--summary-json", str(summary), *args]
    assert T.run_train(parser.parse_args(argv), out=out) == 0
    return out.getvalue(), json.loads(summary.read_text())


def _config(tmp_path: Path) -> Path:
    tok, path = _data(tmp_path)
    raw = {
        "zero": {"stage": 3},
        "model": {"type": "llama", "vocab_size": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32},
        "train": {"steps": 4, "micro_batch_size": MICRO, "seq_len": 16, "log_every": 1, "objective": "dpo"},
        "data": {"path": str(path), "tokenizer": str(tok)},
        "dpo": {"beta": BETA},
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 2},
    }  # fmt: skip
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "dpo.yaml"


def test_a_resumed_run_reads_the_table_and_ends_as_the_unbroken_run(tmp_path: Path) -> None:
    config, ckpt = _config(tmp_path), tmp_path / "ckpt"
    text, unbroken = _run(config)
    kept = ckpt / REFERENCE_FILE
    computed = (
        rf"dpo reference: the initial model's log-probs of 8 records computed in \d+\.\d\d s \(3 no-grad forwards\), kept in {kept}\n"
    )
    assert re.search(computed, text)
    expected = load_file(ckpt / "4" / "rank-00000.safetensors")
    text, resumed = _run(config, "--resume", "2")  # its step 4 replaces the unbroken run's
    assert f"resumed from {ckpt / '2'} at step 2\n" in text and f"\ndpo reference: the log-probs of 8 records read from {kept}\n" in text
    assert resumed["losses"] == unbroken["losses"][2:]
    actual = load_file(ckpt / "4" / "rank-00000.safetensors")
    assert expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)


def test_a_missing_or_corrupt_table_is_refused_on_resume(tmp_path: Path) -> None:
    config, ckpt = _config(tmp_path), tmp_path / "ckpt"
    _run(config, "--steps", "2")
    kept = ckpt / REFERENCE_FILE
    good = kept.read_bytes()
    kept.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # the last value's lowest bit
    fix = "restore this run's file, or start a fresh run without --resume"
    with pytest.raises(CheckpointError) as refused:
        _run(config, "--resume")
    assert str(refused.value) == f"{kept} fails its checksum: it is corrupt or was edited; {fix}"
    kept.unlink()
    with pytest.raises(CheckpointError) as refused:
        _run(config, "--resume")
    assert str(refused.value) == (
        f"{kept} is missing: a resumed dpo.reference precomputed run reads the reference log-probs its start computed, "
        f"which cannot be computed again from the trained weights; {fix}"
    )


def test_a_table_of_another_run_or_other_records_is_refused(tmp_path: Path) -> None:
    path, values = tmp_path / REFERENCE_FILE, torch.randn(RECORDS, 2)
    ReferenceTable(logps=values, fingerprint="0123abcd").write(path, run_id="aaaa")
    read = ReferenceTable.read(path, fingerprint="0123abcd", run_id="aaaa")
    assert torch.equal(read.logps, values)
    batch = PreferenceBatch(tokens=torch.zeros(4, 1), targets=torch.zeros(4, 1), records=torch.tensor([5, 2]))
    assert torch.equal(read.lookup(batch), values[[5, 2, 5, 2], [0, 0, 1, 1]])
    fix = "restore this run's file, or start a fresh run without --resume"
    with pytest.raises(CheckpointError) as refused:
        ReferenceTable.read(path, fingerprint="0123abcd", run_id="bbbb")
    assert str(refused.value) == f"{path} is the reference of run aaaa, the checkpoint is of run bbbb: {fix}"
    with pytest.raises(CheckpointError) as refused:
        ReferenceTable.read(path, fingerprint="99999999", run_id="aaaa")
    assert str(refused.value) == (
        f"{path} was computed for other records (8 records, fingerprint 0123abcd, these 99999999): data.path, "
        "data.tokenizer, train.seq_len or dpo.max_prompt_len changed since the run began; resume with the run's data "
        "and settings, or start a fresh run without --resume"
    )
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} is not a readable safetensors file \(.+\): .+; {fix}$"):
        ReferenceTable.read(path, fingerprint="0123abcd", run_id="aaaa")


def test_auto_is_precomputed_without_lora_and_adapters_off_with_it(tmp_path: Path) -> None:
    tok, path = _data(tmp_path)
    raw = {"train": {"objective": "dpo"}, "data": {"path": str(path), "tokenizer": str(tok)}}
    lora = {"model": {"lora": {"r": 4}}}
    assert load_config(raw).dpo_reference == "precomputed"
    assert load_config(raw | lora).dpo_reference == "adapters_off"
    assert load_config(raw | lora | {"dpo": {"reference": "precomputed"}}).dpo_reference == "precomputed"
    with pytest.raises(ConfigError, match=r"^dpo.reference is adapters_off but model.lora.r is 0 \(full fine-tuning\)"):
        load_config(raw | {"dpo": {"reference": "adapters_off"}})
