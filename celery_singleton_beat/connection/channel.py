"""One Redis connection per process and thread for the lock commands of runs.

A run's critical path has two lock requests: the acquire (its reply decides
whether the body runs) and the release. The channel writes a release at once
-- Redis executes it as soon as it reads it, so other processes see the key
free without delay -- and reads its reply later, in the same round trip as the
next request it waits for (the next acquire, under steady load). A run
therefore waits for one round trip, not two, and requests stay in order on the
connection: a run of the same key right after its predecessor always finds the
predecessor's release already executed. A run whose end others wait on (a
chain's next step, callbacks) calls :meth:`Channel.flush` after writing its
release, so that the release has executed before its end is published.

When no next request comes, a background thread reads the pending replies
:data:`.flusher.FLUSH_AFTER` seconds after they were written (:mod:`.flusher`), so the outcome of a
release (was the lock still ours?) is always reported within that bound.

The connection itself, and its life -- replaced when the server closed it, dropped
when replies on it are left unread -- is :class:`.lock_connection.LockConnection`, the
channel's base class (:mod:`.lock_connection` explains both).

Used for standalone Redis clients without ``singleton_wait_replicas``, in
processes whose sockets are not green (Sentinel, Cluster, ``WAIT`` and the
gevent / eventlet pools keep the pooled path; a gevent worker's acquires share
a :class:`.green.GreenChannel`). The connection is made from
the client's own pool settings, belongs to one thread and process (a forked
child makes its own).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from .flusher import watcher
from .lock_connection import LockConnection, ReplyHandler, _deliver, _Pending
from .wire import (
    BROKEN,
    NOT_SHORT,
    RETRIED,
    Request,
    SocketLink,
    _NoScript,
    read_own,
    write_request,
)

__all__ = ["Channel", "ReplyHandler"]


class Channel(LockConnection):
    """A dedicated connection: blocking calls, and sends whose replies are read later.

    Replies are read strictly in the order the requests were written. The
    connection's state is its link's :attr:`~.wire.Link.outstanding` count and
    the :class:`_Pending` sends: idle (nothing outstanding, nothing pending),
    busy (replies outstanding: the sends' and, during a call, the call's), or
    none. Whatever exception leaves a method while replies are outstanding (or
    sends listed) drops the connection; the sends whose replies were not read
    are written again, in order, ahead of the next request on a new one.
    """

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client)
        # Held by the owning thread for each call, and by the flusher thread.
        self._lock = threading.Lock()
        #: True while the flusher thread watches this channel (set and cleared by it).
        self.watched = False

    # ----------------------------------------------------------------- public

    def call(self, request: Request, before_write: Callable[[], Any] | None = None) -> Any:
        """Send ``request`` and return its result; earlier sends' replies are read first.

        One round trip: the request is written before the pending replies are
        read. ``before_write`` runs once the connection is up, before anything
        is written (a recovery window's wait, see :mod:`.server`).
        """
        with self._lock:
            try:
                for attempt in (1, 2):
                    stale = self._used
                    written = None
                    try:
                        link = self._connect()
                        if before_write is not None:
                            before_write()
                        written = write_request(link, request)
                        self._used = True
                        again = self._read_pending(link) if self._pending else None
                        short = request.short
                        if short is not None and not again and not written.loads:
                            # The usual reply, read in one step (else the general path below).
                            result = link.read_short(short, request.count)
                            if result is not NOT_SHORT:
                                self._last_read = time.monotonic()
                                return result
                        try:
                            replies = read_own(link, written)
                        except _NoScript:  # a SCRIPT FLUSH: every send that met it, then this again
                            replies = self._redo(link, request, None)
                        else:
                            if again:  # sends that met it ran after this one: both again, in order
                                replies = self._redo(link, request, replies)
                        self._last_read = time.monotonic()
                        return request.finish(replies)
                    except RETRIED as exc:
                        self._lost(exc, resend=True)
                        if attempt == 2 or not stale:
                            raise
                        if written is not None and request.unsure_when_repeated:
                            request = _repeated(request)
                    except BROKEN as exc:
                        self._lost(exc, resend=False)
                        raise
            except BaseException:
                self._drop_if_unread()
                raise
        raise AssertionError("unreachable")

    def send(self, request: Request, on_reply: ReplyHandler) -> None:
        """Write ``request`` now; ``on_reply`` gets its result when it is read.

        Raises ``redis.RedisError`` if it could not be written (after one more
        try on a new connection when the old one had been closed by the server).
        """
        with self._lock:
            try:
                for attempt in (1, 2):
                    stale = self._used
                    try:
                        written = write_request(self._connect(), request)
                        self._used = True
                        break
                    except RETRIED as exc:
                        self._lost(exc, resend=True)
                        if attempt == 2 or not stale:
                            raise
                    except BROKEN as exc:
                        self._lost(exc, resend=False)
                        raise
                self._pending.append(_Pending(written, on_reply))
                if self.oldest is None:
                    self.oldest = time.monotonic()
                watched = self.watched
            except BaseException:
                self._drop_if_unread()
                raise
        if not watched:  # under steady load the flusher keeps watching: no lock, no wake-up
            watcher().watch(self)

    def flush(self) -> None:
        """Read every pending reply now (blocks one round trip at most, two after a lost connection)."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        """:meth:`flush`, the channel's lock held."""
        try:
            for attempt in (1, 2):
                if not self._pending:
                    return
                try:
                    link = self._connect()
                    if self._read_pending(link):
                        self._write_unsent(link)
                        self._read_pending(link, last=True)
                    self._last_read = time.monotonic()
                    return
                except RETRIED as exc:
                    self._lost(exc, resend=attempt == 1)
                except BROKEN as exc:
                    self._lost(exc, resend=False)
                    raise
        except BaseException:
            self._drop_if_unread()
            raise

    def unwatch_if_idle(self) -> bool:
        """The flusher's check: nothing pending, so stop being watched (True), else False.

        Under the channel's lock, so a send either sees ``watched`` cleared (and
        asks to be watched again) or is seen pending here. Never waits: a busy
        channel stays watched.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.oldest is None:
                self.watched = False
                return True
            return False
        finally:
            self._lock.release()

    def close(self) -> None:
        """Read the pending replies (each handler gets its outcome), then close the connection.

        For a channel nobody will use any more: its client was dropped
        (:func:`.channels.close_channels`) or its thread is done (:func:`.channels.close_own_channels`).
        Should it be used after all (a run still holding a lease of a dropped client),
        it connects again.
        """
        with self._lock:  # held throughout: a send of its thread meanwhile is read too, or waits
            with contextlib.suppress(Exception):  # each handler got the error
                self._flush_locked()
            if self._pending:  # could not be read: reported lost, not sent again
                self._lost(None, resend=False)
            else:
                self._drop()
            self.closed = True

    @property
    def pending(self) -> int:
        """Requests written whose reply has not been read yet."""
        return len(self._pending)

    @property
    def outstanding(self) -> int:
        """Replies written on the connection and not read yet (0 when idle or unconnected)."""
        link = self._link
        return 0 if link is None else link.outstanding

    # ----------------------------------------------------------------- internals

    def _read_pending(self, link: SocketLink, *, last: bool = False) -> list[_Pending]:
        """Read every pending reply, delivering each; those that met ``NOSCRIPT`` (returned).

        Those stay pending, to be written again (:meth:`_write_unsent`) once
        every reply written before has been read (written now, they would run
        after requests already on the wire); ``last``: the second time in a
        row, delivered as the error instead.
        """
        self.oldest = None
        pending = self._pending
        again: list[_Pending] = []
        while pending:
            entry = pending[0]
            try:
                replies = read_own(link, entry.written)
            except _NoScript as exc:  # a SCRIPT FLUSH: load and run it again, in order
                pending.popleft()
                if last:
                    _deliver(entry.on_reply, None, exc)
                else:
                    again.append(entry)
                continue
            except redis.ResponseError as exc:  # its SCRIPT LOAD refused; every reply was read
                pending.popleft()
                _deliver(entry.on_reply, None, exc)
                continue
            # Popped only once read: an exception before leaves it to be sent again.
            pending.popleft()
            try:
                result = entry.written.request.finish(replies)
            except Exception as exc:  # an error reply: the request's outcome
                _deliver(entry.on_reply, None, exc)
                continue
            if entry.resent and not result and entry.written.request.unsure_when_repeated:
                result = None  # its first attempt may have run: unknown, not "not ours"
            _deliver(entry.on_reply, result, None)
        if again:
            pending.extend(again)  # every other reply was read: they are all that is pending
            self._unsent = True
            self.oldest = time.monotonic()
        return again

    def _redo(self, link: SocketLink, request: Request, replies: list[Any] | None) -> list[Any]:
        """After a ``SCRIPT FLUSH``: run the sends that met ``NOSCRIPT`` again, then ``request``
        (its replies: None if it met ``NOSCRIPT`` too) unless it ran and is a compare-and-delete
        (run again, it would find nothing; nothing it does depends on the sends before)."""
        self._write_unsent(link)
        self._read_pending(link, last=True)
        if replies is None or not request.unsure_when_repeated:
            replies = read_own(link, write_request(link, request))
        return replies


def _repeated(request: Request) -> Request:
    """``request`` to be sent again after its connection failed: a falsy outcome of a
    compare-and-delete is then unknown (None), its first attempt may have run."""
    def finish(replies: list[Any]) -> Any:
        return request.finish(replies) or None

    return Request(None, finish, request.scripts, unsure_when_repeated=True, data=request.data,
                   count=request.count)
