"""Adversarial review of the slot gate's memory of runs (``SlotGate._seen_here`` and ``_remember``).

A worker connection remembers the slot messages it ran (task id + sending beat instance,
with the kombu message). A later delivery of one of them is acknowledged and dropped when
the run's message was acknowledged; left alone while the run's message is unacknowledged
with the same delivery tag (``acks_late``, still running: kombu's Redis restore keeps the
tag, so the run's acknowledgement settles both); run again when the run's message was
given back (rejected with requeue).

Every scenario runs real ``celery worker`` processes on the session's redis-server. The
test publishes the slot messages itself, with the headers a beat sends (claim key, sending
instance, slot, entry) and the slot's task id, so it controls each copy; the copies the
broker makes are kombu's own restores (``visibility_timeout`` of a few seconds, restored
every second), not simulated. The task (``tests/apps/adversary_slots_app.py``) runs while
the test holds its ``hold:<key>`` record.

Attacks that held, kept as tests of the promise they check:

* an acks_late slot task still running when kombu's restore puts a copy back (same tag),
  in the prefork, threads and gevent pools: the copy is left alone; once the run's
  acknowledgement comes, nothing of the queue is left in the broker, and nothing comes
  back after further visibility timeouts: one run;
* the prefork child SIGKILLed mid-run (``task_reject_on_worker_lost``, acks_late), after a
  restored copy was left alone: the requeued message runs again, once, in another child;
* a restored copy that reaches the worker after its acks_late run succeeded (prefetch 1):
  dropped, one run;
* the broker connection killed mid-run (acks_late, long-running tasks cancelled on
  connection loss): the message kombu restores runs again on the new connection (new
  gate), to the end, once; the gate does not drop it as "already ran".

Breaks found, each fixed (both failed before their fix):

* a restored copy that reaches the worker after its acks_late run *rejected its message
  without requeue* (``Reject(requeue=False)``) ran a second time: kombu's message state
  says REJECTED with or without requeue; the gate now learns the requeue from the reject
  callback Celery calls, and drops the copy of a message rejected for good;
* the memory bound (``RAN_REMEMBERED``) evicted an unacknowledged, still running acks_late
  run: kombu's next restored copy ran a second time, concurrently with the first (the
  bound lowered to 2 in the worker; the default bound in the same scenario is the control).
  Only settled runs are forgotten now.

The gevent pool's worker never runs kombu's ``restore_visible`` sweep itself (its consumer
loop does not call it): there the test runs kombu's sweep, as another consumer of the
broker would.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import kombu
import pytest
import redis
from celery import Celery

from celery_singleton_beat.beat.entries import slot_task_id
from celery_singleton_beat.task.slot_delivery import CLAIM_HEADER, ENTRY_HEADER, INSTANCE_HEADER, SLOT_HEADER

from .support import RECORD_DB, CeleryProcess, RedisServer, queue_drained, soak, start_worker, wait_for
from .support.stalls import StallWindow, unexplained_errors

APP = "tests.apps.adversary_slots_app"
TASK = "tests.apps.adversary_slots_app.work"
LEFT_ALONE = "delivered again while its run's message is unacknowledged"
RAN_HERE = "delivered again after this worker ran it"
#: kombu's Redis transport: messages unacknowledged for 2 s are restored, checked every second.
VISIBILITY = 2
TRANSPORT = {"visibility_timeout": VISIBILITY, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
INSTANCE = "beat-a:4242:adversary"


@dataclass
class Slots:
    """Slot messages of one test: published by the test as a beat would, run by its worker."""

    server: RedisServer
    names: str
    client: Celery = field(init=False)
    sent: dict[str, str] = field(default_factory=dict)  # key -> task id

    def __post_init__(self) -> None:
        self.client = Celery("adversary-slots-client", broker=self.server.url(0))
        self.client.conf.broker_connection_retry_on_startup = True

    @property
    def queue(self) -> str:
        return f"adv-{self.names}"

    @property
    def records(self) -> redis.Redis:
        return self.server.client(RECORD_DB)

    def worker(self, name: str, pool: str = "prefork", concurrency: int = 1,
               ran_remembered: int | None = None, **settings: Any) -> CeleryProcess:
        env = {"CSB_ADV_QUEUE": self.queue, "CSB_ADV_SETTINGS": json.dumps(settings)}
        if ran_remembered is not None:
            env["CSB_ADV_RAN_REMEMBERED"] = str(ran_remembered)
        return start_worker(self.server, APP, f"{name}-{self.names}", pool=pool, concurrency=concurrency,
                            env=env)

    def publish(self, key: str, mode: str = "ok", hold: bool = False) -> str:
        """Send the slot ``key`` once, from :data:`INSTANCE`; ``hold``: its run lasts until released."""
        entry = f"{self.names}{key}"
        slot = "2024-05-01T12:00:00Z"
        claim = f"singleton:{{beat:{entry}}}:{slot}"
        task_id = slot_task_id(claim)
        if hold:
            self.records.set(f"hold:{key}", 1)
        self.client.send_task(TASK, args=[key, mode], queue=self.queue, task_id=task_id, headers={
            CLAIM_HEADER: claim, INSTANCE_HEADER: INSTANCE, SLOT_HEADER: slot, ENTRY_HEADER: entry})
        self.sent[key] = task_id
        return task_id

    def release(self, key: str) -> None:
        self.records.delete(f"hold:{key}")

    def started(self, key: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.records.lrange(f"started:{key}", 0, -1)]

    def ended(self, key: str) -> int:
        return int(self.records.llen(f"ended:{key}"))

    def drained(self) -> bool:
        with redis.Redis.from_url(self.server.url(0)) as broker:
            return queue_drained(broker, self.queue)

    def waiting(self) -> int:
        """Messages of the queue waiting in the broker (not delivered)."""
        with redis.Redis.from_url(self.server.url(0)) as broker:
            return int(broker.llen(self.queue))

    def restore(self) -> None:
        """One sweep of kombu's own ``restore_visible`` (as every consumer of the broker runs
        it) from this process: the gevent pool's worker does not sweep (its consumer loop
        never calls it), another worker of the broker would."""
        with kombu.Connection(self.server.url(0), transport_options=TRANSPORT) as connection:
            connection.default_channel.qos.restore_visible(num=100, interval=1)

    def close(self) -> None:
        for key in list(self.sent):
            self.release(key)
        self.client.close()


@pytest.fixture
def slots(redis_server: RedisServer, names: str) -> Iterator[Slots]:
    case = Slots(redis_server, names)
    yield case
    case.close()


def lines(worker: CeleryProcess, text: str, task_id: str) -> int:
    """Log lines of ``worker`` with ``text`` about the message ``task_id``."""
    return sum(1 for line in worker.output().splitlines() if text in line and task_id in line)


def only_runs(slots: Slots, key: str, count: int) -> Callable[[], bool]:
    """A soak invariant: ``key`` started ``count`` times, no more."""
    def check() -> bool:
        started = len(slots.started(key))
        assert started <= count, f"{key} started {started} times, {count} expected"
        return True
    return check


# ----------------------------------------------------------------- attack 1 (+6): acks_late run still running


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_a_copy_restored_while_its_acks_late_run_runs_is_settled_by_that_run(
        slots: Slots, processes: list[CeleryProcess], pool: str, stalls: StallWindow) -> None:
    """The run holds its message past ``visibility_timeout``: kombu's restore puts a copy back
    (same delivery tag), which the worker receives while the run goes on (prefetch 4): left
    alone, not run. The run's acknowledgement settles both: nothing of the queue is left in
    the broker (no ``unacked`` entry, nothing waiting), and nothing comes back over three more
    visibility timeouts. One run. No error logged, but for the worker's liveness key found
    expired after the machine itself froze that long (a VM paused past the key's TTL)."""
    worker = slots.worker("held", pool=pool, concurrency=2, task_acks_late=True,
                          worker_prefetch_multiplier=4, broker_transport_options=TRANSPORT)
    processes.append(worker)
    task_id = slots.publish("long", hold=True)
    wait_for(lambda: len(slots.started("long")) == 1, timeout=30, message="the run to start")

    def sweep() -> bool:  # gevent: kombu's restore from here (its worker does not sweep)
        if pool == "gevent":
            slots.restore()
        return True

    def restored_and_left_alone() -> bool:
        return sweep() and lines(worker, LEFT_ALONE, task_id) >= 1

    wait_for(restored_and_left_alone, timeout=10 * VISIBILITY, interval=0.5,
             message="a restored copy received while the run runs")
    assert not slots.drained(), "the running copy's message is unacknowledged"
    soak(VISIBILITY + 1, check=lambda: sweep() and only_runs(slots, "long", 1)(),
         interval=0.5, what="the run, past a further restore")
    slots.release("long")
    wait_for(lambda: slots.ended("long") == 1, timeout=30, message="the run to end")
    wait_for(slots.drained, timeout=10, message="the run's acknowledgement to settle every copy")
    soak(3 * (VISIBILITY + 1), check=lambda: sweep() and only_runs(slots, "long", 1)() and slots.drained(),
         interval=0.5, what="three visibility timeouts after the run")
    assert len(slots.started("long")) == 1 and slots.ended("long") == 1
    assert lines(worker, "Traceback", "") == 0
    assert unexplained_errors(worker.output(), stalls) == []


# ----------------------------------------------------------------- attack 2: pool child lost mid-run


@pytest.mark.slow
def test_a_slot_run_whose_pool_child_is_killed_runs_again_once(
        slots: Slots, processes: list[CeleryProcess]) -> None:
    """acks_late, ``task_reject_on_worker_lost``: a restored copy of the running message was
    left alone, then the prefork child running it is SIGKILLed. Celery rejects the message
    with requeue (kombu: state REJECTED, the same tag back at the head of the queue): the gate
    must run it again, not take it for "already ran". It runs once more, in another child,
    and the requeued run's acknowledgement leaves nothing behind."""
    worker = slots.worker("lost", pool="prefork", concurrency=1, task_acks_late=True,
                          task_reject_on_worker_lost=True, worker_prefetch_multiplier=4,
                          broker_transport_options=TRANSPORT)
    processes.append(worker)
    task_id = slots.publish("lost", hold=True)
    wait_for(lambda: len(slots.started("lost")) == 1, timeout=30, message="the run to start")
    wait_for(lambda: lines(worker, LEFT_ALONE, task_id) >= 1, timeout=10 * VISIBILITY,
             message="a restored copy left alone while the run runs")
    [first] = slots.started("lost")
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: len(slots.started("lost")) == 2, timeout=60, message="the requeued message to run again")
    second = slots.started("lost")[1]
    assert second["pid"] != first["pid"] and second["task_id"] == task_id
    assert slots.ended("lost") == 0
    slots.release("lost")
    wait_for(lambda: slots.ended("lost") == 1, timeout=30, message="the second run to end")
    wait_for(slots.drained, timeout=10, message="the second run's acknowledgement to settle the queue")
    soak(3 * (VISIBILITY + 1), check=lambda: only_runs(slots, "lost", 2)() and slots.drained(),
         what="three visibility timeouts after the second run")
    assert "WorkerLostError" in worker.output()


# ----------------------------------------------------------------- attack 3: the broker connection drops


def drop_broker_connection(slots: Slots, name: str) -> int:
    """Kill the worker's consuming broker connection (its blocked ``BRPOP``) at the server.

    Only the connections the worker named ``name`` (kombu's ``client_name``): the session's
    redis-server is shared, and another client's ``BRPOP`` there (a worker of another module
    still on its way out, anything blocked on another database) is neither this worker's
    connection nor the test's to kill."""
    with redis.Redis.from_url(slots.server.url(0)) as broker:
        consuming = [client for client in broker.client_list()
                     if client.get("cmd") == "brpop" and client.get("name") == name]
        for client in consuming:
            broker.client_kill_filter(_id=client["id"])
    return len(consuming)


@contextmanager
def bystander_brpop(slots: Slots) -> Iterator[Callable[[], bool]]:
    """Another client of the session's server blocked in ``BRPOP`` (on another database and
    list) while the test runs; yields whether its connection is still open."""
    bystander = redis.Connection(port=slots.server.port, db=RECORD_DB)
    try:
        bystander.connect()
        bystander.send_command("CLIENT", "SETNAME", f"bystander-{slots.names}")
        bystander.read_response()
        bystander.send_command("BRPOP", f"bystander:{slots.names}", 0)  # never answered: blocked
        with redis.Redis.from_url(slots.server.url(0)) as admin:
            wait_for(lambda: any(c.get("name") == f"bystander-{slots.names}" and "b" in c.get("flags", "")
                                 for c in admin.client_list()), timeout=10, message="the bystander to block")

        def alive() -> bool:
            with redis.Redis.from_url(slots.server.url(0)) as admin:
                return any(c.get("name") == f"bystander-{slots.names}" for c in admin.client_list())

        yield alive
    finally:
        bystander.disconnect()


@pytest.mark.slow
def test_a_slot_message_redelivered_after_a_reconnection_runs(
        slots: Slots, processes: list[CeleryProcess]) -> None:
    """acks_late with ``worker_cancel_long_running_tasks_on_connection_loss``: the worker's
    broker connection is killed while a slot run holds its message. Celery cancels the run,
    kombu restores the message as the old channel closes, and the worker receives it again
    on its new connection, with a new gate that remembers nothing: it runs again (as before
    the gate's memory; dropping it as "already ran" would lose the slot), to the end, once,
    and the queue is left drained."""
    name = f"recon-{slots.names}"
    worker = slots.worker("recon", pool="prefork", concurrency=1, task_acks_late=True,
                          worker_prefetch_multiplier=4, worker_cancel_long_running_tasks_on_connection_loss=True,
                          broker_transport_options={"client_name": name})
    processes.append(worker)
    task_id = slots.publish("recon", hold=True)
    wait_for(lambda: len(slots.started("recon")) == 1, timeout=30, message="the run to start")
    with bystander_brpop(slots) as bystander_alive:
        assert drop_broker_connection(slots, name) == 1
        assert bystander_alive(), "only the worker's connection was dropped"
    worker.wait_for_log("Connection to broker lost", timeout=30)
    wait_for(lambda: len(slots.started("recon")) == 2, timeout=60,
             message="the message restored at the reconnection to run again")
    first, second = slots.started("recon")
    assert second["pid"] != first["pid"] and slots.ended("recon") == 0, "one child: the first run was cancelled"
    slots.release("recon")
    wait_for(lambda: slots.ended("recon") == 1, timeout=30, message="the second run to end")
    wait_for(slots.drained, timeout=30, message="the queue drained")
    assert slots.ended("recon") == 1
    assert lines(worker, RAN_HERE, task_id) == 0 and lines(worker, LEFT_ALONE, task_id) == 0
    assert [run["task_id"] for run in slots.started("recon")] == [task_id, task_id]


# ----------------------------------------------------------------- attack: the run ends before the copy comes


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    "ok",
    "reject",
])
def test_a_copy_restored_during_its_run_and_received_after_it_is_not_run(
        slots: Slots, processes: list[CeleryProcess], mode: str) -> None:
    """Prefetch 1: while the acks_late run holds its message past ``visibility_timeout``,
    kombu's restore pushes a copy back to the queue, where it waits (the worker takes no
    second message). The run ends, as ``mode`` says: ``ok`` acknowledges its message,
    ``reject`` rejects it without requeue (the worker discards it). Then the worker receives
    the copy: it must not run it (a message the worker settled, by ack or by discarding, is
    not run again from its restored copy)."""
    worker = slots.worker("after", pool="prefork", concurrency=1, task_acks_late=True,
                          worker_prefetch_multiplier=1, broker_transport_options=TRANSPORT)
    processes.append(worker)
    task_id = slots.publish("after", mode=mode, hold=True)
    wait_for(lambda: len(slots.started("after")) == 1, timeout=30, message="the run to start")
    wait_for(lambda: slots.waiting() == 1, timeout=10 * VISIBILITY,
             message="kombu's restore to put a copy back while the run runs")
    slots.release("after")
    wait_for(lambda: slots.ended("after") >= 1, timeout=30, message="the run to end")
    wait_for(lambda: lines(worker, RAN_HERE, task_id) + len(slots.started("after")) >= 2, timeout=30,
             message="the restored copy to be handled")
    wait_for(slots.drained, timeout=10, message="the queue drained")
    assert len(slots.started("after")) == 1, f"started {len(slots.started('after'))} times, 1 expected"
    assert lines(worker, RAN_HERE, task_id) == 1


# ----------------------------------------------------------------- attack 5: the memory bound


@pytest.mark.slow
@pytest.mark.parametrize("ran_remembered", [
    None,
    2,
], ids=["default-bound", "bound-2"])
def test_a_long_acks_late_run_is_remembered_past_later_slot_runs(
        slots: Slots, processes: list[CeleryProcess], ran_remembered: int | None) -> None:
    """A long acks_late slot run in one prefork child while three quick slot messages run in
    the other; then kombu restores the long run's message (same tag) again. The copy must be
    left alone as before: a running message's memory is what keeps it from running twice.
    ``default-bound`` (1024) is the control: the same scenario without an eviction holds."""
    worker = slots.worker("bound", pool="prefork", concurrency=2, ran_remembered=ran_remembered,
                          task_acks_late=True,
                          worker_prefetch_multiplier=4, broker_transport_options=TRANSPORT)
    processes.append(worker)
    task_id = slots.publish("long", hold=True)
    wait_for(lambda: len(slots.started("long")) == 1, timeout=30, message="the long run to start")
    for key in ("b", "c", "d"):
        slots.publish(key)
    wait_for(lambda: all(slots.ended(key) == 1 for key in ("b", "c", "d")), timeout=30,
             message="the three later slots to run")
    before = lines(worker, LEFT_ALONE, task_id)
    wait_for(lambda: lines(worker, LEFT_ALONE, task_id) > before or len(slots.started("long")) > 1,
             timeout=10 * VISIBILITY, message="a restored copy of the long run received after them")
    slots.release("long")
    wait_for(lambda: slots.ended("long") >= 1, timeout=30, message="the long run to end")
    wait_for(slots.drained, timeout=30, message="the queue drained")
    assert len(slots.started("long")) == 1, f"started {len(slots.started('long'))} times, 1 expected"
    assert lines(worker, LEFT_ALONE, task_id) > before


