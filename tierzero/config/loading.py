"""`load_config`: a file, a dict, a DeepSpeed config or a `Config` in; a validated `Config` out.

A dict or file with a top-level "zero_optimization" key is a DeepSpeed config: it is
translated first (tierzero.config.deepspeed.translate), and any error about a value that came from
it names the DeepSpeed key as well as the tierzero key it became.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierzero.config.deepspeed.translate import Translation, translate_deepspeed
from tierzero.config.errors import ConfigError
from tierzero.config.optim import TORCH_WEIGHT_DECAY
from tierzero.config.reading import check_bounds, read_mapping_file
from tierzero.config.schema import Config
from tierzero.config.tree import build, plain, set_dotted

DEEPSPEED_MARKER = "zero_optimization"
"""A dict with this top-level key is a DeepSpeed config and is translated first."""


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    """A `Config`, and what only its source knows: whether it named a workload, and its "auto" values."""

    config: Config
    names_workload: bool
    """The source or the overrides name a model (any key of `model`) or data (`data.path`)."""
    autos: tuple[str, ...] = ()
    """Each DeepSpeed "auto" value and what it resolved to, e.g.
    `train_micro_batch_size_per_gpu -> train.micro_batch_size 4`."""


def load_config(
    source: Config | Mapping[str, Any] | str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None
) -> Config:
    """Build and validate a `Config` (see `read_config`)."""
    return read_config(source, overrides=overrides).config


def read_config(
    source: Config | Mapping[str, Any] | str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None
) -> LoadedConfig:
    """Build and validate a `Config`, noting what its source said (`LoadedConfig`).

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
    cfg = source if isinstance(source, Config) and cfg == source else cfg
    autos = () if translation is None else tuple(_resolved(cfg, key, keys) for key, keys in translation.autos.items())
    return LoadedConfig(cfg, names_workload=_names_workload(raw), autos=autos)


def _names_workload(raw: Mapping[str, Any]) -> bool:
    """A model section with any key, or a data.path: the config says what to train on what."""
    model, data = raw.get("model"), raw.get("data")
    return (isinstance(model, Mapping) and bool(model)) or (isinstance(data, Mapping) and data.get("path") is not None)


def _resolved(cfg: Config, ds_key: str, keys: tuple[str, ...]) -> str:
    """`ds_key -> key value, ...`: what a DeepSpeed "auto" became."""
    if not keys:
        return f"{ds_key} -> not used by tierzero"
    return f"{ds_key} -> " + ", ".join(f"{key} {_shown(cfg, key)}" for key in keys)


def _shown(cfg: Config, key: str) -> str:
    *parents, leaf = key.split(".")
    node: Any = cfg
    for name in parents:
        node = getattr(node, name)
    spec = next(spec for spec in dataclasses.fields(node) if spec.name == leaf)
    value = plain(getattr(node, leaf), human=spec.metadata["check"].is_size)
    return value if isinstance(value, str) else json.dumps(value)


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
    if cfg.optimizer.weight_decay == TORCH_WEIGHT_DECAY.get(cfg.optimizer.type, 0.0):
        del raw["optimizer"]["weight_decay"]
    return raw
