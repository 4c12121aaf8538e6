"""``celery_singleton_beat.contrib.redbeat.SingletonRedBeatScheduler`` on RedBeat's own keys.

* in-process schedulers (sends recorded, real time): what RedBeat's API does
  reaches the beat at its next tick; ``last_run_at`` is the slot; nothing is
  written between claims won ahead and their publish;
* three real beats on one Redis beside three beats of RedBeat's own
  ``RedBeatScheduler``, entries created and edited through RedBeat's API while
  they run, one beat of each SIGKILLed: one run per slot and no gap for ours,
  and what RedBeat's lock hand-over costs, measured side by side and printed.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta
from typing import Any

import pytest

from .support import LOCK_DB, RedisServer, importorskip, wait_for
from .support.beat import already_scheduled
from .support.redbeat import OURS, api_app, create_entry, meta_of, recording_scheduler, set_every
from .support.slots import UTC, parse_slot, slot_floor

importorskip("redbeat")


def sent_names(scheduler: Any) -> list[str]:
    return [sent["args"][0] for sent in scheduler.sent]


def test_base_install_does_not_import_redbeat() -> None:
    """The package imports without RedBeat; the contrib module names the extra."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'redbeat':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import celery_singleton_beat, celery_singleton_beat.cli, celery_singleton_beat.contrib\n"
        "try:\n"
        "    import celery_singleton_beat.contrib.redbeat\n"
        "except ImportError as exc:\n"
        "    print('HINT', exc)\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] == 'redbeat'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout
    assert "pip install 'celery-singleton-beat[redbeat]'" in done.stdout


def test_what_redbeats_api_does_reaches_the_beat_at_its_next_tick(redis_db: Any, redis_server: RedisServer) -> None:
    """Created, edited, disabled, enabled and deleted through RedBeat's API: each is in the
    beat's schedule after its next tick. A new entry sends nothing before its next slot
    (RedBeat's own scheduler would send it at once)."""
    from redbeat import RedBeatSchedulerEntry

    api = api_app(redis_server)
    scheduler = recording_scheduler(redis_server)
    try:
        scheduler.tick()
        assert scheduler.schedule == {}
        create_entry(api, "hourly", 3600)
        scheduler.tick()
        assert list(scheduler.schedule) == ["hourly"]
        assert scheduler.schedule["hourly"].schedule.run_every == timedelta(hours=1)
        set_every(api, "hourly", 7200)
        scheduler.tick()
        assert scheduler.schedule["hourly"].schedule.run_every == timedelta(hours=2)
        key = RedBeatSchedulerEntry.generate_key(api, "hourly")
        entry = RedBeatSchedulerEntry.from_key(key, app=api)
        entry.enabled = False
        entry.save()
        scheduler.tick()
        assert scheduler.schedule == {}
        entry.enabled = True
        entry.save()
        scheduler.tick()
        assert list(scheduler.schedule) == ["hourly"]
        entry.delete()
        scheduler.tick()
        assert scheduler.schedule == {}
        assert scheduler.sent == []
    finally:
        scheduler.close()


def test_last_run_at_is_the_slot_written_once_by_the_beat_that_sent_it(
        redis_db: Any, redis_server: RedisServer) -> None:
    """Two beats; the entry's latest slot was missed (catch-up): one sends it, and RedBeat's
    ``meta`` says ``last_run_at`` = the slot (not the send time), one run, and its score in
    RedBeat's schedule is the next slot."""
    api = api_app(redis_server)
    already_scheduled(redis_server.client(LOCK_DB), {"hourly": {}})
    create_entry(api, "hourly", 3600)
    first, second = recording_scheduler(redis_server), recording_scheduler(redis_server)
    try:
        for scheduler in (first, second):
            wait_for(lambda scheduler=scheduler: scheduler.tick() > 0, timeout=10, message="the due slot handled")
        assert sent_names(first) + sent_names(second) == ["hourly"]
        sent = (first.sent + second.sent)[0]
        slot = parse_slot(sent["slot"])
        assert slot == slot_floor(datetime.now(UTC).timestamp(), 3600)
        meta = meta_of(api, "hourly")
        assert meta["last_run_at"] == slot
        assert meta["total_run_count"] == 1
        assert meta["score"] == (slot + timedelta(hours=1)).timestamp()
    finally:
        first.close()
        second.close()


def test_nothing_is_written_between_claims_won_ahead_and_their_send(
        redis_db: Any, redis_server: RedisServer) -> None:
    """Two entries due at once: the first send leaves the second's slot claimed ahead;
    ``meta`` is written only once both are sent. The entry deleted in between through
    RedBeat's API is not written back (no ``meta``, not in RedBeat's schedule)."""
    from redbeat.schedulers import get_redis

    api = api_app(redis_server)
    names = ["burst-a", "burst-b"]
    already_scheduled(redis_server.client(LOCK_DB), {name: {} for name in names})
    for name in names:
        create_entry(api, name, 3600)
    as_created = {name: meta_of(api, name) for name in names}
    scheduler = recording_scheduler(redis_server)
    try:
        assert scheduler.tick() == 0
        assert len(scheduler.sent) == 1
        assert scheduler.claims_in_flight
        first, other = sent_names(scheduler)[0], next(n for n in names if n not in sent_names(scheduler))
        assert meta_of(api, first) == as_created[first]  # not written while a claim is unsent
        from redbeat import RedBeatSchedulerEntry

        RedBeatSchedulerEntry(first, app=api).delete()
        assert scheduler.tick() == 0
        assert sent_names(scheduler) == [first, other]
        assert not scheduler.claims_in_flight
        assert meta_of(api, other)["total_run_count"] == 1
        client = get_redis(api)
        key = RedBeatSchedulerEntry.generate_key(api, first)
        assert not client.exists(key)
        assert client.zscore(api.redbeat_conf.schedule_key, key) is None
    finally:
        scheduler.close()


def test_an_entry_the_beat_cannot_schedule_is_logged_and_skipped(
        redis_db: Any, redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A definition with a bad ``singleton`` option does not stop the beat: the other entries run."""
    api = api_app(redis_server)
    scheduler = recording_scheduler(redis_server)
    try:
        create_entry(api, "bad", 3600, options={"singleton": "yes"})
        create_entry(api, "good", 3600)
        scheduler.tick()
        assert list(scheduler.schedule) == ["good"]
        assert f"RedBeat entry {OURS}bad not scheduled" in caplog.text
    finally:
        scheduler.close()
