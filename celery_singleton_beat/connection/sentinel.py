"""Sentinel: every process follows the primary the sentinels name.

redis-py's Sentinel pool asks the sentinels for the primary only when it makes a
new connection. After ``SENTINEL FAILOVER`` the old primary goes on taking
writes until the sentinels turn it into a replica (about ten seconds later), so a
process whose pooled connections still point at it keeps renewing its leases
there -- writes the promoted primary never sees -- while processes with new
connections already use the promoted one. Here a pool asks the sentinels at most
every :data:`FOLLOW_EVERY` seconds, before it lends a connection, and a
connection to a server that is no longer the primary is dropped before use: a
process with lock traffic reaches the promoted primary within that bound.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis
from redis.sentinel import SentinelConnectionPool

__all__ = ["FOLLOW_EVERY", "FollowingSentinelPool"]

#: Seconds between two questions to the sentinels, per pool (process), at most.
FOLLOW_EVERY = 0.5


class FollowingSentinelPool(SentinelConnectionPool):
    """A Sentinel connection pool that follows the primary, not only on new connections."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # redis-py
        self._next_ask = 0.0
        self._primary: tuple[Any, Any] | None = None

    def follow(self) -> None:
        """Ask the sentinels for the primary now; drop the idle connections if it moved."""
        self._next_ask = time.monotonic() + FOLLOW_EVERY
        # Drops the idle connections when the primary moved (redis-py's pool does);
        # when no sentinel answers, the connection's own use tells.
        with contextlib.suppress(redis.RedisError):
            self._primary = tuple(self.get_master_address())  # type: ignore[no-untyped-call]

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() >= self._next_ask:
            self.follow()
        connection = super().get_connection(*args, **kwargs)
        primary = self._primary
        if primary is not None and connection.host is not None and (connection.host, connection.port) != primary:
            # Lent out while the primary moved: it still points at the former one.
            try:
                connection.disconnect()
                connection.connect()  # asks the sentinels
            except BaseException:
                self.release(connection)
                raise
        return connection
