"""Taking over the lock of a worker that is provably dead.

Node names decide nothing (they are not unique, and pods return under new
ones): a lock names the worker incarnation that holds it, and each incarnation
proves it is alive with a liveness key (:mod:`.liveness`). A lock is taken over
only when its holder's liveness key is gone **and** the lock itself missed its
renewals (its remaining TTL shows it, on the server's clock) **and** it stays
unrenewed for :data:`.lease.TAKEOVER_WAIT` more seconds while the taker
watches. A missing liveness key alone proves nothing (deleted, evicted, lost
in a failover, or the worker's main process stalled while its pool child
renews), and a lock that merely could not be renewed while Redis was down is
renewed within the watch once Redis answers again.
"""

from __future__ import annotations

import time

from ..connection.client import RedisClient
from . import counters
from .commands import look_request, take_over_request
from .executor import execute
from .holder import Holder, text_of
from .lease import Lease, replaced_lease
from .liveness import boot_id, is_alive
from .spec import TAKEOVER_WAIT, LockSpec

__all__ = ["looks_dead", "missed_renewals", "take_over"]


def looks_dead(client: RedisClient, prefix: str, holder: Holder) -> bool:
    """A first look: a worker's run lock whose worker's liveness key is gone (one ``EXISTS``)."""
    return (holder.live and not holder.claim and bool(holder.boot) and holder.boot != boot_id()
            and not is_alive(client, prefix, holder.boot or ""))


def missed_renewals(holder: Holder, pttl: int) -> bool:
    """The lock's remaining TTL shows that its keeper missed a renewal.

    Renewed every ``every`` seconds back to ``ttl``: more than two intervals
    since the last renewal is a missed one. A value without these fields
    (written before 0.3) counts as missed: its liveness key alone decides, as
    it did then, after the wait of :data:`.lease.TAKEOVER_WAIT`.
    """
    if pttl < 0:
        return False  # gone meanwhile, or a key without expiry: not ours to take
    if holder.ttl is None or holder.every is None:
        return True
    return holder.ttl * 1000 - pttl > 2 * holder.every * 1000


def take_over(client: RedisClient, key: str, spec: LockSpec, task_id: str | None, value: str,
              holder: Holder) -> Lease | None:
    """Take the lock of ``holder`` if it is provably dead (see the module docstring); the new
    lease, or None when it is not (or another got there first)."""
    assert spec.liveness_prefix is not None
    look = execute(client, key, lambda info: look_request(key, info=info))
    if look.current is None or text_of(look.current) != holder.raw or not missed_renewals(holder, look.pttl):
        return None
    time.sleep(TAKEOVER_WAIT)
    if is_alive(client, spec.liveness_prefix, holder.boot or ""):
        return None
    raw = text_of(look.current)  # the holder's exact value (checked above)
    lease = replaced_lease(client, key, spec, task_id,
                           lambda info: take_over_request(info, key, raw, look, value, spec.ttl_ms), value)
    if lease is not None:
        counters.count(client, spec.stats_key, "taken_over")
    return lease
