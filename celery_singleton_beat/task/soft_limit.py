"""A soft time limit that reaches a pool process after its run ended is dropped.

A prefork worker's main process times each run; when a run passes its soft time
limit it sends the pool process ``SIGUSR1`` (``revoke(terminate=True,
signal="SIGUSR1")`` sends the same), and billiard's handler raises
:class:`~billiard.exceptions.SoftTimeLimitExceeded` wherever that process is.
The main process's timer fires late when that process is busy or was paused, so
the signal can arrive after the run ended: while the pool process writes the
run's result into the pipe it shares with the main process, or waits for its
next job, or ends. Raised there, the exception

* cuts the result message in two: the main process reads garbage
  (``Unrecoverable error: UnpicklingError``), stops, and its warm shutdown then
  waits for the rest of that message for ever (the worker never exits); or
* ends the pool process (``Pool process ... error: SoftTimeLimitExceeded``) and
  can cut its exit short, before its pending lock releases were sent.

A worker with this library installed raises it only while Celery's tracer runs a
task in that process (the task's body, its handlers, storing its result: as
before), and drops a late one elsewhere, with a warning. One that lands while the
library ends a run (:meth:`.SingletonTask._end`) is held until that is done, then
raised (:func:`raise_held`): raised there, it could come before the run's lease left
the keeper, which then renewed it for as long as the process lived (no later run of
that key), or cut its release short. One that lands while the keeper queues a lease
(the run's own, or a late-answered lock's release) is held the same way and raised
once the run has its lease: raised inside, as the keeper started its thread, it left
the keeper marked running with no thread, and no later lease of that process was
renewed. A held one is never raised in another run: a run that begins, or that fails
to begin for another reason, drops it (:func:`drop_held`).
The handler is billiard's own, replaced where billiard looks it up when it starts a
pool process.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

import billiard.pool
from billiard.exceptions import SoftTimeLimitExceeded
from celery.app import trace

from ..lease.keeper import LeaseKeeper
from ..log import logger

__all__ = ["drop_held", "dropped", "guard_soft_limits", "raise_held"]

#: Celery's tracer: a frame of its ``trace_task`` on the stack means a task is being run.
_TRACER_FILE = trace.__file__
_TRACER_NAME = "trace_task"
#: billiard's handler, as found before it was replaced.
_billiard_handler = billiard.pool.soft_timeout_sighandler
_dropped = 0
#: A soft time limit landed while the library ended a run: raised once that is done.
_held = False
#: The keeper queueing a lease (a run's, or a release to send again): a soft time limit
#: landing in it during a run is held (raised there, as the keeper started its thread, it
#: left the keeper marked running with no thread).
_QUEUEING = LeaseKeeper._add.__code__


def dropped() -> int:
    """Soft time limits this process dropped because no run was being traced."""
    return _dropped


def _ending_code() -> Any:
    """The code of :meth:`.SingletonTask._end` (None before that module is imported: no run
    of a singleton task can be ending then). Looked up, not imported: it imports this module."""
    module = sys.modules.get("celery_singleton_beat.task.task")
    end = getattr(getattr(module, "SingletonTask", None), "_end", None)
    return getattr(end, "__code__", None)


#: Where a soft time limit lands: in a run (raise it), in a part of one it must not cut
#: (hold it), in :func:`raise_held` (raise it, the held one with it), or outside (drop it).
RUN, HOLD, RAISING, OUTSIDE = "run", "hold", "raising", "outside"


def _where(frame: FrameType | None) -> str:
    """Where the frame ``frame`` (the signal's) is, by the frames from it up to Celery's tracer."""
    ending = _ending_code()
    queueing = raising = False
    while frame is not None:
        code = frame.f_code
        if code is ending:
            return HOLD
        queueing = queueing or code is _QUEUEING
        raising = raising or code is _RAISE_HELD
        if code.co_name == _TRACER_NAME and code.co_filename == _TRACER_FILE:
            return RAISING if raising else HOLD if queueing else RUN
        frame = frame.f_back
    return OUTSIDE


def _on_soft_limit(signum: int, frame: FrameType | None) -> None:
    """billiard's handler, raising only inside a run, and once the library ended it."""
    global _held, _dropped
    where = _where(frame)
    if where == RAISING:  # the one held (if any) and this one are one exception
        _held = False
        raise SoftTimeLimitExceeded()
    if where == RUN:
        raise SoftTimeLimitExceeded()
    if where == HOLD:
        _held = True
        return
    _dropped += 1
    logger.warning("a soft time limit (signal %d) reached this pool process after its run had ended: "
                   "dropped (raised here it would corrupt the pool's result pipe)", signum)


def raise_held() -> None:
    """Raise the soft time limit that landed while the library ended a run or queued its
    lease in the keeper, now that it is done (where the signal's own exception would have
    gone, a moment later). A signal landing in here is raised at once, the held one with
    it: never left held for another run."""
    global _held
    if _held:
        _held = False
        raise SoftTimeLimitExceeded()


_RAISE_HELD = raise_held.__code__


def drop_held() -> None:
    """Forget a held soft time limit: its run ends otherwise (another exception), or it is
    left from a run that ended (a new run begins): raised later, it would cut another run."""
    global _held
    _held = False


def guard_soft_limits() -> None:
    """Make pool processes started from now on (and this one, if billiard's handler is
    installed in it) raise a soft time limit only inside a run. Idempotent."""
    billiard.pool.soft_timeout_sighandler = _on_soft_limit
    sig = billiard.pool.SIG_SOFT_TIMEOUT
    if (sig is not None and threading.current_thread() is threading.main_thread()
            and signal.getsignal(sig) is _billiard_handler):
        signal.signal(sig, _on_soft_limit)
