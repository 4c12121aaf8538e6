"""One connection for the acquires of a gevent worker's runs, shared by its greenlets.

A thread's :class:`.channel.Channel` is its own; in a gevent worker a "thread" is a
greenlet, new for every run, so each acquire used to borrow a pooled connection
(:mod:`.pooled`): redis-py's lending and giving back (about a hundred Python calls)
around a write and a read. Here the acquires of every greenlet of the hub's thread
go on one connection, replies read in the order the requests were written. A gevent
worker's acquires hardly overlap (it takes its messages in one round trip at a time),
so the greenlet that wrote a request reads the replies itself when nobody else is
reading, up to its own, as a thread reads its channel; requests written meanwhile
by others are read by a reader greenlet, which hands each reply to its greenlet.

**Every reply is read.** Replies are read one at a time, each kept with its request
until the request has them all, so a reader interrupted between two (a greenlet
killed, a ``gevent.Timeout``) loses none: a reader greenlet takes over. A greenlet
that stops waiting leaves its request; its reply is read and dropped, the stream
stays in step and the connection is kept. The request may have run (an acquire
nobody owns lapses at its TTL, as on a pooled connection).

**A lost connection fails every request waiting on it.** A read or write error drops
the connection; each waiting greenlet gets the error and, where the connection had
served replies before its request was written (a server restart, an idle timeout),
writes its request once more on a new connection -- as a channel does (every lock
request is safe to send twice: see :mod:`.wire`). A timeout fails them all: the
server did not answer in ``socket_timeout``.

Only under gevent (not eventlet), for standalone Redis on a plain pool; one
channel per client and OS thread (the keeper's threads have clients of their
own), made again in a forked child.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from .. import native
from .channels import _register
from .lending import is_plain_pool, request_bound
from .wire import (
    BROKEN,
    NOT_SHORT,
    RETRIED,
    Request,
    SocketLink,
    Written,
    _NoScript,
    ensure_checked,
    looker_of,
    own_replies,
    write_request,
)

__all__ = ["GreenChannel", "green_channel_or_none"]


def _gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


def green_channel_or_none(client: Any) -> GreenChannel | None:
    """The shared acquire channel of ``client`` for the calling OS thread under gevent, or
    None (no gevent, eventlet, Sentinel, Cluster, a custom pool: the pooled path)."""
    known: tuple[int, dict[int, GreenChannel | None]] | None = vars(client).get("csb_green")
    if known is None or known[0] != os.getpid():  # a forked child makes its own
        known = client.csb_green = (os.getpid(), {})
    ident = native.get_ident()
    channels = known[1]
    channel: GreenChannel | None = channels.get(ident, _NONE)
    if channel is None or (channel is not _NONE and channel._hub is channel._get_hub()):
        return channel
    # None seen yet, or one made by an ended thread whose ident this one was given (its
    # socket waits on that thread's hub, gone): a new one, on this thread's hub.
    channel = None
    if isinstance(client, redis.Redis) and is_plain_pool(client.connection_pool) and _gevent_patched():
        channel = GreenChannel(client)
        _register(channel, client)  # type: ignore[arg-type]  # closed with the client (reset_clients)
    channels[ident] = channel
    return channel


_NONE: Any = object()


class _Entry:
    """A request written on the shared connection, its replies so far, and its outcome."""

    __slots__ = ("done", "error", "event", "finished", "replies", "value", "written")

    def __init__(self, written: Written | None) -> None:
        self.written: Any = written
        #: Replies read so far (a reader interrupted between two keeps them here).
        self.replies: list[Any] = []
        self.done = False
        #: The request's own replies, or its result when ``finished`` (read in one step).
        self.value: Any = None
        self.finished = False
        self.error: BaseException | None = None
        #: Set once done, for a greenlet waiting while another reads (None: nobody waits).
        self.event: Any = None

    def deliver(self, value: Any, finished: bool, error: BaseException | None) -> None:
        self.value, self.finished, self.error, self.done = value, finished, error, True
        if self.event is not None:
            self.event.set()


class GreenChannel:
    """The acquires of a gevent thread's greenlets on one connection (see the module)."""

    def __init__(self, client: redis.Redis) -> None:
        from gevent import get_hub, spawn_raw
        from gevent.event import Event
        from gevent.lock import Semaphore

        self._client = client
        #: The hub of the thread that made it: its socket and greenlets are that hub's.
        self._get_hub = get_hub
        self._hub = get_hub()
        self._event = Event
        self._spawn = spawn_raw
        pool = client.connection_pool
        self._connection: Any = pool.connection_class(**pool.connection_kwargs)
        self._link: SocketLink | None = None
        #: Held while connecting and while writing: one greenlet at a time on the socket.
        self._writing = Semaphore()
        self._pending: deque[_Entry] = deque()
        #: The link being read (None: nobody reads).
        self._reader: SocketLink | None = None
        #: Replies read on the current connection (a connection that served one may have
        #: been closed by the server since: a request that fails there is sent once more).
        self._served = 0
        #: The longest a request waits for its reader: the reader fails it within its
        #: socket timeout, so this is only a bound that no bug can turn into a hang.
        self._bound = request_bound(pool) * 2
        #: Its client was dropped: the connection is closed whenever nothing is pending.
        self.closed = False

    def call(self, request: Request, before_write: Callable[[], Any] | None = None) -> Any:
        """Write ``request``, wait for its replies and return ``request.finish(replies)``.

        ``before_write`` runs once connected, before each write (a recovery window's wait).
        A request that meets ``NOSCRIPT`` (a ``SCRIPT FLUSH``) is written again with its
        script; one whose connection failed after serving earlier replies is written once
        more on a new connection.
        """
        reloaded = resent = False
        hook = before_write
        while True:
            entry, link, stale = self._write(request, hook)
            hook = before_write
            if not entry.done:
                self._await(entry, link)
            error = entry.error
            if error is None:
                return entry.value if entry.finished else request.finish(entry.value)
            if type(error) is _NoScript and not reloaded:
                reloaded = True
                hook = None  # the script did not run: loaded and written again at once
            elif isinstance(error, RETRIED) and stale and not resent:
                resent = True
            else:
                raise _own(error)

    def close(self) -> None:
        """Its client is dropped (:func:`.channels.close_channels`): close the connection once
        no request is pending on it (requests waiting get their replies first; one written
        later connects again, and that connection is closed once it is read too). Another
        OS thread's channel is left alone: its socket is that thread's hub's."""
        from gevent._hub_local import get_hub_if_exists  # never makes a hub in the closing thread

        self.closed = True
        if get_hub_if_exists() is self._hub:
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        link = self._link
        if link is not None and not self._pending and self._reader is None and not self._writing.locked():
            self._lost(link, None)

    def _write(self, request: Request,
               before_write: Callable[[], Any] | None) -> tuple[_Entry, SocketLink, bool]:
        if before_write is not None:
            if self._link is None:
                with self._writing:
                    if self._link is None:
                        self._connect()
            before_write()  # outside the lock: a window's wait must not hold others' writes
        with self._writing:
            link = self._link or self._connect()
            stale = self._served > 0
            try:
                written = write_request(link, request)
            except BROKEN as exc:  # maybe half written: nothing after it can be read
                self._lost(link, exc)
                entry = _Entry(None)
                entry.deliver(None, False, exc)
                return entry, link, stale
            except BaseException:
                self._lost(link, None)
                raise
            entry = _Entry(written)
            self._pending.append(entry)
        return entry, link, stale

    def _await(self, entry: _Entry, link: SocketLink) -> None:
        """Until ``entry``, written on ``link``, is done: read (nobody else reads ``link``), or
        wait for its reader. A reader still finishing with a connection dropped before
        (its greenlet not run since) does not count: this link gets a reader of its own."""
        if self._reader is not link:
            self._read(link, entry)
        if not entry.done:
            event = entry.event = self._event()
            if not event.wait(self._bound) and not entry.done:
                # Never seen: the reader would have failed it within its socket timeout.
                late = redis.TimeoutError("no reply from the lock Redis in time")
                self._lost(link, late)
                if not entry.done:
                    entry.deliver(None, False, late)

    def _connect(self) -> SocketLink:
        connection = self._connection
        ensure_checked(connection, looker_of(self._client))  # disconnects on failure
        self._served = 0
        link = self._link = SocketLink(connection._sock, resp3=str(getattr(connection, "protocol", 2)) == "3")
        return link

    def _read(self, link: SocketLink, own: _Entry | None) -> None:
        """Read pending replies in order, delivering each: until ``own`` is done, or (a reader
        greenlet, ``own`` None) until none is pending. Whoever stops while requests are still
        pending leaves them to a reader greenlet."""
        if own is None and self._reader is not link:
            return  # spawned for a link dropped since, whose successor has a reader of its own
        self._reader = link
        pending = self._pending
        try:
            while pending and self._link is link and not (own is not None and own.done):
                entry = pending[0]
                written = entry.written
                request = written.request
                short = request.short
                if short is not None and entry is own and len(pending) == 1 and not written.loads:
                    # The usual reply of the only request waiting, read in one step.
                    result = link.read_short(short, request.count)
                    if result is not NOT_SHORT:
                        pending.popleft()
                        self._served += 1
                        entry.deliver(result, True, None)
                        continue
                replies = entry.replies
                needed = written.loads + request.count
                while len(replies) < needed:
                    replies.append(link.read())
                pending.popleft()
                self._served += 1
                try:
                    entry.deliver(own_replies(link, written, replies), False, None)
                except Exception as exc:  # every reply of it was read: its outcome (the stream is in
                    # step). Not only ResponseError: a SCRIPT LOAD refused -LOADING is redis-py's
                    # BusyLoadingError, a ConnectionError, which must not be taken for a lost
                    # connection here (the request, popped, would never be answered).
                    entry.deliver(None, False, exc)
        except BROKEN as exc:
            self._lost(link, exc)
        except BaseException as exc:
            if own is None:  # the reader greenlet itself stopped: nobody would read on
                self._lost(link, redis.ConnectionError(f"the lock connection's reader stopped: {exc!r}"))
            raise
        finally:
            if self._reader is link:
                self._reader = None
                if self._pending and self._link is link:
                    self._reader = link
                    self._spawn(self._read, link, None)
                elif self.closed:
                    self._close_if_idle()

    def _lost(self, link: SocketLink, error: BaseException | None) -> None:
        """Drop ``link``'s connection; every request waiting on it gets the error."""
        if self._link is not link:
            return
        self._link = None
        with contextlib.suppress(Exception):
            self._connection.disconnect()
        failure = error or redis.ConnectionError("the lock connection was dropped with replies unread")
        pending, self._pending = self._pending, deque()
        while pending:
            pending.popleft().deliver(None, False, failure)


def _own(error: BaseException) -> BaseException:
    """``error`` to raise in one greenlet: a lost connection's is shared by every request
    waiting on it, so each raises a copy of its own (same type and message)."""
    if isinstance(error, BROKEN) and not isinstance(error, _NoScript):
        try:
            copy = type(error)(*error.args)
        except Exception:
            return error
        copy.__cause__ = error
        return copy
    return error
