"""A round of the lease keeper's renewals: each lease's reply judged, lost locks put back.

The keeper (:mod:`.keeper`) takes the leases due within a short horizon off its queue and
hands them to its :class:`Renewer`, which renews them in one request per server where several
share it (:mod:`.batches`: one call of the many-lease script, or pipelined compare-and-extend
commands) and judges each lease on its own reply: renewed (due again a renewal interval after
its confirmation), put back where the server lost the lock and the rules allow it (under the
keeper's mutex, so that a run that ends never has its lock written back), lost (its owner is
told), or retried every :data:`~.lease.RETRY_EVERY` seconds while Redis does not answer, until
the lease would have expired. The same round sends again the releases that got no answer
(:mod:`.releases`). The keeper schedules each entry again at the time given back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from ..connection.client import is_cluster
from ..log import logger
from ..recovery.lock_redis import thread_client
from ..recovery.server import PORTABLE, server_of
from .batches import group_key, renew_many, renew_scripted, scripted
from .commands import Renewal
from .kept import KeptLease, Later, renewed_together
from .lease import retry_pause
from .releases import PendingRelease

__all__ = ["LOG_EVERY", "Renewer"]

#: Seconds between two log lines about the same lease while Redis does not answer.
LOG_EVERY = 5.0


class Renewer:
    """The renewals of a :class:`~.keeper.LeaseKeeper`'s rounds, and the judging of their replies.

    ``mutex``: the keeper's, held around a put-back (a run's :meth:`~.keeper.LeaseKeeper.releasing`
    and :meth:`~.keeper.LeaseKeeper.forget` take it too); ``forget``: the keeper's, for an entry
    with nothing left to do (its release ran, or was given up)."""

    def __init__(self, mutex: Any, forget: Callable[[KeptLease | PendingRelease], None]) -> None:
        self._mutex = mutex
        self._forget = forget
        #: Requests that renewed several leases at once (diagnostics and tests).
        self.batches = 0

    def renew_round(self, leases: list[KeptLease], buckets: list[tuple[float, list[KeptLease]]]
                    ) -> list[tuple[KeptLease | PendingRelease, float | None]]:
        """Renew ``leases``: in one request per server where several share it (:mod:`.batches`),
        each judged on its own reply; the monotonic time of each one's next attempt. The leases
        a many-lease script renewed (:func:`.batches.renew_scripted`) go in ``buckets`` instead,
        with their next due time: those renewed together with the same interval share it."""
        groups: dict[tuple[int, str], tuple[Any, bool, list[KeptLease]]] = {}
        # The keeper's own client and its kind, once per lock client, not per lease: in a
        # gevent worker this thread's Python work holds up the hub (see .native). A client
        # that cannot be made (a Cluster whose seed does not answer: each attempt waits up to
        # its connect timeout) is tried once per round too; its leases are retried.
        # Off Cluster, all of a client's leases share one group, found with the client.
        vias: dict[int, tuple[Any, bool, list[KeptLease] | None] | BaseException] = {}
        done: list[tuple[KeptLease | PendingRelease, float | None]] = []
        for kept in leases:
            client = kept.lease.client
            found = vias.get(id(client))
            if found is None:
                try:
                    via = thread_client(client)
                    cluster = is_cluster(via)
                    shared = None if cluster else groups.setdefault((id(via), ""), (via, False, []))[2]
                    found = vias[id(client)] = (via, cluster, shared)
                except Exception as exc:  # judged with each of its leases, where errors are
                    found = vias[id(client)] = exc
            if isinstance(found, BaseException):
                done.append((kept, self.renew_one(kept, found)))
                continue
            via, cluster, shared = found
            if shared is not None:
                shared.append(kept)
                continue
            try:
                groups.setdefault(group_key(via, kept.lease, cluster), (via, cluster, []))[2].append(kept)
            except Exception:  # no node for it now (a Cluster being reshaped): on its own
                groups[(id(kept), "")] = (via, cluster, [kept])
        for via, cluster, group in groups.values():
            if len(group) == 1:
                done.append((group[0], self.renew_one(group[0], via=via)))
                continue
            self.batches += 1
            if scripted(server_of(via).info or PORTABLE, cluster):
                try:
                    started, epoch, failed = renew_scripted(via, [kept.lease for kept in group])
                except redis.ResponseError:  # refused as a whole (-BUSY, -NOPERM): each lease on its own below
                    pass
                except Exception as exc:  # the request as a whole: each lease's error
                    done += [(kept, self.renew_one(kept, exc, via)) for kept in group]
                    continue
                else:
                    for at, found_at in failed.items():  # each judged alone, as its own reply would be
                        done.append((group[at], self.renew_one(group[at], found_at, via)))
                    renewed = [kept for at, kept in enumerate(group) if at not in failed] if failed else group
                    buckets += renewed_together(renewed, started, epoch)
                    continue
            try:
                outcomes: list[Renewal | BaseException] = renew_many(via, [kept.lease for kept in group])
            except Exception as exc:  # the request as a whole: each lease's error
                outcomes = [exc] * len(group)
            for kept, outcome in zip(group, outcomes, strict=True):
                # A reply of its own that is an error (-BUSY, -MOVED): on the one-lease path.
                alone = isinstance(outcome, redis.ResponseError)
                done.append((kept, self.renew_one(kept, via=via) if alone else self.renew_one(kept, outcome, via)))
        return done

    def settle(self, kept: KeptLease, outcome: Renewal, client: Any) -> bool | Later:
        """What a renewal of ``kept`` that found ``outcome`` means: True if the lease holds
        (renewed, or put back where the server lost it and the rules allow it); a
        :class:`Later` when its put-back must wait for the end of the recovery window."""
        lease = kept.lease
        if outcome is not Renewal.GONE:
            return outcome is Renewal.RENEWED
        epoch = server_of(client or lease.client).epoch
        late = kept.put_back_at is not None and lease.may_put_back_late(kept.put_back_at, client)
        if late or lease.may_put_back(client):
            with self._mutex:
                return kept.active and not kept.releasing and lease.put_back(client, decided=epoch)
        if kept.releasing:  # the run releases it
            return False
        if kept.put_back_at is not None:  # its turn came too late; or a data loss moved it forward early: it waits
            return Later(kept.put_back_at) if time.monotonic() < kept.put_back_at else False
        at = lease.late_put_back_at(client)
        if at is None:
            return False
        kept.put_back_at = at
        return Later(at)

    def renew_one(self, kept: KeptLease, outcome: Renewal | BaseException | None = None,
                  via: Any = None) -> float | None:
        """Renew once (or judge ``outcome``, what a batched renewal of it found) through ``via``
        (the keeper's client of the lease's server; found here when None); the monotonic
        time of the next attempt, or None when done."""
        lease = kept.lease
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            if via is None:
                via = thread_client(lease.client)
            held = self.settle(kept, lease.renew_once(via) if outcome is None else outcome, via)
            if isinstance(held, Later):
                return held.at
            if held:
                kept.renewals += 1
                if kept.next_complaint:
                    kept.next_complaint = 0.0
                    logger.warning("renewed lock %s again: Redis answers", lease.key)
                # From its confirmation, not from now: judging a large batch takes time.
                return max(time.monotonic(), lease.confirmed_at + lease.renew_every)
            if kept.releasing:  # its release ran (or the lock went another way): nothing left to renew
                self._forget(kept)
            elif kept.active:  # else the run ended and released it while this renewal was on its way
                kept.mark_lost("the lock was deleted, expired or taken by another holder")
            return None
        except redis.RedisError as exc:
            now = time.monotonic()
            if now >= lease.valid_until:
                if kept.releasing:  # its release reports it (sent again while Redis does not answer)
                    self._forget(kept)
                elif kept.active:
                    kept.mark_lost(f"the lease expired while Redis was unreachable ({exc})")
                return None
            if now >= kept.next_complaint:  # the first failure, then every LOG_EVERY seconds
                kept.next_complaint = now + LOG_EVERY
                holder = lease.holder
                logger.error("cannot renew lock %s of %s[%s], retrying until it would expire in %.1fs: %s",
                             lease.key, holder.task if holder else "?", holder.task_id if holder else "?",
                             lease.valid_until - now, exc)
            return min(now + retry_pause(lease.ttl), lease.valid_until)
        except Exception:  # never let the keeper thread die
            logger.exception("unexpected error renewing lock %s", lease.key)
            return time.monotonic() + lease.renew_every

    def release_again(self, pending: PendingRelease) -> float | None:
        """Send a pending release once; the monotonic time of the next attempt, or None when done."""
        error = pending.send()
        next_time = None if error is None else pending.next_attempt(time.monotonic())
        if error is not None and next_time is None:
            pending.give_up(error)
        if next_time is None:
            self._forget(pending)
        return next_time
