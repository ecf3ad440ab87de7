"""The typed config: schema and loading (schema.py), field checks (fields.py), DeepSpeed import (deepspeed.py), the `config` command (cli.py)."""

from tierzero.config.fields import ConfigError, TierZeroConfigWarning
from tierzero.config.schema import Config, ZeroConfig, config_markdown, load_config

__all__ = ["Config", "ConfigError", "TierZeroConfigWarning", "ZeroConfig", "config_markdown", "load_config"]
