"""The root of the config tree, `Config`, and the rules that span its sections.

`tierzero.config.loading.load_config` builds one from a file, a dict or a DeepSpeed
config. The tree is frozen: to change a value, load again with overrides,
`load_config(cfg, overrides={"zero.stage": 2})`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.config.checks import AUTO, float_check, int_check
from tierzero.config.data import DataConfig
from tierzero.config.errors import ConfigError
from tierzero.config.model import ModelConfig
from tierzero.config.optim import OptimizerConfig, SchedulerConfig, per_unit
from tierzero.config.precision import PrecisionConfig
from tierzero.config.sections import (
    ActivationsConfig,
    CheckpointConfig,
    DistConfig,
    DpoConfig,
    GenerateConfig,
    OffloadConfig,
    PrefetchConfig,
    SwapperConfig,
    TiersConfig,
    TrainConfig,
    ZeroConfig,
)
from tierzero.config.tree import Section, section, setting


@dataclass(kw_only=True, slots=True, frozen=True)
class Config(Section):
    """Everything one training run needs, checked as a whole."""

    zero: ZeroConfig = section(ZeroConfig)
    precision: PrecisionConfig = section(PrecisionConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    gradient_clipping: float = setting(0.0, float_check(lo=0.0))
    """Clip the global gradient norm to this (0: no clipping)."""
    gradient_accumulation_steps: int = setting(1, int_check(1))
    """Micro-batches whose gradients are summed before each optimizer step."""
    train: TrainConfig = section(TrainConfig)
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    offload: OffloadConfig = section(OffloadConfig)
    activations: ActivationsConfig = section(ActivationsConfig)
    tiers: TiersConfig = section(TiersConfig)
    swapper: SwapperConfig = section(SwapperConfig)
    prefetch: PrefetchConfig = section(PrefetchConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    dist: DistConfig = section(DistConfig)
    dpo: DpoConfig = section(DpoConfig)
    generate: GenerateConfig = section(GenerateConfig)

    def _validate(self) -> None:
        _check_stage_allows_offload(self.zero.stage, self.offload)
        _check_sequence_fits(self.model, self.train)
        _check_nvme_placement(self)
        _check_preference_tuning(self)
        if per_unit(self.optimizer.type) and self.offload.optimizer is Tier.NVME:
            message = (
                f"offload.optimizer is nvme but optimizer.type {self.optimizer.type} keeps its states as torch tensors "
                "of its own, in memory: set offload.optimizer to cpu or device, or optimizer.type to adamw"
            )
            raise ConfigError(message, key="offload.optimizer")
        self.model.lora.quantized(self.precision.param_dtype)

    def placements(self) -> dict[str, Tier | str]:
        """offload key -> tier or "auto", e.g. {"offload.params": Tier.NVME, ...}."""
        return {f"offload.{name}": getattr(self.offload, name) for name in ("params", "gradients", "optimizer")}

    @property
    def uses_nvme(self) -> bool:
        return Tier.NVME in self.placements().values()

    @property
    def dpo_reference(self) -> str:
        """dpo.reference with auto resolved: adapters_off with model.lora, precomputed without."""
        if self.dpo.reference != AUTO:
            return self.dpo.reference
        return "adapters_off" if self.model.lora.r else "precomputed"


# Optimizer states may live off the device at every stage the engine runs (1 to 3), so only
# parameters and gradients have a lowest stage.
_MIN_STAGE = {"params": (3, "3"), "gradients": (2, "2 or 3")}


def _check_stage_allows_offload(stage: int, offload: OffloadConfig) -> None:
    what = {"params": "parameter", "gradients": "gradient"}
    for name, (min_stage, allowed) in _MIN_STAGE.items():
        tier = getattr(offload, name)
        if isinstance(tier, Tier) and tier is not Tier.DEVICE and stage < min_stage:
            raise ConfigError(
                f"offload.{name} is {tier.value} but zero.stage is {stage}: {what[name]} offload "
                f"needs zero.stage {allowed}; set zero.stage: {min_stage} or offload.{name}: device",
                key=f"offload.{name}",
            )


def _check_sequence_fits(model: ModelConfig, train: TrainConfig) -> None:
    # A pretrained model's positions are in its config.json, checked where the directory is read
    # (tierzero.pretrained.files.check_positions): model.max_seq_len says nothing of them.
    if model.type != "transformers" and model.pretrained is None and train.seq_len > model.max_seq_len:
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
    cache = cfg.tiers.nvme.cache
    if cpu_capacity is not None and cache and staging + cache > cpu_capacity:
        raise ConfigError(
            f"tiers.nvme.cache {format_size(cache)} and the swapper's staging {format_size(staging)} need "
            f"{format_size(staging + cache)} of host memory but tiers.cpu.capacity is {format_size(cpu_capacity)}: "
            "lower tiers.nvme.cache or raise tiers.cpu.capacity",
            key="tiers.nvme.cache",
        )


def _check_preference_tuning(cfg: Config) -> None:
    """`train.objective: dpo` needs adapters to switch off for dpo.reference adapters_off, and tokenized JSON Lines."""
    if cfg.train.objective != "dpo":
        return
    if cfg.dpo.reference == "adapters_off" and cfg.model.lora.r == 0:
        raise ConfigError(
            "dpo.reference is adapters_off but model.lora.r is 0 (full fine-tuning): there are no adapters to switch "
            "off; set dpo.reference to precomputed (or auto), or model.lora.r (e.g. 8)",
            key="dpo.reference",
        )
    if cfg.data.tokenizer is None or cfg.data.format not in ("auto", "jsonl"):
        raise ConfigError(
            f"train.objective is dpo, which reads JSON Lines records {{prompt, chosen, rejected}} tokenized with "
            f"data.tokenizer, but data.tokenizer is {cfg.data.tokenizer or 'null'} and data.format {cfg.data.format}: "
            "set data.tokenizer to a tokenizer directory and data.format to jsonl or auto",
            key="data.tokenizer" if cfg.data.tokenizer is None else "data.format",
        )
    if cfg.dpo.max_prompt_len > cfg.train.seq_len:
        raise ConfigError(
            f"dpo.max_prompt_len {cfg.dpo.max_prompt_len} is above train.seq_len {cfg.train.seq_len}, which would leave "
            "a long prompt's completion no token: lower dpo.max_prompt_len (0: half of train.seq_len)",
            key="dpo.max_prompt_len",
        )
