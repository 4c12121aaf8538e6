"""A running run keeps its lock (issue 20), as the run itself sees it: discarded copies,
pauses, greenlet pools, and the end of a run.

Real ``celery worker`` processes of ``tests.apps.keeps_lock_app`` (each on a queue
of its own), real redis-servers. What each test protects:

* ``test_a_discarded_copy_leaves_the_running_original_alone``: a copy of a running
  ``acks_late`` task (broker redelivery, or a second publish with the same id)
  that expires or is revoked frees only itself: the original's lock stays (no
  new run of the key beside it) and its stored state is never REVOKED while it
  runs; it ends SUCCESS.
* ``test_paused_past_its_lease_ensure_held_never_passes_again``: a run paused
  (SIGSTOP) past its lease, whose key a successor took meanwhile, is not told
  its lock is held once it resumes.
* ``test_a_blocked_hub_keeps_its_lease``: on gevent and eventlet, a greenlet that
  blocks the hub longer than the lease does not let the lease expire (renewal
  from a real thread): no second run of the key starts.
* ``test_a_renewal_in_flight_at_the_end_is_no_lost_lock``: a renewal sent just
  before a run ended, executed after its release, is not reported as a lost
  lock (no "lost its lock" warning, no ``task-lock-lost`` event).

Each asserts through run records, ``AsyncResult`` states and named log lines or
events, and checks that it reached its fault.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from types import ModuleType

import pytest
import redis

from celery_singleton_beat.lease.holder import parse_holder

from .support import LOCK_DB, CeleryProcess, RedisServer, soak, wait_for
from .support.holding_proxy import HoldingProxy
from .support.keeps_lock import (
    assert_never_beside,
    decision,
    ended_run,
    entries,
    knobs,
    load_app,
    started_run,
    wait_started,
    worker,
)
from .support.tasks import EventCapture


@pytest.fixture
def app_env(redis_db: redis.Redis) -> Iterator[dict[str, str]]:
    """The workers' environment, filled in by the test (see ``support.keeps_lock.knobs``)."""
    yield from knobs()


LIVENESS_TTL = 2.0
#: Seconds from publish until a message with ``expires`` expires (its copy is discarded then).
EXPIRES = 6.0


# ===================================================================== case 5: paused past the lease


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_paused_past_its_lease_ensure_held_never_passes_again(
    redis_server: RedisServer, records: redis.Redis, app_env: dict[str, str],
) -> None:
    """A's pool child runs ``k`` (``lock_ttl`` 2 s), calling ``ensure_held()`` before each
    step; it is SIGSTOPped until its lease expired and B's run of ``k`` started (the
    expired lease, as documented). Once resumed, ``ensure_held()`` must not pass while B
    holds ``k``.

    Today it passed once after SIGCONT (it read a flag only the keeper sets).
    """
    app_env.update(CSB_LOCK_TTL="2", CSB_LIVENESS_TTL=str(LIVENESS_TTL))
    app = load_app(redis_server, **app_env)
    worker(redis_server, "a", app_env)
    worker(redis_server, "b", app_env)
    records.set("hold:a", "1")
    records.set("hold:b", "1")
    original = app.guarded.apply_async(("k",), {"hold": "a"}, queue="a")
    pid = wait_started(records, "k", original)["pid"]
    wait_for(lambda: records.llen(f"passes:{original.id}") > 0, timeout=10, message="the original checking its lock")

    attempts = []

    def successor_started() -> dict | None:
        if attempts:
            run = started_run(records, "k", attempts[-1].id)
            if run is not None or not attempts[-1].ready():
                return run
        attempts.append(app.guarded.apply_async(("k",), {"hold": "b"}, queue="b"))
        return None

    os.kill(pid, signal.SIGSTOP)
    try:
        successor = wait_for(successor_started, timeout=30, message="B's run of k started (A's lease expired)")
        resumed = time.time()
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: ended_run(records, "k", original.id), timeout=30, message="the original ended")
    assert ended_run(records, "k", successor["task_id"]) is None, "B still held k after A resumed"
    late = [p for p in entries(records, f"passes:{original.id}") if p[0] >= resumed]
    records.delete("hold:b")
    assert not late, f"ensure_held() passed {len(late)} time(s) after the resume, while B held k: {late}"
    assert original.get(timeout=10) == "lost", "the original learnt it lost its lock"


# ===================================================================== case 6: a blocked gevent / eventlet hub

#: How long the greenlet blocks its hub, and the lease (renewed every third of it).
BLOCK, SHORT_TTL = 6.0, 2.0


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_blocked_hub_keeps_its_lease(
    pool: str, redis_server: RedisServer, records: redis.Redis, app_env: dict[str, str],
) -> None:
    """On a ``pool`` worker, a run of ``k`` (``lock_ttl`` 2 s) blocks the hub for 6 s (an
    unpatched sleep, as a C call or a CPU loop would). ``k`` is sent to a prefork worker
    again and again meanwhile: none may run while the blocked run goes on, also after
    the lease would have expired unrenewed.

    Today the blocked worker's heartbeat (a greenlet too) let its liveness key lapse, and
    B took the lock over about 1.7 s into the block and ran beside it; the lease itself
    would have expired unrenewed right after (prefork and threads keep theirs: their
    keeper and heartbeat are real threads).
    """
    app_env.update(CSB_LOCK_TTL=str(SHORT_TTL), CSB_LIVENESS_TTL=str(LIVENESS_TTL))
    app = load_app(redis_server, **app_env)
    a = worker(redis_server, "a", app_env, pool=pool, concurrency=4)
    a.wait_for_line("concurrency:", f"4 ({pool}", timeout=5)
    worker(redis_server, "b", app_env)
    blocked = app.block_hub.apply_async(("k", BLOCK), queue="a")
    wait_started(records, "k", blocked)

    tries: list = []
    locks = redis_server.client(LOCK_DB)
    key = app.block_hub.singleton_key(("k", BLOCK), {})
    #: (time, the lock's remaining ms) read while the blocked run holds it: renewals show as a rise.
    pttls: list[tuple[float, int]] = []

    def block_over() -> bool:
        if ended_run(records, "k", blocked.id) is not None:
            return True
        with locks.pipeline(transaction=True) as pipe:
            value, pttl = pipe.get(key).pttl(key).execute()
        holder = parse_holder(value)
        if holder is not None and holder.task_id == blocked.id:
            pttls.append((time.time(), pttl))
        if not tries or tries[-1].ready():
            tries.append(app.block_hub.apply_async(("k", 0.3), queue="b"))  # same task, same key
        return False

    wait_for(block_over, timeout=BLOCK + 30, message="the blocked run ended")
    block = blocked.get(timeout=10)
    began, ended = block["began"], block["ended"]
    renewed = [later for (_, before), (at, later) in itertools.pairwise(pttls)
               if began < at < ended and later > before]
    assert len(renewed) >= 2, f"the run's lock was renewed during the block (its keeper is a real thread): {pttls}"
    wait_for(lambda: all(t.ready() for t in tries), timeout=30, message="every second submission settled")
    decisions = [decision(records, "k", t.id) for t in tries]
    late = [d for d in decisions if d[0] >= began + SHORT_TTL and d[1] <= ended]
    assert late, (f"a second submission was decided after the lease would have expired unrenewed, "
                  f"while the hub was blocked ({began:.3f}-{ended:.3f}): {decisions}")
    assert_never_beside(records, "k", blocked.id)
    print(f"\n{pool}: {len(tries)} second submissions during the {BLOCK:.0f}s block, "
          f"{len(late)} after the unrenewed lease's end, "
          f"{sum(started_run(records, 'k', t.id) is not None for t in tries)} ran")


# ===================================================================== case 4: a discarded copy of a running task


class Watch:
    """Reads a task's stored state and whether its lock exists, every 20 ms, from a thread."""

    def __init__(self, app: ModuleType, task_id: str, locks: redis.Redis, lock: str) -> None:
        self.app, self.task_id, self.locks, self.lock = app, task_id, locks, lock
        #: (time before, time after, state, lock present) of each look: both reads happened
        #: between the two times, and only a look whose reads all fell inside the run tells
        #: what the run held (a read sent before the run ended may be answered after it).
        self.looks: list[tuple[float, float, str, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch-original", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.time()
            present = bool(self.locks.exists(self.lock))
            state = self.app.app.AsyncResult(self.task_id).state
            self.looks.append((before, time.time(), state, present))
            self._stop.wait(0.02)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("copy", ["redelivered", "published-again"])
@pytest.mark.parametrize("discard", ["expires", "revoke"])
def test_a_discarded_copy_leaves_the_running_original_alone(
    discard: str, copy: str, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """An ``acks_late`` run of ``k`` (``lock_ttl`` 9 s) goes on on one worker while a copy of
    its message (``copy``: restored by the broker after a 2 s visibility timeout, or
    published again with the same task id) waits on the other worker for the original
    to end; the copy is then discarded (``discard``: its ``expires`` passes, or
    ``revoke(id)`` without terminate). The copy frees nothing of the original: its lock
    stays (``k`` sent again is not run beside it), its stored state is never REVOKED
    while it runs, and it ends SUCCESS.

    Today the discard deleted the original's lock (a release matched on the task id
    only), a new run of ``k`` ran beside the original, and the original read REVOKED
    until its SUCCESS.

    With ``revoke``, the tasks track STARTED (``task_track_started``), as the README
    advises: Celery 5.6+ workers that receive ``revoke(id)`` and hold no delivery of it
    mark a task whose state reads PENDING as REVOKED, running or not, whatever its base
    class; a running task that tracks STARTED is left alone. What is tested is then this
    library's own part: discarding the copy writes nothing.
    """
    app_env.update(CSB_LOCK_TTL="9", CSB_LIVENESS_TTL=str(LIVENESS_TTL),
                   CSB_VISIBILITY="2" if copy == "redelivered" else "3600",
                   CSB_TRACK_STARTED="1" if discard == "revoke" else "")
    app = load_app(redis_server, **app_env)
    # Both take queue "a": the broker's copy goes to whichever is free.
    workers = {"a": worker(redis_server, "a", app_env), "b": worker(redis_server, "b", app_env, queues="a,b")}
    lock = app.hold.singleton_key(("k",))
    expires = datetime.now(timezone.utc) + timedelta(seconds=EXPIRES) if discard == "expires" else None
    records.set("hold:k", "1")
    with Watch(app, (original := app.hold.apply_async(("k",), queue="a", expires=expires)).id, locks, lock) as watch:
        holder = wait_started(records, "k", original)["node"].split("@")[0]
        free = "b" if holder == "a" else "a"  # the free worker takes the copy and the next run
        if copy == "published-again":
            app.hold.apply_async(("k",), queue=free, task_id=original.id, expires=expires)
        workers[free].wait_for_line("already running on", original.id, timeout=30)  # the copy waits
        if discard == "revoke":
            app.app.control.revoke(original.id)
        wait_for(lambda: records.llen(f"revoked:{original.id}") or any(
            "Discarding revoked task" in line and original.id in line for line in workers[free].output().splitlines()),
            timeout=30, message="the copy discarded (Celery's task_revoked signal, or its 'Discarding revoked task')")
        assert ended_run(records, "k", original.id) is None, "the original still ran when its copy was discarded"

        second = app.hold.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue=free)
        wait_for(lambda: second.ready(), timeout=30, message="the next submission of k settled")
        assert ended_run(records, "k", original.id) is None, "the original still ran when k was sent again"
        records.delete("hold:k")
        wait_for(lambda: app.app.AsyncResult(original.id).state == "SUCCESS", timeout=30,
                 message="the original's SUCCESS")
    assert app.app.AsyncResult(original.id).result.startswith(f"{holder}@"), "the original's result stands"
    run = ended_run(records, "k", original.id)
    while_running = [(state, present) for before, after, state, present in watch.looks
                     if run["start"] <= before and after < run["end"]]
    beside = [e["task_id"] for e in entries(records, "started:k") if e["task_id"] != original.id]
    revoked = [state for state, _ in while_running if state == "REVOKED"]
    problems = []
    if records.get("overlap:k") is not None or beside:
        problems.append(f"a new run of k ran beside the original ({beside})")
    if not all(present for _, present in while_running):
        gone = [f"{before - run['start']:.3f}-{after - run['start']:.3f}" for before, after, _, present
                in watch.looks if run["start"] <= before and after < run["end"] and not present]
        problems.append(f"the original's lock vanished while it ran ({len(gone)} of {len(while_running)} "
                        f"looks, at {', '.join(gone)} s of its {run['end'] - run['start']:.3f} s)")
    if revoked:
        problems.append(f"the original read REVOKED while it ran ({len(revoked)} of {len(while_running)} looks)")
    assert not problems, "; ".join(problems)


# ===================================================================== case 8: a renewal in flight at the end


def no_lost_lock(process: CeleryProcess) -> bool:
    """True while ``process`` logged no ``LockLost`` warning ("lost its lock"); else fails with it."""
    lines = [line for line in process.output().splitlines() if "lost its lock" in line]
    assert not lines, f"LockLost reported after a clean ending: {lines}"
    return True


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_renewal_in_flight_at_the_end_is_no_lost_lock(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """A's lock connections go through a proxy. While A runs ``k`` (``lock_ttl`` 1.5 s) the
    proxy holds what A sends; once it holds A's next renewal (the first command naming
    the lock key), the run ends cleanly. Its release (the key again, on another
    connection) is let through first, then the renewal: the renewal meets the executed
    release. A run that ended cleanly is no lost lock: no "lost its lock" warning, no
    ``task-lock-lost`` event.

    Today the renewal's miss was reported as ``LockLost`` after the clean ending.
    """
    lock_redis = make_redis()
    with HoldingProxy(lock_redis.port) as proxy:
        # A held renewal must not time out: 5 s sockets.
        app_env.update(CSB_LOCK_TTL="1.5", CSB_LIVENESS_TTL=str(LIVENESS_TTL), CSB_LOCK_REDIS=proxy.url(),
                       CSB_SOCKET_TIMEOUT="5")
        app = load_app(redis_server, **app_env)
        a = worker(redis_server, "a", app_env)
        key = app.hold.singleton_key(("k",)).encode()
        with EventCapture(app.app, "task-lock-lost") as lost:
            records.set("hold:k", "1")
            run = app.hold.apply_async(("k",), queue="a")
            wait_started(records, "k", run)
            proxy.hold(naming=key)  # commands about the lock, from now on
            renewal_at, renewal = wait_for(lambda: proxy.held_with(key), timeout=10,
                                           message="A's renewal of its lock, held")[0]
            records.delete("hold:k")  # the run ends now, its renewal in flight
            try:
                _, release = wait_for(lambda: [h for h in proxy.held_with(key) if h[1] != renewal], timeout=5,
                                      message="A's release, held")[0]
            except AssertionError:
                release = None  # the run's end waits for its renewal: the two cannot cross
            proxy.let_go([release] if release is not None else [])
            assert run.get(timeout=30).startswith("a@"), "the run ended cleanly"
            assert renewal_at < ended_run(records, "k", run.id)["end"], "the renewal was sent before the run ended"
            # The renewal's reply is read within a round trip of its release: a report would follow at once.
            soak(2, check=lambda: no_lost_lock(a), interval=0.05, what="a clean ending")
        assert not lost.events, f"task-lock-lost event after a clean ending: {lost.events}"
        print("\nrenewal in flight at the end: "
              + ("the release was let through ahead of the held renewal" if release is not None
                 else "the run's end waited for its renewal (no release while it was held)"))
