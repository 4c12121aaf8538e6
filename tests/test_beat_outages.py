"""Beat slots through outages: the broker down at a beat's re-send, the lock Redis down at the worker.

Real ``celery beat -S singleton`` processes and real workers; the broker (or
the Redis of the slot claims) is a redis-server of the test's own, stopped and
started again with its append-only file, so what was queued survives. The
``CSB_PAUSE`` hook of ``tests/apps/beat_app.py`` blocks the beat that wins the
slot before or after its publish, so the test kills exactly that beat.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .support import LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, start_worker, wait_for
from .support.beat import BEAT_APP, claims_of, pause, paused_beat, read_runs, slot_counts, start_beat_pair

pytestmark = pytest.mark.slow

PERIOD = 4
#: Long enough for the test to stop the broker between the winner's publish and
#: the survivor's take-over (which comes one lease after the slot).
LEASE = 3.0


@pytest.fixture
def names(redis_server: RedisServer) -> Iterator[str]:
    """Fresh claims and records for a test; yields a unique entry-name prefix."""
    for db in (0, LOCK_DB, RECORD_DB):
        redis_server.client(db).flushdb()
    yield f"o{uuid.uuid4().hex[:6]}-"


def holder_pid(claim: dict[str, Any]) -> int:
    """The pid in a claim's instance id (``<host>:<pid>:<random>``)."""
    return int(str(claim.get("instance", "::")).split(":")[1] or 0)


# ----------------------------------------------------------------- point 3: a beat's re-send fails


@dataclass
class FailedTakeOver:
    """Two beats, the winner of the entry's first slot killed, the survivor's re-send refused."""

    broker: RedisServer
    survivor: CeleryProcess
    entry: str
    queue: str
    slot: str  # the first slot: taken over, handed back
    settings: dict[str, Any]

    def start_worker(self, redis_server: RedisServer, names: str) -> CeleryProcess:
        return start_worker(redis_server, BEAT_APP, f"w-{names}", pool="solo", concurrency=1,
                            extra=["-Q", self.queue],
                            env={"CSB_BEAT_SETTINGS": json.dumps(self.settings)})

    def drained(self) -> bool:
        client = self.broker.client(0)
        return client.llen(self.queue) == 0 and client.hlen("unacked") == 0


def failed_take_over(redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
                     tmp_path: Path, processes: list[CeleryProcess], when: str) -> FailedTakeOver:
    """Beat A wins the first slot and blocks ``when`` ("before" / "after") its publish; the
    broker (a redis-server with an append-only file) is stopped and A killed; beat B takes
    the slot over one lease later, cannot publish, and hands it back (``released``, B's name).
    Returns with the broker still down."""
    broker = make_redis("--appendonly", "yes")
    entry, warm, queue = f"{names}slot", f"{names}warm", f"late-{names}"
    schedule = {entry: {"every": PERIOD, "options": {"queue": queue}},
                # Sent by both beats every second, so each has its broker connection open
                # (a beat connects at its first publish, and would wait for the broker there).
                warm: {"every": 1, "options": {"singleton": False, "queue": f"warm-{names}"}}}
    settings = {"broker_url": broker.url(0), "singleton_beat_pending_lease": LEASE,
                "singleton_beat_catch_up": "none", "beat_max_loop_interval": 1}
    marker = f"pause:{names}"
    beats = start_beat_pair(redis_server, tmp_path, schedule, settings,
                            pause(marker, 1, when, entry), PERIOD)
    processes.extend(beats)
    victim = paused_beat(redis_server, beats, marker)
    survivor = next(beat for beat in beats if beat is not victim)
    [(slot, claim)] = claims_of(redis_server, entry).items()
    assert holder_pid(claim) == victim.pid, claim
    wait_for(lambda: survivor.output().count(f"Sending due task {warm}") >= 2, timeout=LEASE / 2,
             message="the survivor to have published (its broker connection is open)")
    broker.stop()  # before the survivor's take-over, one lease after the slot
    victim.kill_group()
    wait_for(lambda: claims_of(redis_server, entry)[slot].get("state") == "released", timeout=60,
             message="the survivor to hand the slot back after its failed publish")
    assert holder_pid(claims_of(redis_server, entry)[slot]) == survivor.pid
    return FailedTakeOver(broker, survivor, entry, queue, slot, settings)


def ran_once_each(redis_server: RedisServer, entry: str, slots: Iterable[str]) -> None:
    counts = slot_counts(read_runs(redis_server), entry)
    assert {slot: counts.get(slot, 0) for slot in slots} == {slot: 1 for slot in slots}, counts


@pytest.mark.parametrize("survivor_after_hand_back", ["keeps-running", "stopped"])
def test_a_dead_beats_queued_copy_is_not_lost_when_the_take_over_cannot_publish(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess], survivor_after_hand_back: str) -> None:
    """Beat A publishes the slot and dies before marking it sent; beat B takes the claim
    over, but the broker is down: B hands the slot back. The broker comes back with A's
    copy queued. The slot runs once: the worker runs the one copy there is (a
    ``released`` claim drops nothing), or B sends it again once the broker answers and
    the worker runs one of the two copies. With B running, the slots B could not
    publish during the outage are sent too.

    Before the fix the worker dropped A's copy (another instance than the claim's)
    and nobody looked at B's hand-backs again: every slot of the outage was lost.
    """
    case = failed_take_over(redis_server, make_redis, names, tmp_path, processes, "after")
    if survivor_after_hand_back == "stopped":
        case.survivor.stop()
    case.broker.start()  # A's copy is still queued (append-only file)
    assert case.broker.client(0).llen(case.queue) == 1
    # Slots claimed so far: the first, and any later one B could not publish either.
    outage = sorted(claims_of(redis_server, case.entry))
    processes.append(case.start_worker(redis_server, names))

    expected = outage if survivor_after_hand_back == "keeps-running" else [case.slot]
    wait_for(lambda: all(claims_of(redis_server, case.entry)[slot].get("state") == "received"
                         for slot in expected), timeout=90,
             message=f"a worker to accept slots {expected}")
    wait_for(case.drained, timeout=60, message="the worker to drain the queue")
    ran_once_each(redis_server, case.entry, expected)


def test_a_slot_no_beat_could_publish_is_sent_once_the_broker_is_back(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """Beat A claims the slot and dies before publishing; beat B takes it over while the
    broker is down and hands it back. No copy exists: B keeps watching its own hand-back
    and sends the slot once the broker answers. Before the fix it was lost."""
    case = failed_take_over(redis_server, make_redis, names, tmp_path, processes, "before")
    case.broker.start()
    assert case.broker.client(0).llen(case.queue) == 0  # no copy of the slot anywhere
    outage = sorted(claims_of(redis_server, case.entry))
    processes.append(case.start_worker(redis_server, names))

    wait_for(lambda: all(claims_of(redis_server, case.entry)[slot].get("state") == "received"
                         for slot in outage), timeout=90,
             message=f"slots {outage} to be sent once the broker is back, and run")
    assert holder_pid(claims_of(redis_server, case.entry)[case.slot]) == case.survivor.pid
    wait_for(case.drained, timeout=60, message="the worker to drain the queue")
    ran_once_each(redis_server, case.entry, outage)
