"""Worker-side support: locks of runs that could not release them themselves.

* :class:`SingletonRequest` runs in the worker's main process. When a pool
  child dies with a singleton run on it (SIGKILL, OOM killer, hard time limit,
  revoke with ``terminate=True``), the child's ``finally`` never runs; the main
  process learns of it at once and deletes the lock if that task id still
  holds it.
* :class:`SingletonWorkerStep` runs at worker start-up: it validates the
  ``singleton_*`` settings (a mistake stops the worker with a clear error)
  and reclaims locks left by a previous incarnation of the same node name
  (a worker restarted after ``kill -9``), instead of waiting out their TTL.

Every lock value records the worker incarnation (``boot``) that took it; a
node name is unique among running workers, so a lock with this node's name
and another boot id belongs to a process that is gone.
"""

from __future__ import annotations

import uuid
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import Celery, bootsteps, signals
from celery.exceptions import Terminated, TimeLimitExceeded
from celery.worker.request import Request

from .client import get_redis, mget_any, scan_all
from .config import get_settings
from .events import logger
from .keys import QUEUED_SUFFIX, is_run_lock_key, task_stats_key
from .lock import parse_holder, release_task, release_value

__all__ = ["SingletonRequest", "SingletonWorkerStep", "boot_id", "install", "reclaim_node_locks"]

_boot_id = uuid.uuid4().hex

#: Endings after which the pool child cannot have released its lock.
_CHILD_GONE = (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit, KeyboardInterrupt)


def boot_id() -> str:
    """The id of this worker incarnation (inherited by prefork pool children)."""
    return _boot_id


def install(app: Celery) -> None:
    """Make ``app``'s workers run :class:`SingletonWorkerStep` (idempotent)."""
    app.steps["worker"].add(SingletonWorkerStep)


def _release_for_request(request: Request, why: str) -> None:
    """Delete the locks the request's task id holds, from the main process."""
    task = request.task
    key_of = getattr(task, "singleton_key", None)
    if key_of is None:
        return
    try:
        key = key_of(request.args, request.kwargs)
    except Exception:  # bad arguments: the run never took a lock
        return
    try:
        client = get_redis(task.app)
        stats_key = task.singleton_stats_key()
        freed = [k for k in (key, key + QUEUED_SUFFIX)
                 if release_task(client, k, request.id, stats_key=stats_key, counter="reclaimed")]
    except redis.RedisError as exc:
        logger.error("%s[%s] %s; could not free %s (it expires after its TTL): %s",
                     request.name, request.id, why, key, exc)
        return
    if freed:
        logger.warning("%s[%s] %s; freed its lock %s", request.name, request.id, why, key)


class SingletonRequest(Request):
    """Request class of singleton tasks: frees locks of pool children that died."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback wraps the real one
        if isinstance(exc, _CHILD_GONE):
            _release_for_request(self, f"ended without releasing ({type(exc).__name__})")
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        result = super().on_timeout(soft, timeout)
        if not soft:
            _release_for_request(self, f"hit the hard time limit ({timeout}s)")
        return result


def reclaim_node_locks(client: redis.Redis, prefix: str, node: str, current_boot: str,
                       stats: bool = True) -> int:
    """Delete run locks held by ``node`` under an older boot id; returns how many.

    Uses SCAN (never KEYS) and deletes each lock with compare-and-delete, so a
    lock re-taken in the meantime is left alone. Each freed lock is logged.
    """
    freed = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal freed
        for key, raw in zip(batch, mget_any(client, batch)):
            holder = parse_holder(raw)
            if holder is None or holder.node != node or holder.claim or holder.boot in (None, current_boot):
                continue
            stats_key = task_stats_key(prefix, holder.task) if stats and holder.task else None
            if release_value(client, key, raw, stats_key=stats_key, counter="reclaimed"):
                freed += 1
                logger.warning("reclaimed %s of %s[%s], left by a previous run of %s (pid %s)",
                               key, holder.task, holder.task_id, node, holder.pid)
        batch.clear()

    # Glob braces are literal: this matches keys ending in "}", i.e. run locks.
    for raw_key in scan_all(client, f"{prefix}:{{*}}", count=1000):
        key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
        if is_run_lock_key(prefix, key):
            batch.append(key)
            if len(batch) >= 500:
                flush()
    if batch:
        flush()
    return freed


class SingletonWorkerStep(bootsteps.StartStopStep):
    """Validates settings when the worker starts and reclaims this node's stale locks."""

    label = "singleton"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.settings = get_settings(worker.app)  # raises ImproperlyConfigured

    def start(self, worker: Any) -> None:
        try:
            freed = reclaim_node_locks(
                get_redis(worker.app), self.settings.key_prefix, worker.hostname, boot_id(),
                stats=self.settings.stats,
            )
        except redis.RedisError as exc:
            logger.error("could not reclaim locks of a previous run of %s: %s", worker.hostname, exc)
            return
        if freed:
            logger.warning("reclaimed %d lock(s) left by a previous run of %s", freed, worker.hostname)


@signals.worker_init.connect
def _install_on_worker_init(sender: Any = None, **_: Any) -> None:
    """Add the worker step for apps whose singleton tasks are declared lazily.

    ``@app.task`` on an app that is not finalized yet creates the task class
    only at finalization, possibly after the worker blueprint was built; this
    receiver runs just before the blueprint, so it finalizes and checks.
    """
    app = getattr(sender, "app", None)
    if app is not None and any(hasattr(task, "singleton_key") for task in app.tasks.values()):
        install(app)
