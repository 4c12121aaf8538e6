"""Lock requests on a borrowed connection read their replies off its socket (real redis-server).

In a gevent worker every acquire borrows a connection of the lock client's pool (no
thread has a channel there), one after another as the worker takes in its messages:
Python work per acquire is added to every start. redis-py's reply reading was about a
sixth of an acquire's Python calls (its reads, buffer and host-error layers, twice per
acquire: 26 of 150); the requests are the ones a thread's channel reads straight off its socket,
and a borrowed connection of a plain pool is read the same way: counted here, not timed.
What the requests return, their errors and script reloads, and what goes back to the
pool are checked on both protocols; that a green acquire makes no call into redis-py's
reply parser is counted in ``tests/test_acquire_green_cost.py``.
"""

from __future__ import annotations

import select
from collections.abc import Callable

import pytest
import redis

from celery_singleton_beat.connection.pooled import run_pooled
from celery_singleton_beat.connection.replies import NOT_YET, PyReader, reply_reader
from celery_singleton_beat.connection.wire import LuaScript, Request
from celery_singleton_beat.lease.commands import acquire_request, release_request
from celery_singleton_beat.lease.executor import execute

from .support import RedisServer, wait_for

KEY = "t:{demo.task:pooled-reads}"
ECHO = LuaScript("return ARGV[1]")


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def client(request: pytest.FixtureRequest, redis_db: redis.Redis,
           redis_server: RedisServer) -> redis.Redis:
    """A client of the session's server on one protocol, its pool a plain one (not a channel's)."""
    return redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=10, protocol=request.param)


def _ok(replies: list[object]) -> list[object]:
    return replies


def test_lock_requests_on_a_borrowed_connection_read_what_they_read_before(client: redis.Redis) -> None:
    """An acquire gets its fencing token, a second one the holder, a release its answer; the
    connection goes back to the pool with nothing unread, and the next request reads its own."""
    value = '{"id":"run-1"}'
    token = execute(client, KEY, lambda info: acquire_request(info, KEY, value, 60_000, None), pooled=True)
    assert type(token) is int and token > 0
    again = execute(client, KEY, lambda info: acquire_request(info, KEY, "other", 60_000, None), pooled=True)
    assert type(again) is not int and again.previous in (value, value.encode())
    assert execute(client, KEY, lambda info: release_request(info, KEY, "other"), pooled=True) is False
    assert execute(client, KEY, lambda info: release_request(info, KEY, value), pooled=True) is True
    assert run_pooled(client, KEY, Request([(b"GET", KEY)], lambda replies: replies[0])) is None
    pool = client.connection_pool
    assert len(pool._in_use_connections) == 0  # type: ignore[attr-defined]


def test_an_error_reply_and_a_flushed_script_on_a_borrowed_connection(client: redis.Redis) -> None:
    """An error reply is handed to ``finish`` in its place; a script flushed since it was
    loaded on the connection is loaded and run again; the stream stays in step."""
    client.set(KEY, "a string")
    replies: list[object] = execute(client, KEY, lambda info: Request(
        [(b"HGET", KEY, b"f"), (b"GET", KEY)], _ok), pooled=True)
    assert isinstance(replies[0], redis.ResponseError) and replies[1] == b"a string"
    echo: Callable[[str], object] = lambda text: execute(client, KEY, lambda info: Request(  # noqa: E731
        [ECHO.command([KEY], [text])], lambda r: r[0], (ECHO,)), pooled=True)
    assert echo("one") == b"one"
    client.script_flush()
    assert echo("two") == b"two"
    assert echo("three") == b"three"


def test_a_push_frame_waiting_on_a_borrowed_connection_is_skipped(redis_db: redis.Redis,
                                                                    redis_server: RedisServer) -> None:
    """redis-py 8 lends a RESP3 connection with bytes waiting on it (push frames it expects:
    maintenance notices). Here a client-side caching invalidation waits on the pool's one
    connection: the acquire skips it and reads its own replies; the connection stays in step."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=10, protocol=3,
                         max_connections=1)
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        connection.send_command("CLIENT", "TRACKING", "ON")
        assert connection.read_response() in (b"OK", "OK")
        connection.send_command("GET", KEY)
        assert connection.read_response() is None  # KEY tracked for this connection
    finally:
        pool.release(connection)
    redis_server.client().set(KEY, "changed")  # the server pushes an invalidation of KEY
    wait_for(lambda: select.select([connection._sock], [], [], 0)[0], timeout=10,
             message="the invalidation on the idle connection")
    redis_server.client().delete(KEY)
    token = execute(client, KEY, lambda info: acquire_request(info, KEY, "mine", 60_000, None), pooled=True)
    assert type(token) is int
    assert run_pooled(client, KEY, Request([(b"GET", KEY)], lambda replies: replies[0])) == b"mine"



def _readers() -> list[tuple[str, Callable[[], object]]]:
    """The reply readers a lock connection may use: the Python one, and hiredis's if installed."""
    found: list[tuple[str, Callable[[], object]]] = [("python", lambda: PyReader(NOT_YET))]
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return found
    return [*found, ("hiredis", lambda: reply_reader(resp3=True))]


@pytest.mark.parametrize("name,make", _readers(), ids=[name for name, _ in _readers()])
def test_loading_is_read_as_redis_py_reads_it_an_outage(name: str, make: Callable[[], object]) -> None:
    """``-LOADING`` (the server loading its data: ``DEBUG RELOAD`` or a replica's full resync
    under a connection checked before) is ``BusyLoadingError``, a ``ConnectionError``, as
    redis-py's reads report it: an acquire is retried on a new connection (then an outage),
    and a keeper batch's renewals are judged as an outage, not each sent again alone.
    Other error replies stay ``ResponseError``."""
    reader = make()
    reader.feed(b"-LOADING Redis is loading the dataset in memory\r\n-ERR wrong\r\n")  # type: ignore[attr-defined]
    loading, other = reader.gets(), reader.gets()  # type: ignore[attr-defined]
    assert isinstance(loading, redis.BusyLoadingError), loading
    assert isinstance(loading, redis.ConnectionError)
    assert type(other) is not redis.BusyLoadingError and isinstance(other, redis.ResponseError), other
    assert str(other) == "ERR wrong"


def test_a_resp3_bulk_error_is_an_error_reply() -> None:
    """RESP3's bulk error (``!<length>``, which Redis may send for an error whose text holds a
    line break) is one error reply, read by its length: not a line, then stray bytes."""
    reader = PyReader(NOT_YET)
    reader.feed(b"!22\r\nSYNTAX invalid\r\nsyntax\r\n:7\r\n")
    error, after = reader.gets(), reader.gets()
    assert isinstance(error, redis.ResponseError) and str(error) == "SYNTAX invalid\r\nsyntax", error
    assert after == 7
    reader.feed(b"!9\r\nLOADING x\r\n")
    assert isinstance(reader.gets(), redis.BusyLoadingError)
