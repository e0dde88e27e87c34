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


# The engine's rooms, each a package of chat/engine/, and the rooms each may import (every room may import
# the engine's interface, chat/engine/base.py and events.py, and what lies outside chat/engine/). The serving
# core decides and runs the model room; the model room runs forwards over the kernels and the KV storage;
# the kernels and the KV storage import no other room; the remote engine stands beside the local one.
ROOMS = {
    "kernels": set(),
    "kv": set(),
    "model": {"kernels", "kv"},
    "core": {"model", "kernels", "kv"},
    "remote": set(),
}


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["chat", "engine"] and parts[2] in ROOMS else None


def test_the_engine_is_its_rooms_and_the_interface():
    engine = CHAT / "engine"
    loose = sorted(p.name for p in engine.glob("*.py") if p.name not in ("__init__.py", "base.py", "events.py"))
    assert loose == [], "modules of chat/engine/ outside a room"
    assert sorted(p.name for p in engine.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ROOMS)


def test_each_engine_room_imports_only_the_rooms_below_it():
    wrong = {f"{name} -> {target}" for name, targets in graph().items() if room(name)
             for target in targets if room(target) and room(target) != room(name)
             and room(target) not in ROOMS[room(name)]}
    assert sorted(wrong) == []


def test_the_rooms_rule_catches_a_wrong_import():
    assert room("chat.engine.kernels.quant") == "kernels" and room("chat.engine.base") is None
    assert "core" not in ROOMS["model"] and "model" not in ROOMS["kernels"]


def test_the_scheduler_decides_without_torch_or_the_runner():
    scheduler = CHAT / "engine" / "core" / "scheduler.py"
    assert "torch" not in outside_imports(scheduler)
    assert "chat.engine.model.runner" not in graph()["chat.engine.core.scheduler"]
