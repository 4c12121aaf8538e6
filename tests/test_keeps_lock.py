"""A running run keeps its lock (issue 20): no take-over, restart or failover frees a lock
that is still being renewed.

Real ``celery worker`` processes of ``tests.apps.keeps_lock_app`` (prefork, each
on a queue of its own), and a real redis-server for the locks that the tests
delete keys on, SIGSTOP, SIGKILL and restart (its own server where it restarts,
so the broker is not what is tested). What each test protects:

* ``test_deleted_liveness_key_of_a_live_holder_is_no_take_over``: a holder whose
  liveness key is gone (``DEL``, ``FLUSHDB``, an eviction) but whose lock is
  renewed is alive: another worker must not take its lock over.
* ``test_stalled_main_process_is_no_take_over``: the worker's main process
  stalled (SIGSTOP) lets its liveness key lapse while its pool child runs and
  renews: no take-over either.
* ``test_outage_longer_than_liveness_is_no_take_over``: a lock-Redis outage longer
  than ``singleton_liveness_ttl`` (AOF restart: the locks survive, the liveness
  keys do not): the first acquire after recovery must not take over a run that
  is still going.
* ``test_restart_without_persistence_never_runs_the_key_twice``: the lock Redis
  restarted empty under a running run: the same key submitted after the
  restart must not run beside it (skipped as its duplicate, or run after it).
* ``test_aof_restart_a_run_ending_after_it_frees_its_lock``: with AOF, a run that
  ends after the restart really releases (the next run of the key runs, it is
  not skipped as a duplicate of a run that ended), and a stale connection does
  not cost the next run a fail-closed retry while Redis is up.
* ``test_fencing_tokens_grow_across_a_failover``: Sentinel promotes a replica
  that lacks the last lock and the fencing counter's last increment: the next
  holder's fencing token is still larger than the old holder's.

Each asserts the outcome through run records, ``AsyncResult`` states, Redis keys
by their documented names and named log lines, and checks that it reached its
fault (the key really absent, the server really restarted, the second
submission really decided while the first run went on).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_singleton_beat.task.keys import task_stats_key

from .support import RedisServer, soak, wait_for
from .support.keeps_lock import (
    KeyWatch,
    assert_never_beside,
    call_of,
    decision,
    ended_run,
    knobs,
    live_key_of,
    load_app,
    replica_cut_off,
    run_id,
    started_run,
    wait_called,
    wait_started,
    worker,
)
from .support.tasks import lock_keys, skipped
from .support.topologies import start_sentinels, wait_for_new_primary


@pytest.fixture
def app_env(redis_db: redis.Redis) -> Iterator[dict[str, str]]:
    """The workers' environment, filled in by the test (see ``support.keeps_lock.knobs``)."""
    yield from knobs()


LIVENESS_TTL = 2.0


def a_holds_k(redis_server: RedisServer, records: redis.Redis, env: dict[str, str]) -> tuple[Any, ...]:
    """Workers A and B (``lock_ttl`` 30 s, liveness TTL :data:`LIVENESS_TTL`), and ``k`` held
    running on A: returns the app, A, B, the original's result and its start record."""
    env.update(CSB_LOCK_TTL="30", CSB_LIVENESS_TTL=str(LIVENESS_TTL))
    app = load_app(redis_server, **env)
    a = worker(redis_server, "a", env)
    b = worker(redis_server, "b", env)
    records.set("hold:k", "1")
    original = app.hold.apply_async(("k",), queue="a")
    return app, a, b, original, wait_started(records, "k", original)


def send_to_b_while_a_stopped(app: Any, records: redis.Redis, locks: redis.Redis, live: str,
                              original: Any) -> Any:
    """Send ``k`` to B while A's main process is stopped and its liveness key ``live`` is
    gone; return that submission once B decided it, having checked that the key stayed
    absent (only A's stopped main process writes it) and the original still ran."""
    second = app.hold.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue="b")
    wait_called(records, "k", second)
    assert not locks.exists(live), "A's liveness key was still absent after B decided"
    assert ended_run(records, "k", original.id) is None, "the original still ran when B decided"
    return second


def end_alone(records: redis.Redis, original: Any, seconds: list[Any], b: Any = None) -> None:
    """Let the held run of ``k`` end and check the outcome: the original completed on A,
    every later submission of ``k`` settled, none ran beside it, and B (if given) never
    took A's lock over."""
    records.delete("hold:k")
    assert original.get(timeout=30).startswith("a@"), "the original completed"
    wait_for(lambda: all(t.ready() for t in seconds), timeout=30, message="the later submissions settled")
    assert_never_beside(records, "k", original.id)
    if b is not None:
        assert not any("took over" in line for line in b.output().splitlines()), \
            f"B took A's live lock over:\n{b.tail(20)}"


# ===================================================================== case 1: liveness key gone, holder alive


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_deleted_liveness_key_of_a_live_holder_is_no_take_over(
    redis_server: RedisServer, records: redis.Redis, locks: redis.Redis, app_env: dict[str, str],
) -> None:
    """Worker A runs ``k`` (``lock_ttl`` 30 s, renewed); its liveness key is deleted (and kept
    deleted) and ``k`` is sent to worker B: B must not run it beside A.

    Today B "took over ... whose worker is gone" at once and both bodies ran together.
    """
    app, a, b, original, _ = a_holds_k(redis_server, records, app_env)

    with KeyWatch(locks, live_key_of(a), delete=True) as gone:
        # The key is deleted again each time A's heartbeat writes it: a decision of B that
        # did not provably fall in a gap is tried again.
        tries: list = []

        def decided_while_gone() -> object:
            if tries:
                if call_of(records, "k", tries[-1].id) is None:
                    return None
                if gone.absent_throughout(*decision(records, "k", tries[-1].id), LIVENESS_TTL):
                    return tries[-1]
            tries.append(app.hold.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue="b"))
            return None

        wait_for(decided_while_gone, timeout=30, message="B deciding while A's liveness key was gone")
    assert ended_run(records, "k", original.id) is None, "the original still ran when B decided"

    end_alone(records, original, tries, b)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stalled_main_process_is_no_take_over(
    redis_server: RedisServer, records: redis.Redis, locks: redis.Redis, app_env: dict[str, str],
) -> None:
    """Worker A's main process is SIGSTOPped while its pool child runs ``k`` and renews its
    lock; A's liveness key lapses; ``k`` sent to B must not run beside A.

    Today B took over once the liveness key lapsed.
    """
    app, a, b, original, run = a_holds_k(redis_server, records, app_env)
    live = live_key_of(a)
    assert run["pid"] != a.pid, "the run is in a pool child, not in the main process"

    a.signal(signal.SIGSTOP)
    try:
        wait_for(lambda: not locks.exists(live), timeout=LIVENESS_TTL * 5, message="A's liveness key lapsed")
        second = send_to_b_while_a_stopped(app, records, locks, live, original)
    finally:
        a.signal(signal.SIGCONT)

    end_alone(records, original, [second], b)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_outage_longer_than_liveness_is_no_take_over(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """The lock Redis (AOF) is down longer than ``singleton_liveness_ttl`` while A runs ``k``:
    after the restart the lock is there (30 s TTL) and A's liveness key is not (2 s). ``k``
    sent to B at once must not take A's lock over before A had a chance to renew it.

    A's main process is held (SIGSTOP) from the restart until B decided, so its heartbeat
    cannot write the liveness key back first (a race it wins or loses by chance): what
    must protect the run is that its holder keeps renewing, and that nobody takes a lock
    over in the first moments after Redis comes back, before holders could renew.

    Today B's first acquire after the restart took A's live lock over.
    """
    lock_redis = make_redis("--appendonly", "yes")
    lock_client = lock_redis.client()
    app_env["CSB_LOCK_REDIS"] = lock_redis.url()
    app, a, b, original, _ = a_holds_k(redis_server, records, app_env)
    live = live_key_of(a)
    [lock] = lock_keys(lock_client)
    before = run_id(lock_client)

    lock_redis.stop()  # SIGTERM: the AOF has every write
    soak(LIVENESS_TTL + 1, check=lambda: not lock_redis.running, what="the outage")
    a.signal(signal.SIGSTOP)
    try:
        lock_redis.start()
        assert run_id(lock_client) != before, "the lock Redis restarted"
        assert lock_client.exists(lock), "the lock survived the restart (AOF)"
        assert not lock_client.exists(live), "A's liveness key did not (it expired during the outage)"
        second = send_to_b_while_a_stopped(app, records, lock_client, live, original)
    finally:
        a.signal(signal.SIGCONT)

    end_alone(records, original, [second], b)


# ===================================================================== case 2: restart without persistence


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_restart_without_persistence_never_runs_the_key_twice(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """A runs ``k`` (``lock_ttl`` 6 s); the lock Redis (no persistence) is SIGKILLed and
    restarted empty; ``k`` sent to B right after must not run beside A: the holder puts
    its lock back, and a new acquisition of ``k`` waits for that short window (B's run is
    skipped as A's duplicate, or runs after A).

    Today B ran at once beside A (the restarted server had no lock).
    """
    lock_redis = make_redis()
    lock_client = lock_redis.client()
    app_env.update(CSB_LOCK_TTL="6", CSB_LIVENESS_TTL=str(LIVENESS_TTL), CSB_LOCK_REDIS=lock_redis.url())
    app = load_app(redis_server, **app_env)
    worker(redis_server, "a", app_env)
    worker(redis_server, "b", app_env)
    records.set("hold:k", "1")
    original = app.hold.apply_async(("k",), queue="a")
    wait_started(records, "k", original)
    before = run_id(lock_client)

    lock_redis.restart()  # SIGKILL, started again on its port: empty
    restarted = time.time()
    assert run_id(lock_client) != before, "the lock Redis restarted"
    second = app.hold.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue="b")
    wait_called(records, "k", second)
    received, decided = decision(records, "k", second.id)
    assert ended_run(records, "k", original.id) is None, "the original still ran when B decided"

    end_alone(records, original, [second])
    print(f"\nrestart without persistence: B received k {received - restarted:.2f}s after the restart, "
          f"decided in {decided - received:.2f}s: {'skipped' if skipped(second) else second.state}")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_eager_run_puts_its_lock_back_before_the_restarts_window_closes(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """A holder outside any worker (an eager ``apply()`` in this test process, ``lock_ttl``
    30 s, ``singleton_liveness_ttl`` 3 s) holds ``k``; the lock Redis is restarted empty;
    ``k`` sent to worker B (which used the server before, so it notices the restart and
    waits for the recovery window) must not run beside the eager run: every holder renews
    within a third of the liveness TTL, so the eager run puts its lock back before the
    window closes.

    Before, an eager run renewed every ``lock_ttl / 3`` (10 s): B acquired ``k`` when the
    2.5 s window closed and ran beside it, while the eager run's ``ensure_held()`` kept
    passing.
    """
    lock_redis = make_redis()
    lock_client = lock_redis.client()
    app_env.update(CSB_LOCK_TTL="30", CSB_LIVENESS_TTL="3", CSB_LOCK_REDIS=lock_redis.url())
    app = load_app(redis_server, **app_env)
    worker(redis_server, "b", app_env)
    assert app.hold.apply_async(("warm",), queue="b").get(timeout=30).startswith("b@"), \
        "B used the lock Redis before the restart (it notices the restart)"
    records.set("hold:k", "1")
    eager: list[Any] = []
    thread = threading.Thread(target=lambda: eager.append(app.guarded.apply(("k",), task_id="eager-k")),
                              name="eager-run", daemon=True)
    thread.start()
    wait_for(lambda: started_run(records, "k", "eager-k"), timeout=30, message="the eager run of k started")
    # Its acquisition counted and written (the counters' batch reaching the new server would
    # let this process notice the restart at once, whatever its renewals do).
    wait_for(lambda: lock_client.hget(task_stats_key("singleton", app.guarded.name), "acquired"), timeout=10,
             message="the eager run's counters written")
    before = run_id(lock_client)

    lock_redis.restart()  # SIGKILL, started again on its port: empty
    restarted = time.time()
    assert run_id(lock_client) != before, "the lock Redis restarted"
    second = app.guarded.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue="b")  # the same key
    wait_called(records, "k", second)
    received, decided = decision(records, "k", second.id)
    assert started_run(records, "k", second.id) is None, \
        "B ran k: the eager run's lock was not back when the recovery window closed"
    assert ended_run(records, "k", "eager-k") is None, "the eager run still ran when B decided"

    records.delete("hold:k")
    thread.join(30)
    assert eager and eager[0].get() == "held", "the eager run kept its lock to the end"
    wait_for(second.ready, timeout=30, message="B's submission settled")
    assert_never_beside(records, "k", "eager-k")
    print(f"\neager holder, restart without persistence: B received k {received - restarted:.2f}s after the "
          f"restart, decided in {decided - received:.2f}s: {'skipped' if skipped(second) else second.state}")


# ===================================================================== case 3: AOF restart, the run ends after it


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_aof_restart_a_run_ending_after_it_frees_its_lock(
    redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """The lock Redis (AOF) restarts while A runs ``k``; A ends after the restart. The next
    run of ``k`` (on B, whose lock connection dates from before the restart) must run:
    A's release reached Redis (retried on a new connection if need be), and B's stale
    connection costs it no fail-closed retry while Redis is up.

    Today A's release was written onto the dead connection and lost (the lock stayed
    until its TTL, so the next run was skipped as a duplicate of a run that had ended),
    and B's first acquire failed with "Redis unavailable ... Connection closed by server".
    """
    lock_redis = make_redis("--appendonly", "yes")
    lock_client = lock_redis.client()
    app_env.update(CSB_LOCK_TTL="10", CSB_LIVENESS_TTL=str(LIVENESS_TTL), CSB_LOCK_REDIS=lock_redis.url())
    app = load_app(redis_server, **app_env)
    worker(redis_server, "a", app_env)
    b = worker(redis_server, "b", app_env)
    assert app.hold.apply_async(("warm",), queue="b").get(timeout=30).startswith("b@"), \
        "B's pool process ran a run (its lock connection is open)"
    records.set("hold:k", "1")
    original = app.hold.apply_async(("k",), queue="a")
    wait_started(records, "k", original)
    [lock] = lock_keys(lock_client)
    before = run_id(lock_client)

    lock_redis.stop()  # SIGTERM: the AOF has every write
    lock_redis.start()
    restarted = time.time()
    assert run_id(lock_client) != before, "the lock Redis restarted"
    assert lock_client.exists(lock), "A's lock survived the restart (AOF)"

    records.delete("hold:k")
    assert original.get(timeout=30).startswith("a@"), "the original completed"
    ended = ended_run(records, "k", original.id)
    assert ended is not None and ended["end"] > restarted, "the original ended after the restart"

    following = app.hold.apply_async(("k",), queue="b")
    wait_for(lambda: following.ready(), timeout=30, message="the next run of k settled")
    run = started_run(records, "k", following.id)
    unavailable = [line for line in b.output().splitlines() if "Redis unavailable" in line]
    problems = []
    if run is None:
        problems.append(f"the next run of k did not run ({'skipped' if skipped(following) else following.state}): "
                        f"the ended run's lock was still there")
    if unavailable or (run is not None and run["retries"]):
        problems.append(f"B's stale lock connection cost the next run a fail-closed retry: {unavailable}")
    assert not problems, "; ".join(problems)
    print(f"\nAOF restart: the next run of k started {run['start'] - ended['end']:.2f}s after the run ended")


# ===================================================================== case 9: fencing tokens across a failover


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fencing_tokens_grow_across_a_failover(
    redis_server: RedisServer, records: redis.Redis, app_env: dict[str, str],
) -> None:
    """Sentinel (3 sentinels, one replica): an earlier run of ``k`` took fencing token F,
    replicated; the replica is then cut off (SIGSTOPped, its link killed), A takes ``k``
    (token F+1) on the primary alone, and the primary is SIGKILLed. Sentinel promotes
    the replica, which lacks A's lock and the counter's last increment. The next holder
    of ``k`` must still get a larger token than A's.

    Today it got A's token again (F+1 twice). Also measured (printed, not asserted):
    how long until the next holder starts, and when A is told ``LockLost``.
    """
    group = start_sentinels(down_after_ms=1000)
    try:
        app_env.update(CSB_LOCK_TTL="10", CSB_LIVENESS_TTL=str(LIVENESS_TTL), CSB_LOCK_REDIS=group.url)
        app = load_app(redis_server, **app_env)
        a = worker(redis_server, "a", app_env, concurrency=2)
        earlier = app.hold.apply_async(("k",), queue="a")
        assert earlier.get(timeout=30).startswith("a@")
        old = group.master_address()
        primary = group.server_on(old[1])
        replica = next(s for s in group.servers[:2] if s is not primary)
        primary_client, replica_client = primary.client(), replica.client()
        assert primary_client.wait(1, 5000) == 1, "the replica has every write so far (the earlier token)"

        with replica_cut_off(replica, primary_client):
            records.set("hold:k", "1")
            holder = app.hold.apply_async(("k",), queue="a")
            run = wait_started(records, "k", holder)
            written = primary_client.info("replication")["master_repl_offset"]
            primary.kill()
            killed = time.time()
        assert replica_client.info("replication")["master_repl_offset"] < written, \
            "the replica lacks the primary's last writes (A's lock)"
        wait_for_new_primary(group, old)
        promoted = time.time()

        attempts = []

        def next_holder() -> dict | None:
            if attempts:
                later = started_run(records, "k", attempts[-1].id)
                if later is not None:
                    return later
                if not attempts[-1].ready():
                    return None
                records.delete("hold:k")  # skipped: A still holds k (put back); let it end
            attempts.append(app.hold.apply_async(("k",), queue="a"))
            return None

        later = wait_for(next_holder, timeout=60, message="a later holder of k")
        wait_for(lambda: "lost its lock" in a.output() or ended_run(records, "k", holder.id), timeout=30,
                 message="A told LockLost, or ended")
        records.delete("hold:k")
        assert holder.get(timeout=30).startswith("a@")
        lost_at = ended_run(records, "k", holder.id)["lost_at"]
        earlier_fence = started_run(records, "k", earlier.id)["fence"]
        print(f"\nfailover: promoted {promoted - killed:.2f}s after the kill; next holder started "
              f"{later['start'] - killed:.2f}s after it; A told LockLost "
              + (f"{lost_at - killed:.2f}s after it" if lost_at else "never")
              + f"; tokens: earlier {earlier_fence}, A {run['fence']}, next {later['fence']}")
        assert earlier_fence < run["fence"] < later["fence"], \
            f"fencing tokens grow: earlier {earlier_fence}, A {run['fence']}, next holder {later['fence']}"
    finally:
        group.stop()
