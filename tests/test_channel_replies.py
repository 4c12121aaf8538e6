"""Every reply read where it belongs: a request reads all the replies it wrote, or its
connection is dropped, whatever interrupted it.

Real redis-server, single process. The faults are the server's own (``-BUSY`` while
another client's script runs, ``-NOPERM`` for a user without ``SCRIPT LOAD``, a
``CLIENT PAUSE WRITE`` as ``FAILOVER`` does) and exceptions raised into the waiting
thread by a signal handler, as billiard raises ``SoftTimeLimitExceeded``. After each
fault the next request on the same connection (the thread's channel, or the pool's
connection) must read its own replies: a key held by another is reported held by
that other, never acquired.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded

from celery_singleton_beat.connection import lock_connection
from celery_singleton_beat.connection.channels import channel_for
from celery_singleton_beat.connection.pooled import run_pooled
from celery_singleton_beat.connection.wire import Request, pack
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.commands import raise_errors, release_request
from celery_singleton_beat.lease.lock import AcquireResult
from celery_singleton_beat.lease.scripts import RELEASE
from celery_singleton_beat.recovery.server import PORTABLE

from .support import RedisServer, kill_named, wait_for
from .support.fault_proxy import FaultProxy, Rates
from .support.interrupts import RaiseInto, blocked_on, main_waits_for_a_reply_in, queued_behind, when
from .support.locking import take_lock
from .support.servers import server_busy

KEY = "t:{demo.task:mine}"
#: Held by another client all along: whoever asks must be told so.
HELD = "t:{demo.task:held}"


def take(client: redis.Redis, task_id: str, key: str = KEY) -> AcquireResult:
    return take_lock(client, key, 30, task="demo.task", task_id=task_id, node="w1@host", boot="b1")


def held_by_another(server: RedisServer) -> redis.Redis:
    other = server.client()
    assert take(other, "theirs", key=HELD).acquired
    return other


def assert_told_the_truth(client: redis.Redis) -> None:
    """The next acquire on ``client``'s channel reads its own replies: ``HELD`` is another's."""
    result = take(client, "next", key=HELD)
    assert not result.acquired, f"told acquired (fence {result.lease and result.lease.fence}) for a key another holds"
    assert result.holder is not None and result.holder.task_id == "theirs"


def unpause(admin: redis.Redis) -> None:
    admin.execute_command("CLIENT", "UNPAUSE")


# -------------------------------------------------------------------- exceptions while waiting


def raise_while_paused(admin: redis.Redis, command: str, error: type[BaseException], call: Callable[[], Any]) -> None:
    """``call()`` on a server paused for writes; ``error`` is raised into this thread once the
    server holds ``command`` back (the thread waits for its reply), then the server goes on."""
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        with RaiseInto() as interrupt:
            interrupt.arm(error)
            with when(lambda: blocked_on(admin, command), interrupt.fire, otherwise=lambda: unpause(admin)), \
                    pytest.raises(error):
                call()
    finally:
        unpause(admin)



@pytest.mark.parametrize("error", [SoftTimeLimitExceeded, SystemExit, KeyboardInterrupt])
def test_an_exception_raised_while_an_acquire_waits_leaves_no_reply_to_the_next_request(
        make_redis: Callable[..., RedisServer], error: type[BaseException]) -> None:
    """A soft time limit (or SystemExit, KeyboardInterrupt) lands while the acquire waits on a
    paused server; once the server goes on, the next acquire of a key held by another on the
    same thread is told it is held, not given the interrupted acquire's replies."""
    server = make_redis()
    client, admin = server.client(), server.client()
    held_by_another(server)
    assert take(client, "warm", key="t:{demo.task:warm}").acquired  # the channel is up
    raise_while_paused(admin, "set", error, lambda: take(client, "interrupted"))
    assert_told_the_truth(client)
    assert take(client, "after", key="t:{demo.task:free}").acquired


def test_an_exception_raised_while_a_pooled_request_waits_leaves_no_reply_in_the_pool(
        make_redis: Callable[..., RedisServer]) -> None:
    """The same on the pooled path (the keeper's renewals): the connection whose reply was
    not read never goes back into the pool with it."""
    server = make_redis()
    client, admin = server.client(), server.client()
    held_by_another(server)
    lease = take(client, "id-1").lease
    assert lease is not None and lease.renew_once().value == "renewed"  # a pooled connection, scripts loaded
    raise_while_paused(admin, "evalsha", SoftTimeLimitExceeded, lease.renew_once)
    holder = read_holder(client, HELD)
    assert holder is not None and holder.task_id == "theirs"
    assert lease.renew_once().value == "renewed"


# -------------------------------------------------------------------- error replies to SCRIPT LOAD


@pytest.mark.parametrize("how", ["call", "send"])
def test_a_busy_reply_to_the_script_load_leaves_no_reply_to_the_next_request(
        make_redis: Callable[..., RedisServer], how: str) -> None:
    """Another client's long script makes the server answer ``-BUSY`` to the ``SCRIPT LOAD``
    written ahead of a release and to the release itself: both replies are read (the
    release did not run and says so), and the next acquire reads its own."""
    server = make_redis()
    client, admin = server.client(), server.client()
    admin.config_set("lua-time-limit", 10)  # ms before others are answered BUSY (busy-reply-threshold)
    held_by_another(server)
    lease = take(client, "id-1").lease  # acquire uses no script: none loaded on the channel yet
    assert lease is not None

    ended: list[BaseException] = []

    def long_script() -> None:
        try:
            server.client().eval("while true do end", 0)
        except redis.ResponseError as exc:
            ended.append(exc)

    runner = threading.Thread(target=long_script, daemon=True)
    runner.start()
    try:
        wait_for(lambda: server_busy(admin), timeout=10, interval=0.01, message="the server busy with a script")
        seen: list[tuple[Any, BaseException | None]] = []
        if how == "call":
            with pytest.raises(redis.ResponseError, match="BUSY"):
                lease.release()
        else:
            assert lease.release_soon(lambda released, error: seen.append((released, error)))
    finally:
        wait_for(lambda: admin.script_kill() or True, timeout=10, message="SCRIPT KILL")
        runner.join(10)
    assert_told_the_truth(client)
    if how == "send":
        assert len(seen) == 1 and seen[0][0] is None and "BUSY" in str(seen[0][1])
    assert server.client().exists(KEY), "the refused release did not run"
    assert lease.release(), "the lock is still ours"


@pytest.mark.parametrize("loaded", [False, True], ids=["script-missing", "script-loaded-by-another"])
def test_a_noperm_reply_to_the_script_load_leaves_no_reply_to_the_next_request(
        make_redis: Callable[..., RedisServer], loaded: bool) -> None:
    """A user without ``SCRIPT LOAD``: the load is refused, the script's own reply is read
    too. If another client had loaded the script the release ran and reports it; if not,
    the refusal is what the caller sees. The next acquire reads its own replies."""
    server = make_redis()
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-script|load")
    client = server.client(username="app", password="pw")
    held_by_another(server)
    if loaded:
        admin.script_load(RELEASE.source)
    lease = take(client, "id-1").lease
    assert lease is not None
    if loaded:
        try:
            released: Any = lease.release()
        except redis.ResponseError as exc:
            released = exc
        assert released is True, "the script ran although loading it again was refused"
    else:
        with pytest.raises(redis.ResponseError, match="no permissions"):
            lease.release()
    assert_told_the_truth(client)


def test_a_pooled_request_whose_script_load_is_refused_reads_its_own_reply_before_the_pool_gets_it_back(
        make_redis: Callable[..., RedisServer]) -> None:
    """On the pooled path: the refused ``SCRIPT LOAD`` comes back at once, the script's own
    reply only when the paused server goes on. The connection goes back to the pool only
    once that reply was read; the next pooled command reads its own."""
    server = make_redis()
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-script|load")
    client = server.client(username="app", password="pw")
    held_by_another(server)
    lease = take(client, "id-1").lease
    assert lease is not None
    assert run_pooled(client, KEY, Request([(b"PING",)], raise_errors)) is None  # a pool connection, checked
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        # The server goes on once the renewal waits for its script's reply, or once another
        # command waits behind that reply on the same connection (it went back to the pool).
        with when(lambda: blocked_on(admin, "evalsha") and (
                main_waits_for_a_reply_in("renew_once") or queued_behind(admin, "evalsha")),
                lambda: unpause(admin), otherwise=lambda: unpause(admin)):
            with pytest.raises(redis.ResponseError, match="no permissions"):
                lease.renew_once()  # pooled: SCRIPT LOAD refused, EVALSHA paused, then NOSCRIPT
            holder = read_holder(client, HELD)  # a GET on a connection of the pool
    finally:
        unpause(admin)
    assert holder is not None and holder.task_id == "theirs"


# -------------------------------------------------------------------- through a proxy


NO_FAULTS = Rates(refuse=0, delay=0, close_before=0, close_after=0, cut=0, silence=0)


@pytest.fixture
def proxy(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the session's server, faults only when forced."""
    with FaultProxy(redis_server.port, NO_FAULTS, seed=0) as fault_proxy:
        yield fault_proxy


@pytest.mark.parametrize("path", ["channel", "pool"])
def test_a_release_whose_reply_is_lost_after_it_ran_reports_unknown_not_lost(
        proxy: FaultProxy, redis_server: RedisServer, path: str) -> None:
    """The connection closes once Redis ran the release: sent again on a new connection, it
    finds nothing to delete. Whether the first ran is unknown: reported None, never False
    (which would be a false "lost its lock")."""
    client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=10)
    lease = take(client, "id-1").lease
    assert lease is not None
    proxy.force(b"EVALSHA", "close_after")
    if path == "channel":
        released = lease.release()
    else:
        released = run_pooled(client, KEY, release_request(PORTABLE, KEY, lease.value))
    assert proxy.faults["close_after"] == 1
    assert released is None, "a release sent again reported the lock not ours"
    assert not redis_server.client().exists(KEY)


def test_bytes_no_request_asked_for_break_an_idle_connection(
        proxy: FaultProxy, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes on an idle lock connection (here: what reads as a free key's acquire reply, from a
    broken middlebox) are nobody's: the connection is replaced before the next request."""
    monkeypatch.setattr(lock_connection, "IDLE_CHECK", 0.0)  # look at it before every use
    client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=10)
    held_by_another(redis_server)
    assert take(client, "warm", key="t:{demo.task:warm}").acquired
    channel = channel_for(client)
    assert channel.pending == 0  # idle: nothing written is unread
    assert proxy.inject(b"$-1\r\n*2\r\n$1\r\n1\r\n$1\r\n2\r\n:0\r\n") >= 1  # SET ... GET: nil, TIME, DEL: 0
    sock = channel._link.sock if channel._link is not None else None
    assert sock is not None
    wait_for(lambda: select.select([sock], [], [], 0)[0], timeout=5, message="the bytes on the idle connection")
    assert_told_the_truth(client)


def test_channels_reconnect_as_often_as_they_must_without_using_up_the_pool(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """Every drop costs a new connection: one made by the pool (``make_connection``) counts
    against ``max_connections`` (100 by default in redis-py 8) for good. A channel's
    connection is its own, reconnected each time; threads' channels take nothing from the pool."""
    client = redis.Redis(connection_pool=redis.ConnectionPool(
        host="127.0.0.1", port=redis_server.port, socket_timeout=10, max_connections=2, client_name="drops"))
    admin = redis_server.client()
    for n in range(6):
        assert take(client, f"id-{n}", key=f"t:{{demo.task:{n}}}").acquired
        assert kill_named(admin, "drops") >= 1  # as a restart or a proxy would
    acquired: list[bool] = []
    threads = [threading.Thread(target=lambda i=i: acquired.append(
        take(client, f"thread-{i}", key=f"t:{{demo.task:thread-{i}}}").acquired)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert acquired == [True] * 4
    lease = take(client, "pooled").lease
    assert lease is not None and lease.renew_once().value == "renewed", "the pool still has its connections"


def test_a_put_back_sent_again_after_a_lost_reply_finds_its_own_value_and_says_so(
        proxy: FaultProxy, redis_server: RedisServer) -> None:
    """A put-back whose connection closes once Redis ran it is sent again on a new one: it
    finds its own value there, which is success (a "not put back" would drop a kept lease)."""
    client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=10)
    lease = take(client, "id-1").lease
    assert lease is not None
    redis_server.client().delete(KEY)  # the server lost it
    proxy.force(b"SET", "close_after")
    assert lease.put_back() is True
    assert proxy.faults["close_after"] == 1
    holder = read_holder(redis_server.client(), KEY)
    assert holder is not None and holder.task_id == "id-1"


def test_a_pooled_connection_left_with_a_reply_unread_never_goes_back_to_its_pool(
        make_redis: Callable[..., RedisServer]) -> None:
    """Whatever leaves a borrowed connection with a reply unread (here an ``after`` step that
    writes a command and is interrupted before its reply, which the paused server holds
    back), the connection is dropped, not put back: the pool's next user reads its own."""
    server = make_redis()
    client, admin = server.client(), server.client()
    admin.set(KEY, "the value")
    assert run_pooled(client, KEY, Request([(b"PING",)], raise_errors)) is None  # a pool connection, checked

    def interrupted_after(link: Any, result: Any) -> Any:
        link.send(pack(b"SET", b"t:{demo.task:other}", b"1"))  # paused: its reply comes later
        raise SoftTimeLimitExceeded()

    read: list[Any] = []
    done = threading.Event()
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        # The server goes on once the next request waits: behind the unread reply on the same
        # connection, or on a new connection's look at the server (its recovery check writes).
        with when(lambda: done.is_set() or queued_behind(admin, "set") or blocked_on(admin, "eval"),
                  lambda: unpause(admin), otherwise=lambda: unpause(admin)):
            with pytest.raises(SoftTimeLimitExceeded):
                run_pooled(client, KEY, Request([(b"PING",)], raise_errors), after=interrupted_after)
            read.append(run_pooled(client, KEY, Request([(b"GET", KEY)], lambda replies: replies[0])))
            done.set()
    finally:
        unpause(admin)
    assert read == [b"the value"], "the next request on the pool read another request's reply"
