"""A thread's lock connection and its life: the base class of :class:`.channel.Channel`.

The connection is made on first use and looked at when it has been idle; when it is
replaced or dropped, and what becomes of the replies it owes, is said below. Writing
requests and reading their replies on it is :mod:`.channel`'s part.

A connection the server closed (a restart, a proxy's idle timeout) is found
out when it is next used: the requests whose replies were pending are written
again on a new connection (each is safe to run twice: see :mod:`.wire`) and
their outcomes reported, and the request at hand is sent there too, so a
stale connection costs a run neither its release nor a retry.

**A request reads every reply it wrote, or its connection is dropped.** The
connection counts the replies it owes (:attr:`.wire.Link.outstanding`). An
error reply is read like any other (a refused ``SCRIPT LOAD`` ahead of a
script included). Any exception that leaves the channel while replies are
owed -- a timeout, or what a signal handler raises into a thread waiting for
Redis (``SoftTimeLimitExceeded``, ``SystemExit``, ``KeyboardInterrupt``) --
drops the connection: the replies on it belong to nobody now, and the next
request, on a new connection, reads only its own. The interrupted request's
outcome is unknown to its caller (it got the exception); the releases whose
replies were pending are written again on the new connection. An idle
connection with bytes to read is broken the same way.
"""

from __future__ import annotations

import contextlib
import select
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from ..log import logger
from .wire import SocketLink, Written, ensure_checked, looker_of, write_request

__all__ = ["IDLE_CHECK", "LockConnection", "ReplyHandler"]

#: Called with the result of a request sent without waiting (or the error it got).
ReplyHandler = Callable[[Any, BaseException | None], None]

#: A connection idle for this long is checked (one ``select``, a system call) before it
#: is written to; closed by the server, or holding bytes nobody asked for, it is
#: replaced. A release written onto a connection the server closed (a restart during
#: the run) would only be found out, and sent again, when its reply is read -- up to
#: FLUSH_AFTER (:mod:`.flusher`) later, while others see the lock held. Runs shorter than this skip the
#: check; the flusher still sends their release again.
IDLE_CHECK = 0.02


class _Pending:
    """A request written without waiting, and who wants its result."""

    __slots__ = ("on_reply", "resent", "written")

    def __init__(self, written: Written, on_reply: ReplyHandler) -> None:
        #: The request, and how it was written on the channel's connection (replaced when
        #: it is written again).
        self.written = written
        self.on_reply = on_reply
        #: It was on a connection dropped before its reply was read: written once more
        #: (it may have run twice), and never a third time.
        self.resent = False


class LockConnection:
    """The connection of a :class:`.channel.Channel`, and the sends whose replies it owes.

    Holds the channel's connection state; its methods connect (writing a dropped
    connection's sends again first) and drop the connection. A base class, not an
    object of its own: the channel's every request goes through :meth:`_connect`,
    with no call layer added. Each method runs under the channel's lock.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._client = client
        #: Monotonic time the oldest unread reply was written (None: nothing pending).
        self.oldest: float | None = None
        self._connection: Any = None
        #: The connection's socket, read without redis-py's layers once it is set up.
        self._link: SocketLink | None = None
        #: The connection has carried a request (so the server may have closed it since).
        self._used = False
        #: Monotonic time of the last reply read (or of connecting).
        self._last_read = 0.0
        self._pending: deque[_Pending] = deque()
        #: The pending sends are to be written (again) before anything else: their
        #: connection was dropped, or they met ``NOSCRIPT``. Always all of them at once.
        self._unsent = False
        #: Closed by :meth:`.channel.Channel.close` and not used since (a later use connects again).
        self.closed = False

    # ----------------------------------------------------------------- internals

    def _connect(self) -> SocketLink:
        link = self._link
        if link is not None:
            # An idle connection (no reply outstanding) unused for a while may have been closed
            # by the server meanwhile; bytes on it that no request asked for break it too.
            if link.outstanding or time.monotonic() - self._last_read <= IDLE_CHECK or not _unusable(link):
                return link
            self._lost(None, resend=True)
        if self._connection is None:
            # One connection object for the channel's life, reconnected after each drop. Made
            # from the pool's settings but not by the pool: the pool's make_connection() counts
            # against max_connections (100 by default in redis-py 8) and never counts down.
            pool = self._pool
            self._connection = pool.connection_class(**pool.connection_kwargs)
        self._used = False
        self.closed = False
        self._last_read = time.monotonic()
        ensure_checked(self._connection, looker_of(self._client))
        link = self._link = SocketLink(self._connection._sock,
                                       resp3=str(getattr(self._connection, "protocol", 2)) == "3")
        if self._pending:  # written on a connection dropped before their replies were read
            if not self._unsent:  # an interruption cut _lost short: the same outcome
                for entry in self._pending:
                    entry.resent = True
            self._write_unsent(link)
            logger.info("lock connection replaced; %d request(s) whose reply was not read sent again",
                        len(self._pending))
        return link

    def _write_unsent(self, link: SocketLink) -> None:
        """Write every pending request again on ``link``, in order (see :attr:`_unsent`)."""
        for entry in self._pending:
            entry.written = write_request(link, entry.written.request)
        self._unsent = False
        self._used = True

    def _drop_if_unread(self) -> None:
        """After an exception: drop the connection if a reply on it is still unread
        (or a send still listed), so that no later request reads it as its own."""
        link = self._link
        if link is not None and (link.outstanding or self._pending):
            self._lost(None, resend=True)

    def _lost(self, error: BaseException | None, *, resend: bool) -> None:
        """Drop the connection, which failed (``error``) or was left with unread replies.

        The requests whose replies were pending were written, but whether Redis
        ran them is unknown. With ``resend`` (the server closed the connection:
        a restart, a proxy; or an exception cut a request short), each is
        written once more ahead of the next request, on a new connection, and
        its outcome reported then; otherwise, or if it was written again
        already, its handler gets the error (the lock then lapses at its TTL).
        """
        self._drop()
        kept: deque[_Pending] = deque()
        failure = error or redis.ConnectionError("the lock connection was dropped with replies unread")
        for entry in self._pending:
            if resend and not entry.resent:
                entry.resent = True
                kept.append(entry)
            else:
                _deliver(entry.on_reply, None, failure)
        self._pending = kept
        self._unsent = bool(kept)
        self.oldest = (self.oldest or time.monotonic()) if kept else None

    def _drop(self) -> None:
        """Close the connection (its object stays, to connect again)."""
        self._link = None
        self._used = False
        if self._connection is not None:
            with contextlib.suppress(Exception):  # already broken
                self._connection.disconnect()


def _unusable(link: SocketLink) -> bool:
    """An idle connection (no reply expected): True if anything can be read from it.

    Either the server closed it (EOF, an error) or bytes came that no request
    asked for: both break it. One ``select`` (a system call); only when data is
    there, a read of one byte (TLS: records that carry no data are not bytes).
    """
    if link.unread():
        return True
    sock = link.sock
    if getattr(sock, "pending", None) is not None and sock.pending():
        return True  # TLS: data already decrypted
    try:
        # select first: a socket with a timeout waits that long in recv, flags or not.
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False  # nothing to read: open and clean
        timeout = sock.gettimeout()
        sock.setblocking(False)
        try:
            sock.recv(1)  # EOF or a byte: either way the connection is done
        finally:
            sock.settimeout(timeout)
        return True
    except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
        return False  # readable, yet no data (TLS bookkeeping): open
    except (OSError, ValueError):
        return True


def _deliver(on_reply: ReplyHandler, reply: Any, error: BaseException | None) -> None:
    try:
        on_reply(reply, error)
    except Exception as exc:  # a handler must not break the next run's acquire
        logger.warning("a deferred lock reply handler failed: %s", exc)
