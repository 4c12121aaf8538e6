"""What the keeper's queue holds (a kept lease, a group of leases due together, a put-back's
wait), and which of its entries a round takes."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import NamedTuple

from ..log import logger
from . import counters
from .batches import BATCH_MAX
from .lease import Lease
from .releases import PendingRelease

__all__ = ["BATCH_HORIZON", "Bucket", "Entry", "KeptLease", "Later", "renewed_together", "take_due"]

#: Seconds ahead of its time a lease may be renewed, to share a request with the others
#: due by then (at most a quarter of its renewal interval).
BATCH_HORIZON = 0.25


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


#: An entry of the keeper's queue: due time, order of scheduling, and a lease, a pending
#: release or leases due together.
Entry = tuple[float, int, KeptLease | PendingRelease | Bucket]


def take_due(queue: list[Entry], now: float) -> list[KeptLease | PendingRelease]:
    """The entries of ``queue`` (the keeper's heap, under its mutex) due at ``now``, taken off
    it, with every lease due within its horizon (a quarter of its renewal interval,
    :data:`BATCH_HORIZON` at most) behind them, :data:`.batches.BATCH_MAX` leases at most:
    renewed together, in one request per server. Forgotten entries come off too."""
    taken: list[KeptLease | PendingRelease] = []
    leases = 0
    while queue and leases < BATCH_MAX:
        when, _, kept = queue[0]
        if isinstance(kept, Bucket):  # renewed together before: taken together (or not yet)
            live = [each for each in kept.leases if each.active]
            horizon = min(BATCH_HORIZON, live[0].lease.renew_every / 4) if live else 0.0
            if live and (when > now + (horizon if taken else 0.0) or (taken and leases + len(live) > BATCH_MAX)):
                kept.leases = live
                break
            heapq.heappop(queue)
            taken += live
            leases += len(live)
            continue
        if not kept.active:
            heapq.heappop(queue)
            continue
        horizon = min(BATCH_HORIZON, kept.lease.renew_every / 4) if isinstance(kept, KeptLease) else 0.0
        if when > now + (horizon if taken else 0.0):
            break
        heapq.heappop(queue)
        taken.append(kept)
        leases += isinstance(kept, KeptLease)
    return taken


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
