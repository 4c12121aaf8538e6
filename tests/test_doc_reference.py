"""The mechanical claims of the documentation, checked against the code.

Settings and their defaults, task options, the ``celery singleton`` commands, their
flags and exit codes, the version, and the README's example (run as written by a real
worker and beat). The other claims of README.md and docs/ are in test_doc_claims.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, fields
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

import click
import pytest
import redis
from celery import Celery

import celery_singleton_beat
from celery_singleton_beat import SingletonTask, admin
from celery_singleton_beat.cli import singleton
from celery_singleton_beat.config import SingletonSettings
from celery_singleton_beat.connection.url import DEFAULT_REDIS_OPTIONS
from celery_singleton_beat.recovery import startup
from celery_singleton_beat.task.task import LOCK_MODES, ON_CONFLICT

from .support import CeleryProcess, RedisServer, child_env, start_worker, wait_for
from .support.paths import ROOT

DOCS = ROOT / "docs"


def _rows(markdown: str, first_cell: str) -> dict[str, list[str]]:
    """The rows of Markdown tables whose first cell is a code span matching ``first_cell``:
    {name: the other cells}."""
    rows: dict[str, list[str]] = {}
    for line in markdown.splitlines():
        match = re.match(rf"\|\s*`({first_cell})`\s*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split(" | ")]
    return rows


def _documents() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]}


# ----------------------------------------------------------------- settings


def _shows(cell: str, default: Any) -> bool:
    """Whether a table cell starts with ``default`` as a code span (``60`` and ``60.0`` alike)."""
    match = re.match(r"`([^`]*)`", cell)
    if match is None:
        return False
    shown = match.group(1)
    if isinstance(default, bool) or default is None:
        return shown == str(default)
    if isinstance(default, str):
        return shown == f'"{default}"'
    try:
        return float(shown) == float(default)
    except ValueError:
        return False


def test_the_settings_page_lists_every_setting_with_its_default() -> None:
    """docs/settings.md: one row per field of SingletonSettings, its default as the code has it."""
    rows = _rows((DOCS / "settings.md").read_text(), r"singleton_\w+")
    names = {f"singleton_{f.name}" for f in fields(SingletonSettings)}
    assert set(rows) == names, f"missing {sorted(names - set(rows))}, unknown {sorted(set(rows) - names)}"
    special = {"singleton_redis_url", "singleton_redis_options", "singleton_done_ttl"}
    for f in fields(SingletonSettings):
        name = f"singleton_{f.name}"
        if name in special:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        assert _shows(rows[name][0], default), f"{name}: the docs say {rows[name][0]!r}, the code {default!r}"
    # The defaults the table spells out in words.
    assert "result backend" in rows["singleton_redis_url"][0]
    assert rows["singleton_redis_options"][0] == "`{}`"
    options = rows["singleton_redis_options"][1]
    for option, value in DEFAULT_REDIS_OPTIONS.items():
        unit = "" if option == "max_connections" else " s"  # a count, the others seconds
        assert f"`{option}` {value:g}{unit}" in options, (option, options)
    assert "visibility_timeout" in rows["singleton_done_ttl"][0] and "`7200`" in rows["singleton_done_ttl"][0]
    assert SingletonSettings.done_ttl == 7200


def test_every_settings_table_in_the_docs_agrees_with_the_code() -> None:
    """Any table row of README.md or docs/ that starts with a `singleton_*` setting names a real
    setting, and a default cell that gives a plain value gives the code's."""
    known = {f"singleton_{f.name}": f for f in fields(SingletonSettings)}
    checked = 0
    for where, text in _documents().items():
        if where in ("docs/migrating.md", "docs/comparison.md", "docs/testing.md"):
            continue  # celery-singleton's settings and the pytest fixtures are singleton_* too
        for name, cells in _rows(text, r"singleton_\w+").items():
            assert name in known, f"{where}: {name} is not a setting"
            field = known[name]
            default = field.default if field.default is not MISSING else None
            cell = cells[0]
            if name in ("singleton_redis_url", "singleton_redis_options", "singleton_done_ttl") or default is None:
                continue
            if re.fullmatch(r"`[^`]*`( \(.*\))?", cell):
                assert _shows(cell, default), f"{where}: {name} default {cell!r}, the code {default!r}"
                checked += 1
    assert checked >= 15


def test_scheduler_attributes_are_the_documented_ones() -> None:
    from celery_singleton_beat import SingletonSchedulerMixin as Mixin

    text = (DOCS / "settings.md").read_text()
    for name, shown in (("claim_batch_size", "1000"), ("history_size", "1000"),
                        ("redis_retry_min", "1.0 s"), ("redis_retry_max", "30.0 s")):
        assert f"`{name}` ({shown}" in text, name
        assert float(shown.split()[0]) == getattr(Mixin, name), name


def test_the_task_options_table_is_the_task_class() -> None:
    """docs/tasks.md: the four options, their defaults, the modes and conflict values."""
    text = (DOCS / "tasks.md").read_text()
    section = text[text.index("## Task options"):]
    rows = _rows(section[: section.index("\n## ", 3)], r"\w+")
    assert {"unique_on", "lock_ttl", "lock_mode", "on_conflict"} <= set(rows)
    assert rows["unique_on"][0].startswith("`None`") and SingletonTask.unique_on is None
    assert rows["lock_ttl"][0].startswith("`singleton_lock_ttl` (60 s)") and SingletonTask.lock_ttl is None
    assert rows["lock_mode"][0] == f'`"{SingletonTask.lock_mode}"`'
    assert rows["on_conflict"][0] == f'`"{SingletonTask.on_conflict}"`'
    for mode in LOCK_MODES:
        assert f'`"{mode}"`' in rows["lock_mode"][0] + rows["lock_mode"][1], mode
    for value in ON_CONFLICT:
        assert f'`"{value}"`' in rows["on_conflict"][1] or f'`"{value}"`' == rows["on_conflict"][0], value


# ----------------------------------------------------------------- the command line


def _options(command: click.Command) -> set[str]:
    return {opt for param in command.params if isinstance(param, click.Option)
            for opt in param.opts if opt != "--help"}


def test_every_command_and_flag_is_on_the_cli_page_and_nothing_else() -> None:
    """docs/cli.md: its synopsis lists every `celery singleton` command with every long flag,
    each section heading names a real command and its flags."""
    text = (DOCS / "cli.md").read_text()
    synopsis = dict(re.findall(r"^celery -A proj singleton ([\w-]+) ?(.*)$", text, re.M))
    assert set(synopsis) == set(singleton.commands), synopsis
    for name, command in singleton.commands.items():
        documented = set(re.findall(r"--[\w-]+", synopsis[name]))
        long_flags = {opt for opt in _options(command) if opt.startswith("--")}
        assert documented == long_flags, f"{name}: docs {sorted(documented)}, code {sorted(long_flags)}"
        heading = re.search(rf"^## `{re.escape(name)}\b(.*)`$", text, re.M)
        assert heading is not None, f"no section for {name}"
        assert set(re.findall(r"--[\w-]+", heading.group(1))) == long_flags, name
    # Short flags and defaults the page states.
    release = singleton.commands["release"]
    assert {"-y", "-t"} <= _options(release)
    timeout = next(p for p in release.params if p.name == "timeout")
    assert timeout.default == 1.0 and "default 1)" in text
    last = next(p for p in singleton.commands["slots"].params if p.name == "last")
    assert last.default == 20 and "(default 20)" in text


def test_the_exit_codes_are_the_codes_the_commands_use() -> None:
    """docs/cli.md's exit code table against the admin constants, and 78 at start-up."""
    text = (DOCS / "cli.md").read_text()
    table = text[text.index("## Exit codes"):]
    codes = {int(code) for code in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert codes == {0, 1, 2, admin.EX_UNAVAILABLE, admin.EX_CONFIG}
    assert (admin.EX_FAILURE, admin.EX_UNAVAILABLE, admin.EX_CONFIG) == (1, 69, 78)
    assert startup.EX_CONFIG == 78
    assert click.UsageError.exit_code == 2
    for page in ("guarantees.md", "deployment.md", "getting-started.md"):
        assert "exit code 78" in (DOCS / page).read_text(), page


def test_doctor_checks_are_the_documented_ones(redis_server: RedisServer) -> None:
    """docs/cli.md's doctor table lists the checks doctor runs, in order; --json's shape."""
    app = Celery("doc-reference", set_as_current=False)
    app.conf.update(broker_url=redis_server.url(0), singleton_redis_url=redis_server.url(2))
    report = admin.doctor(app, load=False)
    text = (DOCS / "cli.md").read_text()
    table = text[text.index("| check | fails when |"):].split("\n", 2)[2]
    documented = re.findall(r"^\| (\w+) \|", table, re.M)[: len(report.checks)]
    assert documented == [check.name for check in report.checks]
    document = report.as_json()
    assert set(document) == {"ok", "checks"} and set(document["checks"][0]) == {"check", "status", "detail"}
    assert '`{"ok": bool, "checks": [{"check", "status", "detail"}]}`' in text


# ----------------------------------------------------------------- version


def test_the_version_is_stated_once_and_named_alike() -> None:
    """__version__ is the version; pyproject reads it, the changelog's newest section and
    the site's home page name it."""
    current = celery_singleton_beat.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "celery_singleton_beat.__version__" in pyproject
    project = pyproject[pyproject.index("[project]"):]
    assert not re.search(r"^version\s*=", project[: project.index("\n[", 1)], re.M)
    newest = re.search(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest is not None and newest.group(1) == current
    assert f"version {current}" in (DOCS / "index.md").read_text()
    assert installed_version("celery-singleton-beat") == current, "reinstall: pip install -e ."


# ----------------------------------------------------------------- the README's example


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(# proj\.py\n.*?)```", readme, re.S)
    assert block is not None
    return block.group(1)


def test_the_getting_started_page_shows_the_readme_example() -> None:
    assert _readme_example() in (DOCS / "getting-started.md").read_text()


@pytest.mark.timeout(180)
def test_the_readme_example_runs_as_written(redis_db: redis.Redis, redis_server: RedisServer,
                                            tmp_path: Path) -> None:
    """README's proj.py, saved as is (only the Redis address is the test server's), runs on
    a real worker: a duplicate-free sync of three customers; its beat starts with the
    singleton scheduler, as the README's beat command line has it."""
    address = f"redis://127.0.0.1:{redis_server.port}"
    source = _readme_example()
    assert source.count("redis://localhost:6379") == 2
    (tmp_path / "proj.py").write_text(source.replace("redis://localhost:6379", address))
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    start_worker(redis_server, "proj", "readme", env=env)

    client = Celery("readme-client", broker=f"{address}/0", backend=f"{address}/1", set_as_current=False)
    assert client.send_task("proj.sync_customer", args=[7]).get(timeout=30) == "synced 7"
    assert client.send_task("proj.sync_all").get(timeout=30) is None
    locks = redis_server.client(1)
    counts = "singleton:{stats}:task:proj.sync_customer"
    wait_for(lambda: locks.hget(counts, "released") == b"4", timeout=30,
             message="the four syncs released their locks")
    assert not list(locks.scan_iter("singleton:{proj.sync_customer:*"))

    commands = (ROOT / "README.md").read_text()
    beat_line = re.search(r"^celery -A proj beat (.*?)\s+#", commands, re.M)
    assert beat_line is not None
    argv = beat_line.group(1).replace("/var/lib/proj/beat-1", str(tmp_path / "beat-1")).split()
    beat = CeleryProcess(["-A", "proj", "beat", *argv], child_env(redis_server, **env), name="readme-beat").start()
    beat.wait_for_log("beat: 1 entry scheduled for the first time (sync-all)", timeout=60)
    assert "beat: singleton scheduler" in beat.output()
    record = locks.get("singleton:{beat:sync-all}:scheduled")
    assert record is not None and json.loads(record) > 0
