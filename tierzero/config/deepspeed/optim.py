"""The DeepSpeed keys of the update itself: fp16/bf16, the optimizer and the learning-rate scheduler.

Part of `tierzero.config.deepspeed.translate.translate_deepspeed` (its module docstring has the
rules). The scheduler becomes tierzero's `scheduler` section with convention deepspeed,
which steps as DeepSpeed's engine steps its WarmupLR, WarmupDecayLR and WarmupCosineLR
(see tierzero.optim.schedule). Each scheduler param left out takes DeepSpeed's default, since
the schedule is DeepSpeed's; "auto" takes tierzero's default, or the optimizer's lr for
warmup_max_lr and train.steps for total_num_steps.

WarmupLR and WarmupDecayLR set the rate themselves, from warmup_min_lr to warmup_max_lr,
whatever the optimizer's lr: tierzero keeps optimizer.lr as the peak, so warmup_max_lr
becomes optimizer.lr and warmup_min_lr the ratio warmup_min_lr / warmup_max_lr.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tierzero.config.checks import show
from tierzero.config.deepspeed.reader import Reader, Translation, positive_int
from tierzero.config.errors import ConfigError
from tierzero.config.optim import OptimizerConfig

_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}
_SCHEDULERS = {"warmuplr": "constant", "warmupdecaylr": "linear", "warmupcosinelr": "cosine"}
"""DeepSpeed's scheduler types, lower-cased -> the scheduler.type of the same shape."""
_WARMUP_DECAY_MAX_LR = 1e-3
"""WarmupDecayLR's warmup_max_lr when left out (WarmupLR's is the optimizer's lr)."""
_AUTOCAST_DTYPES = {
    "bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "fp16": "fp16", "half": "fp16", "torch.float16": "fp16",
}  # fmt: skip
"""DeepSpeed's names for torch_autocast.dtype -> tierzero's compute dtype."""


def translate_precision(top: Reader, out: Translation) -> int:
    """fp16 / bf16 (or bfloat16), torch_autocast and communication_data_type; returns the compute dtype's bytes."""
    fp16 = Reader.of(top.data, "fp16")
    bf16_name = "bfloat16" if "bfloat16" in top.data and "bf16" not in top.data else "bf16"
    bf16 = Reader.of(top.data, bf16_name)
    top.data.pop("fp16", None)
    top.data.pop(bf16_name, None)
    use_fp16, use_bf16 = _enabled(fp16), _enabled(bf16)
    if use_fp16 and use_bf16:
        raise ConfigError(f"DeepSpeed fp16.enabled and {bf16_name}.enabled are both true: enable at most one")
    dtype = "fp16" if use_fp16 else "bf16" if use_bf16 else "fp32"
    autocast = _autocast_dtype(top, other="fp16" if use_fp16 else bf16_name if use_bf16 else None)
    if autocast is None:
        out.set("precision.param_dtype", dtype, origin="fp16.enabled" if use_fp16 else f"{bf16_name}.enabled")
    else:
        dtype = autocast
        out.set("precision.param_dtype", dtype, origin="torch_autocast.dtype")
        out.set("precision.autocast", True, origin="torch_autocast.enabled")
    loss_scale = fp16.pop("loss_scale")
    if loss_scale is not None:
        out.set("precision.loss_scale", "dynamic" if loss_scale == 0 else loss_scale, origin="fp16.loss_scale")
    power = fp16.pop("initial_scale_power")
    if power is not None:
        # 2 ** power must be a float32 (inf past 127), and Python overflows past 1023.
        if isinstance(power, bool) or not isinstance(power, (int, float)) or not -126 <= power <= 127:
            raise ConfigError(f"DeepSpeed fp16.initial_scale_power: expected a number from -126 to 127 such as 16 "
                              f"(2 ** power must fit in float32), got {show(power)}", key="fp16.initial_scale_power")
        out.set("precision.initial_scale", 2.0**power, origin="fp16.initial_scale_power")
    for ds_name, tz_name in (("loss_scale_window", "scale_window"), ("min_loss_scale", "min_scale")):
        value = fp16.pop(ds_name)
        if value is not None:
            out.set(f"precision.{tz_name}", value, origin=fp16.key(ds_name))
    reduce = top.data.pop("communication_data_type", None)
    if reduce is not None:
        out.set("precision.reduce_dtype", reduce, origin="communication_data_type")
    fp16.finish()
    bf16.finish()
    return 2 if dtype != "fp32" else 4


def _autocast_dtype(top: Reader, *, other: str | None) -> str | None:
    """The torch_autocast section's compute dtype when it is enabled, else None. Its
    lower_precision_safe_modules are left to the warning for keys without an equivalent:
    tierzero lowers what autocast's own op lists lower (tierzero.units.precision)."""
    section = Reader.of(top.data, "torch_autocast")
    top.data.pop("torch_autocast", None)
    enabled, name = _enabled(section), section.pop("dtype")
    section.finish()
    if not enabled:
        return None
    if other is not None:
        raise ConfigError(
            f"DeepSpeed torch_autocast.enabled and {other}.enabled are both true: torch_autocast keeps fp32 "
            f"parameters and lowers each op, {other} lowers every parameter; enable one of them",
            key="torch_autocast.enabled",
        )
    dtype = _AUTOCAST_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ConfigError(
            f"DeepSpeed torch_autocast.dtype: expected bfloat16 or float16, got {show(name)}; tierzero keeps the "
            "lowered layers' weights in it, so it must be named",
            key="torch_autocast.dtype",
        )
    return dtype


def _enabled(section: Reader) -> bool:
    value = section.pop("enabled")
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"DeepSpeed {section.key('enabled')}: expected true, false or \"auto\", got {show(value)}")
    return bool(value)


def translate_optimizer(top: Reader, out: Translation) -> None:
    if top.data.get("optimizer") is None:
        top.data.pop("optimizer", None)
        return
    optimizer = Reader.of(top.data, "optimizer")
    top.data.pop("optimizer")
    params = Reader.of(optimizer.data, "params", path="optimizer")
    optimizer.data.pop("params", None)
    name = optimizer.pop("type")
    kind = _OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
    if kind is None:
        raise ConfigError(
            f"DeepSpeed optimizer.type: expected AdamW, Adam or SGD, got {show(name)}; tierzero has no other optimizer"
        )
    adam_w_mode = params.pop("adam_w_mode")
    if kind == "adam" and adam_w_mode is not False:
        kind = "adamw"
    out.set("optimizer.type", kind, origin="optimizer.type")
    for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
        value = params.pop(key)
        if value is not None:
            out.set(f"optimizer.{key}", value, origin=params.key(key))
    params.finish()
    optimizer.finish()


def translate_scheduler(top: Reader, out: Translation) -> None:
    """After translate_optimizer: WarmupLR and WarmupDecayLR may replace optimizer.lr."""
    if top.data.get("scheduler") is None:
        top.data.pop("scheduler", None)
        return
    scheduler = Reader.of(top.data, "scheduler")
    top.data.pop("scheduler")
    params = Reader.of(scheduler.data, "params", path="scheduler")
    scheduler.data.pop("params", None)
    name = scheduler.pop("type")
    if name is not None:
        kind = _SCHEDULERS.get(name.lower()) if isinstance(name, str) else None
        if kind is None:
            raise ConfigError(
                f"DeepSpeed scheduler.type: expected WarmupLR, WarmupDecayLR or WarmupCosineLR, got {show(name)}; "
                "tierzero has no other schedule: remove the scheduler block and set scheduler.* in tierzero keys"
            )
        _translate_schedule(params, out, kind=kind, name=name)
    # Without a type DeepSpeed makes no scheduler, so every param is ignored.
    params.finish()
    scheduler.finish()


def _translate_schedule(params: Reader, out: Translation, *, kind: str, name: str) -> None:
    out.set("scheduler.type", kind, origin="scheduler.type")
    out.set("scheduler.convention", "deepspeed", origin="scheduler.type")
    start = params.pop("last_batch_iteration")
    if start is not None and (isinstance(start, bool) or start != -1):
        raise ConfigError(
            f"DeepSpeed {params.key('last_batch_iteration')}: expected -1 (a fresh schedule), got {show(start)}; "
            "tierzero resumes the schedule's position from its checkpoint, so remove it"
        )
    # DeepSpeed warms up over at least 2 steps, whatever it is given.
    _take(params, out, "warmup_num_steps", "scheduler.warmup_steps", default=1000,
          convert=lambda value, key: max(2, positive_int(value, key)))
    _take(params, out, "warmup_type", "scheduler.warmup_type", default="log")
    if kind == "cosine":
        _take(params, out, "warmup_min_ratio", "scheduler.warmup_start_ratio", default=0.0)
        _take(params, out, "cos_min_ratio", "scheduler.min_lr_ratio", default=1e-4)
    else:
        _translate_warmup_rates(params, out, decays=kind == "linear")
    if kind != "constant":
        key = params.key("total_num_steps")
        if "total_num_steps" not in params.data:
            raise ConfigError(
                f"DeepSpeed {key} is not set, and {name} needs it: set it to the optimizer steps the decay spans, "
                'or to "auto" for train.steps'
            )
        _take(params, out, "total_num_steps", "scheduler.total_steps", default=None)


def _take(
    params: Reader,
    out: Translation,
    name: str,
    tz_key: str,
    *,
    default: Any,
    convert: Callable[[Any, str], Any] = lambda value, key: value,
) -> None:
    """params[name] -> tz_key, checked by validation; left out: DeepSpeed's `default`; "auto": tierzero's."""
    key = params.key(name)
    if name not in params.data:
        out.set(tz_key, default, origin=key, absent=True)
        return
    value = params.pop(name)
    if value is not None:
        out.set(tz_key, convert(value, key), origin=key)


def _translate_warmup_rates(params: Reader, out: Translation, *, decays: bool) -> None:
    """warmup_max_lr -> optimizer.lr; warmup_min_lr -> the ratio the warm-up starts at (and WarmupDecayLR decays to)."""
    peak_key, floor_key = params.key("warmup_max_lr"), params.key("warmup_min_lr")
    peak_absent = "warmup_max_lr" not in params.data
    peak = params.pop("warmup_max_lr")
    if peak_absent and decays:
        peak = _WARMUP_DECAY_MAX_LR
    if peak is not None:
        out.set("optimizer.lr", _rate(peak, peak_key, positive=True), origin=peak_key, absent=peak_absent)
    floor = params.pop("warmup_min_lr")
    if floor is None:
        return  # left out or "auto": 0, DeepSpeed's default and tierzero's
    floor = _rate(floor, floor_key, positive=False)
    # "auto" or left out (WarmupLR): the optimizer's lr, as the translation has it.
    peak_from = out.origins.get("optimizer.lr", "optimizer.lr")
    peak = _rate(out.get("optimizer.lr", OptimizerConfig().lr), peak_from, positive=True)
    if floor > peak:
        raise ConfigError(
            f"DeepSpeed {floor_key} {floor:g} is above the peak rate {peak:g} ({peak_from}): tierzero's warm-up "
            "climbs to its peak and cannot fall; lower warmup_min_lr or raise warmup_max_lr",
            key=floor_key,
        )
    out.set("scheduler.warmup_start_ratio", floor / peak, origin=floor_key)
    if decays:
        out.set("scheduler.min_lr_ratio", floor / peak, origin=floor_key)


def _rate(value: Any, key: str, *, positive: bool) -> float:
    number = math.nan
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)  # YAML 1.1 reads 1e-3 as a string
        except ValueError:
            pass
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        hint = "; tierzero has one parameter group, so one rate" if isinstance(value, (list, tuple)) else ""
        raise ConfigError(
            f"DeepSpeed {key}: expected a {'positive' if positive else 'non-negative'} learning rate such as 1e-4 "
            f'or "auto", got {show(value)}{hint}',
            key=key,
        )
    return number
