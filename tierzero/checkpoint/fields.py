"""JSON read strictly: every value a checkpoint file holds is checked for type and range before use.

A manifest is trusted only as far as its own checksum goes, and anyone who can write
the directory can recompute that. So no number in it reaches `torch.empty`, a slice or
a division unchecked: an integer field must be a JSON integer (not a float, a string or
a bool) within its bounds, and each violation is one CheckpointError naming the file
and the field (`units[2].slots[0].offset is -4, expected an integer >= 0`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tierzero.checkpoint.format import CheckpointError

#: Characters of a bad value shown in an error: a planted megabyte string stays one short line.
_SHOWN = 60


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


class Fields:
    """One JSON object of `path`, at `where` inside it (`units[2].`), read field by field."""

    def __init__(self, raw: Any, *, path: Path, where: str = "") -> None:
        self.path, self.where = path, where
        if not isinstance(raw, dict):
            raise self.error(f"{where.rstrip('.') or 'the file'} is {shown(raw)}, expected a JSON object")
        self.raw: dict[str, Any] = raw

    def error(self, text: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {text}: it is corrupt or was edited; load an earlier checkpoint")

    def bad(self, key: str, value: Any, expected: str) -> CheckpointError:
        return self.error(f"{self.where}{key} is {shown(value)}, expected {expected}")

    def get(self, key: str) -> Any:
        if key not in self.raw:
            raise self.error(f"{self.where}{key} is missing")
        return self.raw[key]

    def integer(self, key: str, *, lo: int = 0, hi: int | None = None) -> int:
        return check_int(self.get(key), lo=lo, hi=hi, fail=lambda v, e: self.bad(key, v, e))

    def number(self, key: str, *, lo: float = -math.inf) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < lo:
            raise self.bad(key, value, "a finite number" + (f" >= {lo}" if lo > -math.inf else ""))
        return float(value)

    def text(self, key: str, *, choices: set[str] | None = None) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value or (choices is not None and value not in choices):
            raise self.bad(key, value, f"one of {sorted(choices)}" if choices else "a non-empty string")
        return value

    def run_id(self, key: str) -> str:
        value = self.get(key)
        if not (isinstance(value, str) and 0 < len(value) <= 64 and value.isascii() and value.isalnum()):
            raise self.bad(key, value, "up to 64 ASCII letters and digits")
        return value

    def texts(self, key: str) -> tuple[str, ...]:
        value = self.array(key)
        if not value or not all(isinstance(v, str) and v for v in value):
            raise self.bad(key, value, "a non-empty list of non-empty strings")
        return tuple(value)

    def integers(self, key: str) -> tuple[int, ...]:
        value = self.array(key)
        return tuple(check_int(v, lo=0, hi=None, fail=lambda v, e: self.bad(key, value, f"a list of {e}")) for v in value)

    def array(self, key: str) -> list[Any]:
        value = self.get(key)
        if not isinstance(value, list):
            raise self.bad(key, value, "a list")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self.get(key)
        if not isinstance(value, dict):
            raise self.bad(key, value, "an object")
        return value

    def obj(self, key: str) -> Fields:
        return Fields(self.mapping(key), path=self.path, where=f"{self.where}{key}.")

    def objs(self, key: str) -> list[Fields]:
        return [Fields(v, path=self.path, where=f"{self.where}{key}[{i}].") for i, v in enumerate(self.array(key))]


def check_int(value: Any, *, lo: int, hi: int | None, fail: Any) -> int:
    """`value` when it is a JSON integer in [lo, hi]; else `fail(value, expected)` is raised."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise fail(value, f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))
    return value
