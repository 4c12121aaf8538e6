"""The Redis client used for locks and beat slots.

One client (and so one connection pool) per app and per process: redis-py
pools are not shared across ``fork()``, and prefork pool children each build
their own on first use instead of inheriting the parent's sockets.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import redis
from celery import Celery

from .config import get_settings

__all__ = ["get_redis", "redis_from_url"]

_DEFAULT_OPTIONS: dict[str, Any] = {
    # Fail fast: a lock that cannot be asked for within a few seconds is
    # treated as "Redis unavailable" (fail closed) rather than hanging a worker.
    "socket_timeout": 5.0,
    "socket_connect_timeout": 5.0,
    "health_check_interval": 30,
}

_clients: "weakref.WeakKeyDictionary[Celery, tuple[int, redis.Redis]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def redis_from_url(url: str, **options: Any) -> redis.Redis:
    """Build a redis-py client for ``url`` with the library's default timeouts."""
    merged = {**_DEFAULT_OPTIONS, **options}
    return redis.Redis.from_url(url, **merged)


def get_redis(app: Celery) -> redis.Redis:
    """The Redis client of ``app`` in this process, created on first use."""
    pid = os.getpid()
    cached = _clients.get(app)
    if cached is not None and cached[0] == pid:
        return cached[1]
    with _lock:
        cached = _clients.get(app)
        if cached is None or cached[0] != pid:
            settings = get_settings(app)
            assert settings.redis_url is not None
            client = redis_from_url(settings.redis_url, **settings.redis_options)
            _clients[app] = cached = (pid, client)
    return cached[1]


def reset_clients() -> None:
    """Drop every cached client (tests, or after changing settings at run time)."""
    with _lock:
        for _, client in list(_clients.values()):
            client.close()
        _clients.clear()
