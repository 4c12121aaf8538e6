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
before), and drops a late one elsewhere, with a warning.

Inside a run, the library's own part of it is one protected region: a soft limit that
lands in :meth:`.SingletonTask._begin` or :meth:`~.ReleaseAtEnd._end`, or in anything
they call (the acquire and its reply, the give-back of a late-answered lock, the keeper
queueing a lease or starting its thread, the counters' writer starting), is held and
raised at a safe point (:func:`raise_held`): as ``_begin``'s last call, once the lease
is kept, where a run cut short abandons its lease (released at once); after ``_end``,
once the lock is released. Raised inside, it left state half-made: a lock taken and
never kept nor released (refusing its key until its TTL), a keeper or a counter writer
marked running with no thread (no later lease renewed, no later count written), a lease
renewed for as long as the process lived.

One exception, where nothing is held and a prompt raise matters: the pause of a run
waiting for its lock Redis (:meth:`.OutageWait.after_failure`: sleeping until the next
attempt) raises it at once, and the wait ends on it ("its soft time limit struck"). The
innermost of these frames met from where the signal landed decides: an acquire retried
by that wait is held, and so is the publish of its retry (Celery's ``retry()`` takes any
exception there for a failed publish); a soft limit held by them ends the wait as the
next pause begins (once the retry could not be published), is dropped with the run once
the retry is published, or is raised as the run begins if that acquire got the lock.

A held one is raised in its own run or in none. A run that fails to begin (its lock held
by another: skipped, refused, retried; a delivery already completed; an outage wait that
ended) drops it: that run never ran its body, and its ending is already decided and
recorded (a skip stored, a retry published, a message given back), which a failure would
contradict; so does a run whose body decided its ending (``Retry``, ``Ignore``, ``Reject``)
for one held as it ends. A run that begins drops one left from an earlier run (:func:`drop_held`).
The cost: a soft limit landing while an acquire waits for its reply (a paused or stalled
lock Redis) is raised once the reply comes or the lock client's read timeout passes.

The handler is billiard's own, replaced where billiard looks it up when it starts a
pool process.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import CodeType, FrameType

import billiard.pool
from billiard.exceptions import SoftTimeLimitExceeded
from celery.app import trace

from ..log import logger

__all__ = ["drop_held", "dropped", "guard_soft_limits", "raise_held"]

#: Celery's tracer: a frame of its ``trace_task`` on the stack means a task is being run.
_TRACER_FILE = trace.__file__
_TRACER_NAME = "trace_task"
#: billiard's handler, as found before it was replaced.
_billiard_handler = billiard.pool.soft_timeout_sighandler
_dropped = 0
#: A soft time limit landed in the library's part of a run: raised at its safe point.
_held = False


def dropped() -> int:
    """Soft time limits this process dropped because no run was being traced."""
    return _dropped


#: Where a soft time limit lands: in a run (raise it), in the library's part of one (hold
#: it), in :func:`raise_held` (raise it, the held one with it), or outside (drop it).
RUN, HOLD, RAISING, OUTSIDE = "run", "hold", "raising", "outside"

#: Where each marked method is, by module, class and name, and what a soft limit landing
#: under it (innermost first) is.
_MARKED = (("celery_singleton_beat.task.task", "SingletonTask", "_begin", HOLD),
           ("celery_singleton_beat.task.task", "SingletonTask", "_end", HOLD),
           ("celery_singleton_beat.task.outage", "OutageWait", "after_failure", RUN),
           # Its publish: Celery's ``retry()`` turns any Exception its publish raises into
           # ``Reject`` ("could not publish"), which the wait takes for a failed publish and
           # goes on: the soft limit lost, the body run past it. Held: raised as the pause
           # begins once the publish failed, dropped with the run once it was published.
           ("celery_singleton_beat.task.outage", "OutageWait", "_publish", HOLD))


def _marks() -> dict[CodeType, str]:
    """The code of each marked frame and what it decides. Looked up, not imported (those
    modules import this one); a module not imported yet has no frame on any stack."""
    marks = {_RAISE_HELD: RAISING}
    for module, owner, name, where in _MARKED:
        method = getattr(getattr(sys.modules.get(module), owner, None), name, None)
        code = getattr(method, "__code__", None)
        if code is not None:
            marks[code] = where
    return marks


def _where(frame: FrameType | None) -> str:
    """Where the frame ``frame`` (the signal's) is, by the frames from it up to Celery's
    tracer: the innermost marked one decides, else it is in the run (outside without a tracer)."""
    marks = _marks()
    decided: str | None = None
    while frame is not None:
        code = frame.f_code
        if decided is None:
            decided = marks.get(code)
        if code.co_name == _TRACER_NAME and code.co_filename == _TRACER_FILE:
            return decided or RUN
        frame = frame.f_back
    return OUTSIDE


def _on_soft_limit(signum: int, frame: FrameType | None) -> None:
    """billiard's handler, raising only inside a run, and never inside the library's part of it."""
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
    """Raise the soft time limit that landed in the library's part of the run, now that it
    is at a safe point (where the signal's own exception would have gone, a moment later).
    A signal landing in here is raised at once, the held one with it: never left held for
    another run."""
    global _held
    if _held:
        _held = False
        raise SoftTimeLimitExceeded()


_RAISE_HELD = raise_held.__code__


def drop_held() -> None:
    """Forget a held soft time limit: its run ends otherwise (it failed to begin), or it is
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
