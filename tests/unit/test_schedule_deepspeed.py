"""DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, translated: every step's rate is DeepSpeed's.

The reference below writes out the formulas of deepspeed/runtime/lr_schedules.py and the
order in which DeepSpeed's engine uses them (the scheduler steps after each optimizer step,
from last_batch_iteration -1); it calls nothing of tierzero.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from typing import Any

import pytest
import torch

import tierzero
from tierzero.config import ConfigError, TierZeroConfigWarning, load_config
from tierzero.optim.schedule import Schedule, lr_lambda

STEPS = 48


def _deepspeed_rates(kind: str, params: dict[str, Any], *, optimizer_lr: float, steps: int) -> list[float]:
    """The rate of each optimizer step under DeepSpeed: step k runs at the rate for last_batch_iteration k-1."""
    warmup = max(2, params.get("warmup_num_steps", 1000))
    log = params.get("warmup_type", "log") == "log"
    total = params.get("total_num_steps")

    def climbed(it: int) -> float:
        return math.log(it + 1) / math.log(warmup) if log else it / warmup

    def cosine_rate(it: int) -> float:
        low, floor = params.get("warmup_min_ratio", 0.0), params.get("cos_min_ratio", 0.0001)
        if it < 0:
            return 0.0
        if it < warmup:
            return optimizer_lr * (low + (1 - low) * climbed(it))
        progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
        return optimizer_lr * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)

    def warmup_rate(it: int) -> float:
        low = params.get("warmup_min_lr", 0.0)
        high = params.get("warmup_max_lr", optimizer_lr if kind == "WarmupLR" else 0.001)
        if it < 0:
            return low
        if it < warmup:
            gamma = climbed(it)
        elif kind == "WarmupLR":
            gamma = 1.0
        else:
            gamma = max(0.0, (total - it) / max(1, total - warmup))
        return low + (high - low) * gamma

    rate = cosine_rate if kind == "WarmupCosineLR" else warmup_rate
    return [rate(k - 1) for k in range(steps)]


def _load(ds_scheduler: dict[str, Any], *, optimizer_lr: Any = None, **extra: Any) -> tuple[Any, Counter[str]]:
    ds: dict[str, Any] = {"zero_optimization": {"stage": 3}, "scheduler": ds_scheduler, **extra}
    if optimizer_lr is not None:
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": optimizer_lr}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(ds)
    assert all(issubclass(w.category, TierZeroConfigWarning) for w in caught)
    return cfg, Counter(str(w.message) for w in caught)


def _tierzero_rates(cfg: Any, steps: int) -> list[float]:
    f = lr_lambda(Schedule.of(cfg.scheduler, train_steps=cfg.train.steps))
    return [cfg.optimizer.lr * f(k) for k in range(steps)]


CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 7}),  # warmup_max_lr: the optimizer's lr
    ("WarmupLR", {"warmup_min_lr": 2e-4, "warmup_max_lr": 2e-4, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_max_lr": 1e-3, "warmup_num_steps": 1}),  # at least 2 steps
    ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10, "total_num_steps": 30}),
    ("WarmupDecayLR", {"warmup_num_steps": 4, "total_num_steps": 20}),  # warmup_max_lr: 0.001
    ("WarmupDecayLR", {"warmup_max_lr": 5e-4, "warmup_num_steps": 12, "total_num_steps": 8}),  # ends before warm-up
    ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "cos_min_ratio": 0.05, "warmup_num_steps": 10, "total_num_steps": 30}),
    ("WarmupCosineLR", {"warmup_num_steps": 6, "total_num_steps": 25}),  # cos_min_ratio: 0.0001
    ("WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 3, "cos_min_ratio": 0.0}),
]


@pytest.mark.parametrize("warmup_type", ["log", "linear", None])
@pytest.mark.parametrize(("kind", "params"), CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_every_step_runs_at_deepspeeds_rate(kind: str, params: dict[str, Any], warmup_type: str | None) -> None:
    params = params | ({} if warmup_type is None else {"warmup_type": warmup_type})
    cfg, warned = _load({"type": kind, "params": params}, optimizer_lr=2e-4)
    assert warned == Counter()
    expected = _deepspeed_rates(kind, params, optimizer_lr=2e-4, steps=STEPS)
    assert _tierzero_rates(cfg, STEPS) == pytest.approx(expected, rel=1e-12, abs=1e-20)


def test_the_translated_keys() -> None:
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 4e-4, "warmup_num_steps": 10, "total_num_steps": 30}
    cfg, _ = _load({"type": "WarmupDecayLR", "params": params}, optimizer_lr=1e-3)
    s = cfg.scheduler
    assert (s.type, s.convention, s.warmup_type, s.warmup_steps, s.total_steps) == ("linear", "deepspeed", "log", 10, 30)
    # DeepSpeed sets the rate itself: the peak is optimizer.lr, the rest are ratios of it.
    assert cfg.optimizer.lr == 4e-4 and s.warmup_start_ratio == s.min_lr_ratio == 1e-5 / 4e-4
    cfg, _ = _load({"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_min_ratio": 0.2}}, optimizer_lr=1e-3)
    s = cfg.scheduler
    assert (s.type, s.warmup_steps, s.warmup_type, s.warmup_start_ratio, s.min_lr_ratio) == ("cosine", 1000, "log", 0.2, 0.0001)
    assert cfg.optimizer.lr == 1e-3


def test_auto_values_resolve_to_tierzero_defaults_or_derive() -> None:
    auto = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}
    cfg, _ = _load({"type": "WarmupDecayLR", "params": auto}, optimizer_lr=3e-4, train_batch_size="auto")
    s = cfg.scheduler
    # warmup_max_lr "auto": the optimizer's lr; total_num_steps "auto": train.steps; the rest: tierzero's defaults
    assert cfg.optimizer.lr == 3e-4 and (s.warmup_steps, s.warmup_start_ratio, s.min_lr_ratio, s.total_steps) == (0, 0.0, 0.0, None)
    assert Schedule.of(s, train_steps=cfg.train.steps).total_steps == cfg.train.steps
    total = cfg.train.steps
    rates = _tierzero_rates(cfg, total + 2)
    # no warm-up, and the decay one step late, as in DeepSpeed: zero from step total + 1
    assert rates[:2] == [3e-4, 3e-4] and rates[2] == pytest.approx(3e-4 * (total - 1) / total)
    assert rates[total] == pytest.approx(3e-4 / total) and rates[total + 1] == 0.0
    # The optimizer's lr "auto" too: tierzero's default, which the warm-up start is a ratio of.
    cfg, _ = _load({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": "auto", "warmup_num_steps": 4}},
                   optimizer_lr="auto")
    assert cfg.optimizer.lr == load_config({}).optimizer.lr == 1e-3 and cfg.scheduler.warmup_start_ratio == pytest.approx(0.1)
    cosine = {"warmup_min_ratio": "auto", "cos_min_ratio": "auto", "warmup_type": "auto", "total_num_steps": 50}
    cfg, _ = _load({"type": "WarmupCosineLR", "params": cosine})
    s = cfg.scheduler
    assert (s.warmup_start_ratio, s.min_lr_ratio, s.warmup_type, s.warmup_steps, s.total_steps) == (0.0, 0.0, "linear", 1000, 50)


def _error(ds_scheduler: dict[str, Any], **extra: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _load(ds_scheduler, **extra)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_what_tierzero_cannot_represent_is_refused() -> None:
    assert _error({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-4}}) == (
        "DeepSpeed scheduler.params.warmup_min_lr 0.001 is above the peak rate 0.0001 (scheduler.params.warmup_max_lr): "
        "tierzero's warm-up climbs to its peak and cannot fall; lower warmup_min_lr or raise warmup_max_lr"
    )
    assert _error({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-2}}, optimizer_lr=1e-3) == (
        "DeepSpeed scheduler.params.warmup_min_lr 0.01 is above the peak rate 0.001 (optimizer.params.lr): "
        "tierzero's warm-up climbs to its peak and cannot fall; lower warmup_min_lr or raise warmup_max_lr"
    )
    assert _error({"type": "WarmupLR", "params": {"warmup_max_lr": [1e-4, 2e-4]}}) == (
        'DeepSpeed scheduler.params.warmup_max_lr: expected a positive learning rate such as 1e-4 or "auto", '
        "got [0.0001, 0.0002]; tierzero has one parameter group, so one rate"
    )
    assert _error({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0, "total_num_steps": 10}}) == (
        'DeepSpeed scheduler.params.warmup_max_lr: expected a positive learning rate such as 1e-4 or "auto", got 0'
    )
    assert _error({"type": "WarmupLR", "params": {"last_batch_iteration": 99}}) == (
        "DeepSpeed scheduler.params.last_batch_iteration: expected -1 (a fresh schedule), got 99; tierzero resumes "
        "the schedule's position from its checkpoint, so remove it"
    )
    assert _error({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10}}) == (
        "DeepSpeed scheduler.params.total_num_steps is not set, and WarmupCosineLR needs it: set it to the optimizer "
        'steps the decay spans, or to "auto" for train.steps'
    )
    assert _error({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}) == (
        "DeepSpeed scheduler.params.warmup_num_steps: expected a positive integer such as 4, got 0"
    )


def test_other_scheduler_types_are_refused_and_unknown_params_ignored() -> None:
    assert _error({"type": "OneCycle", "params": {"cycle_min_lr": 0}}) == (
        "DeepSpeed scheduler.type: expected WarmupLR, WarmupDecayLR or WarmupCosineLR, got 'OneCycle'; tierzero "
        "has no other schedule: remove the scheduler block and set scheduler.* in tierzero keys"
    )
    cfg, warned = _load({"type": "WarmupLR", "params": {"warmup_num_steps": 5, "total_num_steps": 9}, "extra": 1})
    assert cfg.scheduler.type == "constant"
    assert warned == Counter(f"DeepSpeed key {key} has no tierzero equivalent; ignored" for key in (
        "scheduler.params.total_num_steps", "scheduler.extra"))
    # No type: DeepSpeed makes no scheduler, so its params are ignored and the rate stays optimizer.lr.
    cfg, warned = _load({"params": {"warmup_num_steps": 5}})
    assert cfg.scheduler == load_config({}).scheduler
    assert warned == Counter(["DeepSpeed key scheduler.params.warmup_num_steps has no tierzero equivalent; ignored"])


def test_bad_values_name_the_deepspeed_key() -> None:
    assert _error({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}) == (
        "scheduler.params.warmup_type (scheduler.warmup_type in tierzero): expected one of linear, log, got 'cubic'"
    )
    assert _error({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}}) == (
        "scheduler.params.cos_min_ratio (scheduler.min_lr_ratio in tierzero): expected a number from 0 to 1 such as "
        "0.1, got 2"
    )
    assert _error({"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}) == (
        "scheduler.params.total_num_steps (scheduler.total_steps in tierzero): expected a positive integer (or null), got 0"
    )


@pytest.mark.parametrize(("key", "value", "message"), [
    ("warmup_type", "cubic", "scheduler.warmup_type: expected one of linear, log, got 'cubic'"),
    ("warmup_start_ratio", 1.5, "scheduler.warmup_start_ratio: expected a number from 0 to 1 such as 0.1, got 1.5"),
    ("warmup_start_ratio", "x", "scheduler.warmup_start_ratio: expected a number from 0 to 1 such as 0.1, got 'x'"),
    ("min_lr_ratio", -0.1, "scheduler.min_lr_ratio: expected a number from 0 to 1 such as 0.1, got -0.1"),
    ("convention", "megatron", "scheduler.convention: expected one of transformers, deepspeed, got 'megatron'"),
])
def test_new_scheduler_keys_are_checked(key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": {key: value}})
    assert str(info.value) == message and info.value.key == f"scheduler.{key}"


def test_a_log_warmup_needs_two_steps() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": {"warmup_type": "log", "warmup_steps": 1}})
    assert str(info.value) == (
        "scheduler.warmup_type log needs scheduler.warmup_steps 0 or at least 2 (ln 1 = 0), got 1: "
        "set scheduler.warmup_steps to 0 or 2, or scheduler.warmup_type to linear"
    )


def test_start_ratio_and_log_warmup_in_tierzero_counting() -> None:
    cfg = load_config({"scheduler": {"type": "linear", "warmup_steps": 4, "warmup_start_ratio": 0.2, "total_steps": 8}})
    f = lr_lambda(Schedule.of(cfg.scheduler, train_steps=100))
    assert [f(k) for k in range(9)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 0.75, 0.5, 0.25, 0.0])
    cfg = load_config({"scheduler": {"warmup_type": "log", "warmup_steps": 4}})
    f = lr_lambda(Schedule.of(cfg.scheduler, train_steps=100))
    assert [f(k) for k in range(5)] == pytest.approx([0.0, 0.5, math.log(3) / math.log(4), 1.0, 1.0])


def test_the_engine_runs_each_step_at_deepspeeds_rate() -> None:
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 4, "total_num_steps": 9, "warmup_type": "linear"}
    ds = {"zero_optimization": {"stage": 1}, "scheduler": {"type": "WarmupDecayLR", "params": params}}
    expected = _deepspeed_rates("WarmupDecayLR", params, optimizer_lr=1e-3, steps=11)
    torch.manual_seed(0)
    rates = []
    with tierzero.initialize(torch.nn.Sequential(torch.nn.Linear(4, 4)), ds) as engine:
        for _ in range(11):
            rates.append(engine.lr)
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
    assert rates == pytest.approx(expected, rel=1e-12, abs=1e-20), (
        "the engine must build its schedule with Schedule.of(cfg.scheduler, train_steps=cfg.train.steps)"
    )
