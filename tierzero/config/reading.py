"""Config text read within bounds: YAML and JSON in, plain data or one `ConfigError` naming the source out.

A config is a few hundred values a few levels deep. What goes far beyond that is refused
before it can cost memory or time: a file over MAX_FILE_BYTES; nesting deeper than
MAX_DEPTH (the parsers recurse, so 5,000 levels would end in a RecursionError); more than
MAX_VALUES values once YAML aliases are expanded (a kilobyte of aliases can stand for
billions of values, which later walks of the tree would expand); a YAML alias that
contains itself; an integer of more than MAX_INT_BITS bits; and a key written twice in one
mapping, which both parsers accept silently, keeping the last.

`check_bounds` applies the same limits to data handed in as Python objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from tierzero.common.safe_files import RefusedFile, check_regular, read_regular
from tierzero.common.sizes import format_size
from tierzero.config.errors import ConfigError

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 64
"""Levels of nesting, the top-level mapping being level 1 and each value one level below its container."""
MAX_VALUES = 100_000
"""Values (scalars, lists and mappings, keys included) once YAML aliases are expanded."""
MAX_INT_BITS = 1024
_MERGE_TAG = "tag:yaml.org,2002:merge"


def read_mapping_file(path: Path) -> dict[str, Any]:
    """The top-level mapping of a .yaml/.yml/.json file; an empty file is an empty mapping."""
    suffix, source = path.suffix.lower(), f"config file {path}"
    try:  # what it is before its name: /dev/zero or a FIFO is no config whatever its suffix, and is never opened
        check_regular(path)
    except FileNotFoundError:
        pass  # worded below, once the suffix is known to be a config's
    except RefusedFile as exc:
        kind = "is a directory" if path.is_dir() else f"is {exc.reason}"
        raise ConfigError(f"{source} {kind}: pass the path of a config file") from None
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read ({exc.strerror}): pass the path of a readable config file") from None
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"config file {path}: expected a .yaml, .yml or .json file, got suffix {suffix or 'none'!r}")
    try:
        raw = read_regular(path, limit=MAX_FILE_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{source} does not exist: pass the path of a config file") from None
    except RefusedFile as exc:  # larger than the cap, or swapped since the check
        if "larger than" not in exc.reason:
            raise ConfigError(f"{source} is {exc.reason}: pass the path of a config file") from None
        raise ConfigError(
            f"{source} is larger than {format_size(MAX_FILE_BYTES)}, far more than a config needs: pass the config file itself"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read ({exc.strerror}): pass the path of a readable config file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{source}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}): save it as UTF-8") from None
    data = parse_json(text, source=source) if suffix == ".json" else parse_yaml(text, source=source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def parse_yaml(text: str, *, source: str) -> Any:
    """`text` as YAML, within the bounds; every failure is a `ConfigError` naming `source`."""
    try:
        return load_yaml(text, source=source)
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else 0
        raise ConfigError(f"{source}: invalid YAML: character #x{code:04x} at line {line} is not allowed: remove it") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "cannot parse"
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None


def load_yaml(text: str, *, source: str) -> Any:
    """`text` as YAML within the bounds: `ConfigError` past them, `yaml.YAMLError` for bad syntax."""
    loader = _BoundedLoader(text, source=source)
    try:
        data = loader.get_single_data()
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # A scalar PyYAML matched but Python refused, e.g. a date 2024-13-45 or a 5,000-digit integer.
        reason = str(exc).split(";")[0]
        raise ConfigError(f"{source}: cannot read the value at line {loader.constructing_line()} ({reason}): fix or quote it") from None
    finally:
        loader.dispose()
    check_bounds(data, source=source)
    return data


def parse_json(text: str, *, source: str) -> Any:
    """`text` as JSON, within the bounds; every failure is a `ConfigError` naming `source`."""
    line = _json_depth_exceeded(text)
    if line is not None:
        raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep at line {line}: flatten it")
    repeated: list[tuple[dict[str, Any], str]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        mapping: dict[str, Any] = {}
        for key, value in items:
            if key in mapping:
                repeated.append((mapping, key))
            mapping[key] = value
        return mapping

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:  # an integer past Python's 4,300 digits
        raise ConfigError(f"{source}: cannot read a number ({str(exc).split(';')[0]}): fix it") from None
    if repeated:
        mapping, key = repeated[0]
        where = _join(_path_of(data, mapping), key)
        raise ConfigError(f"{source}: duplicate key {where}: JSON keeps only the last one; remove the other")
    check_bounds(data, source=source)
    return data


def check_bounds(data: Any, *, source: str) -> None:
    """Refuse data nested past MAX_DEPTH, holding more than MAX_VALUES values, containing
    itself, or holding an integer past MAX_INT_BITS; `source` names it in the error."""
    count = 0

    def visit(value: Any, level: int, path: str, open_ids: set[int]) -> None:
        nonlocal count
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(f"{source}: more than {MAX_VALUES} values: a config needs a few hundred; trim it")
        if level > MAX_DEPTH:
            raise ConfigError(f"{source}: {_short(path)} is nested more than {MAX_DEPTH} levels deep: flatten it")
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise ConfigError(
                f"{source}: {_short(path) or 'the value'} is an integer of {value.bit_length()} bits, "
                "larger than any setting takes: fix it"
            )
        if not isinstance(value, (Mapping, list, tuple)):
            return
        if id(value) in open_ids:
            raise ConfigError(f"{source}: {_short(path) or 'the config'} contains itself: break the loop")
        open_ids.add(id(value))
        for child, child_path in _children(value, path):
            visit(child, level + 1, child_path, open_ids)
        open_ids.discard(id(value))

    visit(data, 1, "", set())


def _children(value: Mapping[Any, Any] | list[Any] | tuple[Any, ...], path: str) -> Iterator[tuple[Any, str]]:
    if isinstance(value, Mapping):
        for key, child in value.items():
            yield key, path
            yield child, _join(path, key)
    else:
        for index, child in enumerate(value):
            yield child, f"{path}[{index}]"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _short(path: str) -> str:
    """A dotted path cut to its first 80 characters: a too-deep path is thousands long."""
    return path if len(path) <= 80 else path[:80] + "..."


def _path_of(data: Any, target: object, path: str = "") -> str:
    """The path of the container `target` (by identity) inside `data`; "" when it is `data`."""
    if data is target:
        return path
    if isinstance(data, (dict, list)):
        for child, child_path in _children(data, path):
            found = _path_of(child, target, child_path)
            if found:
                return found
    return ""


def _json_depth_exceeded(text: str) -> int | None:
    """The line where brackets open past MAX_DEPTH levels (strings skipped), or None.

    Checked on the text because json.loads recurses once per level.
    """
    depth, in_string, escaped = 0, False, False
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return text.count("\n", 0, index) + 1
        elif char in "]}":
            depth -= 1
    return None


class _BoundedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses deep nesting while composing, and before constructing anything
    measures the node graph as aliases would expand it; duplicate keys are refused while constructing.

    [Note: alias bombs] PyYAML composes an alias as a second reference to the anchored node,
    so the graph stays small and each node is measured once here, but the values built from
    it are shared and every later walk (validation, copies, dumps, the model's config class)
    expands them. Hence the measure counts values as expanded.
    """

    def __init__(self, text: str, *, source: str) -> None:
        super().__init__(text)
        self.source = source
        self._depth = 0
        self._composed = 0
        self._paths: dict[int, str] = {}
        """id of each mapping node -> its dotted path (the first one, if aliased), for duplicate keys."""
        self._last: Node | None = None

    def constructing_line(self) -> int:
        """The line of the node being constructed last."""
        return self._last.start_mark.line + 1 if self._last is not None else 1

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        self._composed += 1
        try:
            line = self.peek_event().start_mark.line + 1
            if self._depth > MAX_DEPTH:
                raise ConfigError(f"{self.source}: nested more than {MAX_DEPTH} levels deep at line {line}: flatten it")
            if self._composed > MAX_VALUES:  # stop parsing early; aliases are counted by _measure
                raise ConfigError(f"{self.source}: more than {MAX_VALUES} values (at line {line}): a config needs a few hundred; trim it")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Node) -> Any:
        self._measure(node)
        return super().construct_document(node)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        self._last = node
        return super().construct_object(node, deep=deep)

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            self._refuse_duplicates(node)
        return super().construct_mapping(node, deep=deep)

    def _refuse_duplicates(self, node: MappingNode) -> None:
        # Merged keys (<<: *base) may be overridden, as YAML says; keys written in the mapping itself may not.
        first: dict[Any, tuple[int, Node]] = {}
        for index, (key_node, _) in enumerate(node.value):
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier_index, earlier = first.setdefault(key, (index, key_node))
            except TypeError:
                continue  # an unhashable key: the constructor refuses it in its own words
            if earlier_index != index:
                where = _join(self._paths.get(id(node), ""), key)
                raise ConfigError(
                    f"{self.source}: duplicate key {_short(where)} at line {key_node.start_mark.line + 1} "
                    f"(first at line {earlier.start_mark.line + 1}): YAML keeps only the last one; remove the other"
                )

    def _measure(self, root: Node) -> None:
        """Refuse a graph that expands past MAX_VALUES or MAX_DEPTH, or contains itself (see [Note: alias bombs])."""
        sizes: dict[int, int] = {}
        heights: dict[int, int] = {}
        open_ids: set[int] = set()

        def too_deep(node: Node) -> ConfigError:
            line = node.start_mark.line + 1
            return ConfigError(
                f"{self.source}: nested more than {MAX_DEPTH} levels deep at line {line} once YAML aliases "
                "are expanded: flatten it"
            )

        def visit(node: Node, level: int, path: str) -> int:
            key = id(node)
            if key in open_ids:
                raise ConfigError(
                    f"{self.source}: the node at line {node.start_mark.line + 1} contains an alias of itself, "
                    "which never ends: remove the alias"
                )
            if key in sizes:
                if level + heights[key] - 1 > MAX_DEPTH:
                    raise too_deep(node)
                return sizes[key]
            if level > MAX_DEPTH:
                raise too_deep(node)
            if isinstance(node, MappingNode):
                self._paths.setdefault(key, path)
            open_ids.add(key)
            size, height = 1, 1
            for child, child_path in _node_children(node, path):
                size += visit(child, level + 1, child_path)
                height = max(height, heights[id(child)] + 1)
            open_ids.discard(key)
            sizes[key], heights[key] = size, height
            if size > MAX_VALUES:
                raise ConfigError(
                    f"{self.source}: more than {MAX_VALUES} values once YAML aliases are expanded (at line "
                    f"{node.start_mark.line + 1}): a config needs a few hundred; write out what the aliases repeat"
                )
            return size

        visit(root, 1, "")


def _node_children(node: Node, path: str) -> Iterator[tuple[Node, str]]:
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            yield key_node, path
            name = key_node.value if isinstance(key_node, ScalarNode) else "?"
            yield value_node, path if key_node.tag == _MERGE_TAG else _join(path, name)
    elif isinstance(node, SequenceNode):
        for index, child in enumerate(node.value):
            yield child, f"{path}[{index}]"
