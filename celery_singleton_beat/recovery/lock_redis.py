"""The lock Redis client of an app: one per app and per process, each of its
connections looked at by the server record (:mod:`.server`) as it connects.

:func:`get_redis` builds it with :func:`.connection.client.redis_from_url` from
``singleton_redis_url`` and attaches a :class:`~.server.LockServer`, so a
restart or a failover is noticed by whichever use of the client comes first.
:func:`thread_client` gives a background OS thread a copy of its own in a
greenlet process (see :mod:`.native`).

Fork safety: redis-py pools remember the pid that made them and start afresh in
a child (``ConnectionPool._checkpid``), and that holds for the pools inside a
Sentinel and a Cluster client too. On top of that, a forked child (a prefork
pool process) never touches its parent's client: the cache is keyed by pid,
and an ``os.register_at_fork`` hook moves inherited clients aside (never closed
from the child, so no inherited socket is shut down) and replaces the cache's
lock, which the parent may have held at the moment of the fork.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from celery import Celery

from .. import native
from ..config import get_settings
from ..connection.channels import close_channels
from ..connection.client import RedisClient, redis_from_url
from .server import LockServer, memory_for, server_of

__all__ = ["GENERATION", "get_redis", "release_thread_client", "reset_clients", "thread_client"]


_clients: weakref.WeakKeyDictionary[Celery, tuple[int, RedisClient]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
#: Clients a forked child inherited: kept referenced so that no finalizer in the
#: child ever closes them (their sockets belong to the parent).
_inherited: list[RedisClient] = []


def get_redis(app: Celery) -> RedisClient:
    """The Redis client of ``app`` in this process, created on first use.

    Built outside the cache's lock: a Redis Cluster client talks to the cluster while it
    is built (its slot map, its command table), each new connection looked at as it
    connects (:meth:`.server.LockServer.on_connect`), which lasts as long as the cluster
    takes to answer. A lock held meanwhile is held by a frame that a signal handler on the
    same thread can interrupt, and Celery's beat answers SIGTERM by closing its scheduler,
    building it first when it is not built yet, which asks for this client again: it
    would wait for that lock for ever. Threads that build the client at the same time each
    build one; the first stored is the app's, the others are closed.
    """
    pid = os.getpid()
    cached = _clients.get(app)
    if cached is not None and cached[0] == pid:
        return cached[1]
    client = _build(app)
    with _lock:
        cached = _clients.get(app)
        if cached is None or cached[0] != pid:
            _clients[app] = (pid, client)
            return client
    client.close()
    return cached[1]


def _build(app: Celery) -> RedisClient:
    """A new client of ``app``'s lock Redis, with its :class:`~.server.LockServer`."""
    settings = get_settings(app)
    assert settings.redis_url is not None
    # What this process learns of the server, per connection (see .server): every
    # connection of the client (locks, claims, liveness, counters) is looked at as it
    # connects, so a restart or a failover is noticed by whichever use comes first.
    url = settings.redis_url
    server = LockServer(settings.key_prefix, settings.liveness_ttl, memory_for(url),
                        factory=lambda: redis_from_url(url, **options))
    options = dict(settings.redis_options)
    options["redis_connect_func"] = server.on_connect  # on Cluster: each node's connections
    client = redis_from_url(url, **options)
    client.csb_server = server  # type: ignore[union-attr]
    return client


#: Bumped when cached clients are dropped (:func:`reset_clients`, a fork): references kept elsewhere are stale.
GENERATION = [0]


def reset_clients() -> None:
    """Drop every cached client (tests, or after changing settings at run time).

    Each is closed with everything made for it: its pool, its OS threads' copies
    (:func:`thread_client`) and every thread's lock channel (a connection of the
    thread's own, the heartbeat's included; a gevent thread's shared one once nothing is
    pending on it): a thread that goes on asks for the new client and gets new ones.
    Closed outside the cache's lock: a thread busy on a channel finishes its request first.
    """
    GENERATION[0] += 1
    with _lock:
        pid = os.getpid()
        dropped = [client for owner, client in _clients.values() if owner == pid]
        _clients.clear()
    for client in dropped:
        client.close()
        _close_copies(client)
        close_channels(client)


def _after_fork_in_child() -> None:
    global _lock
    GENERATION[0] += 1
    _lock = threading.Lock()  # the parent may have held it while forking
    _inherited.extend(client for _, client in _clients.values())
    _clients.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def thread_client(client: Any) -> Any:
    """``client``, or in a greenlet process a copy of it owned by the calling OS thread.

    The copy has the same settings and shares what the library knows of the
    server (see :func:`.server.server_of`). It is kept on ``client`` itself, by OS
    thread: it goes with the client it copies (a client replaced by
    :func:`reset_clients` takes its copies' connections along), and a new client can
    never be given the copy of one dropped before (a cache keyed by ``id()`` could:
    a new object may be allocated where a dropped one was).
    """
    if not native.green():
        return client
    copies: dict[int, Any] | None = getattr(client, "csb_thread_clients", None)
    if copies is None:
        copies = vars(client).setdefault("csb_thread_clients", {})
    ident = native.get_ident()
    own = copies.get(ident)
    if own is None:
        own = copies[ident] = server_of(client).copy_of(client)
    return own


def release_thread_client(client: Any) -> None:
    """Close the calling OS thread's copy of ``client`` (:func:`thread_client`), if it has
    one: the thread is done with it (a heartbeat that stops)."""
    copies: dict[int, Any] = getattr(client, "csb_thread_clients", {})
    own = copies.pop(native.get_ident(), None)
    if own is not None:
        own.close()


def _close_copies(client: Any) -> None:
    """Close the OS threads' copies of ``client`` (see :func:`thread_client`)."""
    for own in list(getattr(client, "csb_thread_clients", {}).values()):
        own.close()
