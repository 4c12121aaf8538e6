"""How a run ended, and what its end does with the lock: a small table.

=====================  =========  ===========  ==========================================
ending                 release    done marker  reported
=====================  =========  ===========  ==========================================
returned               soon       left         a lock found gone: lost; no answer: sent again
failed                 soon       left         same
retried                soon       none         same
retried under claim    claim      none         a lock found gone: lost; no answer: logged
requeued (Reject)      soon       none         a lock found gone: lost; no answer: sent again
interrupted            soon       none         same
terminated             now        none         freed / already freed by the main process;
                                               no answer: logged
=====================  =========  ===========  ==========================================

* **soon**: a run whose end no one can see once ``__call__`` returns writes its release
  and goes on, its reply read with the next acquire (one blocking round trip per run
  instead of two); a run whose end can be seen (its result stored, its
  task-succeeded/failed event, a chain's next step, callbacks, a chord, an eager
  caller) releases **now**, reply read at once: whoever sees the end may submit the key
  again at once, and the release must have run by then.
* **claim**: an ``until_executed`` run's retry waits in the queue under the lock,
  turned into its publish-time claim.
* The done marker (``acks_late`` runs) is left only by a run that completed: the same
  task id runs again after a retry or a requeue, and a run cut short (``SystemExit`` of a
  cold shutdown or a terminate, ``KeyboardInterrupt``) did not complete: its message may
  come back and must run.
* A release that got no answer is sent again by the keeper until it runs, except a
  claim's and a terminated run's (the process is ending): those are logged, and the lock
  expires with its TTL.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from celery.exceptions import Reject, Retry

__all__ = ["ENDINGS", "Ending", "Release", "Report", "ending_of"]


class Release(enum.Enum):
    """How the lock is released."""

    #: Reply read later, unless someone can see the end (then at once).
    SOON = "soon"
    #: Compare-and-delete, reply read at once.
    NOW = "now"
    #: Turned into the retry's publish-time claim.
    CLAIM = "claim"


class Report(enum.Enum):
    """What is reported of the release."""

    #: A lock found gone: lost while running (reported once); no answer: sent again by the keeper.
    RUN = "run"
    #: A lock found gone: lost; no answer: logged (the lock expires).
    CLAIM = "claim"
    #: Freed before exiting, or already freed by the worker's main process; no answer: logged.
    TERMINATION = "termination"


class Ending(NamedTuple):
    """One row of the table."""

    name: str
    release: Release
    #: The run leaves its done marker (when its task has one: ``acks_late``).
    marker: bool
    report: Report


RETURNED = Ending("returned", Release.SOON, True, Report.RUN)
FAILED = Ending("failed", Release.SOON, True, Report.RUN)
RETRIED = Ending("retried", Release.SOON, False, Report.RUN)
RETRIED_UNDER_CLAIM = Ending("retried under claim", Release.CLAIM, False, Report.CLAIM)
REQUEUED = Ending("requeued", Release.SOON, False, Report.RUN)
INTERRUPTED = Ending("interrupted", Release.SOON, False, Report.RUN)
TERMINATED = Ending("terminated", Release.NOW, False, Report.TERMINATION)

#: Every ending, by name.
ENDINGS = {ending.name: ending for ending in (
    RETURNED, FAILED, RETRIED, RETRIED_UNDER_CLAIM, REQUEUED, INTERRUPTED, TERMINATED)}


def ending_of(exc: BaseException | None, lock_mode: str) -> Ending:
    """How a run of a task in ``lock_mode`` ended, from what its body raised (None: it returned)."""
    if exc is None:
        return RETURNED
    if isinstance(exc, Retry):
        return RETRIED_UNDER_CLAIM if lock_mode == "until_executed" else RETRIED
    if isinstance(exc, Reject) and exc.requeue:
        return REQUEUED
    if isinstance(exc, SystemExit):
        return TERMINATED
    if not isinstance(exc, Exception):
        return INTERRUPTED
    return FAILED
