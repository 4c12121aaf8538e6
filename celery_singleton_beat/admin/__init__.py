"""The admin API: what ``celery -A proj singleton ...`` shows and does, callable from Python.

For a health endpoint, an admin page or a metrics exporter::

    from celery_singleton_beat import admin

    report = admin.doctor(app)              # never raises for Redis or settings problems
    if not report.ok:
        ...                                 # report.checks: name, status OK/WARN/FAIL, detail

    for lock in admin.list_locks(app, task="proj.sync", kind="run"):
        print(lock.key, lock.holder.task_id, lock.holder.node, lock.ttl)
    for lock in admin.iter_locks(app):      # streamed as found (a large Redis), not sorted
        ...

    stuck = admin.find_release_targets(app, task="proj.sync", every=True)
    result = admin.release(app, stuck)     # compare-and-delete of exactly those values
    result.changed                          # re-taken meanwhile: left alone

    admin.purge_claims(app)                 # after `celery purge`: claims only, never a running lock

    admin.recent_slots(app, entry="hourly", last=10).claims
    admin.read_counters(app).tasks["proj.sync"]["skipped"]

Every function takes the Celery app and reads the Redis of its
``singleton_redis_url`` with SCAN (never KEYS); the functions that walk the keys
take a ``progress`` callback (:class:`ScanProgress` after each SCAN call). Errors: :class:`InvalidSettings`
(also Celery's ``ImproperlyConfigured``), :class:`RedisUnavailable` (Redis
could not be reached), :class:`AdminRedisError` (Redis refused a command; the
base of ``RedisUnavailable``), :class:`NotALockKey` (a ``ValueError``),
:class:`AmbiguousRelease`; all are :class:`AdminError`, a
:class:`~celery_singleton_beat.SingletonError`.
"""

from __future__ import annotations

from ._common import (
    AdminError,
    AdminRedisError,
    InvalidSettings,
    KeySpace,
    NotALockKey,
    Progress,
    RedisUnavailable,
    ScanProgress,
    Target,
    connect,
    glob_escape,
    load_tasks,
)
from .checks import (
    EX_CONFIG,
    EX_FAILURE,
    EX_UNAVAILABLE,
    MIN_REDIS,
    TESTED_REDIS,
    Check,
    DoctorReport,
    Status,
    doctor,
    doctor_exit_code,
    singleton_tasks,
    version_check,
)
from .claims import find_claims, is_claim, purge_claims
from .locks import (
    AmbiguousRelease,
    HeldLock,
    HolderReport,
    HolderState,
    HolderStatus,
    LockKind,
    ReleaseResult,
    check_holders,
    find_release_targets,
    force_release,
    iter_locks,
    list_locks,
    read_lock,
    release,
    release_lock,
)
from .slots import SlotClaim, SlotHistory, SlotSource, recent_slots
from .stats import BEAT_COUNTERS, TASK_COUNTERS, CounterHash, Counters, iter_counters, read_counters

__all__ = [
    "BEAT_COUNTERS",
    "EX_CONFIG",
    "EX_FAILURE",
    "EX_UNAVAILABLE",
    "MIN_REDIS",
    "TASK_COUNTERS",
    "TESTED_REDIS",
    "AdminError",
    "AdminRedisError",
    "AmbiguousRelease",
    "Check",
    "CounterHash",
    "Counters",
    "DoctorReport",
    "HeldLock",
    "HolderReport",
    "HolderState",
    "HolderStatus",
    "InvalidSettings",
    "KeySpace",
    "LockKind",
    "NotALockKey",
    "Progress",
    "RedisUnavailable",
    "ReleaseResult",
    "ScanProgress",
    "SlotClaim",
    "SlotHistory",
    "SlotSource",
    "Status",
    "Target",
    "check_holders",
    "connect",
    "doctor",
    "doctor_exit_code",
    "find_claims",
    "find_release_targets",
    "force_release",
    "glob_escape",
    "is_claim",
    "iter_counters",
    "iter_locks",
    "list_locks",
    "load_tasks",
    "purge_claims",
    "read_counters",
    "read_lock",
    "recent_slots",
    "release",
    "release_lock",
    "singleton_tasks",
    "version_check",
]
