"""The Celery app under test: one singleton task whose runs write the history.

Workers, beats and the submitter all load this module (``-A harness.chaos.app``);
the controller gives them its settings in the environment:

* ``CHAOS_BROKER``, ``CHAOS_BACKEND``, ``CHAOS_LOCK``: broker, result backend and
  lock Redis URLs (the lock URL may name a proxy, or Sentinels);
* ``CHAOS_LOCK_TTL`` (4 s), ``CHAOS_LIVENESS_TTL`` (2 s), ``CHAOS_VISIBILITY`` (12 s),
  ``CHAOS_PENDING_LEASE`` (2 s), ``CHAOS_PREFIX`` (``chaos``), ``CHAOS_WAIT_REPLICAS`` (0);
* ``CHAOS_BROKEN=1``: the control run's lock, broken on purpose: ``unique_on``
  gives every run a key of its own, so runs of one key never exclude each other;
* ``CHAOS_HISTORY`` / ``CHAOS_WHO``: where this process writes its history
  (:mod:`.history`).

:func:`work` is the body: it records its start (task id, key, fencing token,
beat slot), then calls ``ensure_held()`` before each step of
:data:`STEP` seconds of "work" (each call recorded, passed or raised) until its
length is done, and records its end. A body told ``LockLost`` stops at once, as
a body that checks before irreversible work would. The lock core is used as a
user uses it; every seam is a signal or the body.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from celery import Celery, signals
from celery.schedules import crontab

from celery_singleton_beat import LockLost, SingletonTask
from celery_singleton_beat.lease.liveness import boot_id
from celery_singleton_beat.task.slot_delivery import ENTRY_HEADER, INSTANCE_HEADER, SLOT_HEADER

from .history import recorder

#: Seconds of work between two ``ensure_held()`` calls.
STEP = 0.1
#: The beat schedule: entries of their own keys and on keys the submitter uses too.
BEAT_ENTRIES: dict[str, dict[str, Any]] = {
    "own-2s": {"every": 2.0, "key": "beat:own-2s", "seconds": 0.3},
    "own-cron": {"cron": "* * * * *", "key": "beat:own-cron", "seconds": 0.5},
    "shared-3s": {"every": 3.0, "key": "k0", "seconds": 0.2},
    "shared-cron": {"cron": "* * * * *", "key": "k1", "seconds": 1.0},
}


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def _float(name: str, default: float) -> float:
    return float(_env(name, str(default)))


BROKEN = _env("CHAOS_BROKEN", "") == "1"

app = Celery("chaos", broker=_env("CHAOS_BROKER", "redis://127.0.0.1:6379/0"),
             backend=_env("CHAOS_BACKEND", "redis://127.0.0.1:6379/1"))
app.conf.update(
    singleton_redis_url=_env("CHAOS_LOCK", "redis://127.0.0.1:6379/2"),
    singleton_key_prefix=_env("CHAOS_PREFIX", "chaos"),
    singleton_lock_ttl=_float("CHAOS_LOCK_TTL", 4.0),
    singleton_liveness_ttl=_float("CHAOS_LIVENESS_TTL", 2.0),
    singleton_retry_backoff_max=1.0,
    singleton_beat_pending_lease=_float("CHAOS_PENDING_LEASE", 2.0),
    singleton_wait_replicas=int(_env("CHAOS_WAIT_REPLICAS", "0")),
    singleton_wait_timeout=0.5,  # below the socket timeout
    singleton_redis_options={"socket_timeout": 1.0, "socket_connect_timeout": 1.0},
    broker_transport_options={
        "visibility_timeout": _float("CHAOS_VISIBILITY", 12.0),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu takes a mutex (a Redis lock) to restore unacknowledged messages, for 300 s by
        # default: a worker SIGKILLed while it held it stops every restore until it expires.
        "unacked_mutex_expire": 10,
        **({"master_name": os.environ["CHAOS_MASTER"]} if os.environ.get("CHAOS_MASTER") else {}),
    },
    result_backend_transport_options=(
        {"master_name": os.environ["CHAOS_MASTER"]} if os.environ.get("CHAOS_MASTER") else {}),
    task_default_queue="chaos",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_track_started=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    result_backend_always_retry=True,
    result_backend_max_retries=30,
    result_expires=3600,
    worker_hijack_root_logger=True,
    beat_max_loop_interval=1.0,
    beat_scheduler="celery_singleton_beat.beat:SingletonScheduler",
)


def _schedule(spec: dict[str, Any]) -> Any:
    if "cron" in spec:
        minute, hour, day_of_month, month, day_of_week = spec["cron"].split()
        return crontab(minute, hour, day_of_week, day_of_month, month)
    return float(spec["every"])


app.conf.beat_schedule = {
    name: {"task": "harness.chaos.app.work", "schedule": _schedule(spec),
           "args": [spec["key"], spec["seconds"]], "kwargs": {"note": "beat"}}
    for name, spec in BEAT_ENTRIES.items()
}


def _broken_identity(*args: Any, **kwargs: Any) -> str:
    """The control run's ``unique_on``: a new identity per call, so no run excludes another.

    Takes anything: Celery binds a function given as a task attribute to the task,
    so it may be called with the task first.
    """
    return uuid.uuid4().hex


def record(ev: str, **fields: Any) -> None:
    """Write one history event of this process (nothing outside a chaos run)."""
    rec = recorder()
    if rec is not None:
        rec(ev, **fields)


def _slot_of(request: Any) -> dict[str, Any]:
    slot = getattr(request, SLOT_HEADER, None)
    if slot is None:
        return {}
    return {"slot": slot, "entry": getattr(request, ENTRY_HEADER, None),
            "instance": getattr(request, INSTANCE_HEADER, None)}


@app.task(shared=False, bind=True, base=SingletonTask, unique_on=_broken_identity if BROKEN else ["key"])  # type: ignore[untyped-decorator]
def work(self: SingletonTask, key: str, seconds: float, note: str | None = None) -> str:
    """A run of ``key`` lasting ``seconds``, checking its lease before each step."""
    run = self.singleton_run
    request = self.request
    record("start", id=request.id, key=key, fence=run.fence, node=request.hostname, note=note,
           retries=request.retries or 0, redelivered=bool((request.delivery_info or {}).get("redelivered")),
           **_slot_of(request))
    deadline = time.monotonic() + seconds
    try:
        while True:
            m0 = time.monotonic()
            try:
                run.ensure_held()
            except LockLost as lost:
                record("chk", id=request.id, key=key, m0=m0, ok=False, why=str(lost)[:160])
                record("end", id=request.id, key=key, how="lost")
                return "lost"
            record("chk", id=request.id, key=key, m0=m0, ok=True)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(STEP, remaining))
    except BaseException as exc:
        record("end", id=request.id, key=key, how=f"error:{type(exc).__name__}")
        raise
    record("end", id=request.id, key=key, how="done")
    return "done"


# ------------------------------------------------------------------ signals


def _ours(task: Any) -> bool:
    return bool(getattr(task, "name", None) == work.name)


def _key_of(args: Any, kwargs: Any) -> str | None:
    if args:
        return str(args[0])
    return str(kwargs["key"]) if kwargs and "key" in kwargs else None


@signals.task_prerun.connect(weak=False)  # type: ignore[untyped-decorator]
def _prerun(task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    if _ours(task):
        record("prerun", id=task_id, key=_key_of(args, kwargs), retries=task.request.retries or 0,
               **_slot_of(task.request))


def outcome_kind(state: str | None, retval: Any) -> str:
    """What a postrun's state and return value mean for the submission."""
    if state == "SUCCESS":
        return "success"
    if state == "IGNORED":
        if hasattr(retval, "skipped"):  # the library's skip (an Ignore carrying TaskSkipped)
            return "skipped"
        text = str(retval)
        if "already completed" in text:
            return "completed-copy"
        if "still running" in text:
            return "waiting"
        return "ignored"
    return {"FAILURE": "failure", "RETRY": "retry", "REVOKED": "revoked"}.get(state or "", str(state).lower())


@signals.task_postrun.connect(weak=False)  # type: ignore[untyped-decorator]
def _postrun(task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None,
             retval: Any = None, state: str | None = None, **_: Any) -> None:
    if _ours(task):
        record("outcome", id=task_id, key=_key_of(args, kwargs), state=state, kind=outcome_kind(state, retval),
               why=None if state == "SUCCESS" else f"{type(retval).__name__}: {retval}"[:200],
               **_slot_of(task.request))


@signals.task_revoked.connect(weak=False)  # type: ignore[untyped-decorator]
def _revoked(sender: Any = None, request: Any = None, terminated: bool = False, signum: Any = None,
             expired: bool = False, **_: Any) -> None:
    if _ours(sender):
        record("revoked", id=getattr(request, "id", None), terminated=bool(terminated),
               signum=None if signum is None else int(signum), expired=bool(expired))


@signals.worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
def _worker_up(sender: Any = None, **_: Any) -> None:
    record("worker-up", node=getattr(sender, "hostname", None), boot=boot_id())


@signals.worker_process_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _child_up(**_: Any) -> None:
    record("child-up", boot=boot_id())


class _WindowWaits(logging.Handler):
    """A beat's slot that waits for the lock Redis's recovery window (its INFO line) as a
    ``slot-window`` event: after the window an entry due more often than it sends only
    its latest slot (the guarantees), which the checker needs to tell from a lost slot."""

    def emit(self, record_: logging.LogRecord) -> None:
        args = record_.args
        if (record_.msg == "beat: %s: slot %s waits: %s" and isinstance(args, tuple) and len(args) == 3
                and "recovery window" in str(args[2])):
            record("slot-window", entry=str(args[0]), slot=str(args[1]))


@signals.beat_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _beat_up(**_: Any) -> None:
    logging.getLogger("celery_singleton_beat").addHandler(_WindowWaits(logging.INFO))
    record("beat-up")


#: When each publish in flight in this process began (task id -> monotonic time).
_publishing: dict[str, float] = {}


@signals.before_task_publish.connect(weak=False)  # type: ignore[untyped-decorator]
def _publishing_starts(sender: Any = None, headers: Any = None, **_: Any) -> None:
    if sender == work.name and headers and headers.get("id"):
        _publishing[str(headers["id"])] = time.monotonic()


@signals.after_task_publish.connect(weak=False)  # type: ignore[untyped-decorator]
def _published(sender: Any = None, headers: Any = None, **_: Any) -> None:
    headers = headers or {}
    if sender != work.name:
        return
    began = _publishing.pop(str(headers.get("id")), None)
    if SLOT_HEADER in headers:
        record("sent", id=headers.get("id"), slot=headers[SLOT_HEADER], entry=headers.get(ENTRY_HEADER),
               instance=headers.get(INSTANCE_HEADER))
    else:
        # m0: the publish began (the message may reach the broker, and a worker, before ``m``)
        record("pub", id=headers.get("id"), retries=headers.get("retries"),
               **({} if began is None else {"m0": began}))
