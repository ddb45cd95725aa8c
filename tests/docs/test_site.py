"""The documentation site builds with `mkdocs build --strict` (a link to a missing page or
anchor fails it), and the links MkDocs does not check (to repository files outside docs/,
and the README's) resolve."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.doc_files import DOCS, ROOT, pages, repository_links

BUILD_TIMEOUT_S = 120


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    try:
        import mkdocs  # noqa: F401  (the dev extra installs it)
    except ImportError:
        pytest.fail("mkdocs is not installed: pip install -e '.[dev]' (or run python3 scripts/bootstrap.py)")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_site_builds_strict(tmp_path):
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    for page in pages():  # with directory URLs, docs/x/y.md becomes site/x/y/index.html
        built = page.relative_to(DOCS).with_suffix("")
        built = built.parent if built.name == "index" else built
        assert (tmp_path / "site" / built / "index.html").is_file(), f"{page} was not built"
    assert (tmp_path / "site" / "search" / "search_index.json").is_file()


def test_the_site_config_fails_on_a_broken_anchor_and_a_missing_repository_file(tmp_path):
    """The same mkdocs.yml settings over two small pages: each broken link fails the build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n\n[b](../../no_such_file.py)\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), nav=["index.md", "other.md"], hooks=[str(DOCS / "hooks" / "repository_links.py")])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-heading" in result.stderr
    assert "no_such_file.py" in result.stderr


def test_links_to_repository_files_resolve():
    """Links from the docs to files outside docs/ (source files, BENCHMARKS.md and its
    headings), and every link of the README, name files and anchors that exist."""
    links = repository_links()
    problems = []
    for source in [*pages(), ROOT / "README.md"]:
        for target in links.links(source.read_text()):
            if links.EXTERNAL.match(target) or target.startswith("/"):
                continue
            resolved = (source.parent / target.partition("#")[0]).resolve()
            if source != ROOT / "README.md" and resolved.is_relative_to(DOCS):
                continue  # between pages of the site: the strict build checks those
            problems.append(links.repository_link_problem(ROOT, source, target))
    assert not [problem for problem in problems if problem], "\n".join(filter(None, problems))
    assert len(problems) >= 20  # the README's and the docs' links were found


def test_headings_have_the_same_anchor_on_the_site_and_in_a_repository_browser():
    """Anchors cited as docs/<page>.md#<anchor> work in both places only if both slug a
    heading alike: plain ASCII headings, none repeated on a page."""
    from markdown.extensions.toc import slugify

    links = repository_links()
    problems = []
    for page in pages():
        slugs = [links.github_slug(heading) for heading in links.headings(page.read_text())]
        for heading, slug in zip(links.headings(page.read_text()), slugs):
            shown = heading.replace("`", "").replace("*", "")
            if slugify(shown, "-") != slug:
                problems.append(f"{page.relative_to(ROOT)}: {heading!r} is #{slugify(shown, '-')} on the site, "
                                f"#{slug} in a repository browser")
        problems += [f"{page.relative_to(ROOT)}: heading anchor #{slug} repeats" for slug in set(slugs)
                     if slugs.count(slug) > 1]
    assert not problems, "\n".join(problems)


def test_repository_links_are_rewritten_for_the_site(tmp_path):
    links = repository_links()
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "BENCH.md").write_text("# Bench\n\n## 1. A run (issue 2)\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "engine.py").write_text("")
    page = docs / "page.md"
    markdown = ("See [the run](../BENCH.md#1-a-run-issue-2), [pkg/engine.py](../pkg/engine.py), "
                "[a page](other.md#x) and `[code](../nowhere.py)`.\n\n```\n[fenced](../nowhere.py)\n```")

    with_url, problems = links.rewrite_repository_links(markdown, page, docs, tmp_path, "https://example.org/o/r")
    assert not problems
    assert "[the run](https://example.org/o/r/blob/main/BENCH.md#1-a-run-issue-2)" in with_url
    assert "[pkg/engine.py](https://example.org/o/r/blob/main/pkg/engine.py)" in with_url
    assert "[a page](other.md#x)" in with_url  # a page of the site: left to MkDocs
    assert "`[code](../nowhere.py)`" in with_url and "[fenced](../nowhere.py)" in with_url  # code is not prose

    without_url, _ = links.rewrite_repository_links(markdown, page, docs, tmp_path, None)
    assert "See the run (`BENCH.md`), pkg/engine.py, [a page](other.md#x)" in without_url

    _, problems = links.rewrite_repository_links("[x](../BENCH.md#2-missing) [y](../gone.py)", page, docs,
                                                 tmp_path, None)
    assert len(problems) == 2 and "#2-missing" in problems[0] and "gone.py" in problems[1]
