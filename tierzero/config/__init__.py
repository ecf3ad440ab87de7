"""The typed config: one dataclass a section, checked at load, from YAML, JSON, dicts or DeepSpeed configs.

The sections (sections.py; the model's in model.py, the optimizer's and scheduler's in
optim.py, the data's in data.py, the precision's in precision.py) under one root with its cross-section
rules (schema.py), built from files, dicts and DeepSpeed configs by `load_config`
(loading.py, deepspeed/), the files read within bounds (reading.py); field checks
(checks.py) and the tree machinery (tree.py) beneath them; docs/config.md rendered by
markdown.py; the `config` command in tierzero/cli/config.py.
"""

from tierzero.config.checks import AUTO
from tierzero.config.data import DataConfig
from tierzero.config.errors import ConfigError, TierZeroConfigWarning
from tierzero.config.loading import LoadedConfig, load_config, read_config
from tierzero.config.markdown import config_markdown
from tierzero.config.model import ModelConfig
from tierzero.config.optim import OptimizerConfig, SchedulerConfig
from tierzero.config.precision import PrecisionConfig
from tierzero.config.schema import Config
from tierzero.config.sections import (
    ActivationsConfig,
    CheckpointConfig,
    CpuTierConfig,
    DeviceTierConfig,
    DistConfig,
    NvmeTierConfig,
    OffloadConfig,
    PrefetchConfig,
    SwapperConfig,
    TiersConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "AUTO",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "CpuTierConfig",
    "DataConfig",
    "DeviceTierConfig",
    "DistConfig",
    "LoadedConfig",
    "ModelConfig",
    "NvmeTierConfig",
    "OffloadConfig",
    "ActivationsConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "PrefetchConfig",
    "SchedulerConfig",
    "SwapperConfig",
    "TierZeroConfigWarning",
    "TiersConfig",
    "TrainConfig",
    "ZeroConfig",
    "config_markdown",
    "load_config",
    "read_config",
]
