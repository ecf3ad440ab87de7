"""A config tree: frozen dataclasses deriving from `Section`, and the functions that walk, build and dump one.

Each leaf field is declared with `setting(default, check)` followed by its attribute
docstring; each nested section with `section(cls)`. The functions here work on any such
tree (given its root class), so the sections and the root hold only their fields and rules.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, ClassVar

import yaml

from tierzero.common.slices import Tier
from tierzero.config.checks import Check, GiB, KiB, MiB, show
from tierzero.config.errors import ConfigError


def setting(default: Any, check: Check, *, shown_default: str | None = None) -> Any:
    """A leaf field with its default and check; its docstring is the string literal below it.

    `shown_default` is the default column of docs/config.md, for a field whose default
    depends on other fields (its declared default is then None, resolved in the section).
    """
    meta: dict[str, Any] = {"check": check}
    if shown_default is not None:
        meta["shown_default"] = shown_default
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
    SHORTHAND: ClassVar[dict[str, dict[str, Any]]] = {}
    """Words that stand for the whole section, e.g. `offload: auto`, and the keys each sets."""

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
        self._resolve_defaults()
        self._validate()

    def _resolve_defaults(self) -> None:
        """Fill the fields whose default depends on another field; sections that have them override this."""

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
    # A key of control characters or thousands of them is shown quoted and cut short.
    shown = key if key.isprintable() and len(key) <= 100 else show(key)
    if guess is not None:
        return ConfigError(f"unknown key {shown}; did you mean {guess}?", key=key)
    known_parent = parent if parent in keys else ""
    where = f"under {parent}" if known_parent else "at the top level"
    valid = [k for k in keys if k.rpartition(".")[0] == known_parent]
    return ConfigError(f"unknown key {shown}; valid keys {where}: {', '.join(valid)}", key=key)


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
        words = "".join(f" or {word}" for word in getattr(cls, "SHORTHAND", {}))
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys{words}, got {show(raw)}", key=prefix)
    fields = {spec.name: spec for spec in dataclasses.fields(cls)}
    for name in raw:
        if name not in fields:
            raise unknown_key(root, dotted(prefix, str(name)))
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        child = fields[name].metadata.get("section")
        if child and isinstance(value, str) and value.lower() in child.SHORTHAND:
            value = child.SHORTHAND[value.lower()]
        kwargs[name] = build(child, value, root=root, prefix=dotted(prefix, name)) if child else value
    return cls(**kwargs)
