"""Taking a lock by hand, as a run would, with the spec's fields as keyword arguments; renewing it
by hand, as the keeper does (one lease, or a round of many)."""

from __future__ import annotations

from typing import Any

from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper, get_keeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import AcquireResult, acquire
from celery_singleton_beat.lease.spec import LockSpec


def take_lock(client: Any, key: str, ttl: float, *, task: str, task_id: str | None = None, node: str | None = None,
              adopt_claim_of: str | None = None, copy: bool = False, **spec: Any) -> AcquireResult:
    """``acquire(client, key, LockSpec(task=task, ttl=ttl, **spec), task_id, ...)``."""
    return acquire(client, key, LockSpec(task=task, ttl=ttl, **spec), task_id, node=node,
                   adopt_claim_of=adopt_claim_of, copy=copy)


def renew(lease: Lease) -> bool:
    """Renew ``lease`` once, putting its lock back where the server lost it, through the
    keeper's guarded path (:meth:`.keeper.LeaseKeeper.renew`); False if it is no longer ours."""
    return get_keeper().renew(KeptLease(lease, None))


def renew_round(keeper: LeaseKeeper, leases: list[KeptLease]) -> list[tuple[Any, float | None]]:
    """Renew ``leases`` in one renewal round of ``keeper``, from the calling thread and with nothing
    scheduled: each lease with the monotonic time of its next attempt (None: not to be renewed
    again), those a many-lease script renewed together included (the keeper queues them as one
    entry per due time)."""
    buckets: list[tuple[float, list[KeptLease]]] = []
    done = keeper.renewer.renew_round(leases, buckets)
    return done + [(kept, due) for due, group in buckets for kept in group]


def round_in_flight(leases: list[Lease]) -> tuple[LeaseKeeper, list[KeptLease], list[str], list[Any]]:
    """A keeper with no thread (its rounds run in the calling thread) keeping ``leases``, and
    the round it took of them all, now in flight: the keeper, the kept leases, the reasons of
    those reported lost (as they are), and the round's entries."""
    keeper = LeaseKeeper()
    keeper._running = True  # no thread: the rounds run here
    lost: list[str] = []
    kept = [keeper.keep(lease, on_lost=lambda k, reason: lost.append(reason)) for lease in leases]
    with keeper._mutex:
        taken = keeper._take_due(float("inf"))
    return keeper, kept, lost, taken

def take_leases(client: Any, prefix: str, ttls: list[float]) -> list[Lease]:
    """One lease per TTL, keys ``singleton:{<prefix>:<n>}`` (a hash tag each: Cluster-safe), task
    ids ``run-<n>``; each must be won."""
    leases = []
    for n, ttl in enumerate(ttls):
        lease = acquire(client, f"singleton:{{{prefix}:{n}}}", LockSpec(task="adv", ttl=ttl), f"run-{n}").lease
        assert lease is not None
        leases.append(lease)
    return leases
