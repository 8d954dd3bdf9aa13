"""The package structure ARCHITECTURE.md describes, checked on the source: which top-level package
may import which (function-level imports included), and that the documents the code cites exist."""
from __future__ import annotations

import ast
import pathlib
import re
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megarl"


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(absolute megarl module, line) of every import in ``path``, at any depth."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    here = list(rel[:-1] if rel[-1] == "__init__" else rel)
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
    return [(n, line) for n, line in found if n == "megarl" or n.startswith("megarl.")]


def _top(module_path: pathlib.Path) -> str:
    return module_path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def package_graph() -> dict[str, dict[str, list[str]]]:
    """top-level package -> {imported top-level package: [file:line, ...]}"""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in PACKAGE.rglob("*.py"):
        src = _top(path)
        for name, line in _imports(path):
            parts = name.split(".")
            if len(parts) < 2:
                continue
            if parts[1] != src:
                graph[src][parts[1]].append(f"{path.relative_to(ROOT)}:{line}")
    return graph


def _reaches(graph: dict, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo += list(graph.get(node, {}))
    return False


def test_no_import_cycle_between_top_level_packages():
    graph = package_graph()
    cycles = [f"{a} -> {b} ({graph[a][b][0]}) and back" for a in graph for b in graph[a] if _reaches(graph, b, a)]
    assert not cycles, cycles


def test_the_cycle_check_sees_function_level_imports(tmp_path):
    """The check is not blind: the imports it must see, inside functions too, are found."""
    src = tmp_path / "megarl" / "x.py"
    src.parent.mkdir()
    src.write_text("def f():\n    from megarl.trainer import Trainer\n    from .wire import protocol\n")
    global ROOT, PACKAGE
    saved = ROOT, PACKAGE
    ROOT, PACKAGE = tmp_path, tmp_path / "megarl"
    try:
        assert [n for n, _ in _imports(src)] == ["megarl.trainer", "megarl.wire"]
    finally:
        ROOT, PACKAGE = saved


def test_engine_depends_only_on_the_wire_contract_and_wire_on_nothing():
    """The engine speaks the wire contract and reads served weight formats (quant: pure tensor
    functions, the same ones the push uses); neither of those imports anything of megarl."""
    graph = package_graph()
    assert set(graph.get("engine", {})) <= {"wire", "quant"}, dict(graph["engine"])
    assert not graph.get("wire"), dict(graph["wire"])
    assert not graph.get("quant"), dict(graph["quant"])


def test_algorithms_and_the_trainer_stay_in_their_lanes():
    graph = package_graph()
    assert not graph.get("algos"), dict(graph["algos"])          # pure tensor functions
    users_of_trainer = [src for src, targets in graph.items() if "trainer" in targets and src not in ("cli", "evaluation")]
    assert not users_of_trainer, users_of_trainer                  # nothing below the loop imports it


def test_cited_documents_exist():
    """Every document the code, recipes or README cite by name is in the repository."""
    cited = set()
    for path in list(PACKAGE.rglob("*.py")) + [ROOT / "README.md"]:
        cited |= set(re.findall(r"((?:[\w-]+/)*[A-Z][A-Z_]+\.md)\b", path.read_text()))
    assert cited, "no document cited at all: the pattern is broken"
    missing = sorted(name for name in cited if not (ROOT / name).is_file())
    assert not missing, missing
