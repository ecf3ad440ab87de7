"""What every part of the DeepSpeed translation shares: the record it fills and the reader of one section.

`Translation` holds the raw tierzero config being built and, for each tierzero key, the
DeepSpeed key it came from, so that an error names the key the user wrote. `Reader` hands
out the keys of one DeepSpeed section and warns once about each key nobody took. The
translators themselves live in tierzero.config.deepspeed.translate (ZeRO, offload, aio, batch) and
tierzero.config.deepspeed.optim (precision, optimizer, scheduler).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierzero.config.checks import show
from tierzero.config.errors import ConfigError, TierZeroConfigWarning, one_line

AUTO = "auto"


@dataclass(slots=True)
class Translation:
    """A raw tierzero config dict, and for each tierzero key set, the DeepSpeed key it came from."""

    config: dict[str, Any] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)
    """tierzero key -> the DeepSpeed key that would set it (the mapping table's one-to-one rows)."""
    origins: dict[str, str] = field(default_factory=dict)
    """tierzero key -> the DeepSpeed key its value came from."""
    absent: set[str] = field(default_factory=set)
    """tierzero keys whose value is DeepSpeed's default for a key the config left out."""
    overridden: list[str] = field(default_factory=list)
    """tierzero keys (or sections) set by overrides after the translation."""
    autos: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """DeepSpeed key whose value is "auto" -> the tierzero keys it leaves to tierzero (none: ignored)."""

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
        for ds_key, keys in list(self.autos.items()):
            kept = tuple(k for k in keys if not _under(k, key))
            if keys and not kept:
                del self.autos[ds_key]  # no longer auto: the override set every key it stood for
            else:
                self.autos[ds_key] = kept
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
        names = {tz: ds for tz, ds in self.names.items() if not any(_under(tz, o) for o in self.overridden)}
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
class Reader:
    """One DeepSpeed section: hands out its keys and warns once about each key nobody took."""

    path: str
    data: dict[str, Any]

    @classmethod
    def of(cls, parent: Mapping[str, Any], name: str, *, path: str = "") -> Reader:
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


def elements(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not float(value).is_integer():
        raise ConfigError(f"DeepSpeed {key}: expected a number of elements such as 5e8, got {show(value)}", key=key)
    return int(value)


def positive_int(value: Any, key: str) -> int:
    """Checked in the translation, not left to validation, where the translation computes with the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or not float(value).is_integer():
        raise ConfigError(f"DeepSpeed {key}: expected a positive integer such as 4, got {show(value)}", key=key)
    return int(value)
