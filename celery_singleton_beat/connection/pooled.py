"""A request on a connection borrowed from the pool of the server that holds its key.

For requests that do not go through a thread's own channel (:mod:`.channel`):
Sentinel and Cluster clients, requests that need their connection afterwards
(``WAIT``), and callers without a channel. The connection is looked at by the
client's server record first (:func:`.wire.ensure_checked`); on Cluster,
``-MOVED`` and ``-ASK`` are followed (:mod:`.redirects`), and a node that refuses
or drops the connection makes the client read the layout again before the request
is sent once more (the node may be gone: removed from the cluster, or failed over).

The lock requests (``raw``, see :func:`.lease.executor.execute`) on a standalone
client's plain pool read their replies straight off the borrowed connection's socket
(:class:`BorrowedLink`), as a thread's channel reads its own (:class:`.wire.SocketLink`):
in a greenlet pool every release (and under eventlet every acquire) borrows a connection, and redis-py's reply
parser was about a sixth of an acquire's Python calls. Other requests, and every
request on Sentinel and Cluster clients (whose connections act on some replies:
``-READONLY`` after a failover, ``-MOVED``), are read by redis-py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from .client import _outage_as_connection_error, cluster_moved, cluster_reread, group_by_node, is_cluster
from .lending import borrow, give_back, is_plain_pool, pool_is_full
from .redirects import AskFollower
from .wire import (
    BROKEN,
    RETRIED,
    LuaScript,
    PoolLink,
    Request,
    SocketLink,
    ensure_checked,
    loaded_on,
    looker_of,
    run_on,
)

__all__ = ["BorrowedLink", "run_by_node", "run_pooled", "run_script"]

class BorrowedLink(SocketLink):
    """A borrowed connection's socket as a :class:`.wire.Link`, for one borrowing, read
    without redis-py's parser (:class:`.wire.SocketLink`'s reader, new for each borrowing).

    Used only when redis-py's parser holds no byte received earlier (:func:`_link_for`):
    redis-py 8 lends a connection with bytes waiting when it expects push frames
    (maintenance notices), and those in its buffer would be read by nobody here. Push
    frames on the socket are skipped (as a channel skips them); every reply written
    here is read here, and :func:`.lending.give_back` drops the connection if one is
    not, or if bytes no request asked for were received with them. Replies are bytes
    whatever the client's ``decode_responses``: as a channel's.
    """

    __slots__ = ("connection",)

    def __init__(self, connection: Any) -> None:
        super().__init__(connection._sock, resp3=str(getattr(connection, "protocol", 2)) == "3")
        self.connection = connection
        self.loaded = loaded_on(connection)


def _parser_empty(connection: Any) -> bool:
    """redis-py's reply parser of ``connection`` holds no byte received and not read yet
    (False when that cannot be told: a parser of another kind, an old hiredis)."""
    parser = getattr(connection, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if reader is not None:  # hiredis's parser
        has_data = getattr(reader, "has_data", None)
        return has_data is not None and not has_data()
    unread = getattr(getattr(parser, "_buffer", None), "unread_bytes", None)
    return unread is not None and not unread()


def _link_for(connection: Any, raw: bool) -> PoolLink | BorrowedLink:
    """The link of a borrowed, connected connection: its socket read directly for ``raw``
    requests where redis-py's parser has nothing buffered (see :class:`BorrowedLink`)."""
    if raw and _parser_empty(connection):
        return BorrowedLink(connection)
    return PoolLink(connection)


def _node_client(client: Any, key: str, cluster: bool) -> Any:
    if cluster:
        return client.get_redis_connection(client.get_node_from_key(key))
    return client



def run_pooled(client: Any, key: str, request: Request, *, after: Callable[[Any, Any], Any] | None = None,
               before_write: Callable[[], Any] | None = None, raw: bool = False) -> Any:
    """Run ``request`` on a connection borrowed from the pool of the server holding ``key``.

    ``after(link, result)``, if given, runs on the same connection before it
    goes back (``WAIT`` counts the replicas of that connection's writes; on a
    slot that migrates, the connection to the target when the request's first
    command went there). ``before_write`` runs once the connection is up (a
    recovery window's wait, called again only after one); when it waited (returned a
    true value) and the sentinels name another primary meanwhile, the connection is made
    again to that one (and checked, maybe waiting again) before the request is written.
    A connection that fails with a connection error is dropped and the request is
    sent once more on a new one (on Cluster, once the layout was read again: to the
    node serving the slot now); one whose replies were not all read (whatever the
    exception) is dropped, never put back. On Cluster, ``-MOVED`` and ``-ASK`` are followed (see the module
    docstring).
    ``raw``: a lock request whose replies, on a plain pool's connection and
    without ``after``, are read off the socket (:class:`BorrowedLink`).
    """
    cluster = is_cluster(client)
    repeated = False
    for attempt in (1, 2):
        server = _node_client(client, key, cluster)
        pool = server.connection_pool
        try:
            connection = borrow(pool)
        except RETRIED as exc:
            if attempt == 2 or not cluster or pool_is_full(exc):
                raise
            cluster_reread(client)  # the slot's node refused: it may be gone, the slot served by another
            continue
        follow = AskFollower(client) if cluster else None
        direct = raw and after is None and not cluster and is_plain_pool(pool)
        link: PoolLink | BorrowedLink | None = None  # made once connected (a BorrowedLink reads its socket)
        written = False
        try:
            ensure_checked(connection, looker_of(client))
            link = _link_for(connection, direct)
            if before_write is not None:
                waited = before_write()
                while waited and (primary := _primary_after_wait(pool, connection)) is not None:
                    # Sentinel failed over while the request waited (a recovery window): write
                    # it to the primary named now, on a connection checked there (which may
                    # find a window of its own to wait for).
                    connection.disconnect()
                    connection.connect_to(primary)
                    ensure_checked(connection, looker_of(client))
                    link = _link_for(connection, direct)  # scripts loaded on that connection only
                    waited = before_write()
            written = True
            result = run_on(link, request, follow)
            if after is not None:
                result = after(follow.link if follow is not None and follow.link is not None else link, result)
            if repeated and not result and request.unsure_when_repeated:
                return None  # its first attempt may have run: unknown, not "not ours"
            return result
        except RETRIED:
            # Written (maybe in part) before it failed: its commands may have run, even when
            # every reply was read (a reply that reads as an outage, -LOADING, for a done
            # marker written ahead of a compare-and-delete that ran).
            repeated = written
            connection.disconnect()
            if attempt == 2:
                raise
            if cluster:
                cluster_reread(client)
        except BROKEN:
            connection.disconnect()
            raise
        except redis.ResponseError as exc:
            if attempt == 2 or not cluster_moved(client, exc):
                raise
        finally:
            give_back(pool, connection, link)
            if follow is not None:
                follow.close()
    raise AssertionError("unreachable")


def _primary_after_wait(pool: Any, connection: Any) -> Any:
    """The primary the sentinels name now, if not ``connection``'s (None: its own, or a pool
    that does not follow Sentinel: one server, a Cluster node)."""
    after_wait = getattr(pool, "primary_after_wait", None)
    return after_wait(connection) if after_wait is not None else None


def run_by_node(client: Any, commands: Sequence[tuple[Any, ...]], scripts: Sequence[LuaScript] = ()) -> list[Any]:
    """Keyed commands (``(name, key, *args)``, or :meth:`.wire.LuaScript.command` of one of
    ``scripts``) of keys in any hash slots, one request per server (:func:`run_pooled`, so
    scripts are loaded where missing and, on Cluster, ``-MOVED`` and ``-ASK`` are followed:
    see :mod:`.redirects`); their raw replies in order, an error reply as the exception in
    its place (as a pipeline's ``execute(raise_on_error=False)`` gives them).

    For the beat's writes on Redis Cluster: redis-py's cluster pipeline follows an ``-ASK``
    only to a node of its slot map, and a node being added to the cluster is in none until
    a first slot finished migrating to it (its request then fails with an ``AttributeError``).
    The servers are asked one after another: a round trip each.
    """
    replies: list[Any] = [None] * len(commands)
    with _outage_as_connection_error():  # a slot no node serves: an outage, as in redis-py's pipeline
        keys = [_key_of(command) for command in commands]
        for group in group_by_node(client, keys):
            answered = run_pooled(client, keys[group[0]], Request([commands[i] for i in group], list, scripts))
            for index, reply in zip(group, answered, strict=True):
                replies[index] = reply
    return replies


def _key_of(command: tuple[Any, ...]) -> Any:
    """The (first) key of a keyed command or of a script call."""
    return command[3] if command[0] in (b"EVALSHA", "EVALSHA") else command[1]


def run_script(client: Any, script: LuaScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """Run ``script`` on ``client`` through its pool (tools and tests; the run path uses requests)."""
    return run_pooled(client, keys[0] if keys else "", Request([script.command(keys, args)], _first,
                                                                scripts=(script,)))


def _first(replies: list[Any]) -> Any:
    reply = replies[0]
    if isinstance(reply, Exception):
        raise reply
    return reply
