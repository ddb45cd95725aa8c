"""The optimizers' place in the layers (issue 25): shardwise/runtime/optim imports only the
formulas, the distributed primitives and runtime/base (torch version shims, the C builder)
below it, so no folder that uses optimizers (ZeRO, the engine, the config front end, the
planner) is imported back by it, and the formulas import nothing of shardwise but
themselves. Every import counts, inside functions and
under TYPE_CHECKING too."""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

PACKAGE = Path(shardwise.__file__).parent
OPTIM_MAY_IMPORT = ("shardwise.runtime.optim", "shardwise.formulas", "shardwise.runtime.distributed",
                    "shardwise.runtime.base")


def shardwise_imports(folder: Path) -> dict[str, set[str]]:
    """Each file under `folder` (relative path) -> the shardwise modules it imports."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[str(path.relative_to(PACKAGE.parent))] = {name for name in names if name.startswith("shardwise")}
    return found


def outside(imports: dict[str, set[str]], allowed: tuple[str, ...]) -> list[str]:
    return [f"{path} imports {name}" for path, names in imports.items() for name in sorted(names)
            if not any(name == prefix or name.startswith(prefix + ".") for prefix in allowed)]


def test_optim_imports_only_the_layers_below_it():
    assert outside(shardwise_imports(PACKAGE / "runtime" / "optim"), OPTIM_MAY_IMPORT) == []


def test_formulas_import_only_formulas():
    assert outside(shardwise_imports(PACKAGE / "formulas"), ("shardwise.formulas",)) == []


def test_no_relative_imports_hide_from_the_check():
    for folder in (PACKAGE / "runtime" / "optim", PACKAGE / "formulas"):
        for path in folder.rglob("*.py"):
            relative = [node for node in ast.walk(ast.parse(path.read_text()))
                        if isinstance(node, ast.ImportFrom) and node.level]
            assert relative == [], path
