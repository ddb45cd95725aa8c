"""MkDocs hook: links from the docs to repository files outside docs/.

A page links a source file or BENCHMARKS.md by its path relative to the page
(`../shardwise/runtime/engine.py`, `../BENCHMARKS.md#4-the-main-job`), which works where the
Markdown is read on its own (a repository browser, an editor). The built site holds only
docs/, so MkDocs would call such a link broken. This hook checks that the file (and, for
a Markdown file, the anchor) exists, warning otherwise so that `mkdocs build --strict`
fails, and rewrites the link: to the file in the repository browser when mkdocs.yml sets
`repo_url`, else to the link text followed by the path.

The helpers are also what tests/docs/ uses to check the README's links, which MkDocs
does not build.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("mkdocs.hooks.repository_links")

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+).*?\1")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, mailto:, ...
DEFAULT_BRANCH = "main"


def prose_lines(markdown: str) -> list[tuple[int, str]]:
    """(index, line) of every line outside fenced code blocks."""
    lines, inside = [], False
    for index, line in enumerate(markdown.split("\n")):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            lines.append((index, line))
    return lines


def map_links(line: str, replace: Callable[[re.Match], str]) -> str:
    """`line` with every Markdown link outside code spans replaced by `replace(match)`."""
    pieces, position = [], 0
    for span in CODE_SPAN.finditer(line):
        pieces.append(LINK.sub(replace, line[position:span.start()]))
        pieces.append(span.group(0))
        position = span.end()
    pieces.append(LINK.sub(replace, line[position:]))
    return "".join(pieces)


def links(markdown: str) -> list[str]:
    """Every link target in `markdown` outside code."""
    found: list[str] = []
    for _, line in prose_lines(markdown):
        map_links(line, lambda match: found.append(match.group(3)) or match.group(0))
    return found


def github_slug(heading: str) -> str:
    """The anchor a repository browser gives a heading: markup dropped, lower case,
    punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(markdown: str) -> list[str]:
    """Every ATX heading's text, outside fenced code blocks."""
    return [match.group(2) for _, line in prose_lines(markdown) if (match := HEADING.match(line))]


def anchors(markdown: str, slug: Callable[[str], str] = github_slug) -> set[str]:
    """The anchors of a Markdown file's headings; repeated ones get -1, -2, ... as rendered."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(markdown):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def repository_link_problem(root: Path, source: Path, target: str) -> str | None:
    """Why `target`, linked from `source`, does not resolve to a file or folder in the
    repository at `root` (None when it does); anchors are checked for Markdown files."""
    path_part, _, anchor = target.partition("#")
    resolved = (source.parent / path_part).resolve() if path_part else source.resolve()
    if not resolved.is_relative_to(root.resolve()):
        return f"{source.name} links {target!r}, which is outside the repository"
    if not resolved.exists():
        return f"{source.name} links {target!r}, but {resolved.relative_to(root.resolve())} does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
        return f"{source.name} links {target!r}, but {resolved.name} has no heading with anchor #{anchor}"
    return None


def rewrite_repository_links(markdown: str, source: Path, docs_dir: Path, root: Path,
                             repo_url: str | None) -> tuple[str, list[str]]:
    """`markdown` with its links to repository files outside `docs_dir` rewritten, and the
    problems found (missing files or anchors)."""
    problems: list[str] = []

    def replace(match: re.Match) -> str:
        image, text, target = match.groups()
        if EXTERNAL.match(target) or target.startswith(("#", "/")):
            return match.group(0)
        resolved = (source.parent / target.partition("#")[0]).resolve()
        if resolved.is_relative_to(docs_dir.resolve()):
            return match.group(0)  # a page or asset of the site: MkDocs checks it
        problem = repository_link_problem(root, source, target)
        if problem:
            problems.append(problem)
            return match.group(0)
        path = resolved.relative_to(root.resolve()).as_posix()
        anchor = target.partition("#")[2]
        if repo_url:
            kind = "tree" if resolved.is_dir() else "blob"
            url = f"{repo_url.rstrip('/')}/{kind}/{DEFAULT_BRANCH}/{path}" + (f"#{anchor}" if anchor else "")
            return f"{image}[{text}]({url})"
        return text if path in text else f"{text} (`{path}`)"

    lines = markdown.split("\n")
    for index, line in prose_lines(markdown):
        lines[index] = map_links(line, replace)
    return "\n".join(lines), problems


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"])
    root = Path(config["config_file_path"]).parent
    source = Path(page.file.abs_src_path)
    markdown, problems = rewrite_repository_links(markdown, source, docs_dir, root, config.get("repo_url"))
    for problem in problems:
        log.warning(problem)
    return markdown
