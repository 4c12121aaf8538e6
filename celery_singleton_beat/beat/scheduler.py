"""The scheduler mixin: Celery's ``Scheduler`` hooks wired to slots and claims.

Every beat instance runs the whole schedule. When an entry comes due, the
instance works out the entry's slot (:mod:`.slots`) and claims it in Redis
(:mod:`.claims`) before sending; only the winner sends, with a task id derived
from the slot. A claim is ``pending`` until the winner marks it ``sent``; the
beats that lost it look again when the pending lease would have ended and send
what a dead (or stopped) winner did not (:mod:`.handover`). Workers execute a
slot's first delivery only (:mod:`celery_singleton_beat.task.slot_delivery`).

Local schedule state (``last_run_at`` in the shelve file) never decides: a beat
that starts sets each entry's ``last_run_at`` from the slots (see
``singleton_beat_catch_up``), and Redis claims decide who sends.
See ``docs/beat.md`` for the full rules.

The mixin's parts: :mod:`.anchoring` (the start-up rule), :mod:`.sending`
(reserve, claim, send), :mod:`.claiming` (the Redis round trips: claims,
marks, hand-backs, take-overs), :mod:`.probing` (the claims Redis server looked
at between ticks), :mod:`.holding` (entries held back, moved down the heap),
:mod:`.stopping` (close and the stop signals); this module holds Celery's
set-up, timing and tick hooks.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
import weakref
from datetime import datetime, timedelta
from typing import Any

from celery import schedules
from celery.exceptions import ImproperlyConfigured

from ..config import SingletonSettings, get_settings
from ..connection.url import sanitize_redis_url
from ..log import logger
from ..recovery.lock_redis import get_redis
from ..recovery.startup import StartupCheck, refuse_to_start
from .anchoring import Provisional, SlotAnchoring
from .breaker import Breaker
from .claims import Claim, ClaimStore
from .entries import ENTRY_OPTION, SlotSpec, entry_spec
from .handover import Handover
from .holding import CELERY_REHEAPS, HoldBack
from .probing import ServerProbing
from .records import REFRESH, EntryRecords
from .sending import Reservation, SlotSending
from .slots import SlotError, current_slot, interval_slot, to_utc
from .stopping import CleanStop

__all__ = ["SingletonSchedulerMixin"]

#: Per app: the instance id a lazy scheduler (the one Celery builds only to print
#: its start-up banner) showed, and in which process, for the scheduler that runs.
_BANNER_IDS: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()


def _instance_id(app: Any, lazy: bool) -> str:
    """Host, pid and a random suffix; the running scheduler reuses the id its banner showed."""
    pid = os.getpid()
    shown = _BANNER_IDS.pop(app, None)
    if shown is not None and shown[0] == pid and not lazy:
        return shown[1]
    instance = f"{socket.gethostname()}:{pid}:{secrets.token_hex(3)}"
    if lazy:
        _BANNER_IDS[app] = (pid, instance)
    return instance


class SingletonSchedulerMixin(SlotAnchoring, SlotSending, ServerProbing, HoldBack, CleanStop):
    """Claim each due entry's slot in Redis; send only the slots this beat won.

    Mix it in front of any :class:`celery.beat.Scheduler` subclass::

        class Scheduler(SingletonSchedulerMixin, DatabaseScheduler): ...

    It wraps the points every scheduler goes through: ``is_due`` (an entry's
    ``last_run_at`` is set from its slots before the schedule is asked, so
    interval entries stay on epoch-aligned instants), ``reserve`` (the slot is
    chosen), ``apply_entry`` / ``apply_async`` (claimed, then sent or skipped),
    ``populate_heap`` / ``tick`` (batched claims, marks, take-overs, back-off)
    and ``close`` (unsent claims handed back).
    """

    #: Claims sent to Redis in one pipeline when many entries are due at once.
    claim_batch_size: int = 1000
    #: Records kept in the ``<prefix>:{beat}:history`` list.
    history_size: int = 1000
    #: Back-off (seconds) after Redis failed, doubling up to the maximum.
    redis_retry_min: float = 1.0
    redis_retry_max: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs["app"] if "app" in kwargs else args[0]
        try:
            self.singleton_settings: SingletonSettings = get_settings(app)
        except ImproperlyConfigured as exc:
            if kwargs.get("lazy"):  # `celery beat`'s banner, its first scheduler: exit 78 with one line
                refuse_to_start("beat", f"invalid configuration: {exc}")
            raise  # a scheduler built by other code gets the exception
        settings = self.singleton_settings
        #: Who this beat is in claims, logs and its start-up banner: host, pid and a random suffix.
        self.instance_id: str = _instance_id(app, bool(kwargs.get("lazy", False)))
        self.claims = ClaimStore(
            lambda: get_redis(app), settings.key_prefix, self.instance_id,
            margin=timedelta(seconds=max(settings.beat_claim_margin, 3 * settings.beat_pending_lease)),
            wait_replicas=settings.wait_replicas, wait_timeout=settings.wait_timeout,
            stats=settings.stats, history_size=self.history_size)
        self.records = EntryRecords(lambda: get_redis(app), settings.key_prefix,
                                    settings.beat_catch_up_window)
        self.handover = Handover(settings.beat_pending_lease)
        self.breaker = Breaker(settings.beat_fails_open, self.redis_retry_min, self.redis_retry_max)
        # Per entry name: the latest slot this instance handled (sent, skipped or
        # given up); it is the value given to the entry's last_run_at.
        self._handled: dict[str, datetime] = {}
        # Per entry name: the latest real slot instant chosen (a search hint).
        self._hints: dict[str, datetime] = {}
        self._reserved: dict[str, Reservation] = {}
        # Start-up rule state (see anchoring.py): since when entries are scheduled.
        self._since: dict[str, datetime] = {}
        self._provisional: dict[str, Provisional] = {}
        self._unknown: dict[str, datetime] = {}
        self._records_due = time.monotonic() + REFRESH.total_seconds()
        self._renewing: list[Any] = []
        self._new_entries: list[str] = []
        # Claims won ahead for other due entries, and when (monotonic) they were won.
        self._prefetched: dict[str, tuple[Claim, float]] = {}
        self._sending: tuple[Claim, float] | None = None
        # Entries to move down the heap at the end of this tick: name -> seconds from now.
        self._reheap: dict[str, float] = {}
        # Set by reserve within a tick: the entry Celery pushes back on the heap after
        # its send, and the heap time of its next slot (see _when).
        self._next_look: tuple[Any, float] | None = None
        # True while consecutive ticks send due entries (a burst), see schedules_equal.
        self._in_burst = False
        self._burst_compared = False
        # The claims Redis at start; after an outage there, checked again from tick.
        self._server_check = StartupCheck(f"beat {self.instance_id}", lambda: get_redis(app), settings)
        self._fatal: int | None = None
        # Set by _own_stop_signals: this scheduler's close() is the end of a `celery beat` process.
        self._ends_process = False
        # Set when a stop was asked for (see close): the next tick, or the end of this one, stops.
        self._stop_requested = False
        super().__init__(*args, **kwargs)

    # ----------------------------------------------------------------- set-up

    def setup_schedule(self) -> None:
        super().setup_schedule()
        self._check_entries()
        settings = self.singleton_settings
        server = self._server_check.run(  # exits 78 if unusable
            "due slots are " + ("sent unclaimed" if settings.beat_fails_open else "not sent") + " until it answers")
        logger.info(
            "beat: singleton scheduler %s: catch-up %s, %s, pending lease %.1fs, claims in %s",
            self.instance_id, settings.beat_catch_up,
            "fail open" if settings.beat_fails_open else "fail closed",
            settings.beat_pending_lease,
            server.describe() if server else sanitize_redis_url(settings.redis_url),
        )

    def _check_entries(self) -> None:
        """Reject entries whose singleton option or schedule cannot work (at beat start)."""
        now = self._now()
        for entry in list(self.schedule.values()):
            try:
                if entry_spec(entry) is not None:
                    current_slot(entry.schedule, now)
            except SlotError as exc:
                raise ImproperlyConfigured(
                    f"beat entry {entry.name!r}: {exc} (set options={{'{ENTRY_OPTION}': False}} "
                    "to send it from every beat without a claim)"
                ) from exc
            except ValueError as exc:
                raise ImproperlyConfigured(f"beat entry {entry.name!r}: {exc}") from exc

    @property
    def info(self) -> str:
        settings = self.singleton_settings
        line = (
            f"    . singleton -> {sanitize_redis_url(settings.redis_url)} ({settings.topology}) "
            f"prefix={settings.key_prefix} instance={self.instance_id} "
            f"catch-up={settings.beat_catch_up} "
            f"{'fail-open' if settings.beat_fails_open else 'fail-closed'}"
        )
        base = super().info
        return f"{base}\n{line}" if base else line

    # ----------------------------------------------------------------- for schedulers built on the mixin

    @property
    def claims_in_flight(self) -> bool:
        """True while slots claimed ahead in a burst are not sent yet.

        A scheduler built on the mixin should not do slow work (a database
        write or re-read) then: it would sit between those claims and their publish.
        """
        return bool(self._prefetched)

    # ----------------------------------------------------------------- timing

    def _now(self) -> datetime:
        """The scheduler's clock (``app.now()``), in UTC."""
        return to_utc(self.app.now())

    def _spec(self, entry: Any) -> SlotSpec | None:
        try:
            return entry_spec(entry)
        except ValueError:
            # Reported (and the send refused) when the entry is applied.
            return SlotSpec(entry.name)

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        entries = [entry for entry in self.schedule.values() if self._spec(entry) is not None]
        self._sight(entry for entry in entries if entry.name not in self._handled)
        for entry in entries:
            self._normalize(entry)
        if self._new_entries:
            new, self._new_entries = self._new_entries, []
            logger.info("beat: %d entr%s scheduled for the first time (%s%s): slots before now are "
                        "not sent, as with Celery's own scheduler", len(new),
                        "y" if len(new) == 1 else "ies", ", ".join(new[:5]),
                        f", +{len(new) - 5} more" if len(new) > 5 else "")
        super().populate_heap(*args, **kwargs)

    def is_due(self, entry: Any) -> Any:
        if self._spec(entry) is None:
            return super().is_due(entry)
        self._normalize(entry)
        state = super().is_due(entry)
        if not state[0]:
            if not CELERY_REHEAPS:
                self._hold_back_top(entry, state[1])
            return state
        if self.breaker.is_open() and not self.singleton_settings.beat_fails_open:
            self._report_blocked(entry)
            wait = self.breaker.remaining()
            self._reheap[entry.name] = wait  # to the end of the back-off in the heap (see tick)
            return schedules.schedstate(False, wait)
        if isinstance(entry.schedule, schedules.schedule):
            # Celery would check again one period after *now*, drifting off the
            # aligned instants; check again at the next aligned instant instead.
            now = self._now()
            following = interval_slot(entry.schedule.run_every, now).next
            assert following is not None
            return schedules.schedstate(True, max((following - now).total_seconds(), 0.0))
        return state

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One tick, which a stop asked for ends, before it or at its end (see :mod:`.stopping`)."""
        self._stop_if_requested()
        self._ticking_in = threading.get_ident()
        try:
            delay = self._tick(*args, **kwargs)
        finally:
            self._ticking_in = None
        self._stop_if_requested()
        return delay

    def _tick(self, *args: Any, **kwargs: Any) -> float:
        self._next_look = None  # set by a reserve within this tick only
        self._look_at_server()
        if not self.breaker.is_open():
            self.settle()
            self._renew_records(time.monotonic())
        delay = super().tick(*args, **kwargs)
        if self._reheap:
            delay = min(delay, self._move_down_heap())
        self._in_burst = delay <= 0
        if not self._in_burst:
            self._burst_compared = False
            if self._prefetched:
                # The burst of due entries is over: hand back claims won ahead
                # for entries that did not come due after all.
                self._hand_back_prefetched()
        now = time.monotonic()
        if not self.breaker.is_open():
            self._take_over_due(now)
            if self.handover.marks_due(now):
                self._mark_sent()
        wake = self._server_wake(self.handover.next_wake(time.monotonic()))
        return float(delay) if wake is None else min(float(delay), wake)

    def schedules_equal(self, old_schedules: Any, new_schedules: Any) -> bool:
        """Compare the schedule with its copy once per burst, not once per tick.

        Celery's ``tick`` compares every entry on every tick and sends one due
        entry per tick, so a burst of n due entries costs O(n^2) comparisons
        (minutes for 10,000 entries). Within a burst (ticks that return 0) the
        comparison made at its start stands; changes are picked up when the
        burst ends, at most a few seconds later.
        """
        if (self._in_burst and self._burst_compared and old_schedules is not None
                and new_schedules is not None and len(old_schedules) == len(new_schedules)):
            return True
        equal = bool(super().schedules_equal(old_schedules, new_schedules))
        self._burst_compared = equal
        return equal
