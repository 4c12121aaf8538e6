"""The claims Redis server as the scheduler mixin looks at it from ``tick``.

Three looks, each ending a wait that Redis answering makes needless:

* after an outage at start, the start-up check runs again: a server that answers
  but cannot be used stops beat (exit code 78), one that can be used ends the
  Redis back-off at once;
* while the back-off runs (fail closed), a ping ends it as soon as Redis answers;
* while claims this beat wrote recently could still be taken over, the server is
  followed, so that a failover or restart that lost them is found in time.

:class:`ServerProbing` is a base of
:class:`~celery_singleton_beat.beat.scheduler.SingletonSchedulerMixin`, which
holds the state used here (set in its ``__init__``) and calls these from ``tick``.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from ..config import SingletonSettings
from ..connection.sentinel import FOLLOW_EVERY
from ..log import logger
from ..recovery.startup import EX_CONFIG, LockRedisUnusable, StartupCheck
from .breaker import Breaker
from .claims import ClaimStore

__all__ = ["ServerProbing"]


class ServerProbing:
    """Looks at the claims Redis server between ticks (see the module docstring); a base of the mixin."""

    # Set by SingletonSchedulerMixin.__init__ (and Celery's Scheduler: _heap).
    singleton_settings: SingletonSettings
    claims: ClaimStore
    breaker: Breaker
    _server_check: StartupCheck
    _fatal: int | None  # raised by close once the schedule is saved (see .stopping)
    _heap: Any  # Celery's Scheduler attribute (annotation only)

    def _look_at_server(self) -> None:
        """At the start of a tick: the start-up check again after an outage, else a due probe."""
        if self._server_check.pending:
            self._check_server_again()
        elif self.breaker.probe_due():
            self._probe_claims_redis()

    def _server_wake(self, wake: float | None) -> float | None:
        """The sooner of ``wake`` and the next look at the server (seconds; None: neither)."""
        follow = self._follow_server()
        if follow is not None:
            wake = follow if wake is None else min(wake, follow)
        if self._server_check.pending:
            wake = min(wake, self._server_check.wait()) if wake is not None else self._server_check.wait()
        probe = self.breaker.next_probe_in()
        if probe is not None:
            wake = probe if wake is None else min(wake, probe)
        return wake

    def _check_server_again(self) -> None:
        """After an outage at start: a server that answers but cannot be used stops beat.

        Exit code 78, through :meth:`.stopping.CleanStop.close` (Celery's beat loop turns the
        ``SystemExit`` raised here into a clean stop, then closes the scheduler).
        A server that answers and can be used ends the Redis back-off at once: the
        back-off doubled through the outage (16 s after 15 s), and a beat that waited
        out its rest sent nothing for that long while Redis answered, as did every
        beat that started in the same outage (their back-offs run in step).
        """
        try:
            server = self._server_check.poll()
        except LockRedisUnusable:
            self._fatal = EX_CONFIG
            raise SystemExit(EX_CONFIG) from None
        if server is not None and self.breaker.is_open():
            self.breaker.ok()
            # Entries held back for the back-off sit in the heap at its end: build the
            # heap again from their own next instants (the due ones come first).
            self._heap = None

    def _probe_claims_redis(self) -> None:
        """While the Redis back-off runs (fail closed): a server that answers ends it at once,
        and the entries held back to its end come due again (see :meth:`_check_server_again`)."""
        try:
            self.claims.client.ping()
        except redis.RedisError:
            return  # still down: the back-off goes on, not doubled by a look
        self.breaker.ok()
        self._heap = None

    def _follow_server(self) -> float | None:
        """While claims this beat wrote recently could still be taken over by another beat
        (within a pending lease), look at the server every :data:`.sentinel.FOLLOW_EVERY`
        seconds: a failover or restart that lost them is then found, and they are
        written back, before another beat could take them over. Seconds until the next look."""
        lease = self.singleton_settings.beat_pending_lease
        if self.breaker.is_open() or not self.claims.kept.written_within(lease):
            return None
        wait = self.claims.reached + FOLLOW_EVERY - time.monotonic()
        if wait <= 0:
            try:
                self.claims.reach()
            except redis.RedisError as exc:
                logger.debug("beat: could not look at the claims Redis: %s", exc)
            wait = FOLLOW_EVERY
        return wait
