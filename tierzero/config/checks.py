"""Field checks: how one raw config value becomes its typed value, or a one-line `ConfigError`.

Each leaf field of the config tree carries one `Check` (see `tree.setting`). The checks
here know nothing of the tree: they take a dotted key only to name it in the error.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tierzero.common.sizes import format_size, parse_size
from tierzero.common.slices import Tier
from tierzero.config.errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
"""Binary size units, for defaults written the way docs/config.md shows them."""
INT64_MAX = (1 << 63) - 1
"""The limit of an integer setting that names no other: torch and numpy take 64-bit integers."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32; a loss scale past it is inf on the device."""


class AboveLimit(ValueError):
    """Raised by a `Check.convert` for a value of the right kind above the check's `limit`."""


@dataclass(frozen=True, slots=True)
class Check:
    """How one field's raw value becomes its typed value; `convert` raises ValueError or TypeError."""

    expected: str
    """Completes "expected ..., got X" in error messages."""
    type_name: str
    """The type column of docs/config.md."""
    convert: Callable[[Any], Any]
    is_size: bool = False
    refusal: str = "{key}: expected {expected}, got {got}"
    """The error message, formatted with the dotted key, `expected` and the value as written."""
    limit: str | None = None
    """The largest value allowed, as messages show it; `convert` raises `AboveLimit` past it."""

    def apply(self, key: str, value: Any) -> Any:
        try:
            return self.convert(value)
        except AboveLimit:
            message = f"{key} is {show(value)}, above the limit of {self.limit}: set {key} to at most {self.limit}"
            raise ConfigError(message, key=key) from None
        except (ValueError, TypeError, OverflowError):
            message = self.refusal.format(key=key, expected=self.expected, got=show(value))
            raise ConfigError(message, key=key) from None


def show(value: Any) -> str:
    """A value as the user wrote it: strings quoted, None as null, booleans as true/false; cut short past 100 characters."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int) and value.bit_length() > 128:
        # Python refuses to print an integer past 4,300 digits, and one of 30 says no more.
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        return f"a {type(value).__name__} holding a huge integer"
    return text if len(text) <= 100 else f"{text[:80]}... ({len(text)} characters)"


def _as_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(value)


def _as_float(value: Any) -> float:
    # YAML 1.1 reads 1e-3 (no dot) as a string, so numeric strings are accepted.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(value)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(value)
    return number


def _require(ok: bool, value: Any) -> Any:
    if not ok:
        raise ValueError(value)
    return value


def _within(value: Any, limit: float | None) -> Any:
    if limit is not None and value > limit:
        raise AboveLimit(value)
    return value


def int_check(lo: int, hi: int | None = None, *, limit: int = INT64_MAX) -> Check:
    """Integers from `lo` to `hi` (past `hi`: the plain refusal), at most `limit` (past it: "above the limit")."""
    if hi is not None:
        expected, type_name = f"an integer from {lo} to {hi}", f"int {lo}..{hi}"
    else:
        expected = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")
        type_name = f"int >= {lo}"

    def convert(value: Any) -> int:
        n = _as_int(value)
        return _within(_require(n >= lo and (hi is None or n <= hi), n), limit)

    return Check(expected, type_name, convert, limit=f"{limit}")


def float_check(
    *, lo: float, lo_open: bool = False, hi: float | None = None, optional: bool = False, limit: float | None = None
) -> Check:
    """Numbers in [lo, hi), or (lo, hi) with lo_open; hi is always open; at most `limit`. `optional` lets null through."""
    if hi is not None:
        expected = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g})"
    else:
        expected = "a positive number" if lo_open and lo == 0 else f"a number {'>' if lo_open else '>='} {lo:g}"

    def convert(value: Any) -> float | None:
        if value is None and optional:
            return None
        x = _as_float(value)
        return _within(_require((x > lo if lo_open else x >= lo) and (hi is None or x < hi), x), limit)

    type_name = "float \\| null" if optional else "float"
    shown = None if limit is None else f"{limit:g}"
    return Check(expected + (" (or null)" if optional else ""), type_name, convert, limit=shown)


def size_check(
    *, optional: bool = False, multiple_of: int | None = None, allow_zero: bool = False, limit: int | None = None
) -> Check:
    """Sizes (see tierzero.common.sizes), at most `limit` bytes."""
    expected = "a size >= 0" if allow_zero else "a positive size"
    expected += f" that is a multiple of {multiple_of} bytes" if multiple_of else ""
    expected += " such as 4096, '512MB' or '8GiB'" + (" (or null for no limit)" if optional else "")

    def convert(value: Any) -> int | None:
        if value is None and optional:
            return None
        n = parse_size(value)
        return _within(_require((n >= 0 if allow_zero else n > 0) and n % (multiple_of or 1) == 0, n), limit)

    shown = None if limit is None else format_size(limit)
    return Check(expected, "size \\| null" if optional else "size", convert, is_size=True, limit=shown)


def power_of_two_check(lo: int, hi: int) -> Check:
    """Powers of two from `lo` to `hi`."""

    def convert(value: Any) -> int:
        n = _as_int(value)
        return _require(lo <= n <= hi and n & (n - 1) == 0, n)

    expected = f"a power of two from {lo} to {hi}"
    refusal = "{key} is {got}, not {expected}: set {key} to one, such as " + f"{max(lo, min(2048, hi))}"
    return Check(expected, f"int {lo}..{hi}, a power of 2", convert, refusal=refusal)


def choice_check(values: tuple[str, ...]) -> Check:
    def convert(value: Any) -> str:
        return _require(isinstance(value, str) and value.lower() in values, value).lower()

    return Check(f"one of {', '.join(values)}", " \\| ".join(values), convert)


def _tier(value: Any) -> Tier:
    return value if isinstance(value, Tier) else Tier(value.lower() if isinstance(value, str) else value)


def _tier_or_auto(value: Any) -> Tier | str:
    if isinstance(value, str) and value.lower() == AUTO:
        return AUTO
    return _tier(value)


def _loss_scale(value: Any) -> str | float:
    if isinstance(value, str) and value.lower() == "dynamic":
        return "dynamic"
    return _within(_require(_as_float(value) > 0, _as_float(value)), FLOAT32_MAX)


def _betas(value: Any) -> tuple[float, float]:
    pair = tuple(_as_float(b) for b in _require(isinstance(value, (list, tuple)) and len(value) == 2, value))
    return _require(all(0 <= b < 1 for b in pair), pair)


def _names(value: Any) -> list[str]:
    ok = isinstance(value, (list, tuple)) and all(isinstance(n, str) and n.strip() for n in value)
    return list(_require(ok, value))


def _directory(value: Any) -> str | None:
    if value is None:
        return None
    return os.path.abspath(os.path.expanduser(_require(isinstance(value, str) and value.strip(), value)))


BOOL = Check("true or false", "bool", lambda v: _require(isinstance(v, bool), v))
TIER = Check("one of device, cpu, nvme", "device \\| cpu \\| nvme", _tier)
AUTO = "auto"
"""An offload key's value asking the planner (tierzero/placement/planner.py) to choose the tier."""
TIER_OR_AUTO = Check("one of device, cpu, nvme, auto", "device \\| cpu \\| nvme \\| auto", _tier_or_auto)
LOSS_SCALE = Check("'dynamic' or a positive number", "'dynamic' \\| float", _loss_scale, limit=f"{FLOAT32_MAX:g}")
BETAS = Check("two numbers in [0, 1) such as [0.9, 0.999]", "[float, float]", _betas)
NAMES = Check("a list of module class names such as [GPT2Block]", "list[str]", _names)
DIRECTORY = Check("a directory path (or null)", "path \\| null", _directory)


def _optional_name(value: Any) -> str | None:
    if value is None:
        return None
    return _require(isinstance(value, str) and value.strip(), value).strip()


def _keywords(value: Any) -> dict[str, Any]:
    ok = isinstance(value, Mapping) and all(isinstance(k, str) and k.isidentifier() for k in value)
    return _plain(_require(ok, value))


def _plain(value: Any) -> Any:
    """`value` as JSON holds it (tuples become lists), so it dumps and reads back equal; else ValueError.

    The depth is bounded where the config is read (tierzero.config.reading).
    """
    if isinstance(value, Mapping):
        return {_require(isinstance(k, str), k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return _require(math.isfinite(value), value)
    return _require(value is None or isinstance(value, (str, int, bool)), value)


def _path_or_glob(value: Any) -> str | None:
    if value is None:
        return None
    return os.path.expanduser(_require(isinstance(value, str) and value.strip(), value))


OPTIONAL_NAME = Check("a class name such as GPT2LMHeadModel (or null)", "str \\| null", _optional_name)
KEYWORDS = Check(
    "a mapping of keyword arguments such as {n_layer: 2}, holding strings, finite numbers, booleans, nulls, "
    "lists and mappings",
    "mapping",
    _keywords,
)
PATH_OR_GLOB = Check("a file, directory or glob such as 'corpus/*.txt' (or null)", "path \\| glob \\| null", _path_or_glob)


def _ratio(value: Any) -> float:
    return _require(0.0 <= _as_float(value) <= 1.0, _as_float(value))


RATIO = Check("a number from 0 to 1 such as 0.1", "float 0..1", _ratio)
"""A fraction of a rate, both ends included (e.g. the learning-rate multipliers of `scheduler`)."""
