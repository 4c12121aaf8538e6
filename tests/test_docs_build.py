"""The documentation check itself: ``make docs`` fails on a warning.

MkDocs' ``--quiet`` drops warnings before ``--strict`` counts them, so a build with a
page left out of the nav passed ``make docs`` while ``mkdocs build --strict`` failed it.
These tests run the Makefile's own ``docs`` recipe (not a copy of its command line) on a
copy of ``mkdocs.yml`` with one page taken out of the nav, and expect it to fail naming
that page. They need the ``docs`` extra (``make docs`` installs it; CI runs ``make docs``
before the suite, so there a missing MkDocs is a failure, not a skip).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import check_site

from .support import ROOT, run_command
from .support.skips import require, skip_or_fail

#: The page the tests leave out (any page of the nav but the home page would do).
LEFT_OUT = "versions.md"


def _without(items: list[Any], page: str) -> list[Any]:
    """The nav ``items`` with every entry naming ``page`` removed."""
    kept: list[Any] = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            kept.append({next(iter(item)): _without(value, page)})
        elif value != page:
            kept.append(item)
    return kept


def _config_without(page: str, directory: Path) -> Path:
    """A copy of mkdocs.yml in ``directory`` whose nav leaves ``page`` out; the same docs,
    the same plugins, every path made absolute (the copy lives outside the repository)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["nav"] = _without(config["nav"], page)
    config["docs_dir"] = str(ROOT / "docs")
    for extension in config["markdown_extensions"]:
        if isinstance(extension, dict) and "pymdownx.snippets" in extension:
            extension["pymdownx.snippets"]["base_path"] = [str(ROOT)]
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    path = directory / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _make_docs(config: Path, site: Path) -> tuple[int, str]:
    """``make docs`` on ``config`` into ``site``, with this interpreter's tools and without
    reinstalling anything: (exit code, output)."""
    make = require("make")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "mkdocs").exists():
        skip_or_fail(f"mkdocs is not installed next to {sys.executable}: .venv/bin/pip install -e '.[docs]'")
    venv = ROOT / ".venv"
    result = run_command(
        [make, "--no-print-directory", "-o", f"{venv}/.installed", "-o", f"{venv}/.docs-installed", "docs",
         f"VENV={venv}", f"BIN={bin_dir}", f"MKDOCS_CONFIG={config}", f"SITE_DIR={site}"],
        timeout=300, capture_output=True, text=True, env={**os.environ, "MAKEFLAGS": ""})
    return result.returncode, result.stdout + result.stderr


def test_make_docs_fails_on_a_page_left_out_of_the_nav(tmp_path: Path) -> None:
    """The docs check fails when a page of docs/ is missing from the nav, and says which."""
    assert (ROOT / "docs" / LEFT_OUT).exists()
    code, output = _make_docs(_config_without(LEFT_OUT, tmp_path), tmp_path / "site")
    assert code != 0, f"make docs passed with {LEFT_OUT} left out of the nav:\n{output[-3000:]}"
    assert f"- {LEFT_OUT}" in output and "not included in the \"nav\"" in output, output[-3000:]
    assert "Aborted with 1 warnings in strict mode" in output, output[-3000:]


def test_the_site_check_names_a_page_left_out_of_the_nav(tmp_path: Path) -> None:
    """tests/check_site.py reports a docs page the nav does not name, whatever the build's log
    level let through; and mkdocs.yml names every page of docs/."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert check_site.left_out(config, ROOT) == []
    config["nav"] = _without(config["nav"], LEFT_OUT)
    assert check_site.left_out(config, ROOT) == [LEFT_OUT]
    site = tmp_path / "site"
    site.mkdir()
    path = _config_without(LEFT_OUT, tmp_path)
    assert f"{LEFT_OUT}: not in the nav of mkdocs.yml" in check_site.check(site, path)


@pytest.mark.parametrize("page", ["admin.md"])
def test_pages_the_readme_lists_under_reference_are_in_the_nav(page: str) -> None:
    """The README and the home page list the admin API under Reference: it is a page of the site."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    reference = next(item["Reference"] for item in config["nav"] if isinstance(item, dict) and "Reference" in item)
    assert page in [next(iter(entry.values())) for entry in reference]
