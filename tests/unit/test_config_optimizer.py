"""Optimizer defaults are torch.optim's own, per type; a value the config gives always wins."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tierzero.config import config_markdown, load_config
from tierzero.optim.flat import make_optimizer

TORCH = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
HYPER = ("lr", "betas", "eps", "weight_decay", "momentum")


def _torch_defaults(kind: str) -> dict[str, Any]:
    """The hyper-parameters a fresh torch optimizer of `kind` holds when given none."""
    group = TORCH[kind]([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    return {name: group[name] for name in HYPER if name in group}


@pytest.mark.parametrize("kind", TORCH)
def test_defaults_are_torch_defaults(kind: str) -> None:
    expected = _torch_defaults(kind)
    assert {"lr", "weight_decay"} <= expected.keys()
    opt = load_config({"optimizer": {"type": kind}}).optimizer
    assert {name: getattr(opt, name) for name in expected} == expected
    # and the engine's optimizer steps with them
    spec = make_optimizer(opt).spec
    assert {name: getattr(spec, name) for name in expected} == expected


def test_weight_decay_differs_by_type_as_in_torch() -> None:
    decay = {kind: load_config({"optimizer": {"type": kind}}).optimizer.weight_decay for kind in TORCH}
    assert decay == {"adamw": 0.01, "adam": 0.0, "sgd": 0.0}
    assert load_config({}).optimizer.weight_decay == 0.01  # adamw is the default type
    assert load_config({"optimizer": {"type": "SGD", "weight_decay": None}}).optimizer.weight_decay == 0.0


@pytest.mark.parametrize("kind", TORCH)
@pytest.mark.parametrize("decay", [0.0, 0.01, 0.05])
def test_an_explicit_weight_decay_wins(kind: str, decay: float) -> None:
    opt = load_config({"optimizer": {"type": kind, "weight_decay": decay}}).optimizer
    assert opt.weight_decay == decay


def test_reloading_a_config_with_another_type_takes_that_type_default() -> None:
    adamw = load_config({})
    assert load_config(adamw, overrides={"optimizer.type": "sgd"}).optimizer.weight_decay == 0.0
    assert load_config(adamw) is adamw
    explicit = load_config({"optimizer": {"weight_decay": 0.1}})
    assert load_config(explicit, overrides={"optimizer.type": "sgd"}).optimizer.weight_decay == 0.1
    assert load_config(load_config({"optimizer": {"type": "sgd"}}).to_dict()).optimizer.weight_decay == 0.0


def _deepspeed(optimizer: dict[str, Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config({"zero_optimization": {"stage": 2}, "optimizer": optimizer}).optimizer


def test_deepspeed_optimizers_take_the_torch_defaults() -> None:
    assert _deepspeed({"type": "SGD", "params": {"lr": 0.1}}).weight_decay == 0.0
    assert _deepspeed({"type": "Adam", "params": {"adam_w_mode": False}}).weight_decay == 0.0
    assert _deepspeed({"type": "AdamW", "params": {"weight_decay": "auto"}}).weight_decay == 0.01
    assert _deepspeed({"type": "SGD", "params": {"weight_decay": 0.2}}).weight_decay == 0.2


def test_docs_give_each_type_its_torch_default() -> None:
    shown = ", ".join(f"{kind}: {_torch_defaults(kind)['weight_decay']:g}" for kind in TORCH)
    row = next(line for line in config_markdown().splitlines() if line.startswith("| `optimizer.weight_decay`"))
    assert f"| `{shown}` |" in row
