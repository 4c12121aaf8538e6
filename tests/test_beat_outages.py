"""Beat slots through outages: the broker down at a beat's re-send, the claims Redis down at the worker.

Real ``celery beat -S singleton`` processes and real workers; the broker (or
the Redis of the slot claims) is a redis-server of the test's own, stopped and
started again with its append-only file, so what it held survives. The
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

import kombu
import pytest
import redis

from celery_singleton_beat.task.slot_delivery import CLAIM_HEADER, INSTANCE_HEADER

from .support import LOCK_DB, RECORD_DB, CeleryProcess, RedisServer, queue_drained, soak, start_worker, wait_for
from .support.beat import (
    BEAT_APP,
    claims_of,
    pause,
    paused_beat,
    read_runs,
    slot_counts,
    start_beat_pair,
    worker_idle,
)
from .support.servers import flushdb

pytestmark = pytest.mark.slow

PERIOD = 4
#: Long enough for the test to stop the broker between the winner's publish and
#: the survivor's take-over (which comes one lease after the slot).
LEASE = 3.0


@pytest.fixture
def names(redis_server: RedisServer) -> Iterator[str]:
    """Fresh claims and records for a test; yields a unique entry-name prefix."""
    for db in (0, LOCK_DB, RECORD_DB):
        flushdb(redis_server.client(db))
    yield f"o{uuid.uuid4().hex[:6]}-"


def holder_pid(claim: dict[str, Any]) -> int:
    """The pid in a claim's instance id (``<host>:<pid>:<random>``)."""
    return int(str(claim.get("instance", "::")).split(":")[1] or 0)


def first_claim(server: RedisServer, entry: str, db: int | None = None) -> tuple[str, dict[str, Any]]:
    """The entry's earliest slot claim: the one its paused winner holds. On a slow machine
    the other beat can have claimed the next slot by the time the test looks."""
    claims = claims_of(server, entry, db=LOCK_DB if db is None else db)
    slot = min(claims)
    return slot, claims[slot]


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
    victim: int  # the pid of beat A, which published the slot and was killed
    #: Messages in ``queue`` just before the broker went down (the survivor re-sends the
    #: slot as soon as the broker is back: only then is the queue read before it).
    queued_before_outage: int = 0

    def start_worker(self, redis_server: RedisServer, names: str) -> CeleryProcess:
        return start_worker(redis_server, BEAT_APP, f"w-{names}", pool="solo", concurrency=1,
                            extra=["-Q", self.queue],
                            env={"CSB_BEAT_SETTINGS": json.dumps(self.settings)})

    def drained(self) -> bool:
        client = self.broker.client(0)
        return queue_drained(client, self.queue)

    def copies(self) -> list[int]:
        """The pids of the beats whose copy of ``slot`` waits in the queue (no worker reads it)."""
        pids = []
        for raw in self.broker.client(0).lrange(self.queue, 0, -1):
            headers = json.loads(raw)["headers"]
            if str(headers.get(CLAIM_HEADER)).endswith(f"}}:{self.slot}"):
                pids.append(holder_pid({"instance": headers.get(INSTANCE_HEADER)}))
        return pids


def failed_take_over(redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
                     tmp_path: Path, processes: list[CeleryProcess], when: str) -> FailedTakeOver:
    """Beat A wins the first slot and blocks ``when`` ("before" / "after") its publish; the
    broker (a redis-server with an append-only file) is stopped and A killed; beat B takes
    the slot over one lease later, cannot publish, and hands it back (``released``, B's name).
    Returns with the broker still down.

    B's take-over publish waits (the pause hook's ``hold``) until the broker is down: the
    order comes from the test, not from B being slower than the test on a loaded machine."""
    broker = make_redis("--appendonly", "yes")
    entry, warm, queue = f"{names}slot", f"{names}warm", f"late-{names}"
    schedule = {entry: {"every": PERIOD, "options": {"queue": queue}},
                # Sent by both beats every second, so each has its broker connection open
                # (a beat connects at its first publish, and would wait for the broker there).
                warm: {"every": 1, "options": {"singleton": False, "queue": f"warm-{names}"}}}
    settings = {"broker_url": broker.url(0), "singleton_beat_pending_lease": LEASE,
                "singleton_beat_catch_up": "none", "beat_max_loop_interval": 1}
    marker, hold = f"pause:{names}", f"hold:{names}"
    records = redis_server.client(RECORD_DB)
    records.set(hold, 1)
    beats = start_beat_pair(redis_server, tmp_path, schedule, settings,
                            pause(marker, 1, when, entry, hold=hold), PERIOD)
    processes.extend(beats)
    victim = paused_beat(redis_server, beats, marker)
    survivor = next(beat for beat in beats if beat is not victim)
    slot, claim = first_claim(redis_server, entry)
    assert holder_pid(claim) == victim.pid, claim
    wait_for(lambda: records.get(f"{hold}:held") is not None, timeout=60,
             message="the survivor's take-over publish to wait for the test")
    assert int(records.get(f"{hold}:held") or 0) == survivor.pid
    # The warm entry comes due every second, before the take-over one lease after the slot.
    assert f"Sending due task {warm}" in survivor.output(), "the survivor's broker connection is open"
    queued = broker.client(0).llen(queue)
    broker.stop()
    victim.kill_group()
    records.delete(hold)
    wait_for(lambda: claims_of(redis_server, entry)[slot].get("state") == "released", timeout=60,
             message="the survivor to hand the slot back after its failed publish")
    assert holder_pid(claims_of(redis_server, entry)[slot]) == survivor.pid
    return FailedTakeOver(broker, survivor, entry, queue, slot, settings, victim.pid, queued)


def ran_once_each(redis_server: RedisServer, entry: str, slots: Iterable[str]) -> None:
    counts = slot_counts(read_runs(redis_server), entry)
    assert {slot: counts.get(slot, 0) for slot in slots} == {slot: 1 for slot in slots}, counts


@pytest.mark.parametrize("survivor_after_hand_back", ["keeps-running", "stopped"])
def test_a_dead_beats_queued_copy_is_not_lost_when_the_take_over_cannot_publish(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess], survivor_after_hand_back: str) -> None:
    """Beat A publishes the slot and dies before marking it sent; beat B takes the claim
    over, but the broker is down: B hands the slot back. The broker comes back with A's
    copy queued. The slot runs once: with B stopped, the worker runs the one copy there
    is (a ``released`` claim drops nothing); with B running, B sends it again once the
    broker answers (the worker starts after B's copy is queued) and the worker runs one
    of the two copies. With B running, the slots B could not publish during the outage
    are sent too.

    Before the fix the worker dropped A's copy (another instance than the claim's)
    and nobody looked at B's hand-backs again: every slot of the outage was lost.
    """
    case = failed_take_over(redis_server, make_redis, names, tmp_path, processes, "after")
    if survivor_after_hand_back == "stopped":
        case.survivor.stop()
    case.broker.start()  # A's copy is still queued (append-only file)
    if survivor_after_hand_back == "keeps-running":
        # B sends its hand-back again as soon as a publish of its works (within a second:
        # the warm entry), and its later slots too: the queue is not A's copy alone for
        # long. The test waits for B's copy, so the worker always finds both copies;
        # counting the queue right after the start raced with B (2 messages where 1).
        wait_for(lambda: case.survivor.pid in case.copies(), timeout=60,
                 message="B to send its hand-back again once the broker answers")
        assert sorted(case.copies()) == sorted([case.victim, case.survivor.pid])
    else:
        assert case.copies() == [case.victim]
        assert case.broker.client(0).llen(case.queue) == 1
    # Slots claimed so far: the first, and any later one B could not publish either.
    outage = sorted(claims_of(redis_server, case.entry))
    worker = case.start_worker(redis_server, names)
    processes.append(worker)

    expected = outage if survivor_after_hand_back == "keeps-running" else [case.slot]
    wait_for(lambda: all(claims_of(redis_server, case.entry)[slot].get("state") == "received"
                         for slot in expected), timeout=90,
             message=f"a worker to accept slots {expected}")
    wait_for(lambda: case.drained() and worker_idle(worker), timeout=60,
             message="the worker to drain the queue and finish its runs")
    ran_once_each(redis_server, case.entry, expected)


def test_a_slot_no_beat_could_publish_is_sent_once_the_broker_is_back(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """Beat A claims the slot and dies before publishing; beat B takes it over while the
    broker is down and hands it back. No copy exists: B keeps watching its own hand-back
    and sends the slot once the broker answers. Before the fix it was lost."""
    case = failed_take_over(redis_server, make_redis, names, tmp_path, processes, "before")
    # No copy of the slot anywhere: A died before its publish, B's take-over was refused.
    # (Read before the outage: once the broker is back, the survivor sends it at once.)
    assert case.queued_before_outage == 0
    case.broker.start()
    outage = sorted(claims_of(redis_server, case.entry))
    worker = case.start_worker(redis_server, names)
    processes.append(worker)

    wait_for(lambda: all(claims_of(redis_server, case.entry)[slot].get("state") == "received"
                         for slot in outage), timeout=90,
             message=f"slots {outage} to be sent once the broker is back, and run")
    assert holder_pid(claims_of(redis_server, case.entry)[case.slot]) == case.survivor.pid
    wait_for(lambda: case.drained() and worker_idle(worker), timeout=60,
             message="the worker to drain the queue and finish its runs")
    ran_once_each(redis_server, case.entry, outage)


# ----------------------------------------------------------------- point 4: the claims Redis down at the worker

HOLDING = "holding the message until Redis answers (fail closed)"
RAN_HERE = "delivered again after this worker ran it"
DROPPED_HERE = "delivered again after this worker dropped it"
HELD_BEHIND = "waits for Redis behind"


@dataclass
class TwoCopies:
    """Two copies of one slot in a queue no worker reads yet; the claims on ``lock``.

    ``others``: later slots the surviving beat sent before it stopped (it keeps sending
    until then: on a slow machine its take-over of ``slot`` can come just before the
    next one is due), each a single message in the same queue."""

    broker_url: str
    lock: RedisServer
    entry: str
    queue: str
    slot: str
    settings: dict[str, Any]
    others: int = 0
    #: The pids of the two beats that sent the slot (the killed one and the survivor).
    senders: frozenset[int] = frozenset()

    def start_worker(self, redis_server: RedisServer, name: str, pool: str = "solo") -> CeleryProcess:
        return start_worker(redis_server, BEAT_APP, name, pool=pool, concurrency=1,
                            extra=["-Q", self.queue],
                            env={"CSB_BEAT_SETTINGS": json.dumps(self.settings)})

    def ready(self) -> int:
        """Messages in the queue that no worker has taken (held ones are taken)."""
        with kombu.Connection(self.broker_url, connect_timeout=10) as connection:
            try:
                _, count, _ = connection.default_channel.queue_declare(self.queue, passive=True)
            except connection.channel_errors:  # no such queue (Redis: an empty list is none)
                return 0
            return int(count)

    def runs(self, redis_server: RedisServer) -> int:
        return slot_counts(read_runs(redis_server), self.entry).get(self.slot, 0)

    def drained(self) -> bool:
        """No message of the queue waits or is delivered unacknowledged (Redis broker)."""
        with redis.Redis.from_url(self.broker_url) as broker:
            return queue_drained(broker, self.queue)

    def dropped(self) -> int:
        stats = self.lock.client(0).hget(f"singleton:{{stats}}:beat:{self.entry}", "duplicates_dropped")
        return int(stats or 0)

    def ran_once(self, redis_server: RedisServer, worker: CeleryProcess) -> None:
        """Redis is back: one copy runs, the other is dropped, nothing else runs."""
        wait_for(lambda: self.runs(redis_server) >= 1 and self.dropped() >= 1, timeout=60,
                 message="one copy to run and the other to be dropped")
        worker.wait_for_line("Redis answers again", timeout=30)
        wait_for(lambda: self.ready() == 0, timeout=30, message="the queue to be empty")
        soak(2, check=lambda: self.runs(redis_server) == 1, what="no second run")
        assert self.runs(redis_server) == 1 and self.dropped() == 1


def hold_lines(worker: CeleryProcess, slot: str | None = None) -> int:
    """Slot messages (of ``slot``, if given) the worker started to hold (a redelivery kept in
    their place is not one)."""
    return sum(1 for line in worker.output().splitlines()
               if (HOLDING in line or HELD_BEHIND in line) and (slot is None or f"}}:{slot}" in line))


def two_copies(redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
               tmp_path: Path, processes: list[CeleryProcess], broker_url: str, later: int = 0,
               **settings: Any) -> TwoCopies:
    """Beat A publishes the first slot and is killed before marking it sent; beat B takes
    the slot over and sends it again, then stops (after sending ``later`` slots more, where
    asked: on a slow machine it may anyway). The claims live on a redis-server of the
    test's own (append-only file), so the test can stop it and start it again."""
    lock = make_redis("--appendonly", "yes")
    entry, queue = f"{names}slot", f"late-{names}"
    settings = {"broker_url": broker_url, "singleton_redis_url": lock.url(0),
                "singleton_beat_pending_lease": 1.0, "singleton_beat_catch_up": "none",
                "beat_max_loop_interval": 1, **settings}
    marker = f"pause:{names}"
    beats = start_beat_pair(redis_server, tmp_path, {entry: {"every": PERIOD, "options": {"queue": queue}}},
                            settings, pause(marker, 1, "after", entry), PERIOD)
    processes.extend(beats)
    victim = paused_beat(redis_server, beats, marker)
    survivor = next(beat for beat in beats if beat is not victim)
    slot, claim = first_claim(lock, entry, db=0)
    assert holder_pid(claim) == victim.pid, claim
    victim.kill_group()
    case = TwoCopies(broker_url, lock, entry, queue, slot, settings,
                     senders=frozenset({victim.pid, survivor.pid}))
    survivor.wait_for_log("took over", timeout=60)
    wait_for(lambda: case.ready() >= 2 + later, timeout=30 + later * PERIOD,
             message=f"both copies of the slot and {later} later slot(s) queued")
    survivor.stop()
    claims = claims_of(lock, entry, db=0)
    assert holder_pid(claims[slot]) == survivor.pid
    case.others = sum(1 for label in claims if label > slot)
    return case


@pytest.mark.parametrize(("broker_kind", "pool"), [
    ("redis", "solo"), ("redis-acks-late", "solo"), ("rabbitmq", "solo"), ("rabbitmq-acks-late", "solo"),
    ("redis", "prefork"), ("redis", "threads"), ("redis", "gevent")])
def test_a_slot_message_the_worker_cannot_check_waits_for_redis(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess], broker_kind: str, pool: str,
        request: pytest.FixtureRequest) -> None:
    """Two copies of a re-sent slot reach a worker while the claims Redis is down. Fail
    closed (the default): neither runs, neither is acknowledged or requeued (each is
    received once: no redelivery loop), and the worker keeps them; when Redis answers,
    one runs and the other is dropped. With the event loop (solo, prefork, threads) the
    check is retried on the loop's timer; gevent has no event loop (a greenlet timer).

    Before the fix the worker ran both copies, unchecked ("could not check beat slot
    ...; running it"), whatever ``singleton_fail_open`` said.
    """
    url = request.getfixturevalue("rabbitmq") if broker_kind.startswith("rabbitmq") else redis_server.url(0)
    case = two_copies(redis_server, make_redis, names, tmp_path, processes, url,
                      task_acks_late=broker_kind.endswith("acks-late"))
    case.lock.stop()
    worker = case.start_worker(redis_server, f"w-{names}", pool)
    processes.append(worker)
    worker.wait_for_line("could not check beat slot", timeout=60)

    def held() -> bool:
        worker.check_running()
        return case.runs(redis_server) == 0

    soak(5, check=held, what="both copies held, none run")
    assert case.ready() == 0, "both copies are with the worker, unacknowledged"
    assert hold_lines(worker, case.slot) == 2, worker.output()  # one delivery each: nothing went round
    case.lock.start()  # the claim (B's, "sent") is back from the append-only file
    case.ran_once(redis_server, worker)


def test_a_slot_message_held_past_the_visibility_timeout_is_kept_once(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess]) -> None:
    """Redis broker with a short ``visibility_timeout``: kombu gives the held copies back to
    the queue and the worker gets them again while it still holds them. It keeps one
    delivery of each, and the slot still runs once when the claims Redis answers."""
    transport = {"visibility_timeout": 2, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
    case = two_copies(redis_server, make_redis, names, tmp_path, processes, redis_server.url(0),
                      broker_transport_options=transport)
    case.lock.stop()
    worker = case.start_worker(redis_server, f"w-{names}")
    processes.append(worker)
    worker.wait_for_line("could not check beat slot", timeout=60)

    def held() -> bool:
        worker.check_running()
        return case.runs(redis_server) == 0

    # Three visibility timeouts (and restore sweeps): each copy comes back two or three times.
    soak(3 * (transport["visibility_timeout"] + transport["unacked_restore_interval"]), check=held,
         what="the copies held, none run")
    assert hold_lines(worker, case.slot) == 2, "each delivered again in its own place, not held twice"
    assert worker.output().count("delivered again while held") >= 2
    case.lock.start()
    case.ran_once(redis_server, worker)


FAIL_OPEN = "running it (fail open)"


@pytest.mark.parametrize("later", [0, 1], ids=["survivor-stops", "survivor-sends-one-more"])
def test_with_fail_open_a_slot_message_the_worker_cannot_check_runs(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess], later: int) -> None:
    """Fail open (``singleton_beat_fail_open``, which follows ``singleton_fail_open`` when
    unset, as here: beats then send unclaimed slots too): with the claims Redis down, the
    worker runs every delivery it cannot check, unchecked: both copies of the slot (one
    run each), and each later slot's message once. The surviving beat may send a later
    slot before it stops (on a slow machine); ``survivor-sends-one-more`` makes it so.
    Before, the test counted every fail-open line as a copy of the slot (3 where 2)."""
    case = two_copies(redis_server, make_redis, names, tmp_path, processes, redis_server.url(0),
                      later=later, singleton_fail_open=True)
    assert case.others >= later
    case.lock.stop()
    worker = case.start_worker(redis_server, f"w-{names}")
    processes.append(worker)
    wait_for(lambda: case.runs(redis_server) == 2, timeout=60, message="both copies to run")
    wait_for(lambda: worker.output().count(FAIL_OPEN) >= 2 + case.others, timeout=60,
             message="every message to run")
    wait_for(lambda: case.drained() and worker_idle(worker), timeout=30,
             message="the queue drained and the worker's runs finished")
    lines = [line for line in worker.output().splitlines() if FAIL_OPEN in line]
    assert sum(1 for line in lines if f"}}:{case.slot}" in line) == 2, lines
    assert len(lines) == 2 + case.others, lines
    senders = [holder_pid(run) for run in read_runs(redis_server)
               if run["entry"] == case.entry and run["slot"] == case.slot]
    assert sorted(senders) == sorted(case.senders), "each copy ran once: the dead beat's and the survivor's"
    assert hold_lines(worker) == 0


@pytest.mark.parametrize(("broker_kind", "stop"), [("redis", "sigkill"), ("redis", "sigterm"),
                                                  ("rabbitmq", "sigkill")])
def test_a_held_slot_message_goes_back_to_the_broker_when_its_worker_goes(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess], broker_kind: str, stop: str,
        request: pytest.FixtureRequest) -> None:
    """A worker holding the copies of a slot (claims Redis down) is SIGKILLed or stopped:
    the broker delivers them to another worker, which holds them too and, once Redis
    answers, runs the slot once. RabbitMQ gives them back when the connection closes;
    kombu's Redis transport when the stopping worker gives them back (SIGTERM), else
    once the visibility timeout passed (SIGKILL; 3 s here, 1 h by default)."""
    if broker_kind == "rabbitmq":
        url, extra = request.getfixturevalue("rabbitmq"), {}
    elif stop == "sigkill":
        url, extra = redis_server.url(0), {"broker_transport_options": {
            "visibility_timeout": 3, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}}
    else:
        url, extra = redis_server.url(0), {}
    case = two_copies(redis_server, make_redis, names, tmp_path, processes, url, **extra)
    case.lock.stop()
    first = case.start_worker(redis_server, f"w1-{names}")
    processes.append(first)
    wait_for(lambda: hold_lines(first, case.slot) >= 2, timeout=60, message="the first worker to hold both copies")
    if stop == "sigkill":
        first.kill_group()
    else:
        held = 2 + case.others
        wait_for(lambda: hold_lines(first) >= held, timeout=60, message="the first worker to hold every message")
        first.stop()
        assert f"{held} beat slot message(s) held for the slot check are left to the broker" in first.output()
        wait_for(lambda: case.ready() == held, timeout=30, message="every held message back in the queue")

    second = case.start_worker(redis_server, f"w2-{names}")
    processes.append(second)
    wait_for(lambda: hold_lines(second, case.slot) >= 2, timeout=60,
             message="the second worker to be given both copies, and to hold them")
    assert case.runs(redis_server) == 0
    case.lock.start()
    case.ran_once(redis_server, second)


def held_payloads(broker: redis.Redis, case: TwoCopies) -> list[list[Any]]:
    """The ``[message, exchange, routing key]`` entries of kombu's ``unacked`` hash that are
    copies of ``case.slot`` (what kombu's restore reads and pushes back)."""
    entries = [json.loads(raw) for raw in broker.hvals("unacked")]
    return [entry for entry in entries
            if entry[2] == case.queue and f"}}:{case.slot}" in str(entry[0]["headers"].get(CLAIM_HEADER))]


@pytest.mark.parametrize("acks_late", [False, True], ids=["early-ack", "acks-late"])
def test_a_held_slot_message_the_broker_restores_after_it_ran_is_dropped(
        redis_server: RedisServer, make_redis: Callable[..., RedisServer], names: str,
        tmp_path: Path, processes: list[CeleryProcess], acks_late: bool) -> None:
    """kombu's Redis transport gives back a message held past ``visibility_timeout`` by reading
    it from its ``unacked`` hash and pushing it back to the queue. A restore that read a held
    copy just before the worker ran it (and acknowledged it) puts back a copy, with the same
    delivery tag, that the worker receives after the run: the held-past-the-visibility-timeout
    test's second run. The race is forced here: the test reads the held copies' entries while
    they are held and, once the slot ran, pushes them back as kombu's restore does. The worker
    drops both, and counts neither as a duplicate send (the dropped copy was counted once);
    the slot ran once. Before the fix it ran the copy of the message it had run again (its
    sender is the claim's ``received`` instance)."""
    case = two_copies(redis_server, make_redis, names, tmp_path, processes, redis_server.url(0),
                      task_acks_late=acks_late)
    case.lock.stop()
    worker = case.start_worker(redis_server, f"w-{names}")
    processes.append(worker)
    wait_for(lambda: hold_lines(worker, case.slot) == 2, timeout=60, message="both copies held")
    broker = redis_server.client(0)
    restored = held_payloads(broker, case)
    assert len(restored) == 2, restored
    case.lock.start()
    case.ran_once(redis_server, worker)

    for message, _exchange, _routing_key in restored:  # kombu's restore, after the run
        message["headers"]["redelivered"] = True
        message["properties"]["delivery_info"]["redelivered"] = True
        broker.lpush(case.queue, json.dumps(message))

    def handled() -> int:
        log = worker.output()
        return (case.dropped() - 1) + log.count(RAN_HERE) + log.count(DROPPED_HERE) + (case.runs(redis_server) - 1)

    wait_for(lambda: handled() >= 2, timeout=30, message="both restored copies handled")
    wait_for(lambda: case.drained() and worker_idle(worker), timeout=30,
             message="the queue drained and the worker's runs finished")
    assert case.runs(redis_server) == 1, "the restored copy of the message that ran is not run again"
    log = worker.output()
    assert log.count(RAN_HERE) == 1 and log.count(DROPPED_HERE) == 1
    assert case.dropped() == 1, "a redelivery of the dropped copy is not counted as another duplicate send"
