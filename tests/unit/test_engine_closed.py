"""A closed engine refuses to train or save, in one line, instead of touching freed tiers."""

from __future__ import annotations

import re

import pytest
import torch

import tierzero
from tierzero.models.builtin import GPT, ModelSpec


def test_every_call_after_close_is_refused_and_close_is_idempotent(tmp_path) -> None:
    model = GPT(ModelSpec(n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=16, vocab_size=64))
    engine = tierzero.initialize(model, {"zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": 1e-3}})
    x = torch.randint(0, 64, (2, 16))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    engine.close()
    engine.close()  # twice is fine
    calls = {
        "a forward": lambda: engine(x, x),
        "backward()": lambda: engine.backward(loss),
        "step()": engine.step,
        "save_checkpoint()": lambda: engine.save_checkpoint(tmp_path / "ck"),
        "load_checkpoint()": lambda: engine.load_checkpoint(tmp_path / "ck"),
        "full_state_dict()": engine.full_state_dict,
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{re.escape(what)} after engine\.close\(\): .*tierzero\.initialize$"):
            call()
    assert engine.global_step == 1
    assert not (tmp_path / "ck").exists()
