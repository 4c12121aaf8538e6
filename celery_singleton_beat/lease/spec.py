"""How a task takes its lock: the settings every run of it shares (:class:`LockSpec`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..recovery.window import WINDOW_SLACK

__all__ = ["LATE_PUT_BACK", "TAKEOVER_WAIT", "LockSpec", "ms"]

#: Seconds a worker watches a lock whose holder looks dead (liveness key gone,
#: renewals missed) before taking it over: a holder that is alive renews within
#: it (its keeper retries every quarter second while Redis does not answer: four
#: tries), so a lock that merely could not be renewed during an outage is never
#: taken. It is what a dead pod's lock costs on top of the liveness TTL.
TAKEOVER_WAIT = 1.0
#: Seconds before a recovery window closes at which a lease that cannot vouch for its lock
#: up to the loss puts it back, if no other holder did (:meth:`.lease.Lease.late_put_back_at`):
#: from then another holder may have the key, so no lease vouches for itself past it.
LATE_PUT_BACK = 0.5


def ms(seconds: float) -> int:
    """Whole milliseconds, at least 1 (a ``PX`` of 0 is refused)."""
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class LockSpec:
    """How a task takes its lock: what is the same for every run (built once per task and settings).

    ``live``: the process publishes liveness (a worker), so its locks may be
    taken over once its worker is provably dead. ``liveness_ttl``: every
    holder, worker or not, renews at least every third of it (the recovery
    window after a restart lasts a third of it plus
    :data:`.window.WINDOW_SLACK`). ``liveness_prefix``: take over dead holders
    (None: never). ``check_done``: refuse when this task id's done marker
    exists (``acks_late``). ``claim``: a publish-time claim (held for a
    queued message, not renewed). ``counters``: the counter for "taken" and
    the one for "held by another". ``wait_replicas``: a taken lock must reach
    that many replicas within ``wait_timeout`` (``WAIT``), else it is given
    back and :class:`~.client.ReplicasNotAcknowledged` raised.
    """

    task: str
    ttl: float
    boot: str | None = None
    live: bool = False
    liveness_ttl: float = 10.0
    liveness_prefix: str | None = None
    check_done: bool = False
    claim: bool = False
    stats_key: str | None = None
    counters: tuple[str, str] = ("acquired", "skipped")
    wait_replicas: int = 0
    wait_timeout: float = 1.0
    ttl_ms: int = field(init=False, repr=False)
    #: Seconds between two renewals by the keeper.
    renew_every: float = field(init=False, repr=False)
    #: Seconds after a renewal's start for which the holder vouches for its lease:
    #: until the earliest moment another could have it (see :meth:`__post_init__`).
    grace: float = field(init=False, repr=False)
    #: Seconds after a renewal's start from which another holder could have taken the lock
    #: over (a worker's run: two missed renewals and the watch; else the lease's end). A
    #: lease not confirmed since then never puts its lock back (:meth:`.lease.Lease.may_put_back`).
    takeover_after: float = field(init=False, repr=False)
    #: The end of its lock values per (node, pid): the same for every run (see :func:`.holder.lock_value`).
    tails: dict[tuple[str, int], str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ttl_ms", ms(self.ttl))
        # Every holder renews within a third of the liveness TTL: after a restart or a
        # failover that lost its lock, it puts the lock back before the window closes.
        every = min(self.ttl, self.liveness_ttl) / 3
        object.__setattr__(self, "renew_every", every)
        # Another may hold the key from the earliest of: the lease's end; a late put-back
        # just before a recovery window closes (the server lost the lock right after it was
        # confirmed, a client noticed at once, and a holder stopped before a take-over puts
        # its own back then); for a worker's run, a take-over (two missed renewals and the watch).
        window = self.liveness_ttl / 3 + WINDOW_SLACK
        take_over = min(self.ttl, 2 * every + TAKEOVER_WAIT) if self.live else self.ttl
        object.__setattr__(self, "takeover_after", take_over)
        object.__setattr__(self, "grace", min(self.ttl, window - LATE_PUT_BACK, take_over))
        object.__setattr__(self, "tails", {})
