"""Beat inside every worker (``celery worker -B``): the scheduler it runs, checked at start.

Every embedded beat can be active (``celery worker -B --scheduler singleton``):
each slot is claimed as with separate ``celery beat`` processes. Two mistakes
would silently send every slot from every worker, so they are caught here:

* ``-S singleton`` on ``celery worker``: there ``-S`` is ``--statedb`` (the
  worker's state file), not the scheduler, and the embedded beat runs Celery's
  own scheduler. A worker whose ``--statedb`` (``worker_state_db``) names this
  library's scheduler refuses to start with one line and exit code 78
  (:data:`~celery_singleton_beat.recovery.startup.EX_CONFIG`), like the library's other
  start-up refusals.
* an embedded beat running another scheduler while the library's beats claim
  slots in the same Redis (the same ``singleton_key_prefix``): the worker's
  beat logs a warning when it starts. The evidence is read in one round trip
  each: the entries of this beat whose ``scheduled`` record a singleton beat
  renewed within the hour (every singleton beat renews the records of its
  entries at start and hourly), else a claim won within the hour in the
  claims history.

A worker whose embedded beat is this library's, named on the command line only
(``--scheduler singleton``), also gets the worker step that drops a second
delivery of a slot (:func:`celery_singleton_beat.install`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from typing import Any

import redis
from celery import signals

from ..config import get_settings
from ..connection.url import sanitize_redis_url
from ..log import logger
from ..recovery.lock_redis import get_redis
from ..recovery.startup import EX_CONFIG
from ..task.worker import install
from .entries import entry_spec, history_key
from .records import REFRESH, entry_record_key
from .scheduler import SingletonSchedulerMixin

__all__ = ["names_this_library", "singleton_beats_here"]

#: Entries of a beat whose records are looked at, at most.
LOOKED_AT = 1000


def names_this_library(scheduler: Any) -> bool:
    """Whether a scheduler setting (an alias, a path or a class) is this library's scheduler."""
    if isinstance(scheduler, str):
        return scheduler == "singleton" or scheduler.startswith("celery_singleton_beat")
    return isinstance(scheduler, type) and issubclass(scheduler, SingletonSchedulerMixin)


def singleton_beats_here(client: Any, prefix: str, window: float, claim_names: Iterable[str]) -> str | None:
    """What shows that the library's beats claim slots under ``prefix`` now, or None.

    The claim names of ``claim_names`` whose ``scheduled`` record was renewed
    within :data:`~.records.REFRESH` (its TTL is still above ``window``, the
    ``singleton_beat_catch_up_window``); else the newest claim in the history,
    if it was won within that hour. Two round trips at most. Raises ``redis.RedisError``.
    """
    names = sorted(set(claim_names))[:LOOKED_AT]
    if names:
        with client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.pttl(entry_record_key(prefix, name))
            ttls = pipe.execute()
        shared = [name for name, ttl in zip(names, ttls, strict=True) if ttl > window * 1000]
        if shared:
            more = f" and {len(shared) - 5} more" if len(shared) > 5 else ""
            return f"schedule {', '.join(shared[:5])}{more} too"
    newest = client.lindex(history_key(prefix), 0)
    try:
        record = json.loads(newest) if newest is not None else None
        age = time.time() - float(record["at"]) if isinstance(record, dict) else None
    except (ValueError, TypeError, KeyError):
        return None
    if age is not None and age < REFRESH.total_seconds():
        assert isinstance(record, dict)
        return (f"claim slots here (latest: {record.get('entry')} {record.get('slot')} won by "
                f"{record.get('winner')}, {age:.0f}s ago)")
    return None


@signals.worker_init.connect  # type: ignore[untyped-decorator]  # celery is untyped
def _check_worker(sender: Any = None, **_: Any) -> None:
    """Refuse ``-S singleton`` (``--statedb``); give an embedded singleton beat's worker its step."""
    statedb = getattr(sender, "statedb", None)
    if statedb and names_this_library(statedb):
        logger.critical(
            "worker %s refuses to start: -S/--statedb %r names the singleton scheduler, but on `celery worker` "
            "-S is the worker's state file, and an embedded beat (-B) would run Celery's own scheduler: every "
            "slot sent by every worker. Use `celery worker -B --scheduler singleton`",
            getattr(sender, "hostname", "?"), statedb)
        sys.stderr.flush()
        raise SystemExit(EX_CONFIG)
    app = getattr(sender, "app", None)
    options = getattr(sender, "options", None) or {}
    if app is not None and options.get("beat") and names_this_library(getattr(sender, "scheduler", None)):
        install(app)


@signals.beat_embedded_init.connect  # type: ignore[untyped-decorator]  # celery is untyped
def _warn_foreign_beat(sender: Any = None, **_: Any) -> None:
    """In a worker's embedded beat that is not this library's: warn if singleton beats claim slots here."""
    scheduler = getattr(sender, "scheduler", None)
    app = getattr(sender, "app", None)
    if scheduler is None or app is None or isinstance(scheduler, SingletonSchedulerMixin):
        return
    try:
        settings = get_settings(app)
    except Exception:  # no usable singleton_* settings: the app does not use the library here
        return
    try:
        names = [spec.name for spec in (_spec(entry) for entry in list(scheduler.schedule.values()))
                 if spec is not None]
        evidence = singleton_beats_here(get_redis(app), settings.key_prefix, settings.beat_catch_up_window, names)
    except (redis.RedisError, OSError) as exc:
        logger.debug("beat: could not look for singleton beats in %s: %s",
                     sanitize_redis_url(settings.redis_url), exc)
        return
    if evidence:
        kind = type(scheduler)
        logger.warning(
            "beat: this worker's embedded beat runs %s.%s, not the singleton scheduler, while singleton beats "
            "%s in %s (prefix %r): their slots are sent by them and again by this beat. Start the worker with "
            "`-B --scheduler singleton` (on `celery worker`, -S is --statedb)",
            kind.__module__, kind.__qualname__, evidence, sanitize_redis_url(settings.redis_url),
            settings.key_prefix)


def _spec(entry: Any) -> Any:
    try:
        return entry_spec(entry)
    except ValueError:
        return None
