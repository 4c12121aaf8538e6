"""Sentinel: every process follows the primary the sentinels name.

redis-py's Sentinel pool asks the sentinels for the primary only when it makes a
new connection. After ``SENTINEL FAILOVER`` the old primary goes on taking
writes until the sentinels turn it into a replica (about ten seconds later), so a
process whose pooled connections still point at it keeps renewing its leases
there -- writes the promoted primary never sees -- while processes with new
connections already use the promoted one. Here a pool asks the sentinels at most
every :data:`FOLLOW_EVERY` seconds, before it lends a connection, and a
connection to a server that is no longer the primary is dropped before use: a
process with lock traffic reaches the promoted primary within that bound. A request
that waited after its connection was lent (a recovery window: seconds) asks every
sentinel again before it writes, and goes to the primary named at the newest epoch
(:meth:`FollowingSentinelPool.primary_after_wait`).

The sentinels' answer also carries the primary's **failover epoch** (``config-epoch``
of ``SENTINEL MASTERS``), which grows with every failover. :class:`EpochSentinel`
keeps the latest answer, the primary's address with its epoch, and a new connection's
check (:mod:`..recovery.server`) holds the epoch the sentinels named that address at
against the one the data's record was written at: a primary elected again after a
failover (one that never replicated from the interim primary) is then noticed by a
process that never saw the interim one, at no extra request. The epochs are compared
for equality, not order: sentinels deployed anew count from 0 again.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

__all__ = ["FOLLOW_EVERY", "EpochSentinel", "FollowingSentinelPool", "failover_epoch"]

#: Seconds between two questions to the sentinels, per pool (process), at most.
FOLLOW_EVERY = 0.5


class EpochSentinel(Sentinel):
    """A :class:`redis.sentinel.Sentinel` that remembers, per primary name, the latest
    answer it took: the primary's address and its failover epoch (``config-epoch``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call,unused-ignore]  # redis-py before 8.2
        #: Primary name -> ((host, port), ``config-epoch``) of the latest answer taken.
        self.answers: dict[str, tuple[tuple[Any, Any], int]] = {}

    def check_master_state(self, state: dict[str, Any], service_name: str) -> bool:
        # redis-py calls this with the state of the primary each sentinel names, and uses
        # the first one that passes: the answer recorded is that one.
        usable = bool(super().check_master_state(state, service_name))  # type: ignore[no-untyped-call]
        if usable:
            try:
                epoch = int(state.get("config-epoch") or 0)
            except (TypeError, ValueError):
                epoch = 0
            self.answers[service_name] = ((state.get("ip"), state.get("port")), epoch)
        return usable

    def newest_master(self, service_name: str) -> tuple[Any, Any]:
        """Ask every sentinel, and take the primary named at the highest failover epoch
        (where :meth:`discover_master` takes the first answer that looks usable: one from a
        sentinel that has not heard of a failover yet names the former primary). Raises
        :class:`redis.sentinel.MasterNotFoundError` when none answers usably: an outage."""
        best: tuple[tuple[Any, Any], int] | None = None
        for sentinel in self.sentinels:
            try:
                masters: Any = sentinel.sentinel_masters()
                state = masters.get(service_name)
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            if state and self.check_master_state(state, service_name):
                answer = self.answers[service_name]
                if best is None or answer[1] > best[1]:
                    best = answer
        if best is None:
            raise MasterNotFoundError(f"no sentinel names a usable primary for {service_name!r}")
        self.answers[service_name] = best
        return best[0]


def failover_epoch(connection: Any) -> int:
    """The failover epoch the sentinels named the primary behind ``connection`` at, in
    their latest answer to its pool (0: not a Sentinel connection, or unknown: the latest
    answer named another address, or none was taken)."""
    pool: Any = getattr(connection, "connection_pool", None)
    answers = getattr(getattr(pool, "sentinel_manager", None), "answers", None)
    if not isinstance(answers, dict):
        return 0
    address, epoch = answers.get(pool.service_name, ((None, None), 0))
    return int(epoch) if address == (connection.host, connection.port) else 0


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

    def primary_after_wait(self, connection: Any) -> tuple[Any, Any] | None:
        """The primary to write to, if not ``connection``'s (None: its own), for a request
        that waited since ``connection`` was lent (a recovery window: a failover may have
        happened meanwhile). Every sentinel is asked and the newest answer wins
        (:meth:`EpochSentinel.newest_master`); none answering raises
        :class:`redis.sentinel.MasterNotFoundError` (an outage), never a go-ahead."""
        manager: EpochSentinel = self.sentinel_manager
        primary = manager.newest_master(self.service_name)
        self._primary, self._next_ask = tuple(primary), time.monotonic() + FOLLOW_EVERY
        return None if (connection.host, connection.port) == self._primary else self._primary

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
