"""DeepSpeed configs, read as they are: each key becomes its tierzero key.

`translate_deepspeed` turns a DeepSpeed config dict into a raw tierzero config dict,
which `tierzero.config.load_config` then validates like any other. Rules:

- DeepSpeed counts buffers in *elements*; tierzero in bytes. Element counts
  (offload_param.buffer_size, reduce_bucket_size, stage3_prefetch_bucket_size,
  stage3_max_live_parameters) are multiplied by the bytes of the compute dtype
  (2 for fp16/bf16, 4 for fp32); staging buffer sizes are then rounded up to a
  multiple of 4096 for direct I/O.
- "auto" is what the HF Trainer writes for values it fills in from its own arguments
  and the model (e.g. reduce_bucket_size = hidden_size²). With neither at hand, "auto"
  resolves to tierzero's default, except where DeepSpeed itself derives the value:
  of train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps,
  the missing or "auto" ones are derived from the others and the world size, as
  DeepSpeed does (and an inconsistent triple is refused). fp16.enabled / bf16.enabled
  "auto" resolve to off (fp32).
- Keys left out take tierzero's defaults, except zero_optimization.stage, which takes
  DeepSpeed's default, 0: plain data parallel, which tierzero does not run, so a config
  without a stage is refused until it names one (1, 2 or 3).
- offload_optimizer moves the gradients with the optimizer states (as ZeRO-Offload
  does) at stage 2 and 3. tierzero has one swap directory and one staging pool: the
  two offload sections must agree on nvme_path; buffer_count takes the larger, and
  pin_memory is on if either asks.
- DeepSpeed's "Adam" is AdamW unless optimizer.params.adam_w_mode is false, as in DeepSpeed.
- Every key with no tierzero equivalent, including keys DeepSpeed does not know,
  gives exactly one TierZeroConfigWarning naming it, and is ignored.
- An error about a value that came from a DeepSpeed key names that key first, then the
  tierzero key it became: "zero_optimization.offload_param.nvme_path (tiers.nvme.path in
  tierzero) ...". The fix it suggests is in tierzero keys, which `--set` takes.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierzero.config.checks import show
from tierzero.config.errors import ConfigError, TierZeroConfigWarning, one_line
from tierzero.slices import IO_ALIGNMENT, align_up

AUTO = "auto"
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}
_MAPPING_ROWS = (
    ("zero_optimization.stage", "zero.stage", "absent: 0, as in DeepSpeed, which tierzero refuses: set 1, 2 or 3"),
    ("zero_optimization.offload_param.device", "offload.params", "none -> device"),
    ("zero_optimization.offload_optimizer.device", "offload.optimizer, offload.gradients", "gradients follow at stage 2 and 3"),
    ("zero_optimization.offload_*.nvme_path", "tiers.nvme.path", "both sections must agree"),
    ("zero_optimization.offload_*.pin_memory", "tiers.cpu.pin_memory", "on if either is on"),
    ("zero_optimization.offload_*.buffer_count", "swapper.buffer_count", "the larger"),
    ("zero_optimization.offload_param.buffer_size", "swapper.buffer_size", "elements x dtype bytes, rounded up to 4096"),
    ("zero_optimization.stage3_prefetch_bucket_size", "prefetch.bytes", "elements x dtype bytes"),
    ("zero_optimization.stage3_max_live_parameters", "prefetch.max_live_bytes", "elements x dtype bytes"),
    ("zero_optimization.stage3_param_persistence_threshold", "zero.param_persistence_threshold", "elements; tierzero compares each unit's parameter count"),
    ("zero_optimization.reduce_bucket_size", "zero.reduce_bucket_size", "elements x dtype bytes"),
    ("zero_optimization.overlap_comm", "zero.overlap_comm", ""),
    ("aio.block_size / queue_depth / thread_count", "tiers.nvme.block_size / queue_depth / threads", "intra_op_parallelism also sets threads"),
    ("optimizer.type", "optimizer.type", "AdamW, Adam (AdamW unless adam_w_mode is false), SGD"),
    ("optimizer.params.lr / betas / eps / weight_decay / momentum", "optimizer.*", ""),
    ("fp16.enabled / bf16.enabled", "precision.param_dtype", "\"auto\": off"),
    ("fp16.loss_scale", "precision.loss_scale", "0 -> dynamic"),
    ("fp16.initial_scale_power", "precision.initial_scale", "2 ** power"),
    ("fp16.loss_scale_window / min_loss_scale", "precision.scale_window / min_scale", ""),
    ("gradient_clipping", "gradient_clipping", ""),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", "derived when \"auto\""),
    ("train_micro_batch_size_per_gpu", "train.micro_batch_size", "derived when \"auto\""),
    ("train_batch_size", "(checked)", "must equal micro batch x accumulation x world size"),
)

_DEEPSPEED_NAMES = {
    tz: ds for ds, tz, _ in _MAPPING_ROWS if re.fullmatch(r"[\w.*]+", ds) and re.fullmatch(r"[\w.]+", tz)
}
"""tierzero key -> the DeepSpeed key that sets it, for the rows of the table that map one key to one."""


@dataclass(slots=True)
class Translation:
    """A raw tierzero config dict, and for each tierzero key set, the DeepSpeed key it came from."""

    config: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    """tierzero key -> the DeepSpeed key its value came from."""
    absent: set[str] = field(default_factory=set)
    """tierzero keys whose value is DeepSpeed's default for a key the config left out."""
    overridden: list[str] = field(default_factory=list)
    """tierzero keys (or sections) set by overrides after the translation."""

    def set(self, key: str, value: Any, *, origin: str, absent: bool = False) -> None:
        *parents, leaf = key.split(".")
        node = self.config
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
        self.origins[key] = origin
        if absent:
            self.absent.add(key)

    def forget(self, key: str) -> None:
        """`key` (and every key under it) was overridden: its value no longer comes from DeepSpeed."""
        self.overridden.append(key)
        for known in [k for k in self.origins if _under(k, key)]:
            del self.origins[known]
            self.absent.discard(known)

    def explain(self, error: ConfigError) -> ConfigError:
        """`error` in DeepSpeed words: the first mention of each tierzero key that has a differently
        named DeepSpeed key becomes "<DeepSpeed key> (<tierzero key> in tierzero)".

        A key the translation set names the DeepSpeed key it came from; one it left at its
        default (e.g. tiers.nvme.path when no nvme_path was given) names the DeepSpeed key
        that would set it, unless an override did.
        """
        names = {tz: ds for tz, ds in _DEEPSPEED_NAMES.items() if not any(_under(tz, o) for o in self.overridden)}
        names.update(self.origins)
        renamed = {tz: ds for tz, ds in names.items() if tz != ds}
        if not renamed:
            return error
        message, seen = str(error), set[str]()
        if error.key in renamed and not _mentions(message, error.key):
            message = f"{error.key}: {message}"

        def gloss(match: re.Match[str]) -> str:
            key = match.group(0)
            if key in seen:
                return key
            seen.add(key)
            note = "; not set, so DeepSpeed's default" if key in self.absent else ""
            return f"{renamed[key]} ({key} in tierzero{note})"

        message = _key_pattern(renamed).sub(gloss, message)
        return error if message == str(error) else ConfigError(message, key=error.key)

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.config
        for name in key.split("."):
            if not isinstance(node, dict) or name not in node:
                return default
            node = node[name]
        return node


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(f"{prefix}.")


def _key_pattern(keys: Mapping[str, str]) -> re.Pattern[str]:
    """Whole dotted keys only: "zero.stage" matches in "zero.stage: ..." but not in "zero.stages" or "a.zero.stage"."""
    alternatives = "|".join(re.escape(key) for key in sorted(keys, key=len, reverse=True))
    return re.compile(rf"(?<![\w.])(?:{alternatives})(?!\w|\.\w)")


def _mentions(message: str, key: str) -> bool:
    return _key_pattern({key: key}).search(message) is not None


def ignore(key: str) -> None:
    """The one warning for a DeepSpeed key with no tierzero equivalent."""
    warnings.warn(one_line(f"DeepSpeed key {key} has no tierzero equivalent; ignored"), TierZeroConfigWarning, stacklevel=2)


@dataclass(slots=True)
class _Reader:
    """One DeepSpeed section: hands out its keys and warns once about each key nobody took."""

    path: str
    data: dict[str, Any]

    @classmethod
    def of(cls, parent: Mapping[str, Any], name: str, *, path: str = "") -> _Reader:
        key = f"{path}.{name}" if path else name
        value = parent.get(name) or {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"DeepSpeed {key}: expected a mapping of keys, got {show(value)}", key=key)
        return cls(key, dict(value))

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def pop(self, name: str) -> Any:
        """The value, or None when absent or "auto" (both mean: tierzero's default)."""
        value = self.data.pop(name, None)
        return None if value == AUTO else value

    def finish(self) -> None:
        for name in self.data:
            ignore(self.key(name))


def _elements(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not float(value).is_integer():
        raise ConfigError(f"DeepSpeed {key}: expected a number of elements such as 5e8, got {show(value)}", key=key)
    return int(value)


def _positive(value: Any, key: str) -> int:
    # Checked here, not left to validation: the two offload sections' counts are compared first.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or not float(value).is_integer():
        raise ConfigError(f"DeepSpeed {key}: expected a positive integer such as 4, got {show(value)}", key=key)
    return int(value)


def _enabled(section: _Reader) -> bool:
    value = section.pop("enabled")
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"DeepSpeed {section.key('enabled')}: expected true, false or \"auto\", got {show(value)}")
    return bool(value)


def translate_deepspeed(ds: Mapping[str, Any], *, world_size: int = 1) -> Translation:
    """Translate a DeepSpeed config dict (see the module docstring for the rules)."""
    top = _Reader("", dict(ds))
    out = Translation()
    dtype_bytes = _translate_precision(top, out)
    _translate_optimizer(top, out)
    _translate_batch(top, out, world_size=world_size)
    clipping = top.pop("gradient_clipping")
    if clipping is not None:
        out.set("gradient_clipping", clipping, origin="gradient_clipping")
    _translate_zero(_Reader.of(top.data, "zero_optimization"), out, dtype_bytes=dtype_bytes)
    top.data.pop("zero_optimization", None)
    _translate_aio(_Reader.of(top.data, "aio"), out)
    top.data.pop("aio", None)
    top.finish()
    return out


def _translate_precision(top: _Reader, out: Translation) -> int:
    fp16 = _Reader.of(top.data, "fp16")
    bf16_name = "bfloat16" if "bfloat16" in top.data and "bf16" not in top.data else "bf16"
    bf16 = _Reader.of(top.data, bf16_name)
    top.data.pop("fp16", None)
    top.data.pop(bf16_name, None)
    use_fp16, use_bf16 = _enabled(fp16), _enabled(bf16)
    if use_fp16 and use_bf16:
        raise ConfigError(f"DeepSpeed fp16.enabled and {bf16_name}.enabled are both true: enable at most one")
    dtype = "fp16" if use_fp16 else "bf16" if use_bf16 else "fp32"
    out.set("precision.param_dtype", dtype, origin="fp16.enabled" if use_fp16 else f"{bf16_name}.enabled")
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


def _translate_optimizer(top: _Reader, out: Translation) -> None:
    if top.data.get("optimizer") is None:
        top.data.pop("optimizer", None)
        return
    optimizer = _Reader.of(top.data, "optimizer")
    top.data.pop("optimizer")
    params = _Reader.of(optimizer.data, "params", path="optimizer")
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


def _translate_batch(top: _Reader, out: Translation, *, world_size: int) -> None:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values = [top.pop(name) for name in names]
    for name, value in zip(names, values):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"DeepSpeed {name}: expected a positive integer or \"auto\", got {show(value)}", key=name)
    total, micro, accum = values
    if total is not None:
        if micro is None:
            micro = total // ((accum or 1) * world_size)
        elif accum is None:
            accum = total // (micro * world_size)
        if micro < 1 or (accum or 1) < 1 or micro * (accum or 1) * world_size != total:
            raise ConfigError(
                f"DeepSpeed train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum or 1} x world size {world_size}: fix one of them "
                'or set train_batch_size to "auto"',
                key="train_batch_size",
            )
    origin = "train_batch_size" if total is not None else None
    if micro is not None:
        out.set("train.micro_batch_size", micro, origin=origin if values[1] is None else names[1])
    if accum is not None:
        out.set("gradient_accumulation_steps", accum, origin=origin if values[2] is None else names[2])


def _translate_zero(zero: _Reader, out: Translation, *, dtype_bytes: int) -> None:
    stage = zero.pop("stage")
    # DeepSpeed's default, which validation then refuses in DeepSpeed words; an override can still set it.
    out.set("zero.stage", 0 if stage is None else stage, origin=zero.key("stage"), absent=stage is None)
    _translate_offload(_Reader.of(zero.data, "offload_param", path=zero.path), "params", out, dtype_bytes)
    offload_optimizer = _Reader.of(zero.data, "offload_optimizer", path=zero.path)
    opt_tier = _translate_offload(offload_optimizer, "optimizer", out, dtype_bytes)
    zero.data.pop("offload_param", None)
    zero.data.pop("offload_optimizer", None)
    if opt_tier not in (None, "device") and isinstance(stage, int) and stage >= 2:
        out.set("offload.gradients", opt_tier, origin=f"{zero.path}.offload_optimizer.device")
    byte_keys = (
        ("reduce_bucket_size", "zero.reduce_bucket_size"),
        ("stage3_prefetch_bucket_size", "prefetch.bytes"),
        ("stage3_max_live_parameters", "prefetch.max_live_bytes"),
    )
    for ds_name, tz_key in byte_keys:
        value = zero.pop(ds_name)
        if value is not None:
            out.set(tz_key, _elements(value, zero.key(ds_name)) * dtype_bytes, origin=zero.key(ds_name))
    threshold = zero.pop("stage3_param_persistence_threshold")
    if threshold is not None:
        key = zero.key("stage3_param_persistence_threshold")
        out.set("zero.param_persistence_threshold", _elements(threshold, key), origin=key)
    overlap = zero.pop("overlap_comm")
    if overlap is not None:
        out.set("zero.overlap_comm", overlap, origin=zero.key("overlap_comm"))
    zero.finish()


def _translate_offload(section: _Reader, kind: str, out: Translation, dtype_bytes: int) -> str | None:
    """One offload_* section; returns the tierzero tier name it asked for, or None when absent."""
    if not section.data:
        return None
    device = section.pop("device")
    if device is not None and (not isinstance(device, str) or device.lower() not in _OFFLOAD_DEVICES):
        raise ConfigError(f"DeepSpeed {section.key('device')}: expected one of none, cpu, nvme, got {show(device)}")
    tier = "device" if device is None or device.lower() == "none" else device.lower()
    out.set(f"offload.{kind}", tier, origin=section.key("device"))
    path = section.pop("nvme_path")
    if path is not None:
        other = out.get("tiers.nvme.path")
        if other is not None and other != path:
            raise ConfigError(
                f"DeepSpeed {section.key('nvme_path')} {path} differs from {out.origins['tiers.nvme.path']} "
                f"{other}: tierzero keeps all swap files in one directory; use the same path in both"
            )
        out.set("tiers.nvme.path", path, origin=section.key("nvme_path"))
    pin = section.pop("pin_memory")
    if pin is not None:
        out.set("tiers.cpu.pin_memory", pin or bool(out.get("tiers.cpu.pin_memory")), origin=section.key("pin_memory"))
    count = section.pop("buffer_count")
    if count is not None:
        count = _positive(count, section.key("buffer_count"))
        larger = max(count, out.get("swapper.buffer_count", 0))
        out.set("swapper.buffer_count", larger, origin=section.key("buffer_count"))
    size = section.pop("buffer_size")
    if size is not None:
        nbytes = align_up(_elements(size, section.key("buffer_size")) * dtype_bytes, IO_ALIGNMENT)
        out.set("swapper.buffer_size", max(nbytes, out.get("swapper.buffer_size", 0)), origin=section.key("buffer_size"))
    section.finish()
    return tier


def _translate_aio(aio: _Reader, out: Translation) -> None:
    names = (("block_size", "block_size"), ("queue_depth", "queue_depth"), ("thread_count", "threads"))
    for ds_name, tz_name in (*names, ("intra_op_parallelism", "threads")):
        value = aio.pop(ds_name)
        if value is not None:
            out.set(f"tiers.nvme.{tz_name}", value, origin=aio.key(ds_name))
    aio.finish()


def deepspeed_markdown() -> str:
    """The DeepSpeed section of docs/config.md."""
    rows = [
        "## DeepSpeed configs",
        "",
        __doc__.split("\n\n", 1)[1].strip(),
        "",
        "| DeepSpeed key | tierzero key | note |",
        "|---|---|---|",
    ]
    rows.extend(f"| `{ds}` | `{tz}` | {note} |" for ds, tz, note in _MAPPING_ROWS)
    rows.append("")
    rows.append("Any other key gives one `TierZeroConfigWarning` naming it and is ignored.")
    return "\n".join(rows) + "\n"
