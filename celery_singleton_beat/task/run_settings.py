"""What the runs of a :class:`~celery_singleton_beat.task.task.SingletonTask` take their
lock with: the settings, the lock client and the :class:`~.lease.spec.LockSpec` of a run,
and the task's counter hash, each built once and kept on the task until a cache is reset
(settings cleared, clients dropped, a fork); and the lease its option or the app sets.

A base of ``SingletonTask``, the first of them: the bases after it declare
:meth:`RunSettings._run_context` for their own type checks.
"""

from __future__ import annotations

from typing import Any, ClassVar

import celery
from celery import Task
from celery.backends.base import DisabledBackend

from .. import config
from ..config import SingletonSettings, get_settings
from ..lease.liveness import boot_id, publishes_liveness
from ..lease.spec import LockSpec
from ..recovery import lock_redis
from ..recovery.lock_redis import get_redis
from .keys import task_stats_key

__all__ = ["RunSettings"]

#: Counter bumped when a run finds its lock held, by ``on_conflict``.
_CONFLICT_COUNTERS = {"skip": "skipped", "return_existing": "skipped", "raise": "refused", "retry": "deferred"}


def _stores_results(task: celery.Task) -> bool:
    """The task's app has a result backend (results of runs that do not ignore them are stored)."""
    return not isinstance(task.backend, DisabledBackend)


class RunSettings(Task):
    """The settings, lock client and lock spec a run of the task uses, and its counter hash."""

    lock_ttl: ClassVar[float | None]
    on_conflict: ClassVar[str]

    def singleton_stats_key(self) -> str | None:
        """The counter hash of this task, or None when counters are off."""
        return self._stats_key(get_settings(self.app))

    @property
    def effective_lock_ttl(self) -> float:
        """The lease of this task in seconds (task option, else the app setting)."""
        return self._singleton_lock_ttl(get_settings(self.app))

    def _singleton_lock_ttl(self, settings: SingletonSettings) -> float:
        """The lease under ``settings``: the task's ``lock_ttl`` option, else the app's setting."""
        return float(self.lock_ttl) if self.lock_ttl is not None else settings.lock_ttl

    def _run_spec(self, settings: SingletonSettings, eager: bool) -> LockSpec:
        """How a run of this task takes its lock under ``settings``; built once and kept."""
        live = publishes_liveness()
        cached = self.__dict__.get("_singleton_spec")
        if cached is not None and cached[0] is settings and cached[1] == (eager, live):
            return cached[2]  # type: ignore[no-any-return]
        spec = LockSpec(
            task=self.name, ttl=self._singleton_lock_ttl(settings),
            boot=boot_id(), live=live, liveness_ttl=settings.liveness_ttl, liveness_prefix=settings.key_prefix,
            check_done=bool(self.acks_late) and not eager, stats_key=self._stats_key(settings),
            counters=("acquired", _CONFLICT_COUNTERS[self.on_conflict]),
            wait_replicas=settings.wait_replicas, wait_timeout=settings.wait_timeout)
        self._singleton_spec = (settings, (eager, live), spec)
        return spec

    def _stats_key(self, settings: SingletonSettings) -> str | None:
        """This task's counter hash under ``settings`` (None when counters are off), kept per settings."""
        cached = self.__dict__.get("_singleton_stats")
        if cached is None or cached[0] is not settings:
            cached = self._singleton_stats = (
                settings, task_stats_key(settings.key_prefix, self.name) if settings.stats else None)
        return cached[1]

    def _run_context(self, eager: bool) -> tuple[SingletonSettings, Any, LockSpec, bool]:
        """Settings, lock client, spec of a run and whether the app stores results, kept on
        the task until a cache is reset (settings cleared, clients dropped, a fork): four
        look-ups a run would repeat."""
        generation = (config.GENERATION[0], lock_redis.GENERATION[0], eager, publishes_liveness())
        cached = self.__dict__.get("_singleton_context")
        if cached is not None and cached[0] == generation:
            return cached[1]  # type: ignore[no-any-return]
        settings = get_settings(self.app)
        context = (settings, get_redis(self.app), self._run_spec(settings, eager), _stores_results(self))
        self._singleton_context = (generation, context)
        return context
