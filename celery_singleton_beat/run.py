"""``task.singleton_run``: what a running :class:`~celery_singleton_beat.task.SingletonTask` knows of its lock."""

from __future__ import annotations

from .exceptions import LockLost
from .keeper import KeptLease

__all__ = ["SingletonRun"]


class SingletonRun:
    """What a running task knows about its lock: ``self.singleton_run`` in the body.

    ``fence`` is a number that grows with every acquisition of this key: pass it
    to a downstream store that rejects writes carrying a smaller one, and a run
    that lost its lease cannot overwrite the work of its successor.
    """

    def __init__(self, key: str, kept: KeptLease | None) -> None:
        self.key = key
        self._kept = kept

    @property
    def held(self) -> bool:
        """True while this run holds its lock (False when it runs unlocked, fail-open)."""
        return self._kept is not None and not self._kept.lost

    @property
    def lost(self) -> bool:
        """True once the lease was lost (deleted, expired, taken) during the run."""
        return self._kept is not None and self._kept.lost

    @property
    def fence(self) -> int | None:
        """The fencing token of this run's lease (None when running unlocked)."""
        return self._kept.lease.fence if self._kept is not None else None

    def ensure_held(self) -> int:
        """Raise :class:`LockLost` if the lease is gone; call before irreversible work.

        Returns the fencing token (:attr:`fence`), typed ``int``: the lease is held.
        """
        if self._kept is None:
            raise LockLost(self.key, "the run holds no lock (Redis was unavailable, fail-open)")
        if self._kept.lost:
            raise LockLost(self.key, self._kept.lost_reason or "lost")
        return self._kept.lease.fence
