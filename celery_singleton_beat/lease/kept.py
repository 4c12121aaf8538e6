"""What the keeper's queue holds: a kept lease, a group of leases due together, a put-back's wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from ..log import logger
from . import counters
from .lease import Lease

__all__ = ["Bucket", "KeptLease", "Later", "renewed_together"]


class Later(NamedTuple):
    """A put-back that waits until ``at`` (monotonic): the end of the recovery window."""

    at: float


class KeptLease:
    """A lease under renewal; ``lost`` tells whether it still protects the run."""

    __slots__ = ("active", "lease", "lost_reason", "next_complaint", "on_lost", "put_back_at", "releasing",
                 "renewals")

    def __init__(self, lease: Lease, on_lost: Callable[[KeptLease, str], None] | None) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self.lost_reason: str | None = None
        self.renewals = 0
        self.active = True
        #: The run ended and its release is on its way (:meth:`LeaseKeeper.releasing`): still
        #: renewed, but a lock found gone or another's is the release's doing, not a loss.
        self.releasing = False
        #: Monotonic time before which a failed renewal is not logged again.
        self.next_complaint = 0.0
        #: Monotonic time of a put-back waiting for the end of a recovery window (see
        #: :meth:`.lease.Lease.late_put_back_at`); None when none waits.
        self.put_back_at: float | None = None

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def mark_lost(self, reason: str) -> None:
        if self.lost_reason is None:
            self.lost_reason = reason
            if self.on_lost is not None:
                self.on_lost(self, reason)


class Bucket:
    """Leases renewed in one request and due again at the same moment: one entry of the
    keeper's queue for them all (one heap push per batch, not one per lease). A lease
    forgotten meanwhile stays in it until it comes due, and is skipped then."""

    __slots__ = ("leases",)

    #: An entry of the queue: dropped only when it comes due (its leases are looked at then).
    active = True

    def __init__(self, leases: list[KeptLease]) -> None:
        self.leases = leases


def renewed_together(renewed: list[KeptLease], started: float, epoch: int) -> list[tuple[float, list[KeptLease]]]:
    """``renewed``, renewed by one request sent at ``started`` under ``epoch``: confirmed from then
    (as :meth:`.lease.Lease.settle_renewal` confirms one) and counted; returned in groups of one
    lock client, counter hash and renewal interval, each with its next due time, a renewal interval after ``started``
    (from the confirmation, not from now: judging a large batch takes time)."""
    groups: dict[tuple[int, str | None, float], list[KeptLease]] = {}
    client = spec = same = None
    for kept in renewed:
        lease = kept.lease
        lease.confirm(started, epoch)
        kept.renewals += 1
        if kept.next_complaint:
            kept.next_complaint = 0.0
            logger.warning("renewed lock %s again: Redis answers", lease.key)
        if lease.spec is not spec or lease.client is not client or same is None:
            client, spec = lease.client, lease.spec
            same = groups.setdefault((id(client), spec.stats_key, spec.renew_every), [])
        same.append(kept)
    now = time.monotonic()
    due: list[tuple[float, list[KeptLease]]] = []
    for group in groups.values():
        lease = group[0].lease
        counters.count(lease.client, lease.spec.stats_key, "renewed", len(group))
        due.append((max(now, started + lease.spec.renew_every), group))
    return due
