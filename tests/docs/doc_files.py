"""Where the documentation lives, and loading the files of it that are Python (the MkDocs
hook) or that write it (scripts/update_docs_tables.py)."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def load_module(path: Path) -> ModuleType:
    """A module from a file outside the package."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def repository_links() -> ModuleType:
    """docs/hooks/repository_links.py: link and anchor helpers shared with the site build."""
    return load_module(DOCS / "hooks" / "repository_links.py")


def pages() -> list[Path]:
    """Every Markdown page of the site."""
    return sorted(DOCS.rglob("*.md"))
