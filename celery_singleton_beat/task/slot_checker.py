"""A thread that runs the beat slot checks of one worker connection off Celery's event loop.

The slot check (:func:`~celery_singleton_beat.task.slot_delivery.receive_slot`) is a
Redis script. Run in Celery's event loop (the kombu hub of the prefork, threads and
solo pools), a lock Redis that does not answer (writes paused, a stalled connection)
would hold that whole loop for the lock connection's socket timeout: the loop that
hands messages to the pool, reads results and sends ``acks_late`` acknowledgements.
:class:`SlotChecker` runs the checks on one thread of its own, one after the other,
and hands each outcome back to the loop: the thread appends it to a queue and writes a
byte to a pipe whose reading end the hub watches (:meth:`kombu.asynchronous.Hub.add_reader`),
so the loop wakes at once (a hub timer would be seen only when the loop next wakes,
which can be seconds). The outcome's callback then runs on the loop's thread, the only
one that may touch Celery's and kombu's objects.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..log import logger

__all__ = ["Outcome", "SlotChecker", "checker_for"]

#: What a check returned, or the exception it raised.
Outcome = Any
_Job = tuple[Callable[[], Any], Callable[[Outcome], None]]


class SlotChecker:
    """One thread that runs checks submitted from the event loop, and a self-pipe that
    wakes the loop to take their outcomes (see the module docstring).

    :meth:`submit` and :meth:`close` are called on the loop's thread. A check that ends
    after :meth:`close` is not handed back: its callback is never called.
    """

    def __init__(self, hub: Any) -> None:
        self._hub = hub
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: deque[tuple[Callable[[Outcome], None], Outcome]] = deque()
        self._closed = threading.Event()  # set on the loop, read by the thread
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(write_fd, False)
        # The thread owns (and closes) the writing end: closing it here while the thread
        # writes could let the number be reused by another file in between.
        thread = threading.Thread(target=self._work, args=(write_fd,), name="singleton-slot-check", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            os.close(self._read_fd)
            os.close(write_fd)
            raise
        hub.add_reader(self._read_fd, self._on_readable)

    def submit(self, check: Callable[[], Any], done: Callable[[Outcome], None]) -> None:
        """Run ``check`` on the thread (after those submitted before it); ``done`` is called
        on the loop with what it returned, or the exception it raised."""
        self._jobs.put((check, done))

    def close(self) -> None:
        """Stop watching the pipe and let the thread end (after the check it may be in)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._jobs.put(None)
        try:
            self._hub.remove_reader(self._read_fd)
        except Exception as exc:  # the hub may be closing with the worker
            logger.debug("could not stop watching the beat slot check's pipe: %r", exc)
        os.close(self._read_fd)
        self._done.clear()

    def _on_readable(self) -> None:
        """On the loop: empty the pipe, then hand over every outcome that is in."""
        if self._closed.is_set():
            return
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        while not self._closed.is_set():
            try:
                done, outcome = self._done.popleft()
            except IndexError:
                return
            done(outcome)

    def _work(self, write_fd: int) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None or self._closed.is_set():
                    return
                check, done = job
                try:
                    outcome: Outcome = check()
                except Exception as exc:  # handed to the loop, which decides
                    outcome = exc
                if self._closed.is_set():
                    return
                self._done.append((done, outcome))
                try:
                    os.write(write_fd, b"\0")
                except BlockingIOError:
                    pass  # the pipe is full: the loop has bytes to wake it already
                except OSError:
                    return  # the reading end is closed: the gate is gone
        finally:
            os.close(write_fd)


def checker_for(hub: Any) -> SlotChecker | None:
    """A checker thread for a connection run by ``hub``; None (check inline) without a hub,
    or when the process cannot make a pipe or a thread (out of file descriptors)."""
    if hub is None:
        return None
    try:
        return SlotChecker(hub)
    except (OSError, RuntimeError) as exc:
        logger.warning("beat slot checks run in the worker's event loop: could not start their "
                       "thread (%s)", exc)
        return None
