"""`load_config`: a file, a dict, a DeepSpeed config or a `Config` in; a validated `Config` out.

A dict or file with a top-level "zero_optimization" key is a DeepSpeed config: it is
translated first (tierzero.config.deepspeed.translate), and any error about a value that came from
it names the DeepSpeed key as well as the tierzero key it became.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierzero.config.deepspeed.translate import Translation, translate_deepspeed
from tierzero.config.errors import ConfigError
from tierzero.config.optim import TORCH_WEIGHT_DECAY
from tierzero.config.reading import check_bounds, read_mapping_file
from tierzero.config.schema import Config
from tierzero.config.tree import build, set_dotted

DEEPSPEED_MARKER = "zero_optimization"
"""A dict with this top-level key is a DeepSpeed config and is translated first."""


def load_config(
    source: Config | Mapping[str, Any] | str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None
) -> Config:
    """Build and validate a `Config`.

    `source` is a path to a .yaml/.yml/.json file, a dict, or a `Config` (re-validated,
    and returned as is unless overrides change it). A dict or file with a top-level "zero_optimization" key is read as a
    DeepSpeed config (see `tierzero.config.deepspeed.translate`; its batch-size arithmetic uses the
    WORLD_SIZE environment variable, 1 when unset). `overrides` maps dotted tierzero keys
    to values, e.g. {"tiers.nvme.path": "/x", "zero.stage": 2}; they are applied after
    any DeepSpeed translation and before validation. Raises `ConfigError`, one line.
    """
    raw = _read_source(source)
    translation: Translation | None = None
    if DEEPSPEED_MARKER in raw:
        translation = translate_deepspeed(raw, world_size=_env_world_size())
        raw = translation.config
    for key, value in (overrides or {}).items():
        check_bounds(value, source=f"the override of {key}")
        set_dotted(Config, raw, key, value)
        if translation is not None:
            translation.forget(key)
    try:
        cfg = build(Config, raw, root=Config)
    except ConfigError as exc:
        if translation is None:
            raise
        raise translation.explain(exc) from None
    # An unchanged Config comes back as the same object, once re-validated (its swap dir may be gone).
    return source if isinstance(source, Config) and cfg == source else cfg


def _env_world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    if not (value.isascii() and value.isdigit() and len(value) <= 9) or int(value) < 1:
        raise ConfigError(f"WORLD_SIZE: expected a positive integer, got {value!r}; unset it or fix the launcher", key="WORLD_SIZE")
    return int(value)


def _read_source(source: Any) -> dict[str, Any]:
    if isinstance(source, Config):
        return _raw_of(source)
    if isinstance(source, Mapping):
        check_bounds(source, source="the config")  # before deepcopy, which recurses once per level
        return copy.deepcopy(dict(source))
    if isinstance(source, (str, os.PathLike)):
        return read_mapping_file(Path(source))
    raise ConfigError(
        f"config source: expected a .yaml/.yml/.json path, a dict or a Config, got {type(source).__name__}"
    )


def _raw_of(cfg: Config) -> dict[str, Any]:
    """`cfg` as a raw dict, less a weight decay that is its optimizer type's default.

    So an override of optimizer.type picks the new type's default, as it would from the
    file `cfg` was loaded from; a Config does not remember which values were written.
    """
    raw = cfg.to_dict()
    if cfg.optimizer.weight_decay == TORCH_WEIGHT_DECAY[cfg.optimizer.type]:
        del raw["optimizer"]["weight_decay"]
    return raw
