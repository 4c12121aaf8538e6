"""Fixtures (see ``tests/support/fixtures.py``) and the harness's hooks.

* A failed test's report ends with the last lines of the log of every process
  it started and of every process still running (module workers, servers):
  timeouts included (pytest-timeout fails the test, then this report is made).
* With ``CI`` set, a skipped test fails, except those in
  ``support.skips.ALLOWED_SKIPS``.
* An ``xfail`` test counts as the expected failure only if it raised in its
  ``documented_break()`` step (``support.breaks``): any other exception (a set-up wait
  that timed out, a fixture, the teardown) fails it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from .support.breaks import NOT_THE_BREAK, shows_the_break
from .support.dbbeat import django_db  # noqa: F401 - registered as this conftest's fixture
from .support.fixtures import (  # noqa: F401 - registered as this conftest's fixtures
    OWNER_KEY,
    backend,
    broker,
    busy_script,
    client_apps,
    cluster,
    cluster_client,
    delivery_env,
    harness_session,
    locks,
    make_redis,
    names,
    ops,
    order,
    processes,
    rabbitmq,
    rabbitmq_server,
    records,
    redis_db,
    redis_server,
    tasks,
    test_owner,
)
from .support.owners import EVERYTHING
from .support.skips import ALLOWED_SKIPS, in_ci
from .support.stalls import stalls  # noqa: F401 - registered as this conftest's fixture

#: Lines of each process log attached to a failure report.
TAIL_LINES = 40


def _log_sections(item: pytest.Item) -> list[tuple[str, str]]:
    owner = item.stash.get(OWNER_KEY, [])
    mine = list(owner)
    others = [p for p in EVERYTHING if p.running and not any(p is m for m in mine)]
    sections = []
    for process in mine + others:
        whose = "started by this test" if any(process is m for m in mine) else "still running"
        tail = process.tail(TAIL_LINES) or "    (no output)"
        sections.append((f"{process.name} ({whose}; {process.log})", tail))
    return sections


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _not_the_break(report: Any, call: pytest.CallInfo[None]) -> bool:
    """An xfail outcome from an exception raised outside the test's documented_break() step."""
    excinfo = call.excinfo
    return (hasattr(report, "wasxfail") and excinfo is not None
            and not isinstance(excinfo.value, pytest.xfail.Exception) and not shows_the_break(excinfo.value))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest's own: sees its xfail outcome
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if _not_the_break(report, call):
        report.outcome = "failed"
        report.longrepr = f"{NOT_THE_BREAK} (xfail reason: {report.wasxfail})\n\n{report.longrepr}"
        del report.wasxfail
    if report.failed:
        for title, text in _log_sections(item):
            report.sections.append((f"log of {title}", text))
    if (report.skipped and not hasattr(report, "wasxfail") and in_ci()
            and item.nodeid not in ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI, which is a failure (CI={__import__('os').environ['CI']}): "
                           f"{_skip_reason(report)}\nInstall what is missing, or list the test in "
                           f"tests/support/skips.py ALLOWED_SKIPS with the reason it may skip.")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and collector.nodeid not in ALLOWED_SKIPS:
        report.outcome = "failed"
        report.longrepr = f"module skipped in CI, which is a failure: {_skip_reason(report)}"
