"""Lock commands on the wire: a request is commands written together, replies read in order.

The lock operations (:mod:`.commands`) are built as :class:`Request` objects:
the RESP bytes of one or more commands (a ``MULTI`` block, a native
compare-and-delete with the done marker's ``SET`` behind it, a Lua script)
and the function that turns their replies into the operation's result. Two
executors send them:

* :class:`~.channel.Channel`, a connection of its own per thread, which can
  also write a request and read its replies later (a run's release);
* :func:`run_pooled`, which borrows a connection of the client's pool (of the
  right node on Redis Cluster) for one request: Sentinel, Cluster, greenlet
  pools, the lease keeper, tools.

Both load a request's Lua scripts on a connection before their first use
there (``SCRIPT LOAD`` written just ahead), run a request again after a
``SCRIPT FLUSH`` (every script here compares before it writes, so running one
twice changes nothing), and retry once on a new connection when a connection
the server had closed (a restart, an idle timeout) fails on first use. Every
request is safe to send twice: a repeated acquire finds its own value
(:func:`.lock.acquire` takes that as taken), a repeated compare-and-delete
finds nothing to delete.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

__all__ = ["LuaScript", "Request", "Written", "ensure_checked", "pack", "read_replies", "run_pooled", "write_request"]

#: Connection errors after which a request is tried once more on a new connection.
RETRIED = (redis.ConnectionError, OSError)
#: Errors after which a connection is dropped.
BROKEN = (redis.ConnectionError, redis.TimeoutError, OSError)


class LuaScript:
    """A Lua script run with EVALSHA, loaded on each connection before its first call."""

    def __init__(self, source: str) -> None:
        self.source = source.encode("utf-8")
        self.sha = hashlib.sha1(self.source).hexdigest()

    def command(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        return (b"EVALSHA", self.sha, len(keys), *keys, *args)

    def __call__(self, client: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run on ``client`` through its pool (tools and tests; the run path uses requests)."""
        return run_pooled(client, keys[0] if keys else "", Request([self.command(keys, args)], _first,
                                                                    scripts=(self,)))


def _first(replies: list[Any]) -> Any:
    reply = replies[0]
    if isinstance(reply, Exception):
        raise reply
    return reply


class Request:
    """Commands written in one go, and ``finish(replies)`` giving their meaning.

    ``replies`` holds one entry per command, in order; a command's error
    reply is there as the exception (``finish`` decides), so a request never
    leaves replies unread on its connection.
    """

    __slots__ = ("commands", "finish", "scripts", "unsure_when_repeated")

    def __init__(self, commands: list[tuple[Any, ...]], finish: Callable[[list[Any]], Any],
                 scripts: Sequence[LuaScript] = (), *, unsure_when_repeated: bool = False) -> None:
        self.commands = commands
        self.finish = finish
        self.scripts = scripts
        #: A compare-and-delete sent again after a lost connection: "not ours" may mean
        #: the first attempt ran. Its result is then reported unknown (None).
        self.unsure_when_repeated = unsure_when_repeated


class Written:
    """A request on a connection whose replies are still to be read."""

    __slots__ = ("loads", "request")

    def __init__(self, request: Request, loads: int) -> None:
        self.request = request
        #: ``SCRIPT LOAD`` replies written ahead of the request's own.
        self.loads = loads


def _pack_python(*parts: Any) -> bytes:
    """One command in RESP, for the argument types the lock commands use (bytes, str, int).

    redis-py's general packer costs more than the round trip on these calls.
    """
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        if type(part) is not bytes:
            part = str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def _hiredis_packer() -> Callable[..., bytes] | None:
    """hiredis's C packer (the ``fast`` extra), if installed: 2.5x faster than :func:`_pack_python`."""
    try:
        from hiredis import pack_command
    except ImportError:  # not installed, or too old to have it
        return None

    def pack(*parts: Any) -> bytes:
        return pack_command(parts)  # type: ignore[no-any-return]

    # Same bytes for every argument type the commands pass (checked once, here).
    sample = (b"EVALSHA", "x" * 40, 2, "k:{a}", "\u00e9", 0, -1, b"\x00\xff")
    return pack if pack(*sample) == _pack_python(*sample) else None


pack: Callable[..., bytes] = _hiredis_packer() or _pack_python


def loaded_on(connection: Any) -> set[str]:
    """SHAs of the scripts loaded through ``connection`` since it (re)connected."""
    sock = getattr(connection, "_sock", None)
    known: tuple[Any, set[str]] | None = getattr(connection, "csb_scripts", None)
    if known is None or known[0] is not sock:
        known = connection.csb_scripts = (sock, set())
    return known[1]


def ensure_checked(connection: Any, server: Any) -> None:
    """Connect if needed, and let ``server`` (a :class:`~.server.LockServer`) look at a new connection once."""
    if getattr(connection, "_sock", None) is None:
        connection.connect()
    sock = connection._sock
    if server is not None and getattr(connection, "csb_checked", None) is not sock:
        server.check(connection)
        connection.csb_checked = sock


def write_request(connection: Any, request: Request, *, check_health: bool = False) -> Written:
    """Write ``request`` (its scripts loaded first where needed) in one ``sendall``."""
    if getattr(connection, "_sock", None) is None:
        connection.connect()
    loaded = loaded_on(connection)
    parts = []
    for script in request.scripts:
        if script.sha not in loaded:
            parts.append(pack(b"SCRIPT", b"LOAD", script.source))
            loaded.add(script.sha)
    loads = len(parts)
    parts.extend(pack(*command) for command in request.commands)
    connection.send_packed_command([b"".join(parts)], check_health=check_health)
    return Written(request, loads)


class _NoScript(Exception):
    """A reply of the request was ``NOSCRIPT`` (a ``SCRIPT FLUSH``): load and run it again."""


def read_replies(connection: Any, written: Written) -> Any:
    """Read every reply of ``written`` and return ``finish(replies)``.

    Raises :class:`_NoScript` (after reading all of them) when a script was missing.
    """
    for _ in range(written.loads):
        connection.read_response()
    replies: list[Any] = []
    missing = False
    for _ in written.request.commands:
        try:
            replies.append(connection.read_response())
        except NoScriptError as exc:
            missing = True
            replies.append(exc)
        except redis.ResponseError as exc:
            replies.append(exc)
    if missing:
        loaded_on(connection).clear()
        raise _NoScript
    return written.request.finish(replies)


def run_on(connection: Any, request: Request) -> Any:
    """Write ``request``, read its replies; once more after a ``SCRIPT FLUSH``."""
    try:
        return read_replies(connection, write_request(connection, request))
    except _NoScript:
        return read_replies(connection, write_request(connection, request))


def _node_client(client: Any, key: str) -> Any:
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return client.get_redis_connection(client.get_node_from_key(key))
    return client


def run_pooled(client: Any, key: str, request: Request, *, after: Callable[[Any, Any], Any] | None = None,
               before_write: Callable[[], Any] | None = None) -> Any:
    """Run ``request`` on a connection borrowed from the pool of the server holding ``key``.

    ``after(connection, result)``, if given, runs on the same connection before
    it goes back (``WAIT`` counts the replicas of that connection's writes).
    ``before_write`` runs once the connection is up (a recovery window's wait).
    A connection that fails with a connection error is dropped and the
    request is sent once more on a new one.
    """
    from .client import cluster_moved
    from .server import server_of

    for attempt in (1, 2):
        server = _node_client(client, key)
        pool = server.connection_pool
        connection = pool.get_connection("_")
        try:
            ensure_checked(connection, server_of(client))
            if before_write is not None:
                before_write()
            result = run_on(connection, request)
            if after is not None:
                result = after(connection, result)
            return result
        except RETRIED:
            connection.disconnect()
            if attempt == 2:
                raise
        except BROKEN:
            connection.disconnect()
            raise
        except redis.ResponseError as exc:
            if attempt == 2 or not cluster_moved(client, exc):
                raise
        finally:
            pool.release(connection)
    raise AssertionError("unreachable")
