"""The house plan: imports run one way, shared words sit at the bottom, files stay small."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tierzero"

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


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
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


def test_no_import_loops() -> None:
    cycle = _cycle(_edges(_modules()))
    assert cycle is None, "import loop: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_loop() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _of_project(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "tierzero"
    return any(alias.name.split(".")[0] == "tierzero" for alias in node.names)


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


def test_shared_words_import_nothing_of_the_project() -> None:
    known = _modules()
    assert _edges(known)["tierzero.common.slices"] == set()
    assert _edges(known)["tierzero.common.sizes"] == set()


def test_files_stay_small() -> None:
    """About 400 lines at most: a file past 420 holds more than one idea and is due for a split."""
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 420
    }
    assert not long, f"files over about 400 lines: {long}"
