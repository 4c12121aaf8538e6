"""How the scheduler mixin stops: claims settled at close, a stop signal never lost.

``celery beat``'s stop handler (SIGTERM, SIGINT) closes the scheduler and raises
``SystemExit`` wherever the main thread is. Both can land in the wrong place:
the close in the middle of a tick (it is put off until the tick unwound), the
``SystemExit`` in a finalizer, where Python ignores it (the tick stops at its
end instead). A clean close marks what was sent and hands back what was claimed
but not sent; at the end of a ``celery beat`` process it also keeps a second
stop signal from killing the beat while the interpreter exits.

:class:`CleanStop` is a base of
:class:`~celery_singleton_beat.beat.scheduler.SingletonSchedulerMixin`, which
sets the state used here in its ``__init__`` and calls :meth:`CleanStop._stop_if_requested`
around each ``tick``.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

import redis
from celery import signals

from ..log import logger
from .claiming import ClaimRounds

__all__ = ["CleanStop"]

if TYPE_CHECKING:  # pragma: no cover
    from celery.beat import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class CleanStop(ClaimRounds, _SchedulerBase):
    """The close and stop path (see the module docstring); a base of the mixin."""

    #: The thread inside :meth:`.scheduler.SingletonSchedulerMixin.tick`, if any (see :meth:`close`).
    _ticking_in: int | None = None
    # Set by SingletonSchedulerMixin.__init__.
    _fatal: int | None  # an exit code to raise at the end of close (see .probing)
    _ends_process: bool  # see _own_stop_signals
    _stop_requested: bool  # see close and _stop_if_requested

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

    def close(self) -> None:
        """Clean stop: mark what was sent, hand back what was claimed but not sent.

        Not while this thread is inside :meth:`.scheduler.SingletonSchedulerMixin.tick`: that is ``celery beat``'s
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
    if (isinstance(scheduler, CleanStop)
            and threading.current_thread() is threading.main_thread()
            and callable(handler) and handler is not signal.default_int_handler):
        scheduler._ends_process = True
        _quiet_lost_stops(scheduler)


def _quiet_lost_stops(scheduler: CleanStop) -> None:
    """Say in one line, not a traceback, that the stop handler's ``SystemExit`` was lost in a
    finalizer (Python reports it through ``sys.unraisablehook``, "Exception ignored in"): the
    scheduler stops at the end of its tick (see
    :meth:`~celery_singleton_beat.beat.scheduler.SingletonSchedulerMixin.tick`)."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit) and scheduler._stop_requested:
            logger.info("beat: the stop signal arrived inside a finalizer (%r); stopping after this tick",
                        unraisable.object)
            return
        previous(unraisable)

    sys.unraisablehook = hook
