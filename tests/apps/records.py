"""The record database (db 3) the test apps write their runs to: one client per process."""

from __future__ import annotations

import os

import redis

_clients: dict[str, redis.Redis] = {}


def record_client(base: str) -> redis.Redis:
    """Client of ``<base>/3``, made again in a forked pool child (never shared across a fork)."""
    client = _clients.get(base)
    if client is None or client.connection_pool.pid != os.getpid():
        client = _clients[base] = redis.Redis.from_url(f"{base}/3")
    return client
