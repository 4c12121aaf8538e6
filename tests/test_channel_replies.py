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

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded

from celery_singleton_beat.commands import raise_errors
from celery_singleton_beat.lock import AcquireResult, read_holder
from celery_singleton_beat.scripts import RELEASE
from celery_singleton_beat.wire import Request, run_pooled

from .support import RedisServer, wait_for
from .support.interrupts import RaiseInto, blocked_on, main_waits_for_a_reply_in, queued_behind, when
from .support.locking import take_lock

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
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        with RaiseInto() as interrupt:
            interrupt.arm(error)
            with when(lambda: blocked_on(admin, "set"), interrupt.fire, otherwise=lambda: unpause(admin)), \
                    pytest.raises(error):
                take(client, "interrupted")
    finally:
        unpause(admin)
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
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        with RaiseInto() as interrupt:
            interrupt.arm(SoftTimeLimitExceeded)
            with when(lambda: blocked_on(admin, "evalsha"), interrupt.fire, otherwise=lambda: unpause(admin)), \
                    pytest.raises(SoftTimeLimitExceeded):
                lease.renew_once()
    finally:
        unpause(admin)
    holder = read_holder(client, HELD)
    assert holder is not None and holder.task_id == "theirs"
    assert lease.renew_once().value == "renewed"


# -------------------------------------------------------------------- error replies to SCRIPT LOAD


def server_busy(probe: redis.Redis) -> bool:
    try:
        probe.ping()
    except redis.ResponseError as exc:
        return str(exc).startswith("BUSY")
    return False


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
        assert lease.release() is True, "the script ran although loading it again was refused"
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
