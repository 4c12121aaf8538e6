"""Real OS threads for the library's background work, also under gevent and eventlet.

The lease keeper, the liveness heartbeat and the counters' writer must keep
their pace whatever the task code does. In a gevent or eventlet worker
(``-P gevent``/``eventlet``) the ``threading`` module is patched: a
"thread" is a greenlet, which runs only when the running task gives the hub
control back, so a task that blocks the hub (a CPU loop, an unpatched C call)
for longer than its lease would lose it. Here the original primitives are
used instead: :func:`start_thread` starts a real OS thread, :func:`allocate_lock`
and :class:`Wakeup` block only the thread that waits.

Such a thread talks to Redis through a client of its own
(:func:`.recovery.lock_redis.thread_client`): a connection made on the hub of
one thread must not be used from another. In a process without gevent or
eventlet all of this is the plain ``threading``/``_thread`` module.
"""

from __future__ import annotations

import _thread
import contextlib
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["Wakeup", "allocate_lock", "get_ident", "green", "start_thread"]


#: Set once the process is found patched: patching is never undone, so from then on
#: the answers below are looked up once, not per call (the keeper asks per lease it
#: renews, thousands of times a second in a gevent worker holding thousands of leases).
_patched = False
_original: Any = None


def green() -> bool:
    """True when gevent or eventlet patched the process (greenlet pools)."""
    global _patched
    if _patched:
        return True
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and (gevent.is_module_patched("socket") or gevent.is_module_patched("threading")):
        _patched = True
        return True
    eventlet = sys.modules.get("eventlet.patcher")
    _patched = eventlet is not None and bool(eventlet.is_monkey_patched("socket")
                                             or eventlet.is_monkey_patched("thread"))
    return _patched


def _original_thread_module() -> Any:
    """The unpatched ``_thread`` functions: looked up once the process is patched, then kept."""
    global _original
    if _original is not None:
        return _original
    monkey: Any = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        _original = types.SimpleNamespace(
            start_new_thread=monkey.get_original("_thread", "start_new_thread"),
            allocate_lock=monkey.get_original("_thread", "allocate_lock"),
            get_ident=monkey.get_original("_thread", "get_ident"))
        return _original
    eventlet = sys.modules.get("eventlet.patcher")
    if eventlet is not None and eventlet.is_monkey_patched("thread"):
        _original = eventlet.original("_thread")
        return _original
    return _thread


def allocate_lock() -> Any:
    """A lock that blocks the OS thread that waits on it (never a greenlet's lock)."""
    return _original_thread_module().allocate_lock()


def get_ident() -> int:
    """The OS thread's identity (not a greenlet's)."""
    return int(_original_thread_module().get_ident())


def start_thread(target: Callable[[], Any], name: str) -> None:
    """Run ``target`` in a new daemon OS thread."""
    if not green():
        threading.Thread(target=target, name=name, daemon=True).start()
        return
    _original_thread_module().start_new_thread(target, ())


class Wakeup:
    """Sleep until a deadline or until woken: a one-slot signal between OS threads.

    :meth:`wait` blocks only the calling thread; :meth:`notify` never blocks,
    so a greenlet may call it without holding up its hub.
    """

    def __init__(self) -> None:
        self._signal = allocate_lock()
        self._signal.acquire()  # held: no wake-up pending

    def wait(self, timeout: float) -> bool:
        """Return when woken (True) or after ``timeout`` seconds (False)."""
        return bool(self._signal.acquire(True, max(timeout, 0.0)))

    def notify(self) -> None:
        with contextlib.suppress(RuntimeError):  # already released: a wake-up is pending
            self._signal.release()
