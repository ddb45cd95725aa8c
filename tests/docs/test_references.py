"""Every reference the package's docstrings, comments and messages make resolves to a file
in the repository: `docs/<page>.md#<anchor>` to a page and one of its headings, a root
file such as BENCHMARKS.md to that file, a capability id (C1..C35) to its row in
docs/capabilities.md. A "§" is left only where it cites a paper's section ("Tang et al.,
2021, §4.1"); a section of these docs is cited by its anchor."""

import re
from pathlib import Path

from tests.docs.doc_files import DOCS, ROOT, repository_links

SCANNED = ("shardwise", "scripts", "benchmarks", "tests", "examples")
CHECKERS = ROOT / "tests" / "docs"  # this folder writes the patterns it checks for
DOC_REFERENCE = re.compile(r"\bdocs/([\w/.-]+?\.md)(?:#([\w-]+))?")
ROOT_FILE = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]*\.md)\b")
CAPABILITY = re.compile(r"\bC(\d{1,2})(?:\s*[-–]\s*C(\d{1,2}))?\b")
SECTION_SIGN = "§"
PAPER_CONTEXT = 120  # characters before a "§" in which a paper citation ("et al.") must appear
CAPABILITY_ROW = re.compile(r"^\| C(\d+) \|", re.MULTILINE)


def sources() -> list[Path]:
    files = [path for folder in SCANNED for path in (ROOT / folder).rglob("*.py")]
    return sorted(path for path in files if CHECKERS not in path.parents and ".venv" not in path.parts)


def where(path: Path, text: str, position: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, position) + 1}"


def defined_capabilities() -> list[int]:
    return [int(number) for number in CAPABILITY_ROW.findall((DOCS / "capabilities.md").read_text())]


def test_the_capability_map_defines_c1_to_c35_once_each():
    assert defined_capabilities() == list(range(1, 36))


def test_the_scan_sees_the_package_references():
    """The patterns below find what the package cites today: a check that matches nothing
    would pass whatever the docs say."""
    text = "\n".join(path.read_text() for path in sources())
    assert len(DOC_REFERENCE.findall(text)) >= 20
    assert len(CAPABILITY.findall(text)) >= 20
    assert "BENCHMARKS.md" in ROOT_FILE.findall(text)


def test_docs_references_name_existing_pages_and_anchors():
    links = repository_links()
    problems = []
    for path in sources():
        text = path.read_text()
        for match in DOC_REFERENCE.finditer(text):
            page, anchor = DOCS / match.group(1), match.group(2)
            if not page.is_file():
                problems.append(f"{where(path, text, match.start())}: docs/{match.group(1)} does not exist")
            elif anchor and anchor not in links.anchors(page.read_text()):
                problems.append(f"{where(path, text, match.start())}: docs/{match.group(1)} has no heading "
                                f"with anchor #{anchor}")
    assert not problems, "\n".join(problems)


def test_root_files_cited_exist():
    problems = [
        f"{where(path, text, match.start())}: {match.group(1)} is not a file at the repository root"
        for path in sources()
        for text in [path.read_text()]
        for match in ROOT_FILE.finditer(text)
        if not (ROOT / match.group(1)).is_file()
    ]
    assert not problems, "\n".join(problems)


def test_capability_ids_are_defined_in_the_capability_map():
    defined = set(defined_capabilities())
    problems = []
    for path in sources():
        text = path.read_text()
        for match in CAPABILITY.finditer(text):
            first = int(match.group(1))
            last = int(match.group(2) or first)
            cited = set(range(first, last + 1))
            if last < first or not cited <= defined:
                problems.append(f"{where(path, text, match.start())}: {match.group(0)} is not in docs/capabilities.md")
    assert not problems, "\n".join(problems)


def test_section_signs_cite_papers_only():
    problems = []
    for path in sources():
        text = path.read_text()
        for position in (match.start() for match in re.finditer(SECTION_SIGN, text)):
            if "et al." not in text[max(0, position - PAPER_CONTEXT):position]:
                problems.append(f"{where(path, text, position)}: '{text[position:position + 8].splitlines()[0]}' "
                                "points nowhere: cite a section of the docs as docs/<page>.md#<anchor>")
    assert not problems, "\n".join(problems)
