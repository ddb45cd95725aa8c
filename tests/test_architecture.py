"""The package's layers import in one direction, and no two folders import each other
(docs/architecture.md#layers). Every import counts: at the top of a module, inside a
function, or under `if TYPE_CHECKING`."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shardwise"
# lower layers never import higher ones; shardwise/__init__.py is the public facade over all
LAYERS = ("formulas", "runtime", "models", "frontends", "tools")


def _imports() -> list[tuple[Path, int, str]]:
    """(file, line, imported module) for every shardwise import in the package; `from X
    import Y` names module X.Y when Y is a module, else X."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardwise"):
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    found.append((path, node.lineno, candidate if _module_path(candidate) else node.module))
            elif isinstance(node, ast.Import):
                found += [(path, node.lineno, alias.name) for alias in node.names if alias.name.startswith("shardwise")]
    return found


def _module_path(module: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*module.split("."))
    if base.is_dir():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _folder(path: Path) -> str:
    return path.parent.relative_to(PACKAGE.parent).as_posix()


def test_layers_import_only_downwards():
    wrong = []
    for path, line, module in _imports():
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue  # the facade
        source, target = parts[0], module.split(".")[1] if "." in module else None
        if source in LAYERS and target in LAYERS and LAYERS.index(target) > LAYERS.index(source):
            wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({source}) imports {module} ({target})")
    assert not wrong, "imports that point up the layers " + " < ".join(LAYERS) + ":\n" + "\n".join(wrong)


def test_no_two_folders_import_each_other():
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for path, line, module in _imports():
        target_path = _module_path(module)
        if target_path is None:
            continue
        source, target = _folder(path), _folder(target_path)
        if source != target:
            edges[source].add(target)
            where.setdefault((source, target), f"{path.relative_to(PACKAGE.parent)}:{line}")
    cycles = _cycles(edges)
    described = ["; ".join(f"{a} -> {b} ({where[a, b]})" for a in cycle for b in cycle if b in edges[a])
                 for cycle in cycles]
    assert not cycles, "folders that import each other:\n" + "\n".join(described)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one folder (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_the_checks_see_a_back_pointing_import(tmp_path, monkeypatch):
    """Planted: a runtime module importing a front end, and two folders importing each other."""
    fake = tmp_path / "shardwise"
    for folder in ("runtime/a", "runtime/b", "frontends"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "frontends" / "config.py").write_text("X = 1\n")
    (fake / "runtime" / "a" / "one.py").write_text("from shardwise.frontends import config\n"
                                                   "from shardwise.runtime.b import two\n")
    (fake / "runtime" / "b" / "two.py").write_text("def f():\n    from shardwise.runtime.a import one\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    for check in (test_layers_import_only_downwards, test_no_two_folders_import_each_other):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} missed the planted import")
