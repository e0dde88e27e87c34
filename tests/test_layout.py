"""The layout's rules, read from the source: chat/'s import graph has no circle, and each outside
library is imported by the one package that owns it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

CHAT = Path(__file__).resolve().parent.parent / "chat"


def modules() -> dict[str, Path]:
    """Every module of chat/ by dotted name (a package by its own name)."""
    found = {}
    for path in CHAT.rglob("*.py"):
        parts = list(path.relative_to(CHAT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The chat modules ``name`` imports anywhere in its file (under TYPE_CHECKING and in functions too)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                other = stack.pop()
                group.append(other)
                if other == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_import_graph_of_chat_has_no_circle():
    assert circles(graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_runs_does_not_import_turns():
    assert "chat.turns" not in graph()["chat.runs"]


def outside_imports(path: Path) -> set[str]:
    """The top-level names of the libraries a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("library,owner", [
    ("torch", "chat/engine"), ("transformers", "chat/engine"),
    ("sqlite3", "chat/store"), ("psycopg", "chat/store"),
    ("redis", "chat/state"),
])
def test_one_package_imports_each_library(library, owner):
    importers = {str(path.relative_to(CHAT.parent)) for path in CHAT.rglob("*.py") if library in outside_imports(path)}
    assert importers, f"nothing imports {library}: the rule checks nothing"
    assert {path for path in importers if not path.startswith(owner + "/")} == set()
