"""``task.singleton_run``: what a running :class:`~celery_singleton_beat.task.task.SingletonTask` knows of its lock."""

from __future__ import annotations

import time

from ..exceptions import LockLost
from ..lease.keeper import KeptLease

__all__ = ["SingletonRun"]


class SingletonRun:
    """What a running task knows about its lock: ``self.singleton_run`` in the body.

    ``fence`` is a number that grows with every acquisition of this key: pass it
    to a downstream store that rejects writes carrying a smaller one, and a run
    that lost its lease cannot overwrite the work of its successor.
    """

    def __init__(self, key: str, kept: KeptLease | None, done_ttl: float | None = None) -> None:
        self.key = key
        self._kept = kept
        #: Seconds the done marker of this run's task id is kept after it ends
        #: (``acks_late`` runs on a worker; None: no marker).
        self._done_ttl = done_ttl

    @property
    def held(self) -> bool:
        """True while this run can vouch for its lock: not lost, and renewed recently enough
        that no other holder can have it (False when it runs unlocked, fail-open)."""
        return self._kept is not None and not self._kept.lost and \
            time.monotonic() < self._kept.lease.vouched_until

    @property
    def lost(self) -> bool:
        """True once the lease was lost (deleted, expired, taken) during the run."""
        return self._kept is not None and self._kept.lost

    @property
    def fence(self) -> int | None:
        """The fencing token of this run's lease (None when running unlocked)."""
        return self._kept.lease.fence if self._kept is not None else None

    def ensure_held(self) -> int:
        """Raise :class:`LockLost` unless the run can vouch for its lease; call before irreversible work.

        Returns the fencing token (:attr:`fence`), typed ``int``: the lease is held.
        The lease is vouched for until the earliest moment another could hold it
        after its last renewal: a take-over of a worker's run, or a new
        acquisition once the recovery window of a restart right after that
        renewal closed (see :class:`~.lease.LockSpec` and ``docs/design.md``).
        Past that -- a pause of this process, or Redis unreachable from it --
        this raises even while the lock may still be in Redis; the keeper's next
        successful renewal vouches for it again.
        """
        kept = self._kept
        if kept is None:
            raise LockLost(self.key, "the run holds no lock (Redis was unavailable, fail-open)")
        if kept.lost:
            raise LockLost(self.key, kept.lost_reason or "lost")
        late = time.monotonic() - kept.lease.vouched_until
        if late >= 0:
            raise LockLost(self.key, f"not renewed for {kept.lease.spec.grace + late:.1f}s: another holder "
                                     f"may have it (this process was paused, or Redis did not answer)")
        return kept.lease.fence
