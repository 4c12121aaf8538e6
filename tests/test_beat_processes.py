"""Real ``celery beat -S singleton`` processes, a real worker, one real redis-server.

Each beat has its own schedule file and process (so its own instance id);
the worker runs ``tests.apps.beat_app.record``, which records every real
execution with the slot it was sent for. Waits are deadlines on conditions.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from .support import (
    LOCK_DB,
    RECORD_DB,
    CeleryProcess,
    RedisServer,
    soak,
    wait_for,
)
from .support.beat import (
    RUNS_KEY,
    assert_once_per_slot,
    drain_worker,
    fresh_beat_state,
    module_beat_worker,
    runs_of,
    start_beat,
    wait_between_sends,
    wait_for_slot,
)
from .support.slots import UTC, parse_slot, slot_floor

pytestmark = pytest.mark.slow

QUEUE = "beat-tests"


@pytest.fixture(scope="module")
def beat_worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    """One worker for the module (see ``module_beat_worker``)."""
    yield from module_beat_worker(redis_server, "beatworker")


@pytest.fixture
def clean(redis_server: RedisServer, beat_worker: CeleryProcess) -> str:
    """Fresh claims and run records for a test; a unique entry-name prefix."""
    return fresh_beat_state(redis_server, beat_worker, "t")


def all_running(processes: list[CeleryProcess]) -> Callable[[], bool]:
    """The invariant of a soak: every one of ``processes`` still runs (fails at once otherwise)."""
    def check() -> bool:
        for process in processes:
            process.check_running()
        return True

    return check





def decisions(beat: CeleryProcess, entry: str) -> int:
    """Slots of ``entry`` the beat logged a won or skipped claim for."""
    return beat.output().count(f"beat: {entry}: slot ")


def run_until_each_claimed(beats: list[CeleryProcess], entry: str, minimum: int,
                           also: Callable[[], bool] = lambda: True) -> None:
    """Let the beats run until each decided ``minimum`` slots (and ``also`` holds), every one
    running all along. A wait on what the test needs, not a fixed time: on a loaded machine
    the last beat can take most of a fixed soak to start."""
    check = all_running(beats)
    wait_for(lambda: check() and all(decisions(beat, entry) >= minimum for beat in beats) and also(),
             timeout=120, message=f"each beat to decide {minimum} slots of {entry}")


def assert_all_claimed(beats: list[CeleryProcess], entry: str, minimum: int) -> None:
    """Every beat took part: it logged a won or skipped claim for at least ``minimum`` slots."""
    for beat in beats:
        assert decisions(beat, entry) >= minimum, f"{beat.log.name} hardly claimed:\n{beat.output()[-2000:]}"


def test_three_beats_run_each_slot_once(
        redis_server: RedisServer, beat_worker: CeleryProcess, clean: str, tmp_path: Path,
        processes: list[CeleryProcess]) -> None:
    """3 beats x 1 s interval, staggered start, 20 s: one execution per slot, none missed."""
    entry = f"{clean}every-second"
    schedule = {entry: {"every": 1}}
    began = time.time()
    for name in ("a", "b", "c"):  # each waits for the previous one to tick: staggered
        processes.append(start_beat(redis_server, tmp_path, name, schedule))
    # Eleven decisions each: the last decided slot can be the one ``until`` leaves out (it
    # may be due within the second before the stop), and ten must remain before it.
    run_until_each_claimed(processes, entry, 11)
    stopped = time.time()
    for beat in processes:
        beat.stop()
    drain_worker(redis_server, beat_worker, QUEUE)

    until = slot_floor(stopped - 1, 1)
    runs = runs_of(redis_server, entry)
    slots = assert_once_per_slot(runs, entry, timedelta(seconds=1), until)
    # Every slot from the first one at or after the instant the first beat scheduled the
    # entry (its record; a slot before it came before the entry was scheduled: a first
    # deploy) to the stop ran once. Not the instant the test saw "Starting...": the beat
    # reaches Redis and writes the record later, past a slot boundary on a loaded machine.
    since = float(redis_server.client(LOCK_DB).get(f"singleton:{{beat:{entry}}}:scheduled") or 0)
    assert since > began
    assert slots[0] == slot_floor(math.ceil(since), 1), (slots[0], since)
    assert len([s for s in slots if s <= until]) >= 10
    assert_all_claimed(processes, entry, minimum=10)


def test_sigkill_of_one_beat_leaves_no_gap(
        redis_server: RedisServer, beat_worker: CeleryProcess, clean: str, tmp_path: Path,
        processes: list[CeleryProcess]) -> None:
    """The same with one beat SIGKILLed mid-run: the others keep every slot covered."""
    entry = f"{clean}every-second"
    schedule = {entry: {"every": 1}}
    for name in ("a", "b", "c"):
        processes.append(start_beat(redis_server, tmp_path, name, schedule))
    run_until_each_claimed(processes, entry, 3)
    # Kill the beat that won the latest slot, half-way between two slots, its send done.
    wait_between_sends(redis_server, entry, 1, 1.0, 0.45, 0.55)
    winner = runs_of(redis_server, entry)[-1]["instance"]
    victim = next((beat for beat in processes if f":{beat.pid}:" in winner), processes[1])
    victim.kill_group()
    killed_at = time.time()
    survivors = [beat for beat in processes if beat is not victim]
    run_until_each_claimed(survivors, entry, 12, also=lambda: time.time() >= killed_at + 9)
    stopped = time.time()
    for beat in processes:
        beat.stop()
    drain_worker(redis_server, beat_worker, QUEUE)

    slots = assert_once_per_slot(runs_of(redis_server, entry), entry, timedelta(seconds=1),
                                 slot_floor(stopped - 1, 1))
    assert slots[-1] >= slot_floor(killed_at + 8, 1)  # slots after the kill were covered too
    assert_all_claimed([beat for beat in processes if beat is not victim], entry, minimum=12)


def test_clock_skew_of_beats_does_not_duplicate(redis_server: RedisServer, beat_worker: CeleryProcess, clean: str,
                                                tmp_path: Path,
                                                processes: list[CeleryProcess]) -> None:
    """Beats 0.4 s behind, on time and 0.4 s ahead, 2 s interval: one run per slot."""
    entry = f"{clean}every-two"
    schedule = {entry: {"every": 2}}
    for name, offset in (("behind", -0.4), ("ontime", 0.0), ("ahead", 0.4)):
        processes.append(start_beat(redis_server, tmp_path, name, schedule,
                                    clock={"offset": offset}))
    # Two slots more than the assertion needs: the latest may come after its cut-off.
    run_until_each_claimed(processes, entry, 4, also=lambda: len(runs_of(redis_server, entry)) >= 8)
    stopped = time.time()
    for beat in processes:
        beat.stop()
    drain_worker(redis_server, beat_worker, QUEUE)

    runs = runs_of(redis_server, entry)
    slots = assert_once_per_slot(runs, entry, timedelta(seconds=2), slot_floor(stopped - 2.5, 2))
    assert len(slots) >= 6
    assert_all_claimed(processes, entry, minimum=4)


def test_crontab_every_minute_across_dst_with_three_beats(
        redis_server: RedisServer, beat_worker: CeleryProcess, clean: str,
        tmp_path: Path,
        processes: list[CeleryProcess]) -> None:
    """``* * * * *`` in Europe/Berlin, 3 beats on a shared fake clock running 20x.

    The fake clock starts at 2024-03-31 00:57:30 UTC, three minutes before
    Berlin's clocks jump from 02:00 to 03:00: each real minute runs once. It stands
    still until all three beats have started (on a loaded machine the third one took
    longer to start than the 9 real seconds before the jump).
    """
    entry = f"{clean}minutely"
    speed = 20.0
    anchor_file = tmp_path / "clock-anchor"
    start = datetime(2024, 3, 31, 0, 57, 30, tzinfo=UTC).timestamp()
    clock = {"speed": speed, "anchor_file": str(anchor_file), "start": start}
    settings = {"timezone": "Europe/Berlin", "beat_max_loop_interval": 0.5}

    for name in ("a", "b", "c"):
        processes.append(start_beat(redis_server, tmp_path, name, {entry: {"cron": "* * * * *"}},
                                    settings=settings, clock=clock))
    anchor = time.time()
    staged = anchor_file.with_suffix(".new")
    staged.write_text(repr(anchor))
    staged.replace(anchor_file)  # whole, never half written

    def fake_now() -> float:
        return start + (time.time() - anchor) * speed

    end = datetime(2024, 3, 31, 1, 3, 10, tzinfo=UTC).timestamp()
    soak((end - fake_now()) / speed, check=all_running(processes), what="the fake clock to reach 01:03:10")
    stopped = fake_now()
    for beat in processes:
        beat.stop()
    drain_worker(redis_server, beat_worker, QUEUE)

    slots = assert_once_per_slot(runs_of(redis_server, entry), entry, timedelta(minutes=1),
                                 slot_floor(stopped - 60, 60))
    assert datetime(2024, 3, 31, 1, 0, tzinfo=UTC) in slots  # the minute the clocks jumped
    assert slots[-1] >= datetime(2024, 3, 31, 1, 2, tzinfo=UTC)
    assert_all_claimed(processes, entry, minimum=3)


def test_beats_survive_a_redis_outage(redis_server: RedisServer, beat_worker: CeleryProcess, clean: str, tmp_path: Path,
                                      processes: list[CeleryProcess],
                                      make_redis: Callable[..., RedisServer]) -> None:
    """Claims Redis down: nothing sent (fail closed, logged), beats keep running, then recover."""
    claims = make_redis()
    entry = f"{clean}every-second"
    settings = {"singleton_redis_url": claims.url(0),
                "singleton_redis_options": {"socket_timeout": 1, "socket_connect_timeout": 1}}
    beats = [start_beat(redis_server, tmp_path, name, {entry: {"every": 1}}, settings=settings)
             for name in ("a", "b")]
    wait_for(lambda: len(runs_of(redis_server, entry)) >= 2, timeout=30, message="runs")

    claims.stop()
    down_at = time.time()
    wait_for(lambda: all("NOT sent" in beat.output() for beat in beats), timeout=30,
             message="both beats to log unsent slots")
    soak(4 - (time.time() - down_at), check=all_running(beats), what="4 s of outage")
    drain_worker(redis_server, beat_worker, QUEUE)
    sent_while_down = [run for run in runs_of(redis_server, entry)
                       if parse_slot(run["slot"]).timestamp() > down_at + 1]
    assert sent_while_down == []
    log = beats[0].output()
    assert f"beat: {entry}: slot " in log and "NOT sent" in log

    claims.start()
    back_at = time.time()
    wait_for_slot(redis_server, slot_floor(back_at + 2, 1), timeout=60)
    all_running(beats)()
    for beat in beats:
        beat.stop()
    drain_worker(redis_server, beat_worker, QUEUE)
    counts: dict[str, int] = {}
    for run in runs_of(redis_server, entry):
        counts[run["slot"]] = counts.get(run["slot"], 0) + 1
    assert all(n == 1 for n in counts.values()), counts
    assert any("is back" in beat.output() for beat in beats)


def test_bad_configuration_stops_beat_at_start(redis_server: RedisServer, clean: str,
                                               tmp_path: Path,
                                               processes: list[CeleryProcess]) -> None:
    beat = start_beat(redis_server, tmp_path, "bad", {f"{clean}x": {"every": 1}},
                      settings={"singleton_redis_url": "http://127.0.0.1:1/0"}, wait=False)
    processes.append(beat)
    assert beat.process is not None
    wait_for(lambda: beat.process.poll() is not None, timeout=60, message="beat to exit")
    assert beat.process.returncode == 78, beat.tail(20)  # EX_CONFIG, as every start-up refusal
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
