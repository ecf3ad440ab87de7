"""The one typed, validated training config: a tree of keyword-only dataclasses.

`load_config` takes a YAML or JSON file, a dict (tierzero's own keys, or a DeepSpeed
config, recognised by its "zero_optimization" key) or an existing `Config`, applies
dotted overrides, and returns a `Config` whose values are already parsed: sizes are
int bytes, placements are `Tier` members. Each field carries its docstring and its
check in the field metadata; `__post_init__` converts and checks every field, each
section then checks its own fields together, and `Config` checks across sections.
`config_markdown()` renders the same metadata as docs/config.md.

The tree is frozen: to change a value, load again with overrides,
`load_config(cfg, overrides={"zero.stage": 2})`.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tierzero.config.fields import (
    BETAS,
    BOOL,
    DIRECTORY,
    KEYWORDS,
    LOSS_SCALE,
    NAMES,
    OPTIONAL_NAME,
    PATH_OR_GLOB,
    TIER,
    ConfigError,
    GiB,
    MiB,
    Section,
    TierZeroConfigWarning,
    build,
    choice_check,
    fields_markdown,
    float_check,
    int_check,
    read_mapping_file,
    section,
    set_dotted,
    setting,
    size_check,
)
from tierzero.sizes import format_size
from tierzero.slices import IO_ALIGNMENT, Tier

__all__ = [
    "Config",
    "ConfigError",
    "TierZeroConfigWarning",
    "config_markdown",
    "load_config",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each `precision.param_dtype`."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ZeroConfig(Section):
    """ZeRO sharding: which states are split across the data-parallel ranks, and how gradients travel."""

    SECTION: ClassVar[str] = "zero"
    stage: int = setting(3, int_check(0, 3))
    """0: plain data parallel; 1: shard optimizer states; 2: also gradients; 3: also parameters."""
    unit_classes: list[str] = setting([], NAMES)
    """Class names of the modules wrapped as units (gathered and offloaded as one flat buffer),
    e.g. [GPT2Block]; empty lets the engine choose."""
    reduce_bucket_size: int = setting(25 * MiB, size_check())
    """Bytes of ready gradients (and, in stages 1-2, of updated parameters) sent in one collective;
    a unit larger than this goes alone."""
    overlap_comm: bool = setting(True, BOOL)
    """Overlap collectives with compute instead of running them inline."""
    param_persistence_threshold: int = setting(0, int_check(0))
    """Stage 3: parameters with at most this many elements stay whole on every rank instead of
    being sharded (0 shards all)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PrecisionConfig(Section):
    """Compute dtype and fp16 loss scaling. Master weights and optimizer states are always fp32."""

    SECTION: ClassVar[str] = "precision"
    param_dtype: str = setting("fp32", choice_check(tuple(DTYPE_BYTES)))
    """dtype of parameters and gradients in forward and backward."""
    loss_scale: str | float = setting("dynamic", LOSS_SCALE)
    """fp16 only: 'dynamic' (halve on overflow, grow after scale_window clean steps) or a fixed
    positive scale."""
    initial_scale: float = setting(2.0**16, float_check(lo=0.0, lo_open=True))
    """Starting dynamic loss scale."""
    scale_window: int = setting(1000, int_check(1))
    """Steps without overflow before the dynamic scale doubles."""
    min_scale: float = setting(1.0, float_check(lo=0.0, lo_open=True))
    """The dynamic scale never drops below this."""

    def _validate(self) -> None:
        if self.min_scale > self.initial_scale:
            raise ConfigError(
                f"precision.min_scale {self.min_scale:g} is above precision.initial_scale "
                f"{self.initial_scale:g}: lower min_scale or raise initial_scale",
                key="precision.min_scale",
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.param_dtype]


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig(Section):
    """The optimizer that steps each fp32 master slice where its states live."""

    SECTION: ClassVar[str] = "optimizer"
    type: str = setting("adamw", choice_check(("adamw", "adam", "sgd")))
    """adamw (decoupled weight decay), adam (L2 added to the gradient) or sgd."""
    lr: float = setting(1e-3, float_check(lo=0.0, lo_open=True))
    """Learning rate."""
    betas: tuple[float, float] = setting((0.9, 0.999), BETAS)
    """Adam coefficients for the running averages of the gradient and its square."""
    eps: float = setting(1e-8, float_check(lo=0.0, lo_open=True))
    """Adam term added to the denominator."""
    weight_decay: float = setting(0.01, float_check(lo=0.0))
    """Weight decay (decoupled for adamw, L2 for adam and sgd)."""
    momentum: float = setting(0.0, float_check(lo=0.0, hi=1.0))
    """SGD momentum."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig(Section):
    """The training loop."""

    SECTION: ClassVar[str] = "train"
    micro_batch_size: int = setting(1, int_check(1))
    """Samples per rank per forward/backward."""
    seed: int = setting(0, int_check(0))
    """Seed for parameter init and data order (the same on every rank)."""
    steps: int = setting(100, int_check(1))
    """Optimizer steps `tierzero train` runs (`--steps` overrides it)."""
    seq_len: int = setting(128, int_check(1))
    """Tokens (bytes) per training sequence; at most model.max_seq_len for the built-in models."""
    log_every: int = setting(10, int_check(1))
    """`tierzero train` writes a log line every this many steps (the progress bar updates every step)."""


MODEL_TYPES = ("gpt", "llama", "transformers")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig(Section):
    """The model `tierzero train` builds, with fresh random weights: a built-in GPT or Llama, or a
    transformers class by name. The size fields apply to the built-ins."""

    SECTION: ClassVar[str] = "model"
    type: str = setting("gpt", choice_check(MODEL_TYPES))
    """gpt (pre-LN, learned positions, tied head), llama (RMSNorm, rotary, SwiGLU, untied head) or
    transformers."""
    vocab_size: int = setting(256, int_check(1))
    """Vocabulary size; 256 for the byte-level data."""
    n_layer: int = setting(2, int_check(1))
    """Transformer blocks (one engine unit each)."""
    n_head: int = setting(2, int_check(1))
    """Attention heads; must divide model.d_model."""
    d_model: int = setting(64, int_check(1))
    """Hidden width."""
    d_ff: int = setting(256, int_check(1))
    """Width of the MLP's inner layer."""
    max_seq_len: int = setting(128, int_check(1))
    """Longest sequence the model takes (the GPT's learned positions, the Llama's rotary table)."""
    dropout: float = setting(0.0, float_check(lo=0.0, hi=1.0))
    """Dropout probability (0 keeps runs deterministic)."""
    transformers_class: str | None = setting(None, OPTIONAL_NAME)
    """type transformers: the model class, e.g. GPT2LMHeadModel or LlamaForCausalLM."""
    transformers_config: dict[str, Any] = setting({}, KEYWORDS)
    """type transformers: keyword arguments of the class's config (e.g. GPT2Config); nothing is
    downloaded."""

    def _validate(self) -> None:
        if self.type == "transformers":
            if self.transformers_class is None:
                raise ConfigError(
                    "model.type is transformers but model.transformers_class is not set: name a class such as "
                    "GPT2LMHeadModel, or set model.type to gpt or llama",
                    key="model.transformers_class",
                )
        elif self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model {self.d_model} is not a multiple of model.n_head {self.n_head}: "
                "pick d_model = n_head x head size",
                key="model.d_model",
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig(Section):
    """The byte-level training text `tierzero train` reads."""

    SECTION: ClassVar[str] = "data"
    path: str | None = setting(None, PATH_OR_GLOB)
    """A text file, a directory (every file under it) or a glob (** for subdirectories); null: the
    Python standard library's *.py sources on this machine."""
    max_bytes: int = setting(64 * MiB, size_check())
    """Most bytes of the corpus held in memory; files are taken in a seeded order until it is full."""


@dataclass(kw_only=True, slots=True, frozen=True)
class OffloadConfig(Section):
    """The home tier of each kind of state: device (accelerator memory), cpu (host memory) or nvme."""

    SECTION: ClassVar[str] = "offload"
    params: Tier = setting(Tier.DEVICE, TIER)
    """Home of the parameter slices; cpu or nvme needs zero.stage 3."""
    gradients: Tier = setting(Tier.DEVICE, TIER)
    """Home of the gradient slices; cpu or nvme needs zero.stage 2 or 3."""
    optimizer: Tier = setting(Tier.DEVICE, TIER)
    """Home of the fp32 master weights and optimizer states; cpu or nvme needs zero.stage 1 to 3."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceTierConfig(Section):
    """Accelerator memory."""

    SECTION: ClassVar[str] = "tiers.device"
    capacity: int | None = setting(None, size_check(optional=True))
    """Bytes of model state the device tier may hold; null: what the device has."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CpuTierConfig(Section):
    """Host memory."""

    SECTION: ClassVar[str] = "tiers.cpu"
    capacity: int | None = setting(None, size_check(optional=True))
    """Bytes of model state the host tier may hold; null: what the host has."""
    pin_memory: bool = setting(True, BOOL)
    """Page-lock host buffers for fast device copies; only where CUDA is available."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NvmeTierConfig(Section):
    """The NVMe tier: one preallocated swap file per rank, read and written with direct I/O."""

    SECTION: ClassVar[str] = "tiers.nvme"
    path: str | None = setting(None, DIRECTORY)
    """Existing, writable directory for the swap files (made absolute when loaded); required when
    anything lives on nvme."""
    capacity: int | None = setting(None, size_check(optional=True))
    """Bytes of swap file per rank; null: what the state needs (checked against free space at
    start-up)."""
    block_size: int = setting(8 * MiB, size_check(multiple_of=IO_ALIGNMENT))
    """Bytes per I/O request; a multiple of 4096 for direct I/O."""
    queue_depth: int = setting(16, int_check(1))
    """I/O requests in flight at once."""
    threads: int = setting(8, int_check(1))
    """Worker threads issuing the I/O."""
    verify: bool = setting(False, BOOL)
    """Checksum every slice written and check it when read back."""
    backend: str = setting("pread", choice_check(("pread", "aiofiles")))
    """pread: os.preadv/pwritev on a thread pool; aiofiles: asyncio file I/O."""

    def _validate(self) -> None:
        if self.path is not None:
            _check_swap_dir(self.path)


@dataclass(kw_only=True, slots=True, frozen=True)
class TiersConfig(Section):
    """Capacities and settings of the three tiers."""

    SECTION: ClassVar[str] = "tiers"
    device: DeviceTierConfig = section(DeviceTierConfig)
    cpu: CpuTierConfig = section(CpuTierConfig)
    nvme: NvmeTierConfig = section(NvmeTierConfig)


@dataclass(kw_only=True, slots=True, frozen=True)
class SwapperConfig(Section):
    """The pool of aligned host staging buffers that bytes pass through between tiers."""

    SECTION: ClassVar[str] = "swapper"
    buffer_size: int = setting(8 * MiB, size_check(multiple_of=IO_ALIGNMENT))
    """Bytes per staging buffer; a multiple of 4096."""
    buffer_count: int = setting(8, int_check(1))
    """Staging buffers in the pool."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PrefetchConfig(Section):
    """How far ahead of compute the prefetcher brings slices up."""

    SECTION: ClassVar[str] = "prefetch"
    bytes: int = setting(64 * MiB, size_check(allow_zero=True))
    """Bytes of upcoming units' slices kept in flight (0 turns prefetch off)."""
    max_live_bytes: int = setting(1 * GiB, size_check())
    """Most bytes of gathered and prefetched parameters alive at once."""

    def _validate(self) -> None:
        if self.bytes > self.max_live_bytes:
            raise ConfigError(
                f"prefetch.bytes {format_size(self.bytes)} is above prefetch.max_live_bytes "
                f"{format_size(self.max_live_bytes)}: lower prefetch.bytes or raise prefetch.max_live_bytes",
                key="prefetch.bytes",
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig(Section):
    """Sharded checkpoints: what `tierzero train` writes and `--resume` continues from."""

    SECTION: ClassVar[str] = "checkpoint"
    dir: str | None = setting(None, DIRECTORY)
    """Directory of the checkpoints, one `<step>` directory each and a `latest` pointer (created when
    needed; made absolute when loaded); null: `tierzero train` saves none."""
    every: int = setting(0, int_check(0))
    """`tierzero train` saves every this many optimizer steps, and after the last one (0: only after
    the last one)."""
    keep: int = setting(2, int_check(1))
    """Newest checkpoints kept under checkpoint.dir; older ones are deleted after each save."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DistConfig(Section):
    """The process group `tierzero.initialize` creates under torchrun."""

    SECTION: ClassVar[str] = "dist"
    timeout: float = setting(600.0, float_check(lo=0.0, lo_open=True))
    """Seconds a collective may wait for another rank before the job stops with an error naming the
    lost rank; a dead rank is noticed at once, a hung one after this long."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Config(Section):
    """Everything one training run needs, checked as a whole."""

    zero: ZeroConfig = section(ZeroConfig)
    precision: PrecisionConfig = section(PrecisionConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    gradient_clipping: float = setting(0.0, float_check(lo=0.0))
    """Clip the global gradient norm to this (0: no clipping)."""
    gradient_accumulation_steps: int = setting(1, int_check(1))
    """Micro-batches whose gradients are summed before each optimizer step."""
    train: TrainConfig = section(TrainConfig)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    offload: OffloadConfig = section(OffloadConfig)
    tiers: TiersConfig = section(TiersConfig)
    swapper: SwapperConfig = section(SwapperConfig)
    prefetch: PrefetchConfig = section(PrefetchConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    dist: DistConfig = section(DistConfig)

    def _validate(self) -> None:
        _check_stage_allows_offload(self.zero.stage, self.offload)
        _check_sequence_fits(self.model, self.train)
        _check_nvme_placement(self)

    def placements(self) -> dict[str, Tier]:
        """offload key -> tier, e.g. {"offload.params": Tier.NVME, ...}."""
        return {f"offload.{name}": getattr(self.offload, name) for name in ("params", "gradients", "optimizer")}

    @property
    def uses_nvme(self) -> bool:
        return Tier.NVME in self.placements().values()


_MIN_STAGE = {"params": (3, "3"), "gradients": (2, "2 or 3"), "optimizer": (1, "1, 2 or 3")}


def _check_stage_allows_offload(stage: int, offload: OffloadConfig) -> None:
    what = {"params": "parameter", "gradients": "gradient", "optimizer": "optimizer"}
    for name, (min_stage, allowed) in _MIN_STAGE.items():
        tier = getattr(offload, name)
        if tier is not Tier.DEVICE and stage < min_stage:
            raise ConfigError(
                f"offload.{name} is {tier.value} but zero.stage is {stage}: {what[name]} offload "
                f"needs zero.stage {allowed}; set zero.stage: {min_stage} or offload.{name}: device",
                key=f"offload.{name}",
            )


def _check_sequence_fits(model: ModelConfig, train: TrainConfig) -> None:
    if model.type != "transformers" and train.seq_len > model.max_seq_len:
        raise ConfigError(
            f"train.seq_len {train.seq_len} is above model.max_seq_len {model.max_seq_len}: "
            "lower train.seq_len or raise model.max_seq_len",
            key="train.seq_len",
        )


def _check_nvme_placement(cfg: Config) -> None:
    on_nvme = [key for key, tier in cfg.placements().items() if tier is Tier.NVME]
    if not on_nvme:
        return
    if cfg.tiers.nvme.path is None:
        verb = "is" if len(on_nvme) == 1 else "are"
        raise ConfigError(
            f"{' and '.join(on_nvme)} {verb} nvme but tiers.nvme.path is not set: set tiers.nvme.path "
            "to a directory on a local NVMe disk (or pass --nvme-path)",
            key="tiers.nvme.path",
        )
    staging = cfg.swapper.buffer_count * cfg.swapper.buffer_size
    cpu_capacity = cfg.tiers.cpu.capacity
    if cpu_capacity is not None and staging > cpu_capacity:
        raise ConfigError(
            f"swapper staging needs swapper.buffer_count x swapper.buffer_size = {format_size(staging)} of "
            f"host memory but tiers.cpu.capacity is {format_size(cpu_capacity)}: lower the swapper "
            "settings or raise tiers.cpu.capacity",
            key="swapper.buffer_count",
        )


def _check_swap_dir(path: str) -> None:
    key = "tiers.nvme.path"
    if not os.path.exists(path):
        raise ConfigError(f"{key} {path} does not exist: create it (mkdir -p {path}) or pick another directory", key=key)
    if not os.path.isdir(path):
        raise ConfigError(f"{key} {path} is not a directory: point {key} at a directory, not a file", key=key)
    try:
        fd, probe = tempfile.mkstemp(prefix=".tierzero-probe-", dir=path)
    except OSError as exc:
        raise ConfigError(
            f"{key} {path} is not writable ({exc.strerror}): fix its permissions or pick another directory",
            key=key,
        ) from None
    os.close(fd)
    os.unlink(probe)


# ---------------------------------------------------------------- loading

DEEPSPEED_MARKER = "zero_optimization"
"""A dict with this top-level key is a DeepSpeed config and is translated first."""


def load_config(
    source: Config | Mapping[str, Any] | str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None
) -> Config:
    """Build and validate a `Config`.

    `source` is a path to a .yaml/.yml/.json file, a dict, or a `Config` (re-validated,
    and returned as is unless overrides change it). A dict or file with a top-level "zero_optimization" key is read as a
    DeepSpeed config (see `tierzero.config.deepspeed`; its batch-size arithmetic uses the
    WORLD_SIZE environment variable, 1 when unset). `overrides` maps dotted tierzero keys
    to values, e.g. {"tiers.nvme.path": "/x", "zero.stage": 2}; they are applied after
    any DeepSpeed translation and before validation. Raises `ConfigError`, one line.
    """
    raw = _read_source(source)
    origins: dict[str, str] = {}
    if DEEPSPEED_MARKER in raw:
        from tierzero.config.deepspeed import translate_deepspeed

        translated = translate_deepspeed(raw, world_size=_env_world_size())
        raw, origins = translated.config, translated.origins
    for key, value in (overrides or {}).items():
        set_dotted(Config, raw, key, value)
        origins.pop(key, None)
    try:
        cfg = build(Config, raw, root=Config)
    except ConfigError as exc:
        if exc.key in origins:
            raise ConfigError(f"{exc} (from DeepSpeed key {origins[exc.key]})", key=exc.key) from None
        raise
    # An unchanged Config comes back as the same object, once re-validated (its swap dir may be gone).
    return source if isinstance(source, Config) and cfg == source else cfg


def _env_world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"WORLD_SIZE: expected a positive integer, got {value!r}; unset it or fix the launcher", key="WORLD_SIZE")
    return int(value)


def _read_source(source: Any) -> dict[str, Any]:
    if isinstance(source, Config):
        return source.to_dict()
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        return read_mapping_file(Path(source))
    raise ConfigError(
        f"config source: expected a .yaml/.yml/.json path, a dict or a Config, got {type(source).__name__}"
    )


# ---------------------------------------------------------------- documentation

_DOC_HEADER = """\
# Configuration reference

<!-- Generated by tierzero.config.config_markdown(); edit the field docstrings in
tierzero/config/schema.py and run `tierzero config docs > docs/config.md`. -->

A config is a YAML or JSON file (or a dict) with the keys below; every key is optional.
`tierzero config check FILE [--set key=value ...]` prints the resolved config or one
line saying what is wrong. Sizes are bytes, written as an integer or with a unit:
`4096`, `512MB`, `8GiB` (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024).
A DeepSpeed config (a file with a `zero_optimization` key) is accepted as it is and
translated; see the table at the end.
"""


def config_markdown() -> str:
    """The markdown of docs/config.md: every key with its type, default and docstring."""
    from tierzero.config.deepspeed import deepspeed_markdown

    parts = [_DOC_HEADER]
    parts.extend(fields_markdown(Config))
    parts.append(deepspeed_markdown())
    return "\n".join(parts)
