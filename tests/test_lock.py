"""The lease against a real redis-server: acquire, renew, release, fence, keeper."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_singleton_beat import LockLost
from celery_singleton_beat.connection.redirects import split_commands
from celery_singleton_beat.connection.wire import SocketLink
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.behalf import read_holder, release_for
from celery_singleton_beat.lease.commands import legacy_fence_key
from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import LeaseKeeper, get_keeper
from celery_singleton_beat.lease.scripts import RELEASE
from celery_singleton_beat.recovery.server import PORTABLE, LockServer, server_of
from celery_singleton_beat.task.run import HeldRun

from .support import LOCK_DB, RedisServer, soak, wait_for
from .support.keyspace import keyspace_events
from .support.locking import renew, take_lock
from .support.proxy import DelayProxy
from .support.servers import fill_up

KEY = "t:{demo.task:abc}"


def take(client: redis.Redis, task_id: str = "id-1", ttl: float = 5.0, **kw: Any) -> Any:
    kw.setdefault("boot", "b1")
    return take_lock(client, KEY, ttl, task="demo.task", task_id=task_id, node="w1@host", **kw)


def server_micros(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def test_acquire_is_exclusive_and_reports_the_holder(redis_db: redis.Redis) -> None:
    first = take(redis_db)
    second = take(redis_db, "id-2")
    assert first.acquired and not second.acquired
    assert second.holder is not None and second.holder.task_id == "id-1"
    assert second.holder.node == "w1@host" and second.holder.task == "demo.task"
    assert redis_db.pttl(KEY) > 0, "a lock always expires on its own"


def test_the_value_says_who_holds_it_and_how_often_it_is_renewed(redis_db: redis.Redis) -> None:
    lease = take(redis_db, ttl=6.0, live=True, liveness_ttl=3.0).lease
    value = json.loads(redis_db.get(KEY))
    assert value["v"] == 2 and value["task_id"] == "id-1" and value["boot"] == "b1" and value["live"] is True
    assert value["ttl"] == 6000
    assert value["every"] == 1000, "a worker's lease is renewed every liveness_ttl/3 when that is shorter"
    assert "fence" not in value, "the fencing token comes from the acquisition, not the value"
    assert lease.renew_every == pytest.approx(1.0)
    eager = take_lock(redis_db, "t:{demo.task:eager}", 6.0, task="demo.task", task_id="e").lease
    assert json.loads(redis_db.get("t:{demo.task:eager}"))["every"] == 2000 and eager.renew_every == 2.0


def test_release_and_renew_only_by_the_holder(redis_db: redis.Redis) -> None:
    lease = take(redis_db, ttl=1.0).lease
    assert lease is not None
    redis_db.delete(KEY)
    successor = take(redis_db, "id-2").lease
    assert successor is not None
    # The old holder's late renew and release must leave the new holder alone.
    assert renew(lease) is False
    assert lease.release() is False
    assert read_holder(redis_db, KEY).task_id == "id-2"
    assert renew(successor) is True and redis_db.pttl(KEY) > 1000
    assert successor.release() is True and not redis_db.exists(KEY)


def test_fencing_tokens_are_the_server_clock_and_grow_with_every_acquisition(redis_db: redis.Redis) -> None:
    tokens = []
    for i in range(20):
        before = server_micros(redis_db)
        lease = take(redis_db, f"id-{i}").lease
        after = server_micros(redis_db)
        assert before <= lease.fence <= after, "the server's clock in microseconds at the acquisition"
        tokens.append(lease.fence)
        assert lease.release()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


@pytest.mark.parametrize(("check_done", "copy"), [(False, False), (True, False), (True, True)],
                         ids=["plain", "acks_late", "acks_late-copy"])
def test_an_acquire_writes_its_key_and_nothing_else(redis_db: redis.Redis, check_done: bool, copy: bool) -> None:
    """An acquire on a free key makes one write, the ``SET`` of its key: no command for
    the per-key counter of releases before 0.3 (left over after an upgrade, it expires
    on its own), in the plain write, an ``acks_late`` run's or a copy's script."""
    redis_db.set(legacy_fence_key(KEY), 5, px=60_000)
    with keyspace_events(redis_db, "t:*") as events:
        lease = take(redis_db, check_done=check_done, copy=copy).lease
        assert lease is not None
        assert events() == [(KEY, "set"), (KEY, "expire")], "one SET ... PX of the key"
    assert redis_db.get(legacy_fence_key(KEY)) == b"5", "the 0.2 counter is left to expire"


def test_scripts_are_reloaded_after_script_flush(redis_db: redis.Redis) -> None:
    lease = take(redis_db).lease
    assert renew(lease)
    redis_db.script_flush()
    assert renew(lease), "the renewal script is loaded again"
    assert lease.release()
    assert take(redis_db).acquired


def test_release_for_frees_only_that_very_holder(redis_db: redis.Redis) -> None:
    """A release on someone else's behalf compares the holder's whole identity."""
    take(redis_db, "id-1", boot="b1")
    pid = read_holder(redis_db, KEY).pid
    assert release_for(redis_db, KEY, "someone-else") is False
    assert release_for(redis_db, KEY, "id-1", boot="another-incarnation") is False
    assert release_for(redis_db, KEY, "id-1", boot="b1", pid=pid + 1) is False, "another process of that id"
    assert release_for(redis_db, KEY, "id-1", claims_only=True) is False, "a run lock is never a claim"
    assert redis_db.exists(KEY)
    assert release_for(redis_db, KEY, "id-1", boot="b1", pid=pid) is True
    assert not redis_db.exists(KEY)
    take(redis_db, "queued", claim=True)
    assert release_for(redis_db, KEY, "queued", claims_only=True) is True


def test_a_run_adopts_its_own_publish_claim_only(redis_db: redis.Redis) -> None:
    assert take(redis_db, "id-1", claim=True).acquired
    assert not take(redis_db, "id-2", adopt_claim_of="id-2").acquired
    adopted = take(redis_db, "id-1", adopt_claim_of="id-1")
    assert adopted.acquired and adopted.lease.holder.claim is False
    assert adopted.lease.fence > 0
    # A run lease is never adopted, even by the same task id (acks_late redelivery).
    assert not take(redis_db, "id-1", adopt_claim_of="id-1").acquired


def test_done_marker_ends_a_later_copy_and_spares_retries(redis_db: redis.Redis) -> None:
    run = take(redis_db, "a", boot="b1")
    assert run.lease.release(done_ttl=60)
    assert redis_db.pttl(done_key(KEY, "a")) > 0
    copy = take(redis_db, "a", boot="b2", check_done=True)
    assert copy.completed and not copy.acquired
    assert not redis_db.exists(KEY), "the copy took nothing"
    other = take(redis_db, "z", boot="b2", check_done=True)
    assert other.acquired, "another task id is not affected by a's marker"


def test_a_copy_of_a_completed_run_never_holds_the_key_even_for_a_moment(redis_db: redis.Redis) -> None:
    """A caller who saw the run's result and submits the key again must find it free.

    A redelivered copy of a completed ``acks_late`` message (Redis' visibility
    timeout ended while the run was still going) arrives when it arrives: if
    it took the key and then let it go, a submission in between would be
    skipped as a duplicate of a run that had ended. Redis' own keyspace
    events record every write the copy's acquire made to the key.
    """
    assert take(redis_db, "a", boot="b1").lease.release(done_ttl=60)
    with keyspace_events(redis_db, KEY) as events:
        copy = take(redis_db, "a", boot="b2", check_done=True, copy=True)  # redelivered
        written = events()
    assert copy.completed and not copy.acquired
    assert written == [], f"the copy wrote the key: {written}"


def test_a_copy_between_the_commands_of_a_release_finds_the_run_completed(redis_db: redis.Redis) -> None:
    """A release with its done marker is two commands written together; Redis may run
    another client's command between them (the write reached it in two segments, a
    proxy forwards commands one by one). A copy of the message acquiring right there
    must find the run completed, not a free key to run again."""
    lease = take(redis_db, "a", boot="b1").lease
    redis_db.script_load(RELEASE.source)  # the raw connection below loads nothing itself
    request = lease._release_request(server_of(redis_db).info or PORTABLE, 60)
    first, second = split_commands(request.data, request.count)
    connection = redis_db.connection_pool.get_connection("release")
    try:
        connection.send_packed_command([first])
        connection.read_response()
        copy = take(redis_db, "a", boot="b2", check_done=True)
        connection.send_packed_command([second])
        connection.read_response()
    finally:
        redis_db.connection_pool.release(connection)
    assert copy.completed and not copy.acquired, "the copy would run the completed task again"
    assert not redis_db.exists(KEY) and redis_db.exists(done_key(KEY, "a"))


def test_release_can_leave_a_claim_for_a_retry(redis_db: redis.Redis) -> None:
    run = take(redis_db, "a", boot="b1")
    assert run.lease.release(claim_ttl=5)
    holder = read_holder(redis_db, KEY)
    assert holder.task_id == "a" and holder.claim and not holder.live
    assert 0 < redis_db.pttl(KEY) <= 5000
    assert take(redis_db, "a", boot="b2", adopt_claim_of="a").acquired


# -------------------------------------------------------------------- the keeper


def test_keeper_keeps_a_lease_alive_for_five_times_its_ttl(redis_db: redis.Redis) -> None:
    lease = take(redis_db, ttl=0.5).lease
    keeper = LeaseKeeper()
    kept = keeper.keep(lease)

    def still_held() -> bool:
        holder = read_holder(redis_db, KEY)
        return not kept.lost and holder is not None and holder.task_id == "id-1"

    try:
        # A soak: five TTLs must pass; the lease is checked held all along.
        assert soak(2.5, check=still_held, what="the kept lease") >= 20
        assert kept.renewals >= 4
    finally:
        # Left kept, it is renewed into the next test of this process, whose flushed server
        # looks like one that lost its data: the keeper puts the lock back there, as it must
        # for a live run, and that test's own acquire of the same key finds it held.
        keeper.forget(kept)


def test_a_forked_child_renews_with_a_keeper_of_its_own(redis_db: redis.Redis) -> None:
    """A prefork child inherits the parent's keeper object but not its thread: the
    child's runs must get a keeper whose thread runs there (else nothing renews them)."""
    parent = get_keeper()
    lease = take(redis_db, "id-0").lease
    parent.forget(parent.keep(lease))  # the parent's keeper thread is started
    assert lease.release()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = False
        try:
            keeper = get_keeper()
            kept = keeper.keep(take(redis_db, "id-1", ttl=0.3).lease)
            deadline = time.monotonic() + 10
            while kept.renewals < 2 and not kept.lost and time.monotonic() < deadline:
                time.sleep(0.01)
            ok = keeper is not parent and kept.renewals >= 2 and not kept.lost
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1", "the child's lease was renewed by a keeper of the child's"


def test_keeper_does_not_hold_on_to_forgotten_leases(redis_db: redis.Redis) -> None:
    """Short runs end long before their first renewal: the keeper must not keep each
    ended run's lease (and its callbacks) until that renewal time (60 s leases at 700
    runs/s were 14,000 dead entries)."""
    keeper = LeaseKeeper()
    lease = take(redis_db, ttl=60.0).lease
    for _ in range(1000):
        keeper.forget(keeper.keep(lease))
    running = keeper.keep(lease)
    assert keeper.tracked <= 64, f"{keeper.tracked} entries kept for 1 running lease"
    keeper.forget(running)


def test_keeper_is_not_woken_by_each_short_run(redis_db: redis.Redis) -> None:
    """A run that ends before its first renewal must not cost a thread wake-up.

    Each such wake-up (a futex call, a switch to the keeper thread and back, the
    GIL handed over twice) cost a solo worker about 8 system calls per no-op task.
    Between runs the worker does I/O, which lets the keeper thread run: a PING stands for it.
    """
    keeper = LeaseKeeper()
    lease = take(redis_db, ttl=60.0).lease
    keeper.forget(keeper.keep(lease))  # starts the thread
    wait_for(lambda: keeper.waiting, timeout=10, message="the keeper thread to wait")
    before = keeper.wakeups
    for _ in range(200):  # a no-op body: forgotten before any I/O, as in a worker
        keeper.forget(keeper.keep(lease))
        redis_db.ping()
    assert keeper.wakeups - before <= 5, f"the keeper woke {keeper.wakeups - before} times for 200 short runs"


def test_keeper_reports_a_deleted_lease(redis_db: redis.Redis) -> None:
    lease = take(redis_db, ttl=0.6).lease
    reasons: list[str] = []
    kept = LeaseKeeper().keep(lease, on_lost=lambda _k, reason: reasons.append(reason))
    redis_db.delete(KEY)
    wait_for(lambda: kept.lost, timeout=10, message="loss reported")
    assert reasons and "deleted" in reasons[0]


def test_a_renewal_answered_after_its_run_released_is_no_loss(redis_db: redis.Redis) -> None:
    """A renewal in flight when the run ends meets the executed release: the run ended
    cleanly, so nothing is reported (no LockLost warning, no task-lock-lost event)."""
    lease = take(redis_db, ttl=30.0).lease
    reasons: list[str] = []
    keeper = LeaseKeeper()
    kept = keeper.keep(lease, on_lost=lambda _k, reason: reasons.append(reason))
    # The order of a renewal that was already on its way when the run ended:
    keeper.forget(kept)  # the run ends ...
    assert lease.release()  # ... and its release executes first
    assert keeper.renewer.renew_one(kept) is None  # then the renewal's answer: not ours any more
    assert not kept.lost and reasons == []


def test_keeper_reports_loss_when_redis_is_gone_past_the_ttl(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    client = server.client(socket_timeout=0.2, socket_connect_timeout=0.2)
    lease = take_lock(client, KEY, 0.6, task="demo.task", task_id="id-1").lease
    kept = LeaseKeeper().keep(lease)
    server.kill()
    wait_for(lambda: kept.lost, timeout=10, message="loss reported")
    assert "unreachable" in (kept.lost_reason or "")


def test_ensure_held_fails_once_the_lease_may_have_lapsed_whatever_the_keeper_saw(
        redis_db: redis.Redis) -> None:
    """A process paused past its lease (SIGSTOP, a stalled VM) must not vouch for it after it
    resumes, before its keeper has even looked: ensure_held() reads the clock, not a flag."""
    lease = take(redis_db, ttl=0.5).lease
    run = HeldRun(lease, None)  # never kept: no renewal, as if the process had been stopped
    run.ensure_held()           # (a run forgotten by its keeper has ended: it never vouches)
    wait_for(lambda: time.monotonic() >= lease.valid_until, timeout=5, message="the lease to lapse")
    assert not run.lost, "the keeper never looked"
    with pytest.raises(Exception, match="not renewed"):
        run.ensure_held()
    assert not run.held


def test_ensure_held_never_vouches_past_a_restarts_recovery_window(make_redis: Callable[..., RedisServer]) -> None:
    """A holder outside any worker (an eager run, a script: never taken over) whose renewals
    stopped (a paused process): the lock Redis restarts empty, and another client takes
    the key once the recovery window closes. From then on, ``ensure_held()`` must raise.

    Before, it vouched for the whole ``lock_ttl`` after the last renewal (30 s here),
    while the window lasts ``singleton_liveness_ttl / 3 + 1.5 s`` (2.5 s here)."""
    server = make_redis()
    holder_client, contender = server.client(), server.client()
    holder_client.csb_server, contender.csb_server = LockServer("t", 3.0), LockServer("t", 3.0)
    lease = take(holder_client, ttl=30.0, liveness_ttl=3.0).lease
    assert lease is not None
    run = HeldRun(lease, None)  # never kept: no renewal, as if paused
    assert take_lock(contender, "t:{other}", 30.0, task="demo.task").acquired, "the contender used the server"
    run.ensure_held()

    server.restart()  # SIGKILL, started again on its port: empty
    taken = take_lock(contender, KEY, 30.0, task="demo.task", task_id="id-2", liveness_ttl=3.0)
    assert taken.acquired, "the contender took the key once the recovery window closed"
    assert server_of(contender).recovery().until > 0, "it waited for a recovery window"
    with pytest.raises(LockLost, match="not renewed"):
        run.ensure_held()
    assert not run.held


# -------------------------------------------------------------------- requests


def requests_of(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """From now on, the command names of every write this process makes to a Redis
    connection (one request each; the lock's own connection included)."""
    sent: list[list[str]] = []
    send = redis.connection.AbstractConnection.send_packed_command
    send_link = SocketLink.send

    def names_of(command: Any) -> list[str]:
        data = b"".join(c.encode() if isinstance(c, str) else bytes(c)
                        for c in ([command] if isinstance(command, (bytes, str)) else command))
        names, lines = [], data.split(b"\r\n")
        i = 0
        while i < len(lines) - 1:
            count = int(lines[i][1:])
            names.append(lines[i + 2].decode().upper())
            i += 1 + 2 * count
        return names

    def recorded(self: Any, command: Any, *args: Any, **options: Any) -> Any:
        sent.append(names_of(command))
        return send(self, command, *args, **options)

    def recorded_link(self: SocketLink, data: bytes, replies: int = 1) -> None:  # the lock channel's own connection
        sent.append(names_of(data))
        send_link(self, data, replies)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", recorded)
    monkeypatch.setattr(SocketLink, "send", recorded_link)
    return sent


def test_each_operation_is_one_request_and_counters_are_written_in_batches(
        redis_db: redis.Redis, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Lua in the acquire, no request per run for counters: they arrive in one batch."""
    stats = "t:{stats}:task:demo.task"
    warm = take(redis_db, "warm-up").lease  # connections made and checked, scripts loaded
    assert warm is not None and renew(warm) and warm.release()
    observer = redis_server.client()
    observer.ping()
    counters.flush()
    sent = requests_of(monkeypatch)

    def one_request(operation: Callable[[], Any]) -> Any:
        sent.clear()
        result = operation()
        assert len(sent) == 1, f"one request: {sent}"
        return result

    lease = one_request(lambda: take(redis_db, stats_key=stats).lease)
    info = server_of(redis_db).info
    assert info is not None
    acquire_spelling = ["SET", "TIME"] if info.set_nx_get else ["SET", "GET", "TIME"]  # 6.2: no NX with GET
    assert sent[0][:len(acquire_spelling)] == acquire_spelling and "EVALSHA" not in sent[0], "no Lua in the acquire"
    one_request(lambda: take(redis_db, "id-2", stats_key=stats, counters=("acquired", "refused")))
    one_request(lambda: renew(lease))
    assert sent[0] == (["SET"] if info.set_ifeq else ["EVALSHA"]), f"renewal on {info.describe()}: {sent}"
    one_request(lease.release)
    native = "DELIFEQ" if info.delifeq else "DELEX" if info.delex else "EVALSHA"
    assert sent[0] == [native], f"release on {info.describe()}: {sent}"
    assert observer.hgetall(stats) == {}, "nothing counted per operation"
    sent.clear()
    counters.flush()
    assert len(sent) == 1 and sent[0].count("HINCRBY") == 4, f"one batch: {sent}"
    assert {k.decode(): int(v) for k, v in observer.hgetall(stats).items()} == {
        "acquired": 1, "refused": 1, "renewed": 1, "released": 1}
    assert observer.pttl(stats) > 0, "counters expire when no longer updated"


def test_a_flush_at_exit_waits_for_the_batch_being_written(redis_server: RedisServer, redis_db: redis.Redis) -> None:
    """A process about to end (:func:`counters.flush_at_exit`) must not return while the
    writer thread's batch is still on its way: the process would end with it. The
    writer's write is held at a proxy; the flush at exit waits until it has landed."""
    stats = "t:{stats}:task:demo.exit"
    proxy = DelayProxy(redis_server.port, 0.0, name="counters-proxy").start()
    client = redis.Redis.from_url(proxy.url(LOCK_DB))
    observer = redis_server.client(LOCK_DB)
    proxy.hold()
    try:
        counters.count(client, stats, "acquired")  # the writer writes it within FLUSH_EVERY
        wait_for(lambda: proxy.held_bytes > 0, timeout=10, message="the writer's batch written, held at the proxy")
        landed: list[dict[bytes, bytes]] = []
        at_exit = threading.Thread(target=lambda: (counters.flush_at_exit(), landed.append(observer.hgetall(stats))))
        at_exit.start()
        soak(0.5, check=at_exit.is_alive, what="the flush at exit, waiting for the batch under way")
    finally:
        proxy.resume()
    at_exit.join(timeout=30)
    assert landed == [{b"acquired": b"1"}], "once the flush at exit returned, the batch had landed"
# -------------------------------------------------------------------- a full server


def test_a_full_server_keeps_renewing_a_live_lease(make_redis: Callable[..., RedisServer]) -> None:
    """Under ``maxmemory`` with ``noeviction`` a write that may grow memory is refused: the
    native renewal (``SET ... IFEQ``, Valkey 8.1+, Redis 8.4+) too, while a renewal that
    only compares and sets the expiry still runs. A lease kept through a full server
    stays held over several renewals, each one putting its full TTL back, and its
    release still frees it.

    Before, on Valkey 9.1 the keeper took the refusal for an outage and reported the
    lease lost once it would have expired (the key then expired too). The lease lasts
    30 s and is renewed every 0.3 s (a third of its 0.9 s liveness TTL): the renewals
    are counted, the machine's pace cannot make it expire."""
    server = make_redis()
    client = server.client()
    lease = take(client, ttl=30.0, liveness_ttl=0.9).lease
    assert lease is not None and renew(lease)
    admin = server.client()
    fill_up(admin)
    admin.pexpire(KEY, 20_000)  # every renewal the keeper makes on the full server puts 30 s back
    kept = LeaseKeeper().keep(lease)
    wait_for(lambda: kept.renewals >= 4 or kept.lost, timeout=30, message="four renewals on the full server")
    assert not kept.lost, "renewed while the server refuses writes"
    assert admin.pttl(KEY) > 20_000, "a renewal put the lease's TTL back"
    info = server_of(client).info
    assert info is not None and info.known, "the server was looked at (its native commands are known)"
    assert lease.release() is True and not admin.exists(KEY), "released on a full server"
    client.close()
    admin.close()


def test_a_release_on_a_full_server_reports_what_it_did(make_redis: Callable[..., RedisServer]) -> None:
    """The release runs on a full server (a delete frees memory) but the done marker written
    behind it cannot: the release is reported done, not failed."""
    server = make_redis()
    client = server.client()
    lease = take(client, ttl=5.0).lease
    assert lease is not None
    admin = server.client()
    fill_up(admin)
    try:
        released = lease.release(done_ttl=60)
    except redis.RedisError as exc:
        pytest.fail(f"the release ran, and was reported failed: {exc}")
    assert released is True
    assert not admin.exists(KEY), "the lock is free"
    assert not admin.exists(done_key(KEY, "id-1")), "no marker: the server refused to grow"


def test_a_look_never_dates_a_lock_s_expiry_before_the_server_does(locks: redis.Redis) -> None:
    """The unconfirmed-lock rule frees a lock whose expiry comes before ``window start +
    its TTL`` (it was not renewed since the window opened). The look that reads the expiry
    must never date it earlier than the server holds it: a renewal made right after the
    window opened would look older than it is, and a live holder's lock would be freed.

    The lock's expiry is set to a known absolute ms (``PEXPIREAT``) and looked at many
    times. Where the server has ``PEXPIRETIME`` (Redis 7.0+, Valkey) the look reads it:
    exactly the stored expiry. On Redis 6.2 it is the server's clock plus the remaining
    ms, both read in one transaction with the clock read last: never earlier.

    Before, the clock was read first and the remaining ms after it; the sum was off by the
    time between the two reads within the transaction whenever a millisecond boundary fell
    between them (or Redis was descheduled there, on a busy host: tens of ms), earlier on
    Redis 6.2 and later on 7.0, whose ``PTTL`` reads the transaction's start time."""
    from celery_singleton_beat.lease.commands import look_request
    from celery_singleton_beat.lease.executor import execute

    client = locks
    expires = int(client.time()[0]) * 1000 + 3_600_000 + 123
    client.set(KEY, "held")
    client.pexpireat(KEY, expires)
    servers: list[Any] = []

    def look(info: Any) -> Any:
        servers.append(info)
        return look_request(KEY, info=info)

    dated = [execute(client, KEY, look).expires_ms for _ in range(3000)]
    assert min(dated) >= expires, f"a look dated the expiry {expires - min(dated)} ms early"
    if servers[0].redis_version >= (7, 0, 0):
        assert set(dated) == {expires}, f"looks dated the expiry {sorted(set(dated) - {expires})[:5]}, not {expires}"


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_take_over_replaces_a_lock_unrenewed_since_its_look_and_never_a_renewed_one(locks: redis.Redis) -> None:
    """``TAKE_OVER`` replaces the looked-at value only if the lock's expiry has not moved
    since the look (read as stored where the server has ``PEXPIRETIME``): whatever time
    passed in between, an unrenewed lock is replaced; a lock renewed since is not."""
    from celery_singleton_beat.lease.commands import look_request, take_over_request
    from celery_singleton_beat.lease.executor import execute

    locks.set(KEY, "dead", px=60_000)
    look = execute(locks, KEY, lambda info: look_request(KEY, info=info))
    wait_for(lambda: server_ms(locks) > look.server_ms + 100, timeout=5,
             message="time passed on the server's clock; the lock was not renewed")
    taken = execute(locks, KEY, lambda info: take_over_request(info, KEY, "dead", look, "new", 60_000))
    assert taken.token is not None and locks.get(KEY) == b"new"

    locks.set(KEY, "alive", px=60_000)
    look = execute(locks, KEY, lambda info: look_request(KEY, info=info))
    wait_for(lambda: server_ms(locks) > look.server_ms + 100, timeout=5, message="the server's clock moved on")
    locks.pexpire(KEY, 60_000)  # renewed: its expiry moves by the 100+ ms since the look (6.2's slack: 50)
    refused = execute(locks, KEY, lambda info: take_over_request(info, KEY, "alive", look, "new", 60_000))
    assert refused.token is None and locks.get(KEY) == b"alive"
