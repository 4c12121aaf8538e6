"""What a real ``celery beat`` does when it starts: first deploy, restart after an outage, banner.

Real beat processes (``tests.apps.beat_app``, each on a clock that reads a chosen
day and time), a real worker that records every execution, one real redis-server.

* First sight: an entry no beat had scheduled before (new Redis, new or
  renamed entry) has missed nothing. The first start sends nothing that
  Celery's own ``PersistentScheduler`` would not (which sends nothing at start).
* Outage: slots an entry missed while it was scheduled and every beat was down
  follow ``singleton_beat_catch_up`` (``"latest"``: the latest one, once).
* Redis lost the entry's record: as a first sight (nothing missed is sent).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from celery_singleton_beat.beat import entry_record_key

from .support import LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, queue_drained, wait_for
from .support.beat import assert_stopped_cleanly, fresh_beat_state, module_beat_worker, read_runs, start_beat
from .support.slots import UTC

pytestmark = pytest.mark.slow

QUEUE = "beat-tests"
#: The day of the scenarios (any day works; the issue's measurement was on this one).
DAY = (2026, 11, 25)


@pytest.fixture(scope="module")
def startup_worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    """One worker for the module (see ``module_beat_worker``)."""
    yield from module_beat_worker(redis_server, "startup")


@pytest.fixture
def names(redis_server: RedisServer, startup_worker: CeleryProcess) -> str:
    """Fresh claims, records and runs; a unique entry-name prefix."""
    return fresh_beat_state(redis_server, startup_worker, "s")


def clock_at(hour: int, minute: int, second: float = 0.0) -> dict[str, float]:
    """A beat clock (``CSB_CLOCK``) that reads ``DAY hour:minute:second`` UTC now, then runs."""
    fake = datetime(*DAY, hour, minute, tzinfo=UTC).timestamp() + second
    return {"anchor": time.time(), "start": fake, "speed": 1.0}


def runs_by_entry(redis_server: RedisServer) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for run in read_runs(redis_server):
        found.setdefault(run["entry"], []).append(run)
    return found


def drain(redis_server: RedisServer) -> None:
    broker = redis_server.client(0)
    wait_for(lambda: queue_drained(broker, QUEUE),
             timeout=60, message="the worker to drain the queue")


def wait_for_control(redis_server: RedisServer, entry: str, count: int = 2) -> None:
    """Wait until the 1 s control entry ran ``count`` times, then for the queue to drain.

    Anything a beat sends at start goes out in its first tick, before the
    control's first slot, and the solo worker runs messages in queue order:
    once the control ran, a start-up send has run too.
    """
    wait_for(lambda: len(runs_by_entry(redis_server).get(entry, [])) >= count, timeout=60,
             message=f"{count} runs of the control entry {entry}")
    drain(redis_server)


@pytest.mark.parametrize("scheduler", ["singleton", "celery.beat:PersistentScheduler"])
def test_first_start_sends_no_slot_that_came_before_it(redis_server: RedisServer, names: str,
                                                       tmp_path: Path, processes: list[CeleryProcess],
                                                       scheduler: str) -> None:
    """A first deploy at 12:54: a crontab slot 2 min old and an hourly slot 54 min old are
    not sent, as with Celery's own scheduler (the control proves the beat was sending)."""
    cron, hourly, control = f"{names}cron-1252", f"{names}hourly", f"{names}control"
    schedule = {cron: {"cron": "52 12 * * *"}, hourly: {"every": 3600}, control: {"every": 1}}
    beat = start_beat(redis_server, tmp_path, "first", schedule, scheduler=scheduler,
                      clock=clock_at(12, 54, 0.5))
    processes.append(beat)
    wait_for_control(redis_server, control)

    runs = runs_by_entry(redis_server)
    assert cron not in runs and hourly not in runs, runs
    # Nor Celery's own celery.backend_cleanup (crontab 04:00): the beat sent the control only.
    sent = [line for line in beat.output().splitlines() if "Sending due task" in line]
    assert sent and all(control in line for line in sent), sent
    if scheduler == "singleton":
        # The entries are now recorded as scheduled since this start (see the next test).
        locks = redis_server.client(LOCK_DB)
        for name in (cron, hourly, control):
            assert locks.exists(entry_record_key("singleton", name)), name


def test_restart_after_an_outage_catches_up_scheduled_entries_only(
        redis_server: RedisServer, names: str, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """Beats run at 12:50, every beat is down from 12:50 to 13:05, a beat starts at 13:05.

    Entries scheduled before the outage get their latest missed slot (13:00) once;
    an entry added with this deploy, and one whose record Redis lost, get nothing.
    """
    nightly, hourly, lost = f"{names}nightly-13", f"{names}hourly", f"{names}lost"
    added, control = f"{names}added-13", f"{names}control"
    before = {nightly: {"cron": "0 13 * * *"}, hourly: {"every": 3600},
              lost: {"cron": "0 13 * * *"}, control: {"every": 1}}
    first = start_beat(redis_server, tmp_path, "before", before, clock=clock_at(12, 50))
    processes.append(first)
    wait_for_control(redis_server, control)
    first.stop()
    assert set(runs_by_entry(redis_server)) == {control}  # first sight at 12:50: nothing old sent
    locks = redis_server.client(LOCK_DB)
    assert locks.delete(entry_record_key("singleton", lost)) == 1  # Redis lost this one
    redis_server.client(RECORD_DB).flushdb()

    after = {**before, added: {"cron": "0 13 * * *"}}
    processes.append(start_beat(redis_server, tmp_path, "after", after, clock=clock_at(13, 5)))
    wait_for_control(redis_server, control)

    runs = runs_by_entry(redis_server)
    assert [run["slot"] for run in runs.get(nightly, [])] == ["2026-11-25T13:00:00Z"], runs
    assert [run["slot"] for run in runs.get(hourly, [])] == ["2026-11-25T13:00:00Z"], runs
    assert added not in runs and lost not in runs, runs


def test_banner_names_the_instance_that_runs(redis_server: RedisServer, names: str, tmp_path: Path,
                                             processes: list[CeleryProcess]) -> None:
    """The start-up banner's ``instance=`` is the id in the beat's log, claims and messages."""
    control = f"{names}control"
    beat = start_beat(redis_server, tmp_path, "banner", {control: {"every": 1}})
    processes.append(beat)
    wait_for_control(redis_server, control, count=1)
    output = beat.output()
    banner = re.search(r"\. singleton -> .* instance=(\S+)", output)
    logged = re.search(r"beat: singleton scheduler (\S+): catch-up", output)
    assert banner and logged, output[-3000:]
    sent_by = {run["instance"] for run in runs_by_entry(redis_server)[control]}
    assert banner[1] == logged[1] and sent_by == {logged[1]}, (banner[1], logged[1], sent_by)


# ----------------------------------------------------------------- the schedule file's folder


def test_a_schedule_file_in_a_folder_not_made_yet_starts_the_beat(
        redis_server: RedisServer, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """``celery beat -S singleton --schedule /var/lib/proj/beat-1`` where /var/lib/proj does not
    exist: the beat makes the folder (as ``mkdir -p``), says so once, and runs."""
    folder = tmp_path / "var" / "lib" / "proj"
    beat = start_beat(redis_server, tmp_path, "new-folder", {"s-folder-hourly": {"every": 3600}},
                      schedule_file=folder / "beat-1")
    processes.append(beat)
    beat.wait_for_log("singleton scheduler", timeout=60)
    assert folder.is_dir() and any(folder.iterdir()), sorted(tmp_path.rglob("*"))
    output = beat.output()
    assert f"beat: made the folder {folder} for the schedule file" in output, output[-3000:]
    assert "Traceback" not in output and "ERROR/" not in output and "WARNING/" not in output, output[-3000:]
    beat.signal(signal.SIGTERM)
    assert_stopped_cleanly(beat)


def test_a_schedule_folder_that_cannot_be_made_stops_the_beat_with_one_line(
        redis_server: RedisServer, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """A schedule file whose folder cannot be made (a file stands in its way): one
    ``CRITICAL`` line naming the path and why, exit code 78 (a configuration error: a
    supervisor should not restart it), no traceback."""
    (tmp_path / "proj").write_text("a file, not a folder\n")
    beat = start_beat(redis_server, tmp_path, "no-folder", {"s-folder-hourly": {"every": 3600}}, wait=False,
                      schedule_file=tmp_path / "proj" / "beat-1")
    processes.append(beat)
    assert beat.process is not None
    code = beat.process.wait(60)
    output = beat.output()
    assert code == 78, f"exited {code}\n{output[-3000:]}"
    critical = [line for line in output.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1, output[-3000:]
    assert str(tmp_path / "proj" / "beat-1") in critical[0], critical[0]
    assert "cannot open the schedule file" in critical[0] and "--schedule" in critical[0], critical[0]
    assert "Traceback" not in output and "WARNING/" not in output, output[-3000:]
