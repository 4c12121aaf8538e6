"""Connections lent by a pool for one request, and given back.

Lock requests that do not go through a channel (greenlet pools, except a gevent
worker's acquires, :mod:`.green`; Sentinel, Cluster, the lease keeper, tools) borrow
a connection of the client's pool for one request (:mod:`.pooled`). Under a gevent
or eventlet worker many runs do that at once: with ``-P eventlet -c 500`` a burst of acquires can find
every connection of the pool lent (``max_connections``, 100 by default in
redis-py 8, :data:`~.url.DEFAULT_REDIS_OPTIONS` here). redis-py then raises
``Too many connections``, a ``ConnectionError``: read as an outage, it would
make runs wait or be published again while Redis is idle.

A full pool is not an outage: :func:`borrow` waits until a connection comes
back (:func:`give_back` wakes one waiter; a connection given back by other code
is seen within :data:`LOOK_AGAIN`), for at most the pool's request bound (its
connect plus read timeouts: what one request may take anyway). The pool's
``max_connections`` bounds what a worker opens, however many greenlets ask.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import redis

from .wire import Link

__all__ = ["LOOK_AGAIN", "borrow", "give_back", "is_plain_pool", "pool_is_full", "request_bound"]

#: redis-py 5.0-5.2 require ``get_connection``'s command name; 5.3 deprecated passing it.
_POOL_WANTS_COMMAND = tuple(int(part) for part in redis.__version__.split(".")[:2]) < (5, 3)
#: Seconds between two looks at a full pool when nothing woke the waiter.
LOOK_AGAIN = 0.05
#: The wait for a connection when the pool states no timeouts.
_DEFAULT_WAIT = 10.0

#: redis-py's own pools, exactly: a subclass may act on what its connections read
#: (Sentinel's does, on replies), so requests through it keep redis-py's own reading.
_PLAIN_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)


def is_plain_pool(pool: Any) -> bool:
    """Whether ``pool`` is one of redis-py's own pools, not a subclass (see :data:`_PLAIN_POOLS`)."""
    return type(pool) in _PLAIN_POOLS


#: One condition per pool, notified when a connection is given back through here.
_returned: weakref.WeakKeyDictionary[Any, threading.Condition] = weakref.WeakKeyDictionary()
_returned_guard = threading.Lock()


#: The ``get_connection`` of each pool class, less redis-py's argument check (:func:`_undecorated`).
_getters: dict[type, Any] = {}


def _deprecation_wrapper() -> Any:
    """The code of redis-py's deprecated-arguments wrapper (None where it has none)."""
    try:
        from redis.utils import deprecated_args
    except ImportError:
        return None

    @deprecated_args(args_to_warn=["*"])
    def probe(self: Any) -> None:
        """Never called: only its wrapper's code is kept."""

    return getattr(probe, "__code__", None) if hasattr(probe, "__wrapped__") else None


_DEPRECATION_WRAPPER = _deprecation_wrapper()


def pool_is_full(error: BaseException) -> bool:
    """True for redis-py's "every connection lent" error (``MaxConnectionsError`` since 6.x)."""
    return type(error).__name__ == "MaxConnectionsError" or (
        isinstance(error, redis.ConnectionError) and str(error) == "Too many connections")


def _take(pool: Any) -> Any:
    if _POOL_WANTS_COMMAND:
        return pool.get_connection("_")
    get = _getters.get(type(pool))
    if get is None:
        get = _getters[type(pool)] = _undecorated(type(pool).get_connection)
    return get(pool)


def _undecorated(method: Any) -> Any:
    """``method`` less redis-py's deprecated-arguments wrapper, when that is what it is.

    redis-py 5.3+ wraps ``get_connection`` to warn of the command name it no longer wants;
    the wrapper inspects the arguments of every call, and :func:`_take` passes none. Any
    other wrapper (a subclass's own) is kept.
    """
    if _DEPRECATION_WRAPPER is not None and getattr(method, "__code__", None) is _DEPRECATION_WRAPPER:
        return method.__wrapped__
    return method


def _condition(pool: Any) -> threading.Condition:
    with _returned_guard:
        condition = _returned.get(pool)
        if condition is None:
            condition = _returned[pool] = threading.Condition()
        return condition


def request_bound(pool: Any) -> float:
    """What one request on ``pool`` may take: its connect plus read timeouts."""
    options = getattr(pool, "connection_kwargs", None) or {}
    bound = sum(float(options.get(name) or 0) for name in ("socket_connect_timeout", "socket_timeout"))
    return bound or _DEFAULT_WAIT


def borrow(pool: Any) -> Any:
    """A connection from ``pool``; when every connection is lent, the request waits for
    one to come back (at most the pool's request bound, then redis-py's error)."""
    deadline = None
    while True:
        try:
            return _take(pool)
        except redis.ConnectionError as error:
            if not pool_is_full(error):
                raise
            now = time.monotonic()
            deadline = deadline or now + request_bound(pool)
            if now >= deadline:
                raise
            condition = _condition(pool)
            with condition:
                condition.wait(min(LOOK_AGAIN, deadline - now))


def give_back(pool: Any, connection: Any, link: Link | None) -> None:
    """Return a borrowed connection to its pool, dropped first if replies on it are unread
    (or, read off its socket, bytes were received that no request asked for); wake one
    request waiting for a connection of that pool. ``link`` None: nothing was written."""
    if link is not None and (link.outstanding or link.unread()):
        connection.disconnect()
    pool.release(connection)
    condition = _returned.get(pool)
    if condition is not None:
        with condition:
            condition.notify()
