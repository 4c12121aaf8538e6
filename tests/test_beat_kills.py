"""A beat killed or stopped at the worst moment: no slot lost, none executed twice.

Real ``celery beat -S singleton`` processes and a real worker on one
redis-server. The ``CSB_PAUSE`` hook of ``tests/apps/beat_app.py`` blocks the
first beat that reaches its n-th publish (before or after the message goes
out) and names it in the record database, so each test kills exactly the beat
that holds the claims, at exactly the moment it names.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .support import (
    LOCK_DB,
    CeleryProcess,
    Owner,
    RedisServer,
    owning,
    start_worker,
    wait_for,
)
from .support.beat import (
    assert_stopped_cleanly,
    drain_worker,
    pause,
    paused_beat,
    read_runs,
    runs_by_slot,
    slot_counts,
    start_beat,
    start_beat_pair,
)
from .support.holding_proxy import HoldingProxy
from .support.slots import parse_slot

pytestmark = pytest.mark.slow

QUEUE = "beat-tests"
PERIOD = 4
#: Short pending lease so the survivors look again within a second or two.
SETTINGS = {"singleton_beat_pending_lease": 1.0, "singleton_beat_catch_up": "none",
            "beat_max_loop_interval": 1}


def wait_for_all(redis_server: RedisServer, prefix: str, slot: str, entries: list[str],
                 timeout: float = 60) -> None:
    wait_for(lambda: set(runs_by_slot(redis_server, prefix).get(slot, {})) >= set(entries),
             timeout=timeout, message=f"every entry to run for slot {slot}")





def start_beats(redis_server: RedisServer, tmp_path: Path, schedule: dict[str, Any],
                env: dict[str, str], processes: list[CeleryProcess]) -> list[CeleryProcess]:
    """Two beats with the pause hook; both ticking before the burst's slot comes."""
    beats = start_beat_pair(redis_server, tmp_path, schedule, SETTINGS, env, PERIOD)
    processes.extend(beats)
    return beats


def burst_schedule(prefix: str, count: int) -> dict[str, Any]:
    return {f"{prefix}{i:03d}": {"every": PERIOD} for i in range(count)}


def first_slot(redis_server: RedisServer, prefix: str) -> str:
    wait_for(lambda: runs_by_slot(redis_server, prefix), timeout=60, message="a first run")
    return min(runs_by_slot(redis_server, prefix), key=parse_slot)


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[CeleryProcess]:
    with owning(Owner("beat-kill worker")) as owner:
        process = start_worker(redis_server, "tests.apps.beat_app", f"killworker-{uuid.uuid4().hex[:6]}",
                               pool="solo", concurrency=1)
    yield process
    owner.close()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_the_winning_beat_stopped_mid_burst_loses_no_slot(
        redis_server: RedisServer, worker: CeleryProcess, names: str, tmp_path: Path,
        processes: list[CeleryProcess], signum: int) -> None:
    """300 entries due on one instant; the beat that won them stops after 40 sends.

    Every entry still runs exactly once for that slot: the survivor sends what
    the stopped beat claimed but never published.
    """
    schedule = burst_schedule(names, 300)
    marker = f"pause:{names}"
    beats = start_beats(redis_server, tmp_path, schedule, pause(marker, 40, "before"), processes)
    victim = paused_beat(redis_server, beats, marker)
    survivor = next(beat for beat in beats if beat is not victim)
    victim.signal(signum)
    wait_for(lambda: victim.process is not None and victim.process.poll() is not None,
             timeout=30, message="the stopped beat to exit")

    slot = first_slot(redis_server, names)
    wait_for_all(redis_server, names, slot, list(schedule), timeout=60)
    survivor.check_running()
    survivor.stop()
    drain_worker(redis_server, worker, QUEUE)
    per_entry = runs_by_slot(redis_server, names)[slot]
    assert sorted(per_entry) == sorted(schedule)
    assert {n for n in per_entry.values()} == {1}, {e: n for e, n in per_entry.items() if n != 1}
    for label, counts in runs_by_slot(redis_server, names).items():
        assert max(counts.values()) == 1, f"slot {label} ran twice: {counts}"
    assert "took over" in survivor.output()


def test_a_beat_stopped_while_its_publish_waits_for_the_broker_exits_cleanly(
        redis_server: RedisServer, names: str, tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """SIGTERM (a pod's termination) while the beat waits for the broker's reply to a publish.

    Celery's handler closes the scheduler, then raises ``SystemExit``. Closed at
    that moment, the scheduler released the broker connection the interrupted
    read was using: redis-py then raised "I/O operation on closed file" in place
    of the ``SystemExit``, beat logged the entry as not applied and ran on, until
    the grace period's SIGKILL. The beat must exit, having logged no error.
    """
    entry = f"{names}held"
    with HoldingProxy(redis_server.port, "broker") as broker:
        broker.hold(b"LPUSH")  # the publish reaches the broker only when let go
        beat = start_beat(redis_server, tmp_path, "held", {entry: {"every": 1}},
                          settings={**SETTINGS, "broker_url": broker.url(0)})
        processes.append(beat)
        wait_for(lambda: broker.held_with(b"LPUSH"), timeout=30, message="the beat's publish to be sent")
        beat.terminate()
        broker.let_go([])
        assert_stopped_cleanly(beat)


def test_a_beat_killed_between_claim_and_publish_loses_no_slot(
        redis_server: RedisServer, worker: CeleryProcess, names: str, tmp_path: Path,
        processes: list[CeleryProcess]) -> None:
    """One entry; the winner claims the slot and is SIGKILLed before it publishes."""
    entry = f"{names}solo"
    marker = f"pause:{names}"
    beats = start_beats(redis_server, tmp_path, {entry: {"every": PERIOD}},
                        pause(marker, 1, "before"), processes)
    victim = paused_beat(redis_server, beats, marker)
    survivor = next(beat for beat in beats if beat is not victim)
    claims = redis_server.client(LOCK_DB)
    claimed = [key for key in claims.scan_iter(f"singleton:{{beat:{entry}}}:[0-9]*")]
    assert len(claimed) == 1, claimed
    slot = claimed[0].decode().rsplit("}:", 1)[1]
    victim.kill_group()

    wait_for(lambda: runs_by_slot(redis_server, names).get(slot), timeout=60,
             message=f"slot {slot} to run after the claim holder died")
    survivor.stop()
    drain_worker(redis_server, worker, QUEUE)
    assert runs_by_slot(redis_server, names)[slot] == {entry: 1}
    for label, counts in runs_by_slot(redis_server, names).items():
        assert counts == {entry: 1}, f"slot {label}: {counts}"


def test_a_slot_published_twice_runs_once(
        redis_server: RedisServer, names: str, tmp_path: Path,
        processes: list[CeleryProcess]) -> None:
    """The winner publishes, then dies before it marks the slot sent; the survivor
    takes the slot over and sends it again. Both messages wait in a queue no worker
    reads yet; a worker then executes the slot once and drops the other copy."""
    entry = f"{names}twice"
    marker = f"pause:{names}"
    queue = f"late-{names}"
    beats = start_beats(redis_server, tmp_path, {entry: {"every": PERIOD, "options": {"queue": queue}}},
                        pause(marker, 1, "after"), processes)
    victim = paused_beat(redis_server, beats, marker)
    survivor = next(beat for beat in beats if beat is not victim)
    victim.kill_group()
    broker = redis_server.client(0)
    wait_for(lambda: "took over" in survivor.output(), timeout=60,
             message="the survivor to take the dead beat's slot over")
    wait_for(lambda: broker.llen(queue) >= 2, timeout=30, message="both copies in the queue")
    survivor.stop()
    messages = [json.loads(raw) for raw in broker.lrange(queue, 0, -1)]
    slots = [m["headers"].get("singleton_beat_slot") for m in messages]
    ids = [m["headers"]["id"] for m in messages]
    assert slots[0] == slots[1] and ids[0] == ids[1], (slots, ids)  # one slot, one task id

    worker = start_worker(redis_server, "tests.apps.beat_app", f"late-{uuid.uuid4().hex[:6]}",
                          pool="solo", concurrency=1, extra=["-Q", queue])
    processes.append(worker)
    drain_worker(redis_server, worker, queue)  # the run recorded, not only its message acknowledged
    wait_for(lambda: "dropped" in worker.output(), timeout=30, message="the drop to be logged")
    assert slot_counts(read_runs(redis_server), entry) == {slots[0]: 1}
    stats = redis_server.client(LOCK_DB).hgetall(f"singleton:{{stats}}:beat:{entry}")
    assert int(stats.get(b"duplicates_dropped", 0)) == 1, stats

