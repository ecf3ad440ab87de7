"""The house plan: a package per layer, imports one way, commands only under cli/, small files.

`LAYERS` is where the layers are written down, bottom to top; docs/architecture.md's map of the
house is generated from it and from each module's docstring (`python tests/unit/test_layout.py`
writes it), and `test_the_architecture_map_is_generated` fails when the two part.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tierzero"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

LAYERS = (
    "common", "native", "config", "data", "comm", "units", "optim", "offload", "swapper", "store", "prefetch", "stages",
    "pretrained", "models", "checkpoint", "engine", "inference", "align", "estimate", "placement", "api",
    "integrations", "lora", "cli",
)  # fmt: skip
"""Each package, and each module at the top of `tierzero/`, bottom to top: one imports only from layers below it."""

TOP_LEVEL = {
    "api": "the public API: tierzero.initialize",
    "prefetch": "the design card's prefetch policy: what to bring up the tiers, and when",
    "swapper": "the design card's mover of bytes between tiers",
    "lora": "tierzero.lora, the LoRA helpers' earlier import path, kept for one release",
}
"""The only modules beside `__init__.py`, each with the line that defends it there."""

MAX_TOP_LEVEL = 6
MAX_LINES = 450
MAX_TYPE_IGNORES = 3
PROBE_FREE = ("store", "swapper", "stages")
"""Layers that ask a tier what it can do through its `TierTraits`, never by probing it for a method."""


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = ast.parse(path.read_text(), filename=str(path))
    return out


def _target(module: str, name: str | None, known: dict[str, ast.Module]) -> str | None:
    """The project module an import statement reaches (`from pkg import submodule` reaches the submodule)."""
    if name is not None and f"{module}.{name}" in known:
        return f"{module}.{name}"
    return module if module in known else None


def _edges(known: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Every import of a project module, wherever it stands (top level, function, TYPE_CHECKING block)."""
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, tree in known.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    target = _target(node.module, alias.name, known)
                    if target is not None and target != name:
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known and alias.name != name:
                        edges[name].add(alias.name)
    return edges


def _layer(module: str) -> str | None:
    """The layer of a module: its package under tierzero/, or its own name at the top; None for tierzero itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _layer_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for source, targets in edges.items():
        if (layer := _layer(source)) is None:
            continue
        out.setdefault(layer, set()).update(t for target in targets if (t := _layer(target)) not in (None, layer))
    return out


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def _outside(layer: str) -> dict[str, ast.Module]:
    return {name: tree for name, tree in _modules().items() if _layer(name) != layer}


def test_no_import_loops() -> None:
    cycle = _cycle(_edges(_modules()))
    assert cycle is None, "import loop: " + " -> ".join(cycle or [])


def test_no_loops_between_folders() -> None:
    cycle = _cycle(_layer_edges(_edges(_modules())))
    assert cycle is None, "folder loop: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_loop() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_every_folder_and_top_module_has_a_layer() -> None:
    present = {_layer(name) for name in _modules()} - {None}
    assert present == set(LAYERS), f"not in LAYERS: {sorted(present - set(LAYERS))}; gone: {sorted(set(LAYERS) - present)}"


def test_packages_import_one_way() -> None:
    """A module imports only from its own layer and the layers below it."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [
        f"{source} imports {target} ({_layer(source)} sits below {_layer(target)})"
        for source, targets in sorted(_edges(_modules()).items())
        for target in sorted(targets)
        if _layer(source) is not None and _layer(target) is not None and rank[_layer(target)] > rank[_layer(source)]
    ]
    assert not upward, "\n".join(upward)


def test_the_top_level_is_thin() -> None:
    top = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == set(TOP_LEVEL), f"modules at the top of tierzero/ beyond TOP_LEVEL: {sorted(top - set(TOP_LEVEL))}"
    assert len(top) <= MAX_TOP_LEVEL


def _calls(tree: ast.Module, names: set[str]) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
    ]


def test_commands_live_under_cli_only() -> None:
    """argparse is imported nowhere else: a library module builds no command."""
    found = [
        f"{name}: line {node.lineno}"
        for name, tree in _outside("cli").items()
        for node in ast.walk(tree)
        if (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "argparse")
    ]
    assert not found, "argparse outside tierzero/cli/:\n" + "\n".join(found)


def test_library_modules_never_print() -> None:
    """Output is the commands' business: the library logs, returns or raises."""
    found = [f"{name}: print at line {line}" for name, tree in _outside("cli").items() for line in _calls(tree, {"print"})]
    found += [
        f"{name}: sys.{node.attr} at line {node.lineno}"
        for name, tree in _outside("cli").items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr")
        and isinstance(node.value, ast.Name) and node.value.id == "sys"
    ]  # fmt: skip
    assert not found, "\n".join(found)


def test_tiers_are_asked_not_probed() -> None:
    """The store, the swapper and the stages read a tier's `TierTraits`; the stages never branch on NVMe."""
    found = []
    for name, tree in _modules().items():
        if _layer(name) not in PROBE_FREE:
            continue
        found += [f"{name}: getattr/hasattr at line {line}" for line in _calls(tree, {"getattr", "hasattr"})]
        if _layer(name) == "stages":
            found += [
                f"{name}: Tier.{node.attr} at line {node.lineno}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr == "NVME"
                and isinstance(node.value, ast.Name) and node.value.id == "Tier"
            ]  # fmt: skip
    assert not found, "\n".join(found)


def test_type_ignores_are_few_and_explained() -> None:
    ignores = [
        (f"{path.relative_to(ROOT)}:{n}", line)
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "type: ignore" in line
    ]
    assert len(ignores) <= MAX_TYPE_IGNORES, [where for where, _ in ignores]
    unexplained = [where for where, line in ignores if not re.search(r"type: ignore\[[\w-]+\]\s+#\s*\S", line)]
    assert not unexplained, f"type: ignore without a reason after it: {unexplained}"


def test_no_hidden_imports() -> None:
    """Project imports stand at the top of the module: none inside a function or under TYPE_CHECKING.

    Heavy optional dependencies (transformers, matplotlib) may still be imported where they are used.
    """
    hidden = []
    for name, tree in _modules().items():
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                hidden.append(f"{name}: TYPE_CHECKING block at line {node.lineno}")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top and _of_project(node):
                hidden.append(f"{name}: import at line {node.lineno} inside a function or block")
    assert not hidden, "\n".join(hidden)


def _of_project(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "tierzero"
    return any(alias.name.split(".")[0] == "tierzero" for alias in node.names)


def test_shared_words_import_nothing_of_the_project() -> None:
    edges = _edges(_modules())
    outside = {name: sorted(t for t in targets if _layer(t) != "common") for name, targets in edges.items() if _layer(name) == "common"}
    assert not any(outside.values()), outside


def test_files_stay_small() -> None:
    """A file holds one role; past about 450 lines it holds more than one and is due for a split by role."""
    long = {
        str(path.relative_to(ROOT)): n for path in PACKAGE.rglob("*.py") if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


# ---- the map in docs/architecture.md ------------------------------------------------------

BEGIN = "<!-- house map: generated by `python tests/unit/test_layout.py` from its LAYERS and the docstrings -->"
END = "<!-- end of house map -->"


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _entries(folder: Path, depth: int) -> list[str]:
    lines = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            lines.append(f"{'  ' * depth}- `{path.name}/`: {_summary(path / '__init__.py')}")
            lines += _entries(path, depth + 1)
        elif path.suffix == ".py" and path.stem not in ("__init__", "__main__"):
            lines.append(f"{'  ' * depth}- `{path.name}`: {_summary(path)}")
    return lines


def house_map() -> str:
    """The layers top to bottom, each with what it imports and its files' first docstring paragraphs."""
    imports = _layer_edges(_edges(_modules()))
    out = [BEGIN, ""]
    for layer in reversed(LAYERS):
        below = ", ".join(sorted(imports.get(layer, ()), key=LAYERS.index, reverse=True)) or "nothing of the project"
        folder = PACKAGE / layer
        if folder.is_dir():
            out += [f"### `{layer}/`", "", _summary(folder / "__init__.py"), "", f"Imports: {below}.", ""]
            out += _entries(folder, 0) + [""]
        else:
            out += [f"### `{layer}.py`", "", f"{_summary(PACKAGE / f'{layer}.py')} ({TOP_LEVEL[layer]})", "", f"Imports: {below}.", ""]
    return "\n".join(out + [END])


def _documented_map() -> str:
    text = ARCHITECTURE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def test_the_architecture_map_is_generated() -> None:
    assert _documented_map() == house_map(), "docs/architecture.md's map is stale: run `python tests/unit/test_layout.py`"


def test_the_architecture_names_only_files_that_exist() -> None:
    """Every tierzero/... path the page names is there (the prose outside the map is hand-kept)."""
    named = set(re.findall(r"\btierzero/[\w/]+\.py\b", ARCHITECTURE.read_text()))
    gone = sorted(path for path in named if not (ROOT / path).exists())
    assert not gone, f"docs/architecture.md names files that are gone: {gone}"


if __name__ == "__main__":
    text = ARCHITECTURE.read_text()
    ARCHITECTURE.write_text(text.replace(_documented_map(), house_map()))
    sys.stdout.write(f"wrote the house map into {ARCHITECTURE}\n")
