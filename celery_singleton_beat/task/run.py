"""``task.singleton_run``: what a running :class:`~celery_singleton_beat.task.task.SingletonTask` knows of its lock.

A run that holds its lock is one object, :class:`HeldRun`: what the body reads
(``self.singleton_run``) and the lease keeper's entry for the lease
(:class:`~.lease.kept.KeptLease`), in one. A gevent worker keeps thousands of runs
at once, and every object a held run keeps is one more for each full collection of
Python's garbage collector to go through (see docs/performance.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..exceptions import LockLost
from ..lease.kept import KeptLease
from ..lease.lease import Lease

__all__ = ["ENDED", "HeldRun", "SingletonRun", "UnlockedRun"]

#: Why ``ensure_held()`` raises once the run ended (the lock released, or kept as the
#: claim of an ``until_executed`` run's retry: either way, no longer this run's).
ENDED = "the run ended: its lock is released or handed to its retry"


class SingletonRun:
    """What a running task knows about its lock: ``self.singleton_run`` in the body.

    ``fence`` is a number that grows with every acquisition of this key: pass it
    to a downstream store that rejects writes carrying a smaller one, and a run
    that lost its lease cannot overwrite the work of its successor.

    A run that holds its lock is a :class:`HeldRun`; one that runs without it
    (``singleton_fail_open`` while Redis was unavailable) an :class:`UnlockedRun`.
    """

    __slots__ = ()

    @property
    def key(self) -> str:
        """The run's lock key."""
        raise NotImplementedError

    @property
    def held(self) -> bool:
        """True while this run can vouch for its lock: not lost, not ended (its release sent),
        and renewed recently enough that no other holder can have it (False when it runs
        unlocked, fail-open)."""
        return False

    @property
    def lost(self) -> bool:
        """True once the lease was lost (deleted, expired, taken) during the run."""
        return False

    @property
    def fence(self) -> int | None:
        """The fencing token of this run's lease (None when running unlocked)."""
        return None

    def ensure_held(self) -> int:
        """Raise :class:`LockLost` unless the run can vouch for its lease; call before irreversible work.

        Returns the fencing token (:attr:`fence`), typed ``int``: the lease is held.
        The lease is vouched for until the earliest moment another could hold it
        after its last renewal: a take-over of a worker's run, or a new
        acquisition once the recovery window of a restart right after that
        renewal closed (see :class:`~.lease.LockSpec` and ``docs/design.md``).
        Past that -- a pause of this process, or Redis unreachable from it --
        this raises even while the lock may still be in Redis; the keeper's next
        successful renewal vouches for it again. Once the run ended (its release
        sent) it raises for good: work the body left running must stop.
        """
        raise LockLost(self.key, "the run holds no lock (Redis was unavailable, fail-open)")


class UnlockedRun(SingletonRun):
    """A run without its lock: Redis was unavailable and the task fails open."""

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        self._key = key

    @property
    def key(self) -> str:
        return self._key


class HeldRun(KeptLease, SingletonRun):
    """A run holding its lock: the keeper renews its lease and marks it lost."""

    __slots__ = ("_done_ttl",)

    def __init__(self, lease: Lease, on_lost: Callable[[KeptLease, str], None] | None,
                 done_ttl: float | None = None) -> None:
        super().__init__(lease, on_lost)
        #: Seconds the done marker of this run's task id is kept after it ends
        #: (``acks_late`` runs on a worker; None: no marker).
        self._done_ttl = done_ttl

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def held(self) -> bool:
        return self.lost_reason is None and not self._ended and time.monotonic() < self.lease.vouched_until

    @property
    def _ended(self) -> bool:
        """The run ended: its release is on its way or done (``releasing``), or the keeper
        no longer renews it (``active`` False: forgotten, or abandoned as it began). Another
        run may hold the key at once, whatever grace the lease had left."""
        return self.releasing or not self.active

    @property
    def fence(self) -> int:
        return self.lease.fence

    def ensure_held(self) -> int:
        if self.lost_reason is not None:
            raise LockLost(self.key, self.lost_reason)
        if self._ended:
            raise LockLost(self.key, ENDED)
        lease = self.lease
        late = time.monotonic() - lease.vouched_until
        if late >= 0:
            raise LockLost(self.key, f"not renewed for {lease.spec.grace + late:.1f}s: another holder "
                                     f"may have it (this process was paused, or Redis did not answer)")
        return lease.fence
