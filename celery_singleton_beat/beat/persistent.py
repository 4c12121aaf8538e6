"""The shelve-backed scheduler: Celery's ``PersistentScheduler`` with
:class:`~.scheduler.SingletonSchedulerMixin`, and what it says when the schedule
file's path cannot be used (one line and exit code 78, not a traceback and a retry)."""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, NoReturn

from celery.beat import PersistentScheduler

from ..log import logger
from ..recovery.startup import EX_CONFIG
from .scheduler import SingletonSchedulerMixin

__all__ = ["SingletonScheduler"]

#: Errors opening the schedule file that say the path cannot be used, not that the file is corrupt.
_UNREACHABLE = frozenset({errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EROFS})


class SingletonScheduler(SingletonSchedulerMixin, PersistentScheduler):
    """Celery's default (shelve-backed) scheduler, sending each slot from one beat only.

    Use with ``celery beat -S singleton`` or
    ``beat_scheduler = "celery_singleton_beat.SingletonScheduler"``.

    The schedule file (``--schedule``/``-s``, ``beat_schedule_filename``) goes where it
    says: a folder of its path that does not exist yet is made, as ``mkdir -p`` would
    (the beat logs it once). A path that cannot be used (a folder that cannot be made, no
    permission, a read-only file system) stops the beat at start with one ``CRITICAL``
    line and exit code 78 (:data:`~celery_singleton_beat.startup.EX_CONFIG`).
    """

    def _open_schedule(self) -> Any:
        folder = os.path.dirname(os.path.abspath(self.schedule_filename))
        if not os.path.isdir(folder):
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                self._schedule_unusable(exc)
            logger.info("beat: made the folder %s for the schedule file", folder)
        return super()._open_schedule()

    def _destroy_open_corrupted_schedule(self, exc: Exception) -> Any:
        # Celery calls this when opening the file failed for any reason, logs the error
        # with its traceback, removes the file and opens it again. A path that cannot be
        # used is not a corrupt file: say so once and stop.
        if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
            self._schedule_unusable(exc)
        try:
            return super()._destroy_open_corrupted_schedule(exc)
        except OSError as again:
            self._schedule_unusable(again)

    def _schedule_unusable(self, exc: OSError) -> NoReturn:
        """One ``CRITICAL`` line, then exit code 78: restarting will not make the path usable."""
        if exc.errno in (errno.EEXIST, errno.ENOTDIR) and exc.filename:
            reason = f"{exc.filename} is not a folder"
        else:
            reason = exc.strerror or str(exc)
            if exc.filename and str(exc.filename) != str(self.schedule_filename):
                reason += f" ({exc.filename})"
        logger.critical("beat %s refuses to start: cannot open the schedule file %s: %s. Give --schedule "
                        "(beat_schedule_filename) a path this user can write to",
                        self.instance_id, self.schedule_filename, reason)
        sys.stderr.flush()
        raise SystemExit(EX_CONFIG)
