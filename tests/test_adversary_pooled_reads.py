"""Attacks on the lock requests that read a borrowed connection's replies off its socket
(a gevent worker's acquires and releases, the keeper's batches, on a plain pool): replies
split at every byte, error replies inside a batch, RESP3 push frames, a greenlet killed
mid-reply, a 100 KB value, a connection closed under a request. Real redis-servers only.
After each, the next request on the pool must read its own replies: a key another holds
is reported held by that other, never taken."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
import termios
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_singleton_beat.connection.pooled import run_pooled
from celery_singleton_beat.connection.wire import Request
from celery_singleton_beat.lease.batches import combined
from celery_singleton_beat.lease.commands import AcquireReply, acquire_request, release_request
from celery_singleton_beat.lease.executor import execute

from .support import RedisServer, TestProcess, importorskip, kill_named, wait_for
from .support.fault_proxy import FaultProxy, Rates, reply_length
from .support.loopback import LoopbackProxy, close_socket
from .support.paths import ROOT

HELD = "t:{demo.task:held}"
THEIRS = "theirs-value"


def acquire(client: redis.Redis, key: str, value: str) -> Any:
    """An acquire on a borrowed connection (what a gevent worker sends)."""
    return execute(client, key, lambda info: acquire_request(info, key, value, 60_000, None), pooled=True)


def release(client: redis.Redis, key: str, value: str) -> Any:
    return execute(client, key, lambda info: release_request(info, key, value), pooled=True)


def assert_told_held(client: redis.Redis, holder: str = THEIRS) -> None:
    """The next acquire on the pool reads its own replies: ``HELD`` is another's."""
    reply = acquire(client, HELD, "next")
    assert isinstance(reply, AcquireReply), f"told taken ({reply!r}) for a key another holds"
    assert not reply.taken and reply.previous in (holder, holder.encode())


def only_socket(client: redis.Redis) -> socket.socket:
    """The socket of the pool's one idle connection."""
    pool = client.connection_pool
    (connection,) = pool._available_connections
    return connection._sock  # type: ignore[no-any-return]


def unread_bytes(sock: socket.socket) -> int:
    """Bytes received on ``sock`` that nothing read yet (``FIONREAD``; 0 once it is closed)."""
    try:  # the reader may close it meanwhile (it drops a connection with bytes left)
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0


def drained(sock: socket.socket) -> Callable[[], bool]:
    """Whether ``sock``'s reader has taken everything received (what a split waits for)."""
    return lambda: unread_bytes(sock) == 0


def tracking_on(client: redis.Redis) -> None:
    """Client-side caching (``CLIENT TRACKING ON``) on the pool's one connection: a key read
    there is tracked, and its next change pushes an invalidation to it (RESP3)."""
    connection = client.connection_pool.get_connection()
    try:
        connection.send_command("CLIENT", "TRACKING", "ON")
        assert connection.read_response() in (b"OK", "OK")
    finally:
        client.connection_pool.release(connection)


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def protocol(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def held(redis_db: redis.Redis, redis_server: RedisServer) -> RedisServer:
    """The session's server, with ``HELD`` held by another client."""
    redis_server.client().set(HELD, THEIRS)
    return redis_server


# ----------------------------------------------------------------- a reply split at every byte


class SplitProxy(LoopbackProxy):
    """Relays to a redis-server; once armed, the next ``count`` replies reach the client in
    two segments split at byte ``at``, the second sent only once the client's socket has
    given the first to its reader (so the first ``recv`` returns exactly the first)."""

    nodelay = True

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port, "split-proxy")
        self.armed: tuple[int, int, Callable[[], bool]] | None = None
        self.splits = 0
        self._start_accepting()

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        self.spawn(self.relay, client, lambda data: self.forward(upstream, data) or True,
                   lambda: close_socket(upstream), name="split-up")
        self.spawn(self._down, client, upstream, name="split-down")

    def _down(self, client: socket.socket, upstream: socket.socket) -> None:
        buffer = bytearray()

        def down(data: bytes) -> bool:
            buffer.extend(data)
            if self.armed is None:
                self.forward(client, bytes(buffer))
                buffer.clear()
                return True
            at, count, drained = self.armed
            end = 0
            for _ in range(count):
                end = reply_length(buffer, end)
                if end == 0:
                    return True  # the replies are not all here yet
            self.armed = None
            at = min(at, end - 1)
            self.forward(client, bytes(buffer[:at]))
            wait_for(drained, timeout=10, interval=0.001, message="the client to read the first segment")
            self.splits += 1
            self.forward(client, bytes(buffer[at:]))
            del buffer[:]
            return True

        self.relay(upstream, down, lambda: close_socket(client))


def test_replies_split_at_every_byte_are_read_whole_and_in_step(held: RedisServer, protocol: int) -> None:
    """An acquire taking a key, one finding ``HELD`` another's, a release: their replies split
    in two at every byte. Each reads its own whole, on the same connection throughout."""
    with SplitProxy(held.port) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10, protocol=protocol, max_connections=1)
        assert type(acquire(client, "t:warm", "w")) is int and release(client, "t:warm", "w") is True
        sock = only_socket(client)

        def split(at: int, count: int) -> None:
            proxy.armed = (at, count, drained(sock))

        for at in range(1, 48):
            key, value = f"t:{{demo.task:split}}:{at}", f"run-{at}"
            split(at, 2)
            assert type(acquire(client, key, value)) is int
            split(at, 2)
            reply = acquire(client, HELD, value)
            assert isinstance(reply, AcquireReply) and reply.previous in (THEIRS, THEIRS.encode())
            split(min(at, 3), 1)
            assert release(client, key, value) is True
            assert only_socket(client) is sock, f"the connection was dropped after a split at byte {at}"
        assert proxy.splits == 47 * 3
        assert_told_held(client)


# ----------------------------------------------------------------- error replies inside a batch


class RefusingProxy(FaultProxy):
    """A fault proxy whose forced refusals answer with one chosen error reply."""

    reply = b"-ERR\r\n"

    def __enter__(self) -> RefusingProxy:
        return self

    def refusal(self) -> bytes:
        return self.reply


@pytest.mark.parametrize("error", [
    b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.\r\n",
    b"-MOVED 3999 127.0.0.1:6381\r\n",
    b"-NOPERM this user has no permissions to run the 'evalsha' command\r\n",
    b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
])
def test_an_error_reply_inside_a_batch_is_that_requests_alone(held: RedisServer, protocol: int,
                                                            error: bytes) -> None:
    """A batch (acquire, release script, acquire) whose middle command is refused: that is the
    release's result alone, its code kept (``BUSY``, ``NOPERM``: what the outage and refusal
    rules read); after ``NOSCRIPT`` the batch is sent again. The connection stays in step."""
    with RefusingProxy(held.port, Rates(0, 0, 0, 0, 0, 0), seed=1) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10, protocol=protocol, max_connections=1)
        assert type(acquire(client, "t:mine", "mine")) is int
        assert release(client, "t:other", "x") is False  # the release script loaded on the connection
        sock = only_socket(client)
        proxy.reply = error
        proxy.force(b"EVALSHA", "refuse")
        results = execute(client, "t:a", lambda info: combined([
            acquire_request(info, "t:a", "a", 60_000, None), release_request(info, "t:mine", "mine"),
            acquire_request(info, "t:b", "b", 60_000, None)]), pooled=True)
        assert proxy.faults["refuse"] == 1
        assert type(results[0]) is int and type(results[2]) is int, results
        if error.startswith(b"-NOSCRIPT"):
            assert results[1] is True
        else:
            assert isinstance(results[1], redis.ResponseError), results
            assert str(results[1]).startswith(error[1:].split(b" ")[0].decode()), results[1]
            assert release(client, "t:mine", "mine") is True
        assert only_socket(client) is sock
        assert_told_held(client)


# ----------------------------------------------------------------- RESP3 push frames


def test_a_push_frame_cut_behind_the_last_reply_is_never_lent_on(held: RedisServer) -> None:
    """A release deleting a key its connection tracks: the invalidation is pushed right behind
    its reply, and the release receives the reply and the frame's first bytes, the rest
    later. The connection is ended: the next borrower never reads the frame's tail."""
    with SplitProxy(held.port) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10, protocol=3, max_connections=1)
        for n in range(3):
            assert type(acquire(client, "t:warm", "w")) is int and release(client, "t:warm", "w") is True
            tracking_on(client)
            key = f"t:{{demo.task:cut-push}}:{n}"
            assert type(acquire(client, key, "mine")) is int  # its SET ... GET read the key: tracked
            sock = only_socket(client)
            proxy.armed = (4 + 10, 2, drained(sock))  # ":1\r\n" and 10 bytes of the push
            assert release(client, key, "mine") is True
            wait_for(lambda: proxy.splits == n + 1, timeout=10, message="the push frame's tail sent")  # noqa: B023
            assert_told_held(client)
            assert type(acquire(client, key, "next")) is int


#: redis-py 8.2 and later read the pushes pending on an idle connection as the pool lends it,
#: and replace a connection whose push has no handler of theirs (an invalidation with no
#: client-side cache of redis-py's): a new connection, never one with a frame half read.
#: Before 8.2 the pool lent it as it was, the push's first bytes in its parser.
POOL_REPLACES_PUSHED = redis.VERSION[:2] >= (8, 2)  # type: ignore[attr-defined]


def test_push_frames_in_the_parser_or_between_a_requests_replies(held: RedisServer) -> None:
    """Client-side caching on the pooled connection. Another client's write of a tracked key
    pushes an invalidation to it while idle: its first bytes are in redis-py's parser when
    it is lent (the pool's check read them), the rest comes after; the acquire must not
    start reading mid-frame off the socket, and the connection is kept (redis-py 8.2 and
    later: the pool lends a new connection instead, see ``POOL_REPLACES_PUSHED``). An
    acquire's own ``SET`` of a tracked key pushes one between the ``SET``'s reply and
    ``TIME``'s: skipped, on the same connection."""
    with SplitProxy(held.port) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10, protocol=3, max_connections=1)
        assert type(acquire(client, "t:warm", "w")) is int
        tracking_on(client)
        other = held.client()
        for n in range(10):
            key, own = f"t:{{demo.task:half-push}}:{n}", f"t:{{demo.task:own-push}}:{n}"
            assert run_pooled(client, key, Request([(b"GET", key), (b"GET", own)], list)) == [None, None]
            sock = only_socket(client)
            proxy.armed = (7, 1, drained(sock))  # ">2\r\n$10" of the push
            other.set(key, "theirs")
            wait_for(lambda: unread_bytes(sock) == 7, timeout=10, message="half the push received")  # noqa: B023
            reply = acquire(client, key, "mine")
            assert isinstance(reply, AcquireReply) and reply.previous == b"theirs", reply
            lent = only_socket(client)
            assert (lent is not sock) if POOL_REPLACES_PUSHED else (lent is sock)
            if POOL_REPLACES_PUSHED:  # the new connection tracks nothing yet
                tracking_on(client)
                assert run_pooled(client, own, Request([(b"GET", own)], list)) == [None]
            assert type(acquire(client, own, "mine")) is int
            assert only_socket(client) is lent
        assert_told_held(client)


# ----------------------------------------------------------------- a greenlet killed mid-reply

GREEN = r"""
from gevent import monkey
monkey.patch_all()

import sys
import time
import gevent
import redis
from celery_singleton_beat.lease.commands import acquire_request
from celery_singleton_beat.lease.executor import execute

port, protocol, HELD = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
client = redis.Redis(port=port, socket_timeout=30, protocol=protocol, max_connections=1)
admin = redis.Redis(port=port, socket_timeout=30)

def acquire(key, value):
    return execute(client, key, lambda info: acquire_request(info, key, value, 60_000, None), pooled=True)

class Interrupted(BaseException):
    "What a gevent.Timeout or a soft time limit raises into the waiting greenlet."

def blocked():
    return any("b" in c.get("flags", "") and c.get("cmd") == "set" for c in admin.client_list())

assert type(acquire("t:warm", "w")) is int
for n in range(3):
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        waiting = gevent.spawn(acquire, f"t:killed:{n}", "killed")
        deadline = time.monotonic() + 20
        while not blocked():
            assert time.monotonic() < deadline, "the acquire never reached the paused server"
            gevent.sleep(0.01)
        waiting.kill(Interrupted, block=True)
        assert isinstance(waiting.exception, Interrupted), waiting.exception
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    reply = acquire(HELD, "next")  # the killed acquire's replies arrive now
    previous = getattr(reply, "previous", reply)
    print("REPLY", type(reply).__name__, previous.decode() if isinstance(previous, bytes) else previous, flush=True)
print("RESULT", len(client.connection_pool._in_use_connections), flush=True)
"""


def test_a_greenlet_killed_mid_reply_leaves_nothing_for_the_next_borrower(held: RedisServer,
                                                                          protocol: int) -> None:
    """gevent: an acquire on the pool's only connection is killed while the server holds its
    ``SET`` (``CLIENT PAUSE WRITE``), then answers it. The next acquire on that pool is told
    ``HELD`` is another's, never reads the killed one's replies; nothing stays lent."""
    importorskip("gevent")
    child = TestProcess("adversary-green-kill", [sys.executable, "-c", GREEN, str(held.port), str(protocol), HELD],
                        env={**os.environ, "PYTHONPATH": str(ROOT)}).start()
    try:
        result = child.wait_for_line("RESULT", timeout=60)
        lines = [line for line in child.output().splitlines() if line.startswith("REPLY")]
    finally:
        child.close()
    assert len(lines) == 3, lines
    for line in lines:
        assert line.split()[1:] == ["AcquireReply", THEIRS], f"the next borrower read another's reply: {line}"
    assert result.split()[1] == "0", result


# ----------------------------------------------------------------- a 100 KB lock value


def test_a_100_kb_lock_value_is_read_whole(held: RedisServer, protocol: int) -> None:
    """A 100 KB lock value (a reply larger than one receive) is found whole, and released."""
    client = redis.Redis(port=held.port, socket_timeout=10, protocol=protocol, max_connections=1)
    big = "".join(f"{n:07d}," for n in range(12_800))  # 102,400 bytes, no two stretches alike
    key = "t:{demo.task:big}"
    assert type(acquire(client, key, big)) is int
    sock = only_socket(client)
    for _ in range(3):
        reply = acquire(client, key, "small")
        assert isinstance(reply, AcquireReply) and reply.previous in (big, big.encode())
        assert only_socket(client) is sock
    assert release(client, key, "small") is False
    assert release(client, key, big) is True
    assert_told_held(client)


# ----------------------------------------------------------------- a connection closed under it


@pytest.mark.timeout(60)
def test_a_connection_closed_under_a_borrowed_read_is_retried_or_unknown(held: RedisServer,
                                                                         protocol: int) -> None:
    """Closed before the acquire's ``SET`` reached the server: sent again, the key taken.
    Closed once a release ran: sent again, "not ours" is unknown (None), never False.
    Closed by the server while idle in the pool: replaced. Each next request reads its own."""
    with RefusingProxy(held.port, Rates(0, 0, 0, 0, 0, 0), seed=2) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=10, protocol=protocol, max_connections=1,
                             client_name="borrowed")
        assert type(acquire(client, "t:warm", "w")) is int
        proxy.force(b"SET", "close_before")
        assert type(acquire(client, "t:closed", "mine")) is int
        assert proxy.faults["close_before"] == 1
        assert release(client, "t:warm", "w") is True  # the release script loaded on the new connection
        assert type(acquire(client, "t:warm", "w")) is int
        proxy.force(b"EVALSHA", "close_after")
        assert release(client, "t:warm", "w") is None
        assert proxy.faults["close_after"] == 1
        assert held.client().get("t:warm") is None
        assert kill_named(held.client(), "borrowed") >= 1  # idle in the pool
        assert release(client, "t:closed", "mine") is True
        assert_told_held(client)
