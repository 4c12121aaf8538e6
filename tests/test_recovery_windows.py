"""Recovery windows are anchored where clients are: at the first client that reaches the
new server, never at the server's start.

After the lock Redis lost data (a restart without an append-only file, from an RDB
snapshot, a promoted replica, a missing ``<prefix>:server`` record, a former primary
serving again), no key that may be
held is given to anyone else until every live holder had its chance to put its lock
back. What each test protects:

* ``test_a_missing_server_record_costs_one_window_once``: a Redis without the record
  (new, or emptied) opens one window, at the first client; another process sees that
  same window, and once it closed nobody opens another; an AOF restart opens none.
* ``test_a_lease_taken_after_a_window_runs_from_the_end_of_the_wait``: a run whose
  acquisition waited a window holds a lease counted from the end of the wait.
* ``test_a_check_cut_before_its_record_is_written_is_noticed_again``: a client that
  noticed the new server but failed before the record was written notices it again on
  its next connection (its process remembers the new server only once the record is
  written): its holders put their locks back.
* ``test_the_window_opens_when_clients_first_reach_the_new_server``: real workers. A runs
  ``k`` and reaches the restarted server only once the window is open; the contender
  decides first, after a restart whose snapshot took longer than the window to load,
  after an empty server that was reachable only once it had been up longer than the
  window, or as a worker started after the restart (it never talked to the old
  server). The contender must not run ``k`` beside A.
* ``test_a_window_lasts_as_long_as_the_slowest_holder_needs``: a process renewing every
  0.5 s notices a loss first; the window it opens lasts what a process renewing every
  2 s needs (remembered from the record, or read in the record a failover kept).
* ``test_a_former_primary_serving_again_opens_a_window``: a primary failed over from and
  elected again without ever replicating from the interim primary looks like nothing
  changed; a process that used the interim primary finds its data older (the record's
  generation): a window opens and its holders put their locks back.
* ``test_a_record_written_before_a_sentinel_failover_opens_a_window``: the same former
  primary, reached by a process that never used the interim one: the Sentinel failover
  epoch the record was written at is below the sentinels' now, and a window opens.
* ``test_two_histories_of_one_generation_open_a_window``: a primary restarted with its
  append-only file while its replica was promoted reaches the same generation as the
  replica; a process that used the replica finds another history there.

In-process tests build the library's per-connection check (:class:`LockServer`) on a
plain client, one :class:`ServerMemory` per simulated process.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from celery_singleton_beat import SingletonTask
from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.log import logger
from celery_singleton_beat.recovery.lock_redis import get_redis, reset_clients
from celery_singleton_beat.recovery.records import ServerRecord, recovery_key, server_key, shard_records
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import (
    FAILED_OVER,
    WINDOW_SLACK,
    Finding,
    Notice,
    ServerMemory,
    mark_in_use,
    notice,
)

from .support import RedisServer, wait_for
from .support.keeps_lock import (
    assert_never_beside,
    call_of,
    ended_run,
    knobs,
    load_app,
    replica_cut_off,
    run_id,
    started_run,
    wait_started,
    worker,
)
from .support.proxy import DelayProxy
from .support.tasks import skipped
from .support.topologies import cluster_shard, start_cluster

PREFIX = "singleton"
LIVENESS_TTL = 2.0
#: The recovery window with :data:`LIVENESS_TTL` (see :class:`LockServer`).
WINDOW = LIVENESS_TTL / 3 + WINDOW_SLACK
#: The real workers' liveness TTL in the reachability test, and its window.
REACH_LIVENESS_TTL = 6.0
REACH_WINDOW = REACH_LIVENESS_TTL / 3 + WINDOW_SLACK


def process_client(server: RedisServer, memory: ServerMemory | None = None, liveness_ttl: float = LIVENESS_TTL,
                   **options: Any) -> tuple[redis.Redis, LockServer]:
    """A client whose every connection the library checks, as one process's would be
    (``memory``: what that process saw; a fresh one: a process that never used the server;
    ``liveness_ttl``: that process's ``singleton_liveness_ttl``)."""
    lock_server = LockServer(PREFIX, liveness_ttl, memory or ServerMemory())
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5,
                         retry=Retry(NoBackoff(), 0), redis_connect_func=lock_server.on_connect,
                         **options)
    client.csb_server = lock_server  # type: ignore[attr-defined]
    return client, lock_server


def server_ms(client: redis.Redis) -> int:
    """The server's clock, in Unix ms."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def record_of(client: redis.Redis, key: str = server_key(PREFIX)) -> ServerRecord:
    """The server record ``key`` on ``client``'s server (an AssertionError if there is none)."""
    record = ServerRecord.decode(client.get(key))
    assert record is not None, f"no {key} on the server"
    return record


def fresh_connection(client: redis.Redis) -> None:
    """Make ``client`` connect again (and so be checked again)."""
    client.connection_pool.disconnect()
    client.ping()


# ===================================================================== in-process


def test_a_missing_server_record_costs_one_window_once(make_redis: Callable[..., RedisServer],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A new Redis has no ``<prefix>:server`` record: the first client opens one window,
    says why (in one WARNING line that names the server once), and a process that comes
    later sees the same window (not a new one); once it closed, no client opens another;
    an AOF restart opens none."""
    lock_redis = make_redis("--appendonly", "yes")
    direct = lock_redis.client()
    memory = ServerMemory()
    first, first_server = process_client(lock_redis, memory)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        first.ping()
    [line] = [record.getMessage() for record in caplog.records if "new locks wait" in record.getMessage()]
    assert line.startswith(f"the lock Redis (Redis {direct.info('server')['redis_version']}) "), line
    assert "may have lost locks (no record" in line and "Redis Redis" not in line, line
    opened_ms = direct.pttl(recovery_key(PREFIX))
    assert 0 < opened_ms <= WINDOW * 1000, "a Redis without the server record opens a window at its first client"
    opened = record_of(direct)
    assert opened == ServerRecord(run_id(direct), 1, round(WINDOW, 3), opened.since_ms), \
        "the record names the server, at the first generation, with the window its process needs"
    assert server_ms(direct) - WINDOW * 1000 <= opened.since_ms <= server_ms(direct), \
        "and when the window opened, on the server's clock"
    window = first_server.recovery()
    assert window.open and "new or emptied" in window.reason, window
    assert not LockServer("other-app", LIVENESS_TTL, memory).recovery().open, \
        "another key prefix on the same Redis has a record, and a window, of its own"

    later, later_server = process_client(lock_redis)
    later.ping()
    seen = later_server.recovery()
    assert seen.open and seen.reason == window.reason, "a later process sees the same window"
    assert direct.pttl(recovery_key(PREFIX)) <= opened_ms, "the later process did not extend it"
    assert later_server.epoch == 0, "a process that had seen no data lost none"

    wait_for(lambda: not direct.exists(recovery_key(PREFIX)), timeout=WINDOW + 10, message="the window closed")
    third, third_server = process_client(lock_redis)
    third.ping()
    fresh_connection(first)
    assert not third_server.recovery().open and not first_server.recovery().open, "one window, once"

    before = run_id(direct)
    lock_redis.stop()  # SIGTERM: the append-only file has every write
    lock_redis.start()
    assert run_id(direct) != before, "the lock Redis restarted"
    fresh_connection(first)
    assert not direct.exists(recovery_key(PREFIX)) and not first_server.recovery().open, \
        "an append-only-file restart opens no window"
    assert first_server.epoch == 0, "nor does it make holders put their locks back"
    assert record_of(direct) == ServerRecord(run_id(direct), 2, round(WINDOW, 3), opened.since_ms), \
        "the record names the new run, one generation up; no window opened since the first"


def test_a_check_cut_before_its_record_is_written_is_noticed_again(
        make_redis: Callable[..., RedisServer]) -> None:
    """A process used the server; it restarted empty. The process's first connection to the
    new server learns its run id (``INFO``) and is cut before the record is written (the
    write is paused: ``CLIENT PAUSE WRITE``, the client times out). Another process then
    notices the new server first. The first process's next connection must still find its
    data lost (the epoch grows: its holders put their locks back) and the window open."""
    lock_redis = make_redis()
    direct = lock_redis.client()
    client, lock_server = process_client(lock_redis)
    client.ping()
    epoch = lock_server.epoch

    before = run_id(direct)
    lock_redis.restart()  # SIGKILL, started again on its port: empty
    assert run_id(direct) != before, "the lock Redis restarted"
    direct.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        with pytest.raises(redis.TimeoutError):
            fresh_connection(client)
        assert direct.get(server_key(PREFIX)) is None, "the check was cut before the record was written"
    finally:
        direct.execute_command("CLIENT", "UNPAUSE")

    other, _ = process_client(lock_redis)
    other.ping()  # another process notices the new server first: the record names it now
    assert record_of(direct).server == run_id(direct)
    fresh_connection(client)
    assert lock_server.epoch > epoch, "the process found its data lost on its next connection"
    window = lock_server.recovery()
    assert window.open, "and the window open"


#: A slow process's ``singleton_liveness_ttl`` (renews every 2 s) and a fast one's.
SLOW_TTL, FAST_TTL = 6.0, 1.5
#: The windows each of them needs: 3.5 s and 2.0 s.
SLOW_NEED, FAST_NEED = SLOW_TTL / 3 + WINDOW_SLACK, FAST_TTL / 3 + WINDOW_SLACK


def replicate_then_promote(primary: RedisServer, replica: RedisServer) -> None:
    """``replica`` copies ``primary``'s data, then is promoted (``REPLICAOF NO ONE``) as a
    failover would; ``primary`` is never told (cut off by a partition, it goes on as a primary)."""
    source, copy = primary.client(), replica.client()
    copy.replicaof("127.0.0.1", primary.port)
    wait_for(lambda: copy.info("replication").get("master_link_status") == "up"
             and copy.get(server_key(PREFIX)) == source.get(server_key(PREFIX)),
             timeout=30, message="the replica has the primary's data")
    copy.replicaof("NO", "ONE")


@pytest.mark.parametrize("how", ["restart-empty", "promoted-replica"])
def test_a_window_lasts_as_long_as_the_slowest_holder_needs(how: str,
                                                             make_redis: Callable[..., RedisServer]) -> None:
    """Process S renews every 2 s (``singleton_liveness_ttl`` 6: it needs a 3.5 s window to
    put its locks back), process F every 0.5 s (1.5: 2 s). F notices the loss first; the
    window it opens must last S's need, not its own:

    * ``restart-empty``: both used the server, which restarts empty (the record is lost
      with the data): F remembers what the record said of S;
    * ``promoted-replica``: S used the primary; its replica is promoted, and F, a process
      that never used either server, is the first to reach it: the record, replicated
      with the data, says what S needs.

    Before, F opened its own 2 s window: S's renewal came after it had closed, and a new
    acquisition in between took the key S still held."""
    lock_redis = make_redis()
    mark_in_use(lock_redis.client())  # a Redis in use: no first-deploy window to wait out
    slow, _ = process_client(lock_redis, liveness_ttl=SLOW_TTL)
    slow.ping()
    fast_memory = ServerMemory()
    if how == "restart-empty":
        before_fast, _ = process_client(lock_redis, fast_memory, liveness_ttl=FAST_TTL)
        before_fast.ping()  # F used the server too
        lock_redis.restart()  # SIGKILL, started again on its port: empty
        noticed = lock_redis
    else:
        noticed = make_redis()
        replicate_then_promote(lock_redis, noticed)
    fast, fast_server = process_client(noticed, fast_memory, liveness_ttl=FAST_TTL)
    before = time.monotonic()
    fast.ping()  # F notices first
    pttl = noticed.client().pttl(recovery_key(PREFIX))
    elapsed = time.monotonic() - before
    window = fast_server.recovery()
    assert window.open, f"{how}: F opened a window"
    assert window.until - before >= SLOW_NEED - 0.001, (
        f"{how}: F opened a window of {window.until - before:.2f}s from its check, S needs {SLOW_NEED:.2f}s")
    assert pttl / 1000 + elapsed >= SLOW_NEED - 0.002, \
        f"{how}: <prefix>:recovery lasts {pttl / 1000 + elapsed:.2f}s, S needs {SLOW_NEED:.2f}s"
    assert SLOW_NEED > FAST_NEED
    assert record_of(noticed.client()).need == SLOW_NEED, "the record keeps the slowest need it was told"


def test_a_former_primary_serving_again_opens_a_window(make_redis: Callable[..., RedisServer]) -> None:
    """P1 (append-only file) serves a process A. A partition cuts P1 off; its replica P2 is
    promoted (A's check opens the failover's window there), and A takes a lock on P2.
    Then P1 is elected again: it never became P2's replica, so it has its own run id, its
    record naming itself, its append-only file, no promotion: nothing looks new, but it
    lacks every write made on P2. A's next check must open a window (its data is older
    than what A has seen) and make A's holders put their locks back (the epoch grows); a
    process that only ever saw P1 finds the same window.

    Before, nothing opened: A's lock on P2 was free on P1 for anyone."""
    p1, p2 = make_redis("--appendonly", "yes"), make_redis("--appendonly", "yes")
    p1_direct = p1.client()
    mark_in_use(p1_direct)
    memory = ServerMemory()
    on_p1, p1_server = process_client(p1, memory)
    on_p1.ping()
    only_p1, only_p1_server = process_client(p1)  # another process: it never reaches P2
    only_p1.ping()

    replicate_then_promote(p1, p2)  # the failover: P1 cut off, never told
    on_p2, p2_server = process_client(p2, memory)
    on_p2.ping()
    assert p2_server.recovery().open and p2_server.epoch == 1, "the promoted replica opened a window (as before)"
    on_p2.set("singleton:{held-on-p2}", "A's lock")
    wait_for(lambda: not p2_server.recovery().open, timeout=WINDOW + 10, message="the failover's window closed")

    fresh_connection(on_p1)  # P1 elected again, A's connections follow it
    assert not p1_direct.exists("singleton:{held-on-p2}"), "P1 lacks the lock A took on P2"
    window = p1_server.recovery()
    assert window.open and "older" in window.reason, \
        f"P1 serving again opens a window (A saw newer data on P2); A's process knows {window}"
    assert p1_direct.pttl(recovery_key(PREFIX)) > 0, "every client finds it"
    assert p1_server.epoch == 2, "A's holders put their locks back"
    assert record_of(p1_direct).generation == record_of(p2.client()).generation + 1, \
        "P1's record is one generation above any A saw"
    fresh_connection(only_p1)
    assert only_p1_server.recovery().open, "a process that never saw P2 waits in the same window"


def test_a_record_written_before_a_sentinel_failover_opens_a_window(
        make_redis: Callable[..., RedisServer]) -> None:
    """The sentinels name a primary at a failover epoch (``config-epoch``) that grows with
    every failover; the record carries the one its last writer was told. A primary
    elected again without ever replicating from the interim one (its record naming
    itself, its own run id, no promotion) lacks every write made on the interim primary:
    a process that never used the interim primary tells it only by the epoch. Its check
    must open a window (keeping the generation, so a process that saw the interim
    primary still finds the data older); a client that is not Sentinel's (0) must not,
    nor a second check at the same epoch. A lower epoch opens one too: sentinels deployed
    anew count from 0 again (a sentinel that lags behind costs a window, not a miss)."""
    primary = make_redis()
    direct = primary.client()
    mark_in_use(direct, PREFIX, failover_epoch=3)
    written = record_of(direct)
    assert written.epoch == 3
    server = run_id(direct)
    records = (server_key(PREFIX), recovery_key(PREFIX))

    def check(told: int, memory: ServerMemory) -> Notice:
        connection = direct.connection_pool.get_connection()
        try:
            seen = notice(connection, records, server, promoted=False, aof=False, need=WINDOW,
                          known=memory.known(records[0]), failover_epoch=told)
        finally:
            direct.connection_pool.release(connection)
        memory.learn(PREFIX, records[0], server, seen, promoted=False, aof=False)
        return seen

    used_it = ServerMemory()  # a process that used this primary before the failovers
    for told in (0, 3):
        seen = check(told, used_it)
        assert (seen.finding, seen.left) == (Finding.SAME, 0.0), f"failover epoch {told}: nothing new ({seen})"
    assert record_of(direct).epoch == 3 and used_it.epoch == 0

    seen = check(5, ServerMemory())  # a fresh process, told of two failovers since
    assert seen.finding is Finding.FAILED_OVER and seen.reason == FAILED_OVER, seen
    assert seen.left > 0 and direct.pttl(recovery_key(PREFIX)) > 0, "a window every client finds"
    after = record_of(direct)
    assert (after.epoch, after.generation) == (5, written.generation), \
        f"the record is at the new epoch, its generation kept: {after}"
    assert after.since_ms > 0, "locks not confirmed since the failover are unconfirmed once the window closed"

    seen = check(5, ServerMemory())  # another fresh process at the same epoch
    assert seen.finding is Finding.SAME and seen.left > 0, "it waits in the same window, opens none"
    seen = check(5, used_it)
    assert seen.finding is Finding.SAME and used_it.epoch == 0, \
        "a process that never left this primary finds its own writes here: its holders have nothing to put back"

    seen = check(1, ServerMemory())  # sentinels deployed anew, after a failover of their own
    assert seen.finding is Finding.FAILED_OVER and record_of(direct).epoch == 1, \
        f"a record written under other sentinels opens a window too: {seen}"


def test_two_histories_of_one_generation_open_a_window(make_redis: Callable[..., RedisServer]) -> None:
    """Two servers can reach the same generation apart: P1 restarted with its append-only
    file (no window: every write kept; C notices it first and writes the next generation)
    while its replica P2 was promoted (B notices that, writes the same next generation,
    and takes a lock there). When B reaches P1 afterwards, P1's record names another
    server at the generation B saw on P2: another history, without B's lock. B's check
    must open a window and its epoch grow."""
    p1, p2 = make_redis("--appendonly", "yes"), make_redis("--appendonly", "yes")
    p1_direct = p1.client()
    mark_in_use(p1_direct)
    b_memory, c_memory = ServerMemory(), ServerMemory()
    for memory in (b_memory, c_memory):
        process_client(p1, memory)[0].ping()
    replicate_then_promote(p1, p2)
    on_p2, p2_server = process_client(p2, b_memory)
    on_p2.ping()  # B follows the failover to P2
    on_p2.set("singleton:{held-on-p2}", "B's lock")
    p1.stop()  # SIGTERM: P1's append-only file has every write it acknowledged
    p1.start()
    c_client, c_server = process_client(p1, c_memory)
    c_client.ping()  # C, which never saw P2, notices P1's restart first: no window
    assert not c_server.recovery().open, "an append-only-file restart opens no window"
    wait_for(lambda: not p2_server.recovery().open, timeout=WINDOW + 10, message="the failover's window closed")
    epoch = p2_server.epoch

    on_p1, p1_server = process_client(p1, b_memory)
    on_p1.ping()  # B reaches P1 again
    assert not p1_direct.exists("singleton:{held-on-p2}"), "P1 lacks the lock B took on P2"
    window = p1_server.recovery()
    assert window.open, f"B finds another history at the generation it saw: a window opens (B knows {window})"
    assert p1_server.epoch > epoch, "B's holders put their locks back"


def test_a_lease_taken_after_a_window_runs_from_the_end_of_the_wait(
        make_redis: Callable[..., RedisServer]) -> None:
    """An eager run with a 1 s lease is the first client of a new Redis: its acquisition
    waits the window (longer than the lease), and its lease then runs from the end of the
    wait: the run holds its lock."""
    lock_redis = make_redis()
    app = Celery("window-lease", broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url=lock_redis.url(), singleton_liveness_ttl=LIVENESS_TTL,
                    task_always_eager=True)

    @app.task(base=SingletonTask, bind=True, shared=False, name="window.held", lock_ttl=1.0)
    def held(self: SingletonTask) -> dict[str, Any]:
        return {"held": self.singleton.held, "window": server_of(get_redis(app)).recovery()}

    try:
        seen = held.delay().get()
    finally:
        reset_clients()
        clear_settings_cache()
    assert seen["window"].reason and seen["window"].until > 0, "the run's acquisition met a window"
    assert seen["held"], "the lease runs from the end of the window's wait, not from before it"


# ===================================================================== real workers


@pytest.fixture
def app_env(redis_db: redis.Redis) -> Iterator[dict[str, str]]:
    """The workers' environment, filled in by the test (see ``support.keeps_lock.knobs``)."""
    yield from knobs()


def uptime(client: redis.Redis) -> int:
    return int(client.info("server")["uptime_in_seconds"])


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["slow-snapshot-load", "reachable-late", "new-worker"])
def test_the_window_opens_when_clients_first_reach_the_new_server(
    how: str, redis_server: RedisServer, make_redis: Callable[..., RedisServer], records: redis.Redis,
    app_env: dict[str, str],
) -> None:
    """A runs ``k`` (``lock_ttl`` 30 s) and reaches the lock Redis through a proxy that
    holds its requests from just before the restart until a recovery window is open (or
    the contender decided): the contender is the first client of the new server.

    * ``slow-snapshot-load``: restarted from an RDB snapshot (which has the server record,
      not A's lock) that takes longer than the window to load; B reaches it once loaded;
    * ``reachable-late``: restarted empty, reachable (B's proxy) only once it has been up
      longer than the window (a readiness probe, a slow Service);
    * ``new-worker``: restarted empty; C, a worker started after the restart, never
      talked to the old server.

    The workers' liveness TTL is 6 s: A puts its lock back only if the server lost it
    within two renewals and the take-over watch of A's last renewal (5 s), and the
    restart, with up to a second of rounding in the server's uptime, must fit in that.

    Before, each opened no window (the first two measured it from the server's start, the
    third saw no earlier server) and the contender ran ``k`` beside A.
    """
    slow_load = how == "slow-snapshot-load"
    lock_redis = make_redis(*(("--key-load-delay", "500", "--loading-process-events-interval-bytes", "1024")
                              if slow_load else ()))
    direct = lock_redis.client()
    a_link = DelayProxy(lock_redis.port, 0.0, name="a-lock-link").start()
    b_link = DelayProxy(lock_redis.port, 0.0, name="b-lock-link").start()
    app_env.update(CSB_LOCK_TTL="30", CSB_LIVENESS_TTL=str(REACH_LIVENESS_TTL))
    app = load_app(redis_server, **app_env, CSB_LOCK_REDIS=lock_redis.url())
    worker(redis_server, "a", {**app_env, "CSB_LOCK_REDIS": a_link.url()})
    if how != "new-worker":
        worker(redis_server, "b", {**app_env, "CSB_LOCK_REDIS": b_link.url()})
    wait_for(lambda: direct.get(server_key(PREFIX)), timeout=30, message="the workers used the lock Redis")
    if slow_load:
        pipe = direct.pipeline(transaction=False)
        for i in range(8000):  # loaded at 0.5 ms a key: about 4 s
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
        direct.save()  # the snapshot: the server record, without A's lock
    records.set("hold:k", "1")
    original = app.hold.apply_async(("k",), queue="a")
    wait_started(records, "k", original)
    before = run_id(direct)

    a_link.hold()
    b_link.hold()
    lock_redis.restart()  # SIGKILL, started again on its port (loading the snapshot, if any)
    if slow_load:
        wait_for(lambda: direct.info("persistence")["loading"] == 0, timeout=60, message="the snapshot loaded")
        assert record_of(direct).server == before, "the snapshot had the server record"
    else:
        wait_for(lambda: uptime(direct) > REACH_WINDOW, timeout=30, message="the server up longer than the window")
    up = uptime(direct)
    assert run_id(direct) != before and up > REACH_WINDOW, \
        f"the lock Redis restarted, and was first reachable {up}s after its start (window {REACH_WINDOW:.2f}s)"

    if how == "new-worker":
        worker(redis_server, "c", {**app_env, "CSB_LOCK_REDIS": lock_redis.url()})
        contender = "c"
    else:
        b_link.resume()
        contender = "b"
    second = app.hold.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue=contender)
    wait_for(lambda: direct.exists(recovery_key(PREFIX)) or call_of(records, "k", second.id),
             timeout=60, message="a recovery window, or the contender's decision")
    opened = bool(direct.exists(recovery_key(PREFIX)))
    a_link.resume()  # A reaches the new server: within the window, if one is open
    resumed = time.time()

    wait_for(lambda: call_of(records, "k", second.id), timeout=60, message="the contender decided")
    assert ended_run(records, "k", original.id) is None, "the original still ran when the contender decided"
    run = started_run(records, "k", second.id)
    assert run is None or skipped(second), (
        f"{how}: the contender ran k beside A's live run, {run['start'] - resumed:+.2f}s after A could reach "
        f"the server, first reachable {up}s after its start ({'a' if opened else 'no'} window open)")
    records.delete("hold:k")
    assert original.get(timeout=30).startswith("a@"), "the original completed"
    wait_for(lambda: second.ready(), timeout=30, message="the contender's copy settled")
    assert_never_beside(records, "k", original.id)
    print(f"\n{how}: first reachable {up}s after the server's start (window {REACH_WINDOW:.2f}s); "
          f"window open: {opened}; contender {'skipped' if skipped(second) else second.state}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_cluster_failover_opens_the_window_for_its_shard(
    redis_server: RedisServer, records: redis.Redis, app_env: dict[str, str],
) -> None:
    """Redis Cluster, 3 primaries with a replica each. A runs ``k``; the replica of ``k``'s
    shard, cut off first (SIGSTOP, its link killed), lacks A's lock but has the shard's
    server record; the primary is stopped and the replica promoted (``CLUSTER FAILOVER
    TAKEOVER``); the old primary resumes and turns into a replica. ``k`` sent to B then
    must not run beside A: the promoted shard opens its window, A puts its lock back.

    Before, a Cluster failover opened no window (each process saw only its own
    connections), A's process never found its data lost, and B ran ``k`` beside A. Also
    checked: a library client's connection to a node is looked at as it connects,
    whatever command it sends (beats and counters use redis-py's own).
    """
    cluster = start_cluster(primaries=3, replicas=1)
    try:
        app_env.update(CSB_LOCK_TTL="30", CSB_LIVENESS_TTL=str(LIVENESS_TTL), CSB_LOCK_REDIS=cluster.url)
        app = load_app(redis_server, **app_env)
        key = app.hold.singleton_key(("k",))
        primary, [replica] = cluster_shard(cluster, key_slot(key.encode()))
        primary_client, replica_client = primary.client(), replica.client()
        get_redis(app.app).exists(key)  # a plain command of a library client, as beats and counters send them
        shard_record, _ = shard_records(PREFIX, primary_client.execute_command("CLUSTER", "NODES")) or ("", "")
        assert record_of(primary_client, shard_record).server == primary_client.info("server")["run_id"], \
            "a library client's connection to a node is looked at as it connects (the shard's record written)"
        worker(redis_server, "a", app_env)
        worker(redis_server, "b", app_env)
        assert app.hold.apply_async(("k",), queue="a").get(timeout=30).startswith("a@"), \
            "A ran k once (its process checked k's shard and wrote the shard's record)"
        assert primary_client.wait(1, 5000) == 1, "the replica has every write so far (the shard's record)"

        with replica_cut_off(replica, primary_client):
            records.set("hold:k", "1")
            original = app.hold.apply_async(("k",), queue="a")
            wait_started(records, "k", original)
            assert primary_client.exists(key), "A holds k on the primary"
            primary.send(signal.SIGSTOP)
        try:
            replica_client.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
            wait_for(lambda: replica_client.info("replication")["role"] == "master", timeout=30,
                     message="the replica promoted")
        finally:
            primary.send(signal.SIGCONT)
        wait_for(lambda: primary_client.info("replication")["role"] == "slave", timeout=30,
                 message="the old primary turned into a replica")
        assert not replica_client.exists(key), "the promoted replica lacks A's lock"
        record, recovery = shard_records(PREFIX, replica_client.execute_command("CLUSTER", "NODES")) or ("", "")

        second = app.hold.apply_async(("k",), {"seconds": 0.5, "hold": "second"}, queue="b")
        wait_for(lambda: replica_client.exists(recovery) or call_of(records, "k", second.id), timeout=60,
                 message="the shard's recovery window, or B's decision")
        window = replica_client.get(recovery)
        wait_for(lambda: call_of(records, "k", second.id), timeout=60, message="B decided")
        assert ended_run(records, "k", original.id) is None, "the original still ran when B decided"
        run = started_run(records, "k", second.id)
        assert run is None or skipped(second), \
            f"B ran k beside A's live run after the shard's failover (window: {window!r})"
        assert window and replica_client.get(record) is not None, "the window and record of k's shard"
        records.delete("hold:k")
        assert original.get(timeout=30).startswith("a@"), "the original completed"
        wait_for(lambda: second.ready(), timeout=30, message="B's copy settled")
        assert records.get("overlap:k") is None, "no run of k started while another ran"
        print(f"\ncluster failover: B {'skipped' if skipped(second) else second.state}; the shard's window: "
              f"{window!r}")
    finally:
        cluster.stop()
