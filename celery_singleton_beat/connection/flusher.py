"""The flusher: reads the replies a :class:`.channel.Channel` left pending when no next
request comes, :data:`FLUSH_AFTER` seconds after they were written, so the outcome of a
release (was the lock still ours?) is always reported within that bound; and
:func:`read_all_replies`, the same at once for every channel of a process about to end.

One daemon thread per process (a forked child starts its own). A channel asks to be
watched when it writes a send and nobody watches it; the flusher lets it go once it has
nothing pending. It knows a channel only by what it asks of it (:class:`Watched`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Protocol

from ..log import logger

__all__ = ["FLUSH_AFTER", "Watched", "read_all_replies", "watcher"]

#: Seconds after which a pending reply is read even if no next request comes.
FLUSH_AFTER = 0.5


class Watched(Protocol):
    """What the flusher asks of a channel."""

    #: Monotonic time the oldest unread reply was written (None: nothing pending).
    oldest: float | None
    #: True while the flusher watches it (set and cleared by the flusher).
    watched: bool

    def flush(self) -> None: ...

    def unwatch_if_idle(self) -> bool: ...


class Flusher:
    """A daemon thread that reads replies left pending for :data:`FLUSH_AFTER` seconds."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: Held until idle: a channel whose thread ended (its thread-local gone) still has
        #: its pending replies read, and each handler told.
        self._channels: list[Watched] = []
        threading.Thread(target=self._run, name="singleton-flush", daemon=True).start()

    def watch(self, channel: Watched) -> None:
        with self._cond:
            if not channel.watched:
                channel.watched = True
                self._channels.append(channel)
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._channels:
                    self._cond.wait()
                channels = list(self._channels)
            now = time.monotonic()
            due = [c for c in channels if c.oldest is not None and now - c.oldest >= FLUSH_AFTER]
            for channel in due:
                try:
                    channel.flush()
                except Exception as exc:  # reported to the handlers; keep flushing others
                    logger.debug("flushing lock replies failed: %s", exc)
            waits = [c.oldest + FLUSH_AFTER - now for c in channels if c.oldest is not None and c not in due]
            with self._cond:
                kept = []
                for channel in self._channels:
                    if channel.unwatch_if_idle():
                        continue  # its next send asks again
                    kept.append(channel)
                self._channels = kept
                self._cond.wait(timeout=max(min(waits, default=FLUSH_AFTER), 0.005))


_flusher_of: dict[int, Flusher] = {}
_flusher_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A lock copied while another thread held it would stay held in the child.
    global _flusher_lock
    _flusher_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def watcher() -> Flusher:
    """This process's flusher thread (a forked child starts its own)."""
    pid = os.getpid()
    flusher = _flusher_of.get(pid)
    if flusher is None:
        with _flusher_lock:
            flusher = _flusher_of.get(pid)
            if flusher is None:
                _flusher_of.clear()
                flusher = _flusher_of[pid] = Flusher()
    return flusher


def read_all_replies() -> None:
    """Read the pending replies of every channel of this process now: it is about to end
    (a prefork child ends with ``os._exit``, where the flusher thread would never run)."""
    flusher = _flusher_of.get(os.getpid())
    if flusher is None:
        return
    with flusher._cond:
        channels = list(flusher._channels)
    for channel in channels:
        try:
            channel.flush()
        except Exception as exc:  # reported to the handlers; read the others
            logger.debug("reading lock replies at exit failed: %s", exc)
