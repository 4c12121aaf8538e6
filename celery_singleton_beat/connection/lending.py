"""Connections lent by a pool for one request, and given back.

Lock requests that do not go through a thread's own channel (greenlet pools,
Sentinel, Cluster, the lease keeper, tools) borrow a connection of the client's
pool for one request (:mod:`.pooled`). Under a gevent or eventlet worker many
runs do that at once: with ``-P gevent -c 500`` a burst of acquires can find
every connection of the pool lent (``max_connections``, 100 by default in
redis-py 8, :data:`~.url.DEFAULT_REDIS_OPTIONS` here). redis-py then raises
``Too many connections``, a ``ConnectionError``: read as an outage, it would
make runs wait or be published again while Redis is idle.

A full pool is not an outage: :func:`borrow` waits until a connection comes
back (:func:`give_back` wakes one waiter; a connection given back by other code
is seen within :data:`LOOK_AGAIN`), for at most the pool's request bound (its
connect plus read timeouts: what one request may take anyway). The pool's
``max_connections`` bounds what a worker opens, however many greenlets ask.

Connections are opened one after another, not all at once: a request that finds no
idle connection while another request's opening began less than
:data:`OPEN_PATIENCE` ago waits for that one, or for any connection given back,
instead of opening its own. A gevent worker started with a queue of waiting runs
took in its first hundred with some twenty lock connections opened meanwhile, each
a connect, redis-py's set-up commands and the server record's look (``INFO``,
parsed): about a millisecond of the hub each, for requests that hold a connection
for one round trip. The pool still grows while requests keep finding every
connection lent: an opening older than the patience (a far or slow server) no
longer holds the others back, so the next one starts. When an opening fails, the
requests waiting on it open their own (as they did before), until one succeeds
again: a server that refuses one connection in a burst is not taken for a server
that refuses them all.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any

import redis

from .wire import Link

__all__ = ["LOOK_AGAIN", "borrow", "give_back", "pool_is_full"]

#: redis-py 5.0-5.2 require ``get_connection``'s command name; 5.3 deprecated passing it.
_POOL_WANTS_COMMAND = tuple(int(part) for part in redis.__version__.split(".")[:2]) < (5, 3)
#: Seconds between two looks at a full pool when nothing woke the waiter.
LOOK_AGAIN = 0.05
#: Seconds a request waits for a connection another request is opening, from the start
#: of the latest opening: longer than a nearby server takes, short against a lock's TTL.
OPEN_PATIENCE = 0.05
#: The wait for a connection when the pool states no timeouts.
_DEFAULT_WAIT = 10.0

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


def _wait_bound(pool: Any) -> float:
    """What one request on ``pool`` may take: its connect plus read timeouts."""
    options = getattr(pool, "connection_kwargs", None) or {}
    bound = sum(float(options.get(name) or 0) for name in ("socket_connect_timeout", "socket_timeout"))
    return bound or _DEFAULT_WAIT


class _Openings:
    """The connections of one pool being opened through :func:`borrow` now."""

    __slots__ = ("count", "failed", "started")

    def __init__(self) -> None:
        self.count = 0
        #: Monotonic time the latest opening began.
        self.started = 0.0
        #: The last opening failed: no request waits for another's until one succeeds.
        self.failed = False


_openings: weakref.WeakKeyDictionary[Any, _Openings] = weakref.WeakKeyDictionary()


def _after_fork_in_child() -> None:
    """Nothing is being opened in a forked child (its one thread forked), and a lock or a
    condition another thread of the parent held would stay held: start afresh. A count
    copied from a parent's thread mid-opening would gate the pool for the child's life."""
    global _returned_guard
    _returned_guard = threading.Lock()
    _openings.clear()
    _returned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _openings_of(pool: Any) -> _Openings | None:
    """``pool``'s openings, for a pool whose idle connections can be seen (redis-py's
    ``ConnectionPool`` and its subclasses); None for any other (never waited on)."""
    openings = _openings.get(pool)
    if openings is None:
        if not isinstance(getattr(pool, "_available_connections", None), list):
            return None
        with _returned_guard:
            openings = _openings.setdefault(pool, _Openings())
    return openings


def borrow(pool: Any) -> Any:
    """A connection from ``pool``; when none is idle and another request is opening one,
    the request waits for a connection (one at a time is opened, see the module); when
    every connection is lent, the request waits for one to come back (at most the pool's
    request bound, then redis-py's error)."""
    deadline = None
    openings = _openings_of(pool)
    while True:
        opening = openings if openings is not None and not _ready(pool) else None
        if opening is not None and opening.count and not opening.failed:
            # Waited for while the latest opening is young (OPEN_PATIENCE): longer, the
            # server is far or slow, and the request opens its own, as before.
            left = opening.started + OPEN_PATIENCE - time.monotonic()
            if left > 0:
                _wait_for_return(pool, min(LOOK_AGAIN, left))
                continue
        try:
            return _take(pool) if opening is None else _open(pool, opening)
        except redis.ConnectionError as error:
            if not pool_is_full(error):
                raise
            now = time.monotonic()
            deadline = deadline or now + _wait_bound(pool)
            if now >= deadline:
                raise
            _wait_for_return(pool, min(LOOK_AGAIN, deadline - now))


def _ready(pool: Any) -> bool:
    """The connection ``pool`` lends next (its last idle one) is connected: taking it opens
    nothing. An idle connection may be disconnected: dropped when the server went away
    (given back after a failed request), or put back by redis-py 8.2 after its connect
    failed; taking it is an opening like a new connection's (a burst after an outage)."""
    last = pool._available_connections[-1:]
    return bool(last) and getattr(last[0], "_sock", True) is not None


def _open(pool: Any, openings: _Openings) -> Any:
    """A connection of ``pool`` where none was idle and connected (:func:`_ready`): a new one or
    an idle one opened again, counted in ``openings``."""
    openings.started = time.monotonic()
    # No call between the count going up and the try, nor before it goes down: an exception a
    # signal handler raises (a soft time limit) lands as a call returns, and a count left up
    # would gate the pool after every later opening.
    openings.count += 1
    try:
        connection = _take(pool)
    except BaseException as error:
        openings.count -= 1
        if not pool_is_full(error):
            openings.failed = True
            _wake(pool, every=True)  # those waiting on this opening open their own
        # A full pool opened nothing: the waiters would find it full too (each waking
        # every other: a storm of looks while every connection is lent); a give-back wakes one.
        raise
    openings.count -= 1
    openings.failed = False
    _wake(pool)  # this one is in use: the next waiter looks again (and may open one)
    return connection


def _wait_for_return(pool: Any, timeout: float) -> None:
    """Wait until a connection of ``pool`` is given back or opened, ``timeout`` seconds at most."""
    condition = _condition(pool)
    with condition:
        condition.wait(timeout)


def _wake(pool: Any, every: bool = False) -> None:
    """Wake one request waiting for a connection of ``pool`` (``every``: all of them)."""
    condition = _returned.get(pool)
    if condition is not None:
        with condition:
            condition.notify_all() if every else condition.notify()



def give_back(pool: Any, connection: Any, link: Link | None) -> None:
    """Return a borrowed connection to its pool, dropped first if replies on it are unread
    (or, read off its socket, bytes were received that no request asked for); wake one
    request waiting for a connection of that pool. ``link`` None: nothing was written."""
    if link is not None and (link.outstanding or link.unread()):
        connection.disconnect()
    pool.release(connection)
    _wake(pool)
