"""django-celery-beat's ``DatabaseScheduler``, active-active: one send per slot.

Install with ``pip install 'celery-singleton-beat[django]'`` and run every
beat with::

    celery -A proj beat -S celery_singleton_beat.contrib.django:SingletonDatabaseScheduler

(or ``CELERY_BEAT_SCHEDULER`` / ``beat_scheduler`` set to that path). The
schedule stays in the database and is edited as usual (admin, ORM); each beat
re-reads it when ``PeriodicTasks.last_update`` changes, and every slot is
claimed in Redis exactly as with ``SingletonScheduler``. See ``docs/django.md``.

Importing this module needs Django set up (``django.setup()`` or Celery's
Django fix-up), as importing ``django_celery_beat.schedulers`` does.

What this class adds to ``SingletonSchedulerMixin`` + ``DatabaseScheduler``:

* a row saved while the beat starts is not missed (django-celery-beat looks
  at its change marker only after its first read of the rows and its own
  writes), and any move of the marker counts, not only a later timestamp
  (clock skew between the machines that save rows);
* ``schedules_equal`` honours ``DatabaseScheduler``'s "heap invalidated" flag
  before the mixin's once-per-burst shortcut: otherwise a database change seen
  during a burst leaves Celery with the empty heap ``DatabaseScheduler`` put in
  place, and the beat sends nothing until ``beat_max_loop_interval`` later;
* when the database gives an entry a new schedule, the entry's last handled
  slot is re-anchored on the new schedule (an interval entry's next slot is the
  next multiple of the *new* period, on time); an entry that comes back
  (enabled again) has the slots it missed handled by the start-up rule
  (``singleton_beat_catch_up``), as a beat started then would;
* no database read or write between claims won ahead in a burst and their
  publish (django-celery-beat syncs after sends and checks for changes on
  every tick): a beat killed there would hold those slots unsent;
* the per-entry ``singleton`` option, which a database row has no field for,
  is read from the task's ``headers`` JSON (``{"singleton": false}``) and
  taken out of the headers actually sent.
"""

from __future__ import annotations

from typing import Any

try:
    from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    if (exc.name or "").split(".")[0] in ("django", "django_celery_beat", "timezone_field"):
        raise ImportError(
            "celery_singleton_beat.contrib.django needs django-celery-beat: "
            "pip install 'celery-singleton-beat[django]'"
        ) from exc
    raise

from celery_singleton_beat import SingletonSchedulerMixin
from celery_singleton_beat.beat.following import ScheduleFollower

__all__ = ["HEADER_OPTION", "SingletonDatabaseScheduler", "SingletonModelEntry"]

#: Key of ``PeriodicTask.headers`` read as the entry's ``singleton`` option
#: (``true``, ``false`` or ``{"key": ..., "include_args": ...}``); not sent.
HEADER_OPTION = "singleton"

_ABSENT = object()


class SingletonModelEntry(ModelEntry):
    """A ``PeriodicTask`` row as a beat entry, with its ``singleton`` option.

    The option lives in the row's ``headers`` JSON under ``"singleton"``: it is
    moved to ``options["singleton"]`` (what the scheduler mixin reads) and is
    not part of the message headers. Entries given in ``beat_schedule`` with
    ``options={"singleton": ...}`` are stored that way too (django-celery-beat
    would otherwise drop the option when it writes the row).
    """

    def __init__(self, model: Any, app: Any = None) -> None:
        super().__init__(model, app=app)
        headers = dict(self.options.get("headers") or {})
        option = headers.pop(HEADER_OPTION, _ABSENT)
        if option is not _ABSENT:
            self.options["headers"] = headers
            self.options[HEADER_OPTION] = option

    @classmethod
    def _unpack_options(cls, headers: Any = None, **options: Any) -> dict[str, Any]:
        option = options.pop(HEADER_OPTION, _ABSENT)
        if option is not _ABSENT:
            headers = {**(headers or {}), HEADER_OPTION: option}
        fields: dict[str, Any] = super()._unpack_options(headers=headers, **options)
        return fields


class SingletonDatabaseScheduler(ScheduleFollower, SingletonSchedulerMixin, DatabaseScheduler):
    """django-celery-beat's database scheduler, sending each slot from one beat only.

    Run as many beats on one database as you like; they share the schedule
    (database) and the slot claims (Redis, ``singleton_redis_url``).

    The database columns ``last_run_at`` and ``total_run_count`` are written as
    django-celery-beat writes them, by every beat (each counts the slots it
    handled, sent or not, and the last write wins): they are informational.
    Slots never depend on them; the claims history in Redis (``celery
    singleton slots``) says which beat sent which slot.
    """

    Entry = SingletonModelEntry

    def should_sync(self) -> bool:
        """Write ``last_run_at`` / ``total_run_count`` after a burst, not inside it.

        While slots claimed ahead for the other due entries are not sent yet,
        a database write (a commit, an fsync, a lock wait on SQLite) would sit
        between their claims and their publish: a beat that dies there loses
        them until the claims expire. The write happens after the burst.
        """
        if self.claims_in_flight:
            return False
        return bool(super().should_sync())

    def schedule_changed(self) -> bool:
        """Any move of the change marker counts, not only a later timestamp.

        django-celery-beat compares with ``>`` against the value it saw last,
        and sees none before its first check, which comes after its first read
        of the rows and its own start-up writes: a row saved by someone else in
        between was not read until the next full read, 5 minutes later. The
        marker is also written with the clock of whoever saved a row, so a
        write from a machine whose clock is behind was missed too. Here the
        first check always re-reads the rows, and any new value is a change.
        """
        if self.claims_in_flight:
            # Slots claimed ahead are not sent yet: read the database after the burst
            # (a few milliseconds later), not between their claims and their publish.
            return False
        last = self._last_timestamp
        changed = bool(super().schedule_changed())
        return changed or self._last_timestamp != last

    def schedules_equal(self, old_schedules: Any, new_schedules: Any) -> bool:
        """A re-read of the database always rebuilds the heap, even in a burst."""
        if getattr(self, "_heap_invalidated", False):
            self._heap_invalidated = False
            return False
        return super().schedules_equal(old_schedules, new_schedules)

    @property
    def info(self) -> str:
        line = "    . schedule -> django-celery-beat database (re-read on changes)"
        return f"{super().info}\n{line}"
