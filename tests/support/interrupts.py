"""Exceptions raised into the test's main thread wherever it is, as a signal handler raises them.

billiard raises ``SoftTimeLimitExceeded`` from a ``SIGUSR1`` handler in a pool
child, wherever the child's main thread is (a ``recv`` waiting for Redis
included); ``revoke(terminate=True, signal="SIGUSR1")`` does the same; a
``SystemExit`` or ``KeyboardInterrupt`` arrives the same way. :class:`RaiseInto`
does exactly that to the test's own main thread: a ``SIGUSR1`` handler raises
the armed exception, and :meth:`RaiseInto.fire` sends the signal from any
thread (``signal.pthread_kill``), so a blocking ``recv`` is interrupted (PEP
475: the handler runs, its exception propagates out of the call).

``SIGALRM`` is left alone: pytest-timeout uses it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from .waiting import wait_for

__all__ = ["RaiseInto", "blocked_on", "main_waits_for_a_reply_in", "queued_behind", "when"]


class RaiseInto:
    """Raise an exception into the main thread on demand (see the module docstring).

    The handler raises only while armed: a signal that lands after :meth:`disarm`
    (the operation it was meant for already returned) does nothing.
    """

    SIGNAL = signal.SIGUSR1

    def __init__(self) -> None:
        self._main = threading.main_thread().ident
        self._armed: Callable[[], BaseException] | None = None
        self.raised = 0
        self._previous: Any = None

    def __enter__(self) -> RaiseInto:
        assert threading.current_thread() is threading.main_thread(), "signals reach the main thread only"
        self._previous = signal.signal(self.SIGNAL, self._handle)
        return self

    def __exit__(self, *_: Any) -> None:
        self._armed = None
        signal.signal(self.SIGNAL, self._previous)

    def arm(self, make: Callable[[], BaseException]) -> None:
        self._armed = make

    def disarm(self) -> None:
        self._armed = None

    def fire(self) -> None:
        """Send the signal to the main thread (from any thread)."""
        assert self._main is not None
        signal.pthread_kill(self._main, self.SIGNAL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        make, self._armed = self._armed, None
        if make is not None:
            self.raised += 1
            raise make()


@contextmanager
def when(condition: Callable[[], Any], action: Callable[[], Any], *, timeout: float = 10.0,
         otherwise: Callable[[], Any] | None = None) -> Iterator[list[BaseException]]:
    """Run ``action`` from a helper thread once ``condition`` holds (polled with a deadline).

    If the condition is not met in time, ``otherwise`` runs instead (e.g. unpause the
    server, so that the main thread is not left blocked) and the failure is in the
    yielded list (re-raised on exit). Joined on exit.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            wait_for(condition, timeout=timeout, interval=0.005, message="the helper thread's condition")
        except AssertionError as exc:
            errors.append(exc)
            if otherwise is not None:
                otherwise()
            return
        action()

    helper = threading.Thread(target=run, name="when", daemon=True)
    helper.start()
    try:
        yield errors
    finally:
        helper.join(timeout + 5)
    if errors:
        raise errors[0]


def blocked_on(admin: Any, command: str) -> bool:
    """True while a client of the server waits with ``command`` unexecuted (``CLIENT PAUSE``,
    a blocking command): ``CLIENT LIST`` shows it with the ``b`` flag."""
    return any("b" in client.get("flags", "") and client.get("cmd") == command for client in admin.client_list())


def queued_behind(admin: Any, command: str) -> bool:
    """True while a client waits with ``command`` unexecuted and more commands queued behind it."""
    return any("b" in client.get("flags", "") and client.get("cmd") == command and int(client.get("qbuf", 0)) > 0
               for client in admin.client_list())


def main_waits_for_a_reply_in(function: str) -> bool:
    """True while the main thread waits on a socket for a reply, inside ``function``: its
    innermost frame is a reader's (redis-py's parsers, the library's link)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None or not any(word in frame.f_code.co_name for word in ("read", "recv", "_receive")):
        return False
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False
