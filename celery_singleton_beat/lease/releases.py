"""Releases that got no answer, sent again until they run.

A run's release -- compare-and-delete of its own lock value, then its task id's done
marker for ``acks_late`` runs -- can meet a lock Redis that does not run it: ``-BUSY``
while another client's script runs, writes paused past the socket timeout, a cut
connection. Given up on, the lock stayed until its TTL and the done marker was never
written, so a copy of the message delivered again (its acknowledgement lost with a
broker restart or a worker crash) ran the completed task a second time.

Sending it again is safe at any time: the delete compares the whole value (never a
later holder's lock), and the marker is this task id's own. So the process's keeper
(:meth:`.keeper.LeaseKeeper.retry_release`) sends it again every quarter second while
the lease lasts, then, for the done marker only, with a growing pause for up to
:data:`MARKER_PATIENCE` more seconds; a process that ends keeps trying for up to
:data:`EXIT_PATIENCE` seconds.
"""

from __future__ import annotations

import time

import redis

from ..log import logger
from ..recovery.lock_redis import thread_client
from .lease import RETRY_EVERY, Lease, retry_pause

__all__ = ["EXIT_PATIENCE", "MARKER_PATIENCE", "PendingRelease"]

#: Seconds after the lease's end that a done marker is still sent again: a copy of the
#: message delivered again must find it (the lock itself has expired by then).
MARKER_PATIENCE = 300.0
#: Longest pause between two sendings once the lease has ended.
SLOW_RETRY = 5.0
#: Seconds a process that ends keeps sending its pending releases (a pool process's
#: exit waits that long at most, plus one socket timeout if Redis does not answer at
#: all, and only when one is pending).
EXIT_PATIENCE = 3.0


class PendingRelease:
    """A run's release that got no answer: sent again until it runs or :attr:`until`."""

    __slots__ = ("active", "attempts", "counted", "done_ttl", "lease", "until")

    def __init__(self, lease: Lease, done_ttl: float | None, counted: bool = True) -> None:
        self.lease = lease
        self.done_ttl = done_ttl
        #: False for a lock no run used: its release is counted neither released nor lost.
        self.counted = counted
        self.attempts = 0
        self.active = True
        #: Monotonic time after which it is given up: the lease's end, and for a done
        #: marker up to MARKER_PATIENCE (at most its own TTL) later.
        self.until = lease.valid_until + (min(done_ttl, MARKER_PATIENCE) if done_ttl else 0.0)

    def send(self) -> redis.RedisError | None:
        """Send it once; None when it ran (or cannot ever run), else why it did not."""
        lease = self.lease
        self.attempts += 1
        try:
            released = lease.release(done_ttl=self.done_ttl, client=thread_client(lease.client), again=True,
                                     counted=self.counted)
        except redis.RedisError as exc:
            return exc
        except Exception:  # never let the keeper thread die
            logger.exception("unexpected error releasing lock %s", lease.key)
            return None
        logger.warning("released lock %s on attempt %d%s", lease.key, self.attempts,
                       "" if released else " (it was gone already: an earlier attempt ran, or it expired)")
        return None

    def next_attempt(self, now: float) -> float | None:
        """When to send it again after a failed sending at ``now``; None: give up."""
        if now >= self.until:
            return None
        if now < self.lease.valid_until:
            return min(now + retry_pause(self.lease.ttl), self.until)
        pause: float = min(SLOW_RETRY, RETRY_EVERY * 2 ** min(self.attempts, 5))
        return min(now + pause, self.until)

    def give_up(self, error: BaseException) -> None:
        logger.error("gave up releasing lock %s after %d attempts (%s): it expires by itself%s",
                     self.lease.key, self.attempts, error,
                     "; its done marker is not written, so a copy of its message delivered again "
                     "would run" if self.done_ttl else "")


def send_until_done(pending: list[PendingRelease], patience: float = EXIT_PATIENCE) -> list[PendingRelease]:
    """Send each of ``pending`` until it runs, for ``patience`` seconds (the process ends),
    plus at most one socket timeout when the server does not answer at all; the ones given
    up on."""
    deadline = time.monotonic() + patience
    errors: dict[int, tuple[PendingRelease, BaseException]] = {}
    while pending:
        left = []
        for i, entry in enumerate(pending):
            if i and time.monotonic() >= deadline:  # a stopped server: one socket timeout per sending
                for late in pending[i:]:
                    errors.setdefault(id(late), (late, redis.TimeoutError("no time left: the process ends")))
                left += pending[i:]
                break
            error = entry.send()
            if error is None:
                errors.pop(id(entry), None)
            else:
                errors[id(entry)] = (entry, error)
                left.append(entry)
        pending = left
        if not pending or time.monotonic() + RETRY_EVERY >= deadline:
            break
        time.sleep(RETRY_EVERY)
    for entry, why in errors.values():
        entry.give_up(why)
    return [entry for entry, _ in errors.values()]
