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
  "auto" resolve to off (fp32). scheduler.params.warmup_max_lr "auto" is the
  optimizer's lr, and total_num_steps "auto" is train.steps.
- Keys left out take tierzero's defaults, except zero_optimization.stage, which takes
  DeepSpeed's default, 0: plain data parallel, which tierzero does not run, so a config
  without a stage is refused until it names one (1, 2 or 3); and the scheduler's params,
  which take DeepSpeed's defaults, since the schedule is DeepSpeed's.
- The scheduler WarmupLR, WarmupDecayLR or WarmupCosineLR becomes scheduler.type
  constant, linear or cosine with scheduler.convention deepspeed: each optimizer step
  runs at the rate DeepSpeed's engine gives it. WarmupLR and WarmupDecayLR set the rate
  themselves, so warmup_max_lr becomes optimizer.lr and warmup_min_lr / warmup_max_lr
  the ratio the warm-up starts at (and WarmupDecayLR decays to); a warmup_min_lr above
  the peak is refused, as is any other scheduler type.
- offload_optimizer moves the gradients with the optimizer states (as ZeRO-Offload
  does) at stage 2 and 3. tierzero has one swap directory and one staging pool: the
  two offload sections must agree on nvme_path; buffer_count takes the larger, and
  pin_memory is on if either asks.
- DeepSpeed's "Adam" is AdamW unless optimizer.params.adam_w_mode is false, as in DeepSpeed.
- Every key with no tierzero equivalent, including keys DeepSpeed does not know,
  gives exactly one TierZeroConfigWarning naming it (`tierzero train` prints it as one
  `tierzero: warning:` line), and is ignored. `tierzero train` lists each "auto" value
  and what it resolved to in its start-up header.
- An error about a value that came from a DeepSpeed key names that key first, then the
  tierzero key it became: "zero_optimization.offload_param.nvme_path (tiers.nvme.path in
  tierzero) ...". The fix it suggests is in tierzero keys, which `--set` takes.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from tierzero.common.slices import IO_ALIGNMENT, align_up
from tierzero.config.checks import show
from tierzero.config.deepspeed.optim import translate_optimizer, translate_precision, translate_scheduler
from tierzero.config.deepspeed.reader import AUTO, Reader, Translation, elements, positive_int
from tierzero.config.errors import ConfigError

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
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
    ("zero_optimization.mics_shard_size", "zero.shard_group_size", "-1 (MiCS off): absent"),
    ("zero_optimization.zero_hpz_partition_size", "zero.hpz_partition_size", "1 (hpZ off): absent"),
    ("zero_optimization.zero_quantized_weights", "zero.quantized_weights",
     "int8; DeepSpeed has no key for the block: zero.quantization_block_size"),
    ("zero_optimization.zero_quantized_gradients", "zero.quantized_gradients", "true -> int4, false -> none"),
    ("zero_optimization.zero_quantized_nontrainable_weights", "model.lora.base_dtype",
     "true -> int8 (the frozen base kept block-wise int8), false: absent; needs model.lora.r"),
    ("aio.block_size / queue_depth / thread_count", "tiers.nvme.block_size / queue_depth / threads", "intra_op_parallelism also sets threads"),
    ("optimizer.type", "optimizer.type", "AdamW, Adam (AdamW unless adam_w_mode is false), SGD"),
    ("optimizer.params.lr / betas / eps / weight_decay / momentum", "optimizer.*", ""),
    ("scheduler.type", "scheduler.type", "WarmupLR -> constant, WarmupDecayLR -> linear, WarmupCosineLR -> cosine, "
     "each with scheduler.convention deepspeed; other types are refused"),
    ("scheduler.params.warmup_max_lr / warmup_min_lr", "optimizer.lr / scheduler.warmup_start_ratio",
     "WarmupLR, WarmupDecayLR: the peak is optimizer.lr (\"auto\": the optimizer's lr; left out: the same in "
     "WarmupLR, 0.001 in WarmupDecayLR), the ratio min / max (WarmupDecayLR: also scheduler.min_lr_ratio)"),
    ("scheduler.params.warmup_num_steps", "scheduler.warmup_steps", "left out: 1000; at least 2, as in DeepSpeed; \"auto\": 0"),
    ("scheduler.params.warmup_type", "scheduler.warmup_type", "left out: log, as in DeepSpeed"),
    ("scheduler.params.warmup_min_ratio", "scheduler.warmup_start_ratio", "WarmupCosineLR"),
    ("scheduler.params.cos_min_ratio", "scheduler.min_lr_ratio", "WarmupCosineLR; left out: 0.0001, as in DeepSpeed"),
    ("scheduler.params.total_num_steps", "scheduler.total_steps", "WarmupDecayLR, WarmupCosineLR: required; \"auto\": null (train.steps)"),
    ("fp16.enabled / bf16.enabled", "precision.param_dtype", "\"auto\": off"),
    ("torch_autocast.enabled / dtype", "precision.autocast / precision.param_dtype",
     "bfloat16 -> bf16, float16 -> fp16, required; not beside fp16 or bf16 enabled; "
     "lower_precision_safe_modules is ignored"),
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


def _sides(text: str) -> list[str]:
    """"aio.block_size / queue_depth" -> ["aio.block_size", "aio.queue_depth"]: later names take the first's parent."""
    first, *rest = (part.strip() for part in text.split(" / "))
    parent = first.rpartition(".")[0]
    return [first, *(name if "." in name or not parent else f"{parent}.{name}" for name in rest)]


def _row_keys() -> list[tuple[str, tuple[str, ...]]]:
    """The mapping table as (DeepSpeed key or pattern, the tierzero keys it sets), one row a key."""
    pairs = []
    for ds, tz, _ in _MAPPING_ROWS:
        ds_keys, tz_keys = _sides(ds), _sides(tz)
        if len(tz_keys) == 1:
            tz_keys = tz_keys * len(ds_keys)
        for ds_key, targets in zip(ds_keys, tz_keys):
            keys = tuple(t.strip() for t in targets.split(","))
            pairs.append((ds_key, tuple(k for k in keys if re.fullmatch(r"[\w.*]+", k))))
    return pairs


_ROW_KEYS = _row_keys()


def tierzero_keys(ds_key: str) -> tuple[str, ...]:
    """The tierzero keys the DeepSpeed key `ds_key` sets, from the mapping table; () when none."""
    if ds_key.startswith("bfloat16."):  # DeepSpeed's other name for the bf16 section
        ds_key = "bf16." + ds_key.removeprefix("bfloat16.")
    if ds_key == "train_batch_size":  # only checked, but "auto" leaves it to these two (and the world size)
        return ("train.micro_batch_size", "gradient_accumulation_steps")
    for pattern, keys in _ROW_KEYS:
        if fnmatch.fnmatchcase(ds_key, pattern):
            leaf = ds_key.rpartition(".")[2]
            return tuple(k.replace("*", leaf) for k in keys)
    return ()


def auto_keys(value: Any, prefix: str = "") -> list[str]:
    """The dotted keys of `value` whose value is "auto", in the order written."""
    if not isinstance(value, Mapping):
        return []
    found = []
    for name, child in value.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        found += [key] if child == AUTO else auto_keys(child, key)
    return found


def translate_deepspeed(ds: Mapping[str, Any], *, world_size: int = 1) -> Translation:
    """Translate a DeepSpeed config dict (see the module docstring for the rules)."""
    top = Reader("", dict(ds))
    out = Translation(names=_DEEPSPEED_NAMES)
    out.autos = {key: tierzero_keys(key) for key in auto_keys(ds)}
    dtype_bytes = translate_precision(top, out)
    translate_optimizer(top, out)
    translate_scheduler(top, out)
    _translate_batch(top, out, world_size=world_size)
    clipping = top.pop("gradient_clipping")
    if clipping is not None:
        out.set("gradient_clipping", clipping, origin="gradient_clipping")
    _translate_zero(Reader.of(top.data, "zero_optimization"), out, dtype_bytes=dtype_bytes)
    top.data.pop("zero_optimization", None)
    _translate_aio(Reader.of(top.data, "aio"), out)
    top.data.pop("aio", None)
    top.finish()
    return out


def _translate_batch(top: Reader, out: Translation, *, world_size: int) -> None:
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


def _translate_zero(zero: Reader, out: Translation, *, dtype_bytes: int) -> None:
    stage = zero.pop("stage")
    # DeepSpeed's default, which validation then refuses in DeepSpeed words; an override can still set it.
    out.set("zero.stage", 0 if stage is None else stage, origin=zero.key("stage"), absent=stage is None)
    _translate_offload(Reader.of(zero.data, "offload_param", path=zero.path), "params", out, dtype_bytes)
    offload_optimizer = Reader.of(zero.data, "offload_optimizer", path=zero.path)
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
            out.set(tz_key, elements(value, zero.key(ds_name)) * dtype_bytes, origin=zero.key(ds_name))
    threshold = zero.pop("stage3_param_persistence_threshold")
    if threshold is not None:
        key = zero.key("stage3_param_persistence_threshold")
        out.set("zero.param_persistence_threshold", elements(threshold, key), origin=key)
    overlap = zero.pop("overlap_comm")
    if overlap is not None:
        out.set("zero.overlap_comm", overlap, origin=zero.key("overlap_comm"))
    quantized_grads = zero.pop("zero_quantized_gradients")
    if quantized_grads is not None:
        key = zero.key("zero_quantized_gradients")
        out.set("zero.quantized_gradients", "int4" if quantized_grads is True else "none", origin=key)
    quantized = zero.pop("zero_quantized_weights")
    if quantized is not None:
        out.set("zero.quantized_weights", quantized, origin=zero.key("zero_quantized_weights"))
    frozen = zero.pop("zero_quantized_nontrainable_weights")
    if frozen is True:
        out.set("model.lora.base_dtype", "int8", origin=zero.key("zero_quantized_nontrainable_weights"))
    elif frozen is not None and frozen is not False:
        key = zero.key("zero_quantized_nontrainable_weights")
        raise ConfigError(f"{key} must be true or false, got {show(frozen)}: set it to true or false", key=key)
    hpz = zero.pop("zero_hpz_partition_size")
    if hpz is not None and hpz != 1:  # 1: DeepSpeed's "hpZ off"
        out.set("zero.hpz_partition_size", hpz, origin=zero.key("zero_hpz_partition_size"))
    mics = zero.pop("mics_shard_size")
    if mics is not None and mics != -1:  # -1: DeepSpeed's "MiCS off"
        out.set("zero.shard_group_size", mics, origin=zero.key("mics_shard_size"))
    zero.finish()


def _translate_offload(section: Reader, kind: str, out: Translation, dtype_bytes: int) -> str | None:
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
        count = positive_int(count, section.key("buffer_count"))
        larger = max(count, out.get("swapper.buffer_count", 0))
        out.set("swapper.buffer_count", larger, origin=section.key("buffer_count"))
    size = section.pop("buffer_size")
    if size is not None:
        nbytes = align_up(elements(size, section.key("buffer_size")) * dtype_bytes, IO_ALIGNMENT)
        out.set("swapper.buffer_size", max(nbytes, out.get("swapper.buffer_size", 0)), origin=section.key("buffer_size"))
    section.finish()
    return tier


def _translate_aio(aio: Reader, out: Translation) -> None:
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
