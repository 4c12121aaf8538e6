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
marks, hand-backs, take-overs); this module holds Celery's set-up, timing and
tick hooks and the back-off while Redis is down.
"""

from __future__ import annotations

import heapq
import os
import secrets
import signal
import socket
import sys
import threading
import time
import weakref
from datetime import datetime, timedelta
from typing import Any

import celery
import redis
from celery import schedules, signals
from celery.exceptions import ImproperlyConfigured

from ..config import SingletonSettings, get_settings
from ..connection.sentinel import FOLLOW_EVERY
from ..connection.url import sanitize_redis_url
from ..log import logger
from ..recovery.lock_redis import get_redis
from ..recovery.startup import EX_CONFIG, LockRedisUnusable, StartupCheck, refuse_to_start
from .anchoring import Provisional, SlotAnchoring
from .breaker import Breaker
from .claims import Claim, ClaimStore
from .entries import ENTRY_OPTION, SlotSpec, entry_spec
from .handover import Handover
from .records import REFRESH, EntryRecords
from .sending import Reservation, SlotSending
from .slots import SlotError, current_slot, interval_slot, to_utc

__all__ = ["SingletonSchedulerMixin"]

#: Celery 5.7+ moves an entry that is not due after all down the heap (celery/celery#7649).
CELERY_REHEAPS: bool = tuple(int(part) for part in celery.__version__.split(".")[:2]) >= (5, 7)

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


class SingletonSchedulerMixin(SlotAnchoring, SlotSending):
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
    #: The thread inside :meth:`tick`, if any (see :meth:`close`).
    _ticking_in: int | None = None

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

    def _check_server_again(self) -> None:
        """After an outage at start: a server that answers but cannot be used stops beat.

        Exit code 78, through :meth:`close` (Celery's beat loop turns the
        ``SystemExit`` raised here into a clean stop, then closes the scheduler).
        A server that answers and can be used ends the Redis back-off at once: the
        back-off doubled through the outage (16 s after 15 s), and a beat that waited
        out its rest sent nothing for that long while Redis answered, as did every
        beat that started in the same outage (their back-offs run in step).
        """
        try:
            server = self._server_check.poll()
        except LockRedisUnusable:
            self._fatal = EX_CONFIG
            raise SystemExit(EX_CONFIG) from None
        if server is not None and self.breaker.is_open():
            self.breaker.ok()
            # Entries held back for the back-off sit in the heap at its end: build the
            # heap again from their own next instants (the due ones come first).
            self._heap = None

    def _probe_claims_redis(self) -> None:
        """While the Redis back-off runs (fail closed): a server that answers ends it at once,
        and the entries held back to its end come due again (see :meth:`_check_server_again`)."""
        try:
            self.claims.client.ping()
        except redis.RedisError:
            return  # still down: the back-off goes on, not doubled by a look
        self.breaker.ok()
        self._heap = None

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
        self._stop_if_requested()
        self._ticking_in = threading.get_ident()
        try:
            delay = self._tick(*args, **kwargs)
        finally:
            self._ticking_in = None
        self._stop_if_requested()
        return delay

    def _stop_if_requested(self) -> None:
        """Raise the ``SystemExit`` of a stop asked for that never reached beat's loop.

        ``celery beat``'s stop handler closes the scheduler and raises ``SystemExit``
        wherever the main thread is. When that is a finalizer (a ``__del__``, such as
        Celery's ``AsyncResult.__del__`` right after each publish, or a weakref
        callback), Python ignores the exception: the handler's only trace is the close
        it asked for, and the beat ran on, sending every slot, until killed.
        """
        if self._stop_requested:
            raise SystemExit()

    def _tick(self, *args: Any, **kwargs: Any) -> float:
        self._next_look = None  # set by a reserve within this tick only
        if self._server_check.pending:
            self._check_server_again()
        elif self.breaker.probe_due():
            self._probe_claims_redis()
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
        wake = self.handover.next_wake(time.monotonic())
        follow = self._follow_server()
        if follow is not None:
            wake = follow if wake is None else min(wake, follow)
        if self._server_check.pending:
            wake = min(wake, self._server_check.wait()) if wake is not None else self._server_check.wait()
        probe = self.breaker.next_probe_in()
        if probe is not None:
            wake = probe if wake is None else min(wake, probe)
        return float(delay) if wake is None else min(float(delay), wake)

    def _follow_server(self) -> float | None:
        """While claims this beat wrote recently could still be taken over by another beat
        (within a pending lease), look at the server every :data:`.sentinel.FOLLOW_EVERY`
        seconds: a failover or restart that lost them is then found, and they are
        written back, before another beat could take them over. Seconds until the next look."""
        lease = self.singleton_settings.beat_pending_lease
        if self.breaker.is_open() or not self.claims.kept.written_within(lease):
            return None
        wait = self.claims.reached + FOLLOW_EVERY - time.monotonic()
        if wait <= 0:
            try:
                self.claims.reach()
            except redis.RedisError as exc:
                logger.debug("beat: could not look at the claims Redis: %s", exc)
            wait = FOLLOW_EVERY
        return wait

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

    def close(self) -> None:
        """Clean stop: mark what was sent, hand back what was claimed but not sent.

        Not while this thread is inside :meth:`tick`: that is ``celery beat``'s
        SIGTERM/SIGINT handler, which closes the scheduler and then raises
        ``SystemExit``, run in the middle of whatever the tick was doing. Closing
        there would release connections the interrupted code is reading from (the
        broker's, during a publish: redis-py then raises "I/O operation on closed
        file" in place of the ``SystemExit``, and beat logs the entry as not
        applied and runs on). The ``SystemExit`` unwinds the tick, and beat's
        service closes the scheduler again on its way out.
        """
        if self._ticking_in == threading.get_ident():
            self._stop_requested = True  # the tick stops at its end if the SystemExit is lost
            return
        try:
            self._hand_back_prefetched()
            self._mark_sent()
        except redis.RedisError as exc:  # the pending lease covers it
            logger.warning("beat: could not settle claims at stop (others take them over): %s", exc)
        super().close()
        if self._ends_process and threading.current_thread() is threading.main_thread():
            # Nothing is left but the interpreter's exit. Python gives its handled signals
            # back to their default action as it tears down, so a second SIGTERM/SIGINT
            # (a rolling deploy, a supervisor, Ctrl-C twice) arriving then killed the beat
            # by the signal. Ignored signals stay ignored: the exit code stays 0 (or 78).
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_IGN)
            self._stop_requested = True  # a tick after this close stops (a SystemExit lost)
        if self._fatal is not None:  # raised again after the schedule was saved: exit code 78
            raise SystemExit(self._fatal)

    # ----------------------------------------------------------------- Redis trouble

    def _report_blocked(self, entry: Any) -> None:
        try:
            slot = current_slot(entry.schedule, self._now(), self._hints.get(entry.name))
        except SlotError:
            return
        if slot is not None:
            self.breaker.report_unsent(entry.name, slot, "Redis unavailable, waiting to try again")

    def _hold_back_top(self, entry: Any, wait: float) -> None:
        """Move ``entry`` to its next check if it sits on top of the heap, past its time.

        Its heap time can be out of date: the start-up rule decided, once Redis
        answered, that its missed slot was not missed after all. Celery 5.7
        moves such an entry down the heap itself; before, it stayed on top and
        held back every entry behind it until it came due (celery/celery#7649).
        """
        heap = getattr(self, "_heap", None)
        if heap and heap[0][2] is entry and heap[0][0] <= self._now().timestamp():
            self._reheap[entry.name] = max(float(wait), 0.0)

    def _move_down_heap(self) -> float:
        """Give the entries in ``_reheap`` their new time in the heap.

        An entry whose claim failed, or that ``is_due`` held back for the Redis
        back-off, comes back at the end of the back-off rather than at its next
        instant; Celery before 5.7 would leave an entry held back on top of the
        heap, where it kept every entry behind it (opted-out ones included) from
        being sent. Returns how long beat may sleep: 0 when another entry is due now.
        """
        moves, self._reheap = self._reheap, {}
        delay = min(moves.values())
        heap = getattr(self, "_heap", None)
        if isinstance(heap, list) and heap:
            now = self._now().timestamp()  # heap times follow the scheduler's clock
            top = heap[0]
            if len(moves) == 1 and top[2].name in moves and hasattr(top, "_replace"):
                # The usual case (the entry on top held back): no scan of the whole heap.
                heapq.heapreplace(heap, top._replace(time=now + moves[top[2].name]))
                return 0.0 if heap[0][0] <= now else delay
            changed = False
            for index, event in enumerate(heap):
                wait = moves.get(event[2].name)
                if wait is not None and event[0] != now + wait and hasattr(event, "_replace"):
                    heap[index] = event._replace(time=now + wait)
                    changed = True
            if changed:
                heapq.heapify(heap)
            if heap[0][0] <= now:
                return 0.0
        return delay


@signals.beat_init.connect  # type: ignore[untyped-decorator]  # celery is untyped
def _own_stop_signals(sender: Any = None, **_: Any) -> None:
    """In a ``celery beat`` process, mark its scheduler as the one whose close ends it.

    ``celery beat`` installs its stop handler (a Python function) for SIGTERM and
    SIGINT on the main thread before the service starts; a worker's embedded beat
    (its own process, SIGTERM left to the default action, or a thread) and a
    scheduler driven by other code do not qualify.
    """
    scheduler = getattr(sender, "scheduler", None)
    handler = signal.getsignal(signal.SIGTERM)
    if (isinstance(scheduler, SingletonSchedulerMixin)
            and threading.current_thread() is threading.main_thread()
            and callable(handler) and handler is not signal.default_int_handler):
        scheduler._ends_process = True
        _quiet_lost_stops(scheduler)


def _quiet_lost_stops(scheduler: SingletonSchedulerMixin) -> None:
    """Say in one line, not a traceback, that the stop handler's ``SystemExit`` was lost in a
    finalizer (Python reports it through ``sys.unraisablehook``, "Exception ignored in"): the
    scheduler stops at the end of its tick (see :meth:`SingletonSchedulerMixin.tick`)."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit) and scheduler._stop_requested:
            logger.info("beat: the stop signal arrived inside a finalizer (%r); stopping after this tick",
                        unraisable.object)
            return
        previous(unraisable)

    sys.unraisablehook = hook
