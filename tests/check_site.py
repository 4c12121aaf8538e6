"""Check a built documentation site: ``python -m tests.check_site site [mkdocs.yml]`` (``make docs`` runs it).

MkDocs' strict build already fails on a broken link in the Markdown; this reads what
was actually written: every page of the nav in ``mkdocs.yml`` was built, has a title and
content, every Markdown page of the docs folder is in the nav (a page left out is built
but nothing links to it), and every link from one page of the site to another (``href`` and ``src``)
names a file that exists and, with ``#anchor``, an element id on that page. The API
pages must show the documented names (the docstrings were found).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urldefrag, urlsplit

import yaml

ROOT = Path(__file__).resolve().parent.parent

#: Names the generated API pages must show (a docstring that mkdocstrings could not
#: find leaves its heading out).
API_NAMES = {
    "api": ["SingletonTask", "SingletonRun", "ensure_held", "SingletonScheduler", "SingletonSchedulerMixin",
            "TaskSkipped", "DuplicateTaskError", "LockLost", "LockUnavailable", "SingletonKeyError"],
    "admin": ["list_locks", "HeldLock", "renewed_ago", "find_release_targets", "release_lock", "purge_claims",
              "recent_slots", "read_counters", "doctor", "DoctorReport", "check_lock_redis", "AmbiguousRelease"],
}


class _Page(HTMLParser):
    """The ids, links and title of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.title = ""
        self.text_length = 0
        self._in_title = False
        self._in_article = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(str(found["id"]))
        if tag == "a" and found.get("name"):
            self.ids.add(str(found["name"]))
        for name in ("href", "src"):
            if found.get(name) and tag in ("a", "img", "link", "script"):
                self.links.append(str(found[name]))
        self._in_title = tag == "title"
        if tag == "article":
            self._in_article += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "article":
            self._in_article -= 1
        self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if self._in_article:
            self.text_length += len(data.strip())


def nav_pages(config: dict[str, Any]) -> Iterator[str]:
    """Every Markdown file the nav names."""
    def walk(items: Any) -> Iterator[str]:
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from walk(value)
            else:
                yield str(value)
    yield from walk(config["nav"])


def built_path(site: Path, page: str) -> Path:
    """Where MkDocs writes ``page`` (directory URLs: ``cli.md`` -> ``cli/index.html``)."""
    stem = page[: -len(".md")]
    return site / "index.html" if stem == "index" else site / stem / "index.html"


def left_out(config: dict[str, Any], config_dir: Path) -> list[str]:
    """The Markdown pages of the docs folder that the nav does not name."""
    docs = (config_dir / config.get("docs_dir", "docs")).resolve()
    named = set(nav_pages(config))
    pages = (str(path.relative_to(docs)) for path in docs.rglob("*.md"))
    return sorted(page for page in pages if page not in named)


def check(site: Path, config_file: Path = ROOT / "mkdocs.yml") -> list[str]:
    config = yaml.safe_load(config_file.read_text())
    problems = [f"{page}: not in the nav of {config_file.name}" for page in left_out(config, config_file.parent)]
    pages: dict[Path, _Page] = {}
    for html in sorted(site.rglob("*.html")):
        parser = _Page()
        parser.feed(html.read_text(encoding="utf-8"))
        pages[html.resolve()] = parser

    for page in nav_pages(config):
        path = built_path(site, page).resolve()
        parsed = pages.get(path)
        if parsed is None:
            problems.append(f"{page}: not built ({path.relative_to(site.resolve())} missing)")
        elif not parsed.title.strip() or parsed.text_length < 200:
            problems.append(f"{page}: built without a title or content")

    for path, parsed in pages.items():
        if path.name == "404.html":
            continue
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue
            url, anchor = urldefrag(link)
            if not url:
                target = path
            else:
                target = (path.parent / unquote(url)).resolve()
                if target.is_dir():
                    target = target / "index.html"
            where = f"{path.relative_to(site.resolve())}: {link}"
            if not target.exists():
                problems.append(f"{where}: no such file")
            elif anchor and target.suffix == ".html" and unquote(anchor) not in pages[target].ids:
                problems.append(f"{where}: no element with id {anchor!r}")

    for page, names in API_NAMES.items():
        parsed = pages.get(built_path(site, f"{page}.md").resolve())
        missing = [name for name in names if parsed is None or not any(i.endswith(name) for i in parsed.ids)]
        if missing:
            problems.append(f"{page}.md: no API entry for {missing} (docstrings not found?)")
    return problems


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "site")
    problems = check(site, Path(argv[1]) if len(argv) > 1 else ROOT / "mkdocs.yml")
    for problem in problems:
        print(problem, file=sys.stderr)
    pages = len(list(site.rglob("index.html")))
    print(f"site check: {pages} pages, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
