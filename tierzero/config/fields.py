"""The machinery under tierzero.config: field checks, and a config tree's walk, build and docs.

A config is a tree of frozen dataclasses deriving from `Section`. Each leaf field is
declared with `setting(default, check)` followed by its attribute docstring; each
nested section with `section(cls)`. The functions here work on any such tree (given
its root class), so tierzero.config holds only the schema and its cross-field rules.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import enum
import inspect
import json
import math
import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from tierzero.sizes import parse_size
from tierzero.slices import Tier

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class TierZeroConfigWarning(UserWarning):
    """A config key was ignored, e.g. a DeepSpeed key with no tierzero equivalent."""


class ConfigError(ValueError):
    """A config the engine cannot run. The message is one line: key, value, what is allowed, the fix."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ---------------------------------------------------------------- field checks


@dataclass(frozen=True, slots=True)
class Check:
    """How one field's raw value becomes its typed value; `convert` raises ValueError or TypeError."""

    expected: str
    """Completes "expected ..., got X" in error messages."""
    type_name: str
    """The type column of docs/config.md."""
    convert: Callable[[Any], Any]
    is_size: bool = False

    def apply(self, key: str, value: Any) -> Any:
        try:
            return self.convert(value)
        except (ValueError, TypeError):
            raise ConfigError(f"{key}: expected {self.expected}, got {show(value)}", key=key) from None


def show(value: Any) -> str:
    """A value as the user wrote it: strings quoted, None as null, booleans as true/false."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return repr(value.value if isinstance(value, enum.Enum) else value)


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ValueError(value)
    return int(value)


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


def int_check(lo: int, hi: int | None = None) -> Check:
    if hi is not None:
        expected, type_name = f"an integer from {lo} to {hi}", f"int {lo}..{hi}"
    else:
        expected = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")
        type_name = f"int >= {lo}"

    def convert(value: Any) -> int:
        n = _as_int(value)
        return _require(n >= lo and (hi is None or n <= hi), n)

    return Check(expected, type_name, convert)


def float_check(*, lo: float, lo_open: bool = False, hi: float | None = None) -> Check:
    """Numbers in [lo, hi), or (lo, hi) with lo_open; hi is always open."""
    if hi is not None:
        expected = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g})"
    else:
        expected = "a positive number" if lo_open and lo == 0 else f"a number {'>' if lo_open else '>='} {lo:g}"

    def convert(value: Any) -> float:
        x = _as_float(value)
        return _require((x > lo if lo_open else x >= lo) and (hi is None or x < hi), x)

    return Check(expected, "float", convert)


def size_check(*, optional: bool = False, multiple_of: int | None = None, allow_zero: bool = False) -> Check:
    expected = "a size >= 0" if allow_zero else "a positive size"
    expected += f" that is a multiple of {multiple_of} bytes" if multiple_of else ""
    expected += " such as 4096, '512MB' or '8GiB'" + (" (or null for no limit)" if optional else "")

    def convert(value: Any) -> int | None:
        if value is None and optional:
            return None
        n = parse_size(value)
        return _require((n >= 0 if allow_zero else n > 0) and n % (multiple_of or 1) == 0, n)

    return Check(expected, "size | null" if optional else "size", convert, is_size=True)


def choice_check(values: tuple[str, ...]) -> Check:
    def convert(value: Any) -> str:
        return _require(isinstance(value, str) and value.lower() in values, value).lower()

    return Check(f"one of {', '.join(values)}", " \\| ".join(values), convert)


def _tier(value: Any) -> Tier:
    return value if isinstance(value, Tier) else Tier(value.lower() if isinstance(value, str) else value)


def _loss_scale(value: Any) -> str | float:
    if isinstance(value, str) and value.lower() == "dynamic":
        return "dynamic"
    return _require(_as_float(value) > 0, _as_float(value))


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
LOSS_SCALE = Check("'dynamic' or a positive number", "'dynamic' \\| float", _loss_scale)
BETAS = Check("two numbers in [0, 1) such as [0.9, 0.999]", "[float, float]", _betas)
NAMES = Check("a list of module class names such as [GPT2Block]", "list[str]", _names)
DIRECTORY = Check("a directory path (or null)", "path \\| null", _directory)


def _optional_name(value: Any) -> str | None:
    if value is None:
        return None
    return _require(isinstance(value, str) and value.strip(), value).strip()


def _keywords(value: Any) -> dict[str, Any]:
    ok = isinstance(value, Mapping) and all(isinstance(k, str) and k.isidentifier() for k in value)
    return dict(_require(ok, value))


def _path_or_glob(value: Any) -> str | None:
    if value is None:
        return None
    return os.path.expanduser(_require(isinstance(value, str) and value.strip(), value))


OPTIONAL_NAME = Check("a class name such as GPT2LMHeadModel (or null)", "str \\| null", _optional_name)
KEYWORDS = Check("a mapping of keyword arguments such as {n_layer: 2}", "mapping", _keywords)
PATH_OR_GLOB = Check("a file, directory or glob such as 'corpus/*.txt' (or null)", "path \\| glob \\| null", _path_or_glob)


def setting(default: Any, check: Check) -> Any:
    """A leaf field with its default and check; its docstring is the string literal below it."""
    meta = {"check": check}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type) -> Any:
    """A nested section, defaulting to all of its defaults."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


class Section:
    """Base of the config dataclasses: per-field checks, to_dict, YAML dump.

    Subclasses are `@dataclass(kw_only=True, slots=True, frozen=True)` and name their
    dotted place in the tree in SECTION, which error messages use.
    """

    __slots__ = ()
    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            child, check = spec.metadata.get("section"), spec.metadata.get("check")
            if child is not None and not isinstance(getattr(self, spec.name), child):
                raise TypeError(
                    f"{type(self).__name__}.{spec.name} takes a {child.__name__}, got "
                    f"{type(getattr(self, spec.name)).__name__}; build configs from dicts with load_config"
                )
            if check is not None:
                key = dotted(self.SECTION, spec.name)
                object.__setattr__(self, spec.name, check.apply(key, getattr(self, spec.name)))
        self._validate()

    def _validate(self) -> None:
        """Checks across this section's fields; sections that need them override this."""

    def to_dict(self, *, human_sizes: bool = False) -> dict[str, Any]:
        """Plain values (str, int, float, bool, list, None) that `load_config` reads back as equal."""
        out: dict[str, Any] = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if "section" in spec.metadata:
                out[spec.name] = value.to_dict(human_sizes=human_sizes)
            else:
                out[spec.name] = plain(value, human=human_sizes and spec.metadata["check"].is_size)
        return out

    def __str__(self) -> str:
        return yaml.safe_dump(self.to_dict(human_sizes=True), sort_keys=False)


def dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def plain(value: Any, *, human: bool) -> Any:
    """A typed value as YAML/JSON writes it; with `human`, sizes as "8MiB" when exact."""
    if isinstance(value, Tier):
        return value.value
    if isinstance(value, (tuple, list)):
        return list(value)
    if human and isinstance(value, int) and value > 0:
        # Whole GiB or MiB, or KiB below 1 MiB; anything else reads better as plain bytes.
        for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
            if value % unit == 0 and (unit != KiB or value < MiB):
                return f"{value // unit}{name}"
    return value


# ---------------------------------------------------------------- walking a tree


def schema(root: type, prefix: str = "") -> dict[str, type | None]:
    """Every dotted key under `root` -> its section class, or None for a leaf setting."""
    keys: dict[str, type | None] = {}
    for spec in dataclasses.fields(root):
        key = dotted(prefix, spec.name)
        child = spec.metadata.get("section")
        keys[key] = child
        if child is not None:
            keys.update(schema(child, key))
    return keys


def unknown_key(root: type, key: str) -> ConfigError:
    """The error for `key`, naming the nearest valid key (difflib) or listing the valid ones."""
    keys = schema(root)
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(leaf, siblings, n=1)
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]  # "stage" -> "zero.stage"
    guess = (
        dotted(parent, near[0]) if near
        else same_leaf[0] if same_leaf
        else next(iter(difflib.get_close_matches(key, list(keys), n=1)), None)
    )
    if guess is not None:
        return ConfigError(f"unknown key {key}; did you mean {guess}?", key=key)
    known_parent = parent if parent in keys else ""
    where = f"under {parent}" if known_parent else "at the top level"
    valid = [k for k in keys if k.rpartition(".")[0] == known_parent]
    return ConfigError(f"unknown key {key}; valid keys {where}: {', '.join(valid)}", key=key)


def set_dotted(root: type, raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` ("tiers.nvme.path") in the raw nested dict, creating sections as needed."""
    if not isinstance(key, str) or key not in schema(root):
        raise unknown_key(root, str(key))
    *parents, leaf = key.split(".")
    node = raw
    for name in parents:
        child = node.get(name)
        if not isinstance(child, dict):
            child = node[name] = {}
        node = child
    node[leaf] = value


def build(cls: type, raw: Any, *, root: type, prefix: str = "") -> Any:
    """Construct `cls` from a raw nested dict; every section's `__post_init__` checks its part."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {show(raw)}", key=prefix)
    fields = {spec.name: spec for spec in dataclasses.fields(cls)}
    for name in raw:
        if name not in fields:
            raise unknown_key(root, dotted(prefix, str(name)))
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        child = fields[name].metadata.get("section")
        kwargs[name] = build(child, value, root=root, prefix=dotted(prefix, name)) if child else value
    return cls(**kwargs)


# ---------------------------------------------------------------- reading files


def read_mapping_file(path: Path) -> dict[str, Any]:
    """The top-level mapping of a .yaml/.yml/.json file; an empty file is an empty mapping."""
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"config file {path}: expected a .yaml, .yml or .json file, got suffix {suffix or 'none'!r}")
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {problem}: pass the path of a config file")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "cannot parse"
        raise ConfigError(f"config file {path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------- documentation


def fields_markdown(cls: type, *, prefix: str = "") -> list[str]:
    """One markdown table per section that has leaf settings: key, type, default, docstring."""
    leaves = [spec for spec in dataclasses.fields(cls) if "section" not in spec.metadata]
    parts: list[str] = []
    if leaves:
        docs = field_docs(cls)
        title = f"`{prefix}`" if prefix else "Top level"
        doc = " ".join((cls.__doc__ or "").split())
        rows = [f"## {title}", "", doc, "", "| key | type | default | description |", "|---|---|---|---|"]
        for spec in leaves:
            check = spec.metadata["check"]
            default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
            shown = plain(default, human=check.is_size)
            text = shown if isinstance(shown, str) else json.dumps(shown)
            rows.append(f"| `{dotted(prefix, spec.name)}` | {check.type_name} | `{text}` | {docs[spec.name]} |")
        parts.append("\n".join(rows) + "\n")
    for spec in dataclasses.fields(cls):
        child = spec.metadata.get("section")
        if child is not None:
            parts.extend(fields_markdown(child, prefix=dotted(prefix, spec.name)))
    return parts


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the attribute docstring written under it in the class body, on one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    missing = [spec.name for spec in dataclasses.fields(cls) if "check" in spec.metadata and spec.name not in docs]
    assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    return docs
