"""The lock channel: a release written now, its reply read with the next acquire.

Real redis-server. What must hold: the key is free for everyone as soon as the
release is written (no waiting for the next run), a same-key acquire right
after its predecessor's release never conflicts with it, the release's outcome
still reaches its handler, and a SCRIPT FLUSH or a lost connection neither
reorders nor hides anything.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_singleton_beat.connection import lock_connection
from celery_singleton_beat.connection.channels import channel_for
from celery_singleton_beat.connection.replies import INCOMPLETE, PyReader
from celery_singleton_beat.connection.wire import NOT_SHORT, SocketLink
from celery_singleton_beat.lease.commands import _TAKEN
from celery_singleton_beat.lease.holder import done_key

from .support import RedisServer, wait_for
from .support.locking import take_lock

KEY = "t:{demo.task:abc}"


def take(client: redis.Redis, task_id: str, key: str = KEY) -> Any:
    return take_lock(client, key, 30, task="demo.task", task_id=task_id, node="w1@host", boot="b1")


def outcomes() -> tuple[list[tuple[bool | None, BaseException | None]], Callable[..., None]]:
    seen: list[tuple[bool | None, BaseException | None]] = []
    return seen, lambda released, error: seen.append((released, error))


def test_a_written_release_frees_the_key_for_others_before_its_reply_is_read(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    lease = take(redis_db, "id-1").lease
    seen, handler = outcomes()
    assert lease.release_soon(handler)
    other = redis_server.client()
    wait_for(lambda: not other.exists(KEY), timeout=5, message="the key freed by the written release")
    assert take(other, "id-2").acquired  # another process is not kept waiting
    channel_for(redis_db).flush()
    assert seen == [(True, None)]


def test_with_no_next_command_the_reply_is_read_in_the_background(redis_db: redis.Redis) -> None:
    """The outcome of a run's release is known even when the process runs nothing else."""
    seen, handler = outcomes()
    take(redis_db, "id-1").lease.release_soon(handler)
    wait_for(lambda: seen == [(True, None)], timeout=10, message="the flusher to read the reply")
    assert channel_for(redis_db).pending == 0


def test_the_next_acquire_of_the_same_key_runs_after_the_release_and_reads_its_reply(
        redis_db: redis.Redis) -> None:
    seen, handler = outcomes()
    for n in range(50):  # back to back, one key, one thread: never a conflict with itself
        result = take(redis_db, f"id-{n}")
        assert result.acquired, f"run {n} conflicted with {result.holder}"
        result.lease.release_soon(handler)
    wait_for(lambda: len(seen) == 50, timeout=10, message="every release's reply")
    assert seen == [(True, None)] * 50


def test_a_release_of_a_lock_that_was_taken_meanwhile_reports_it_lost(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    lease = take(redis_db, "id-1").lease
    other = redis_server.client()
    other.delete(KEY)
    assert take(other, "id-2").acquired
    seen, handler = outcomes()
    lease.release_soon(handler)
    take(redis_db, "id-3", key="t:{demo.task:other}")
    assert seen == [(False, None)]
    assert other.exists(KEY), "the new holder's lock is left alone"


def test_after_script_flush_a_pending_release_still_runs_before_the_next_acquire(
        redis_db: redis.Redis, redis_server: RedisServer) -> None:
    take(redis_db, "warm").lease.release_soon(lambda *_: None)
    take(redis_db, "warm-2", key="t:{demo.task:warm}")  # every script loaded on the channel
    lease = take(redis_db, "id-1").lease
    redis_server.client().script_flush()
    seen, handler = outcomes()
    lease.release_soon(handler)  # meets NOSCRIPT on the server
    assert take(redis_db, "id-2").acquired, "the acquire ran before the release it follows"
    assert seen == [(True, None)]


@pytest.mark.parametrize("idle_check", [0.0, 3600.0], ids=["peeked-first", "found-at-the-reply"])
def test_a_connection_closed_by_a_restart_costs_neither_the_release_nor_the_next_acquire(
        make_redis: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch, idle_check: float) -> None:
    """An AOF restart during a run: its release goes to a new connection and is reported; the
    next acquire does not fail (no fail-closed retry). Either the idle connection is looked
    at before the release is written to it, or the release written onto the dead connection
    is found out when its reply is read and sent again."""
    monkeypatch.setattr(lock_connection, "IDLE_CHECK", idle_check)
    server = make_redis("--appendonly", "yes")  # appendfsync always: see make_redis
    client = server.client()
    lease = take(client, "id-1").lease
    server.kill()  # SIGKILL: the lock is in the append-only file
    server.start()  # same port, same data: the lock is back, the channel's connection is dead
    assert server.client().exists(KEY), "the lock came back with the file"
    seen, handler = outcomes()
    lease.release_soon(handler)
    result = take(client, "id-2")  # the stale connection is found out and replaced
    assert result.acquired, "the release ran before this acquire"
    assert seen == [(True, None)], "its outcome reported"
    assert take(client, "id-3", key="t:{demo.task:other}").acquired


def test_a_forked_child_uses_its_own_connection(redis_db: redis.Redis) -> None:
    parent = channel_for(redis_db)
    take(redis_db, "id-1").lease.release_soon(lambda *_: None)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = channel_for(redis_db) is not parent and take(redis_db, "id-2").acquired
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_usual_replies_read_in_one_step_mean_what_the_general_reader_says(
        redis_server: RedisServer, protocol: int) -> None:
    """An acquire and a release read their usual reply without the reply parser (the
    pure-Python one): the same outcomes as through it, in RESP2 and RESP3, and every
    other reply (held by another, released by no one) still through the general path."""
    client = redis.Redis(port=redis_server.port, db=1, protocol=protocol)
    client.delete(KEY)
    mine = take(client, "id-1")
    assert mine.acquired and isinstance(mine.lease.fence, int)
    raw = client.execute_command("TIME")
    assert abs(mine.lease.fence - (int(raw[0]) * 1_000_000 + int(raw[1]))) < 60_000_000, "the server's clock"
    held = take(client, "id-2")
    assert not held.acquired and held.holder is not None and held.holder.task_id == "id-1"
    assert mine.lease.release() is True and client.get(KEY) is None
    assert mine.lease.release() is False, "not ours any more"
    assert take(client, "id-3").lease.release(done_ttl=5) is True
    assert client.exists(done_key(KEY, "id-3")), "the done marker written ahead of it"
    assert channel_for(client).outstanding == 0


def test_a_reply_that_is_not_all_there_yet_is_left_to_the_general_reader() -> None:
    """The one-step read takes the bytes received only when they are exactly the usual
    reply: one still arriving (a segment at a time) or followed by more is read by the
    general parser, nothing lost or read twice."""
    ours, theirs = socket.socketpair()
    try:
        link = SocketLink(ours)
        link._reader = PyReader(INCOMPLETE)  # the one-step read's reader (with hiredis installed, not used)
        reply = b"_\r\n*2\r\n$10\r\n1700000000\r\n$6\r\n000042\r\n"
        link.outstanding = 2
        theirs.sendall(reply[:9])
        assert link.read_short(_TAKEN, 2) is NOT_SHORT and link.outstanding == 2
        theirs.sendall(reply[9:])
        assert link.read_many(2) == [None, [b"1700000000", b"000042"]] and link.outstanding == 0
        link.outstanding = 3
        theirs.sendall(reply + b":1\r\n")
        while len(link._reader.buffer) < len(reply) + 4:  # both replies received (blocking reads)
            link._receive()
        assert link.read_short(_TAKEN, 2) is NOT_SHORT, "more than the reply: the general path"
        assert link.read_many(3)[2] == 1
        link.outstanding = 2
        theirs.sendall(reply)
        assert link.read_short(_TAKEN, 2) == 1_700_000_000_000_042 and link.outstanding == 0
    finally:
        ours.close()
        theirs.close()
