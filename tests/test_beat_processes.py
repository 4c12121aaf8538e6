"""Real ``celery beat -S singleton`` processes, a real worker, one real redis-server.

Each beat has its own schedule file and process (so its own instance id);
the worker runs ``tests.apps.beat_app.record``, which records every real
execution with the slot it was sent for. Waits are deadlines on conditions.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from .beat_support import (
    RUNS_KEY,
    assert_once_per_slot,
    read_runs,
    slot_floor,
    start_beat,
    wait_for_slot,
)
from .support import LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, start_worker, wait_for

pytestmark = pytest.mark.slow

UTC = timezone.utc
QUEUE = "beat-tests"


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    """One worker for the module: solo pool, one message at a time (easy to drain)."""
    process = start_worker(redis_server, "tests.apps.beat_app", f"beatworker-{uuid.uuid4().hex[:6]}",
                           pool="solo", concurrency=1, extra=["--prefetch-multiplier", "1"])
    yield process
    process.stop()


@pytest.fixture
def clean(redis_server: RedisServer, worker: CeleryProcess) -> Iterator[str]:
    """Fresh claims and run records for a test; yields a unique entry-name prefix."""
    if worker.process is None or worker.process.poll() is not None:
        raise AssertionError(f"the worker died:\n{worker.output()[-3000:]}")
    redis_server.client(LOCK_DB).flushdb()
    redis_server.client(RECORD_DB).flushdb()
    yield f"t{uuid.uuid4().hex[:6]}-"


def drain(redis_server: RedisServer) -> None:
    """Wait until the worker has executed every message sent so far."""
    broker = redis_server.client(0)
    wait_for(lambda: broker.llen(QUEUE) == 0 and broker.hlen("unacked") == 0,
             timeout=60, message="the worker to drain the queue")


def runs_of(redis_server: RedisServer, entry: str) -> list[dict[str, Any]]:
    return [run for run in read_runs(redis_server) if run["entry"] == entry]


def assert_all_claimed(beats: list[CeleryProcess], entry: str, minimum: int) -> None:
    """Every beat took part: it logged a won or skipped claim for at least ``minimum`` slots."""
    for beat in beats:
        log = beat.output()
        decisions = log.count(f"beat: {entry}: slot ")
        assert decisions >= minimum, f"{beat.log.name} hardly claimed:\n{log[-2000:]}"


def test_three_beats_run_each_slot_once(redis_server: RedisServer, clean: str, tmp_path: Path,
                                        processes: list[CeleryProcess]) -> None:
    """3 beats x 1 s interval, staggered start, 20 s: one execution per slot, none missed."""
    entry = f"{clean}every-second"
    schedule = {entry: {"every": 1}}
    began = time.time()
    for name in ("a", "b", "c"):  # each waits for the previous one to tick: staggered
        processes.append(start_beat(redis_server, tmp_path, name, schedule))
    wait_for(lambda: time.time() - began >= 20, timeout=40, interval=0.2, message="20 s of beats")
    stopped = time.time()
    for beat in processes:
        beat.stop()
    drain(redis_server)

    until = slot_floor(stopped - 1, 1)
    runs = runs_of(redis_server, entry)
    slots = assert_once_per_slot(runs, entry, timedelta(seconds=1), until)
    assert slots[0] <= slot_floor(began + 3, 1)
    assert len([s for s in slots if s <= until]) >= 18
    assert_all_claimed(processes, entry, minimum=10)


def test_sigkill_of_one_beat_leaves_no_gap(redis_server: RedisServer, clean: str, tmp_path: Path,
                                           processes: list[CeleryProcess]) -> None:
    """The same with one beat SIGKILLed mid-run: the others keep every slot covered."""
    entry = f"{clean}every-second"
    schedule = {entry: {"every": 1}}
    began = time.time()
    for name in ("a", "b", "c"):
        processes.append(start_beat(redis_server, tmp_path, name, schedule))
    wait_for(lambda: time.time() - began >= 8, timeout=30, interval=0.2, message="8 s of beats")
    # Kill the beat that won the latest slot, half-way between two slots.
    wait_for(lambda: runs_of(redis_server, entry), timeout=20, message="a first run")
    winner = runs_of(redis_server, entry)[-1]["instance"]
    time.sleep((0.5 - time.time() % 1) % 1)
    victim = next((beat for beat in processes if f":{beat.pid}:" in winner), processes[1])
    victim.kill_group()
    killed_at = time.time()
    wait_for(lambda: time.time() - began >= 20, timeout=40, interval=0.2, message="20 s of beats")
    stopped = time.time()
    for beat in processes:
        beat.stop()
    drain(redis_server)

    slots = assert_once_per_slot(runs_of(redis_server, entry), entry, timedelta(seconds=1),
                                 slot_floor(stopped - 1, 1))
    assert slots[-1] >= slot_floor(killed_at + 8, 1)  # slots after the kill were covered too
    assert_all_claimed([beat for beat in processes if beat is not victim], entry, minimum=12)


def test_clock_skew_of_beats_does_not_duplicate(redis_server: RedisServer, clean: str,
                                                tmp_path: Path,
                                                processes: list[CeleryProcess]) -> None:
    """Beats 0.4 s behind, on time and 0.4 s ahead, 2 s interval: one run per slot."""
    entry = f"{clean}every-two"
    schedule = {entry: {"every": 2}}
    began = time.time()
    for name, offset in (("behind", -0.4), ("ontime", 0.0), ("ahead", 0.4)):
        processes.append(start_beat(redis_server, tmp_path, name, schedule,
                                    clock={"offset": offset}))
    wait_for(lambda: time.time() - began >= 16, timeout=40, interval=0.2, message="16 s of beats")
    stopped = time.time()
    for beat in processes:
        beat.stop()
    drain(redis_server)

    runs = runs_of(redis_server, entry)
    slots = assert_once_per_slot(runs, entry, timedelta(seconds=2), slot_floor(stopped - 2.5, 2))
    assert len(slots) >= 6
    assert_all_claimed(processes, entry, minimum=4)


def test_crontab_every_minute_across_dst_with_three_beats(redis_server: RedisServer, clean: str,
                                                          tmp_path: Path,
                                                          processes: list[CeleryProcess]) -> None:
    """``* * * * *`` in Europe/Berlin, 3 beats on a shared fake clock running 20x.

    The fake clock starts at 2024-03-31 00:57:30 UTC, three minutes before
    Berlin's clocks jump from 02:00 to 03:00: each real minute runs once.
    """
    entry = f"{clean}minutely"
    speed = 20.0
    anchor = time.time()
    start = datetime(2024, 3, 31, 0, 57, 30, tzinfo=UTC).timestamp()
    clock = {"speed": speed, "anchor": anchor, "start": start}
    settings = {"timezone": "Europe/Berlin", "beat_max_loop_interval": 0.5}

    def fake_now() -> float:
        return start + (time.time() - anchor) * speed

    for name in ("a", "b", "c"):
        processes.append(start_beat(redis_server, tmp_path, name, {entry: {"cron": "* * * * *"}},
                                    settings=settings, clock=clock))
    end = datetime(2024, 3, 31, 1, 3, 10, tzinfo=UTC).timestamp()
    wait_for(lambda: fake_now() >= end, timeout=60, interval=0.2, message="fake 01:03:10")
    stopped = fake_now()
    for beat in processes:
        beat.stop()
    drain(redis_server)

    slots = assert_once_per_slot(runs_of(redis_server, entry), entry, timedelta(minutes=1),
                                 slot_floor(stopped - 60, 60))
    assert datetime(2024, 3, 31, 1, 0, tzinfo=UTC) in slots  # the minute the clocks jumped
    assert slots[-1] >= datetime(2024, 3, 31, 1, 2, tzinfo=UTC)
    assert_all_claimed(processes, entry, minimum=3)


def test_beats_survive_a_redis_outage(redis_server: RedisServer, clean: str, tmp_path: Path,
                                      processes: list[CeleryProcess]) -> None:
    """Claims Redis down: nothing sent (fail closed, logged), beats keep running, then recover."""
    claims = RedisServer().start()
    try:
        entry = f"{clean}every-second"
        settings = {"singleton_redis_url": claims.url(0),
                    "singleton_redis_options": {"socket_timeout": 1, "socket_connect_timeout": 1}}
        for name in ("a", "b"):
            processes.append(start_beat(redis_server, tmp_path, name, {entry: {"every": 1}},
                                        settings=settings))
        wait_for(lambda: len(runs_of(redis_server, entry)) >= 2, timeout=30, message="runs")

        claims.stop()
        down_at = time.time()
        wait_for(lambda: all("NOT sent" in beat.output() for beat in processes), timeout=30,
                 message="both beats to log unsent slots")
        wait_for(lambda: time.time() - down_at >= 4, timeout=10, message="4 s of outage")
        drain(redis_server)
        sent_while_down = [run for run in runs_of(redis_server, entry)
                           if datetime.strptime(run["slot"], "%Y-%m-%dT%H:%M:%SZ")
                           .replace(tzinfo=UTC).timestamp() > down_at + 1]
        assert sent_while_down == []
        log = processes[0].output()
        assert f"beat: {entry}: slot " in log and "NOT sent" in log

        claims.start()
        back_at = time.time()
        wait_for_slot(redis_server, slot_floor(back_at + 2, 1), timeout=60)
        assert all(beat.process is not None and beat.process.poll() is None for beat in processes)
        for beat in processes:
            beat.stop()
        drain(redis_server)
        runs = runs_of(redis_server, entry)
        counts: dict[str, int] = {}
        for run in runs:
            counts[run["slot"]] = counts.get(run["slot"], 0) + 1
        assert all(n == 1 for n in counts.values()), counts
        assert any("is back" in beat.output() for beat in processes)
    finally:
        claims.stop()


def test_bad_configuration_stops_beat_at_start(redis_server: RedisServer, clean: str,
                                               tmp_path: Path,
                                               processes: list[CeleryProcess]) -> None:
    beat = start_beat(redis_server, tmp_path, "bad", {f"{clean}x": {"every": 1}},
                      settings={"singleton_redis_url": "http://127.0.0.1:1/0"}, wait=False)
    processes.append(beat)
    assert beat.process is not None
    wait_for(lambda: beat.process.poll() is not None, timeout=60, message="beat to exit")
    assert beat.process.returncode != 0
    assert "singleton_redis_url must be a Redis URL" in beat.output()
    assert redis_server.client(RECORD_DB).llen(RUNS_KEY) == 0


def test_history_is_readable_after_real_beats(redis_server: RedisServer, clean: str,
                                              tmp_path: Path,
                                              processes: list[CeleryProcess]) -> None:
    """The history list the CLI will read: one JSON record per slot won."""
    entry = f"{clean}history"
    for name in ("a", "b"):
        processes.append(start_beat(redis_server, tmp_path, name, {entry: {"every": 1}}))
    wait_for(lambda: len(runs_of(redis_server, entry)) >= 3, timeout=30, message="three runs")
    for beat in processes:
        beat.stop()
    records = [json.loads(raw) for raw in
               redis_server.client(LOCK_DB).lrange("singleton:{beat}:history", 0, -1)]
    mine = [r for r in records if r["entry"] == entry]
    assert len(mine) == len({r["slot"] for r in mine}) >= 3
    assert set(mine[0]) == {"entry", "key", "task", "slot", "winner", "at"}
    assert mine[0]["key"] == f"singleton:{{beat:{entry}}}:{mine[0]['slot']}"


def test_control_beats_without_shared_claims_do_duplicate(redis_server: RedisServer, clean: str,
                                                          tmp_path: Path,
                                                          processes: list[CeleryProcess]) -> None:
    """Control: with different key prefixes the beats share no claims, and the records show it."""
    entry = f"{clean}control"
    for name in ("a", "b"):
        processes.append(start_beat(redis_server, tmp_path, name, {entry: {"every": 1}},
                                    settings={"singleton_key_prefix": f"prefix-{name}"}))

    def duplicated_slots() -> int:
        counts: dict[str, int] = {}
        for run in runs_of(redis_server, entry):
            counts[run["slot"]] = counts.get(run["slot"], 0) + 1
        return sum(1 for n in counts.values() if n > 1)

    wait_for(lambda: duplicated_slots() >= 3, timeout=30, message="slots run twice")
    with pytest.raises(AssertionError, match="more than once"):
        assert_once_per_slot(runs_of(redis_server, entry), entry, timedelta(seconds=1),
                             slot_floor(time.time() - 5, 1))
