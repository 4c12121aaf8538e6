"""Every import path the documentation names still imports (issue 35: the layout moved modules).

The paths are read from docs/ and README.md, so a path added to the docs is checked too.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# dotted paths (``celery_singleton_beat.admin.list_locks``) and beat_scheduler strings (``pkg.mod:Name``)
PATH = re.compile(r"\bcelery_singleton_beat(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*)?")
NEEDS_DJANGO = "celery_singleton_beat.contrib.django"


def documented_paths() -> list[str]:
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = {m.group(0) for text in texts for m in PATH.finditer(text.read_text(encoding="utf-8"))}
    return sorted(found)


def resolve(path: str) -> object:
    """Import ``path`` as Celery's symbol_by_name would: ``a.b:C``, or the longest module prefix of ``a.b.C``."""
    if ":" in path:
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:cut]).startswith(exc.name):
                raise
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ImportError(path)


def test_the_docs_name_paths() -> None:
    assert len(documented_paths()) > 20


@pytest.mark.parametrize("path", documented_paths())
def test_a_documented_path_imports(path: str) -> None:
    if path.startswith(NEEDS_DJANGO):
        # Django is configured once per process: in a process of its own, not the suite's
        pytest.importorskip("django_celery_beat")
        code = ("import django; from django.conf import settings; "
                "settings.configure(INSTALLED_APPS=['django_celery_beat'], USE_TZ=True); django.setup(); "
                f"from tests.test_import_paths import resolve; assert resolve({path!r}) is not None")
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
        return
    assert resolve(path) is not None


@pytest.mark.parametrize("scheduler", ["singleton", "celery_singleton_beat.SingletonScheduler",
                                       "celery_singleton_beat.beat:SingletonScheduler",
                                       "celery_singleton_beat.beat.SingletonScheduler"])
def test_the_beat_scheduler_strings_resolve(scheduler: str) -> None:
    from importlib.metadata import entry_points

    from celery.beat import Scheduler
    from celery.utils.imports import symbol_by_name

    # Celery's own aliases for beat_scheduler: the installed celery.beat_schedulers entry points
    aliases = {ep.name: ep.value for ep in entry_points(group="celery.beat_schedulers")}
    found = symbol_by_name(scheduler, aliases=aliases)
    assert issubclass(found, Scheduler)


def test_the_cli_entry_points_import() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    targets = re.findall(r'=\s*"(celery_singleton_beat[\w.]*:\w+)"', text)  # entry points
    assert targets
    for target in targets:
        assert callable(resolve(target))
