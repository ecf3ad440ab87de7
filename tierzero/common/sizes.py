"""Byte sizes as people write them ("8GiB", "512MB", 4096) and as they read them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Return a byte count for ``value``: an int, or a string such as "8GiB" or "512MB".

    Raises ``ValueError`` naming the accepted forms when ``value`` is neither.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 4096, '512MB' or '8GiB', got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            number = float(match.group(1)) * _UNITS[match.group(2).lower()]
            if number.is_integer():
                return int(number)
    raise ValueError(f"expected a size such as 4096, '512MB' or '8GiB', got {value!r}")


def format_size(nbytes: int | float) -> str:
    """Binary units with one decimal: 51757998080 -> '48.2 GiB'."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
