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
:data:`FLUSH_AFTER` seconds after they were written, so the outcome of a
release (was the lock still ours?) is always reported within that bound.

A connection the server closed (a restart, a proxy's idle timeout) is found
out when it is next used: the requests whose replies were pending are written
again on a new connection (each is safe to run twice: see :mod:`.wire`) and
their outcomes reported, and the request at hand is sent there too, so a
stale connection costs a run neither its release nor a retry.

Used for standalone Redis clients without ``singleton_wait_replicas``, in
processes whose sockets are not green (Sentinel, Cluster, ``WAIT`` and the
gevent / eventlet pools keep the pooled path). The connection is made from
the client's own pool settings, belongs to one thread and process (a forked
child makes its own).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeGuard

import redis

from . import native
from .events import logger
from .server import server_of
from .wire import BROKEN, RETRIED, Request, SocketLink, Written, _NoScript, ensure_checked, read_replies, write_request

__all__ = ["Channel", "channel_for", "channel_or_none", "read_all_replies", "supports_channel"]

#: Called with the result of a request sent without waiting (or the error it got).
ReplyHandler = Callable[[Any, BaseException | None], None]

#: Seconds after which a pending reply is read even if no next request comes.
FLUSH_AFTER = 0.5
#: A connection idle for this long is checked (one non-blocking peek, a system call)
#: before it is written to: a release written onto a connection the server closed
#: (a restart during the run) would only be found out, and sent again, when its
#: reply is read -- up to FLUSH_AFTER later, while others see the lock held. Runs
#: shorter than this skip the check; the flusher still sends their release again.
IDLE_CHECK = 0.02


class _Pending:
    """A request written without waiting, and who wants its result."""

    __slots__ = ("attempts", "on_reply", "written")

    def __init__(self, written: Written, on_reply: ReplyHandler) -> None:
        self.written = written
        self.on_reply = on_reply
        #: Connections it was written on (2: written again after a lost connection).
        self.attempts = 1


class Channel:
    """A dedicated connection: blocking calls, and sends whose replies are read later.

    Replies are read strictly in the order the requests were written.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._client = client
        # Held by the owning thread for each call, and by the flusher thread.
        self._lock = threading.Lock()
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
            for attempt in (1, 2):
                stale = self._used
                try:
                    link = self._connect()
                    if before_write is not None:
                        before_write()
                    written = write_request(link, request)
                    self._used = True
                    failed = self._read_pending(link)
                    try:
                        result = read_replies(link, written)
                    except _NoScript:
                        failed.append(_Pending(written, _ignore))  # a placeholder: run below
                        result = None
                    if failed:  # SCRIPT FLUSH: earlier releases ran after this request, so redo both
                        self._redo(link, [entry for entry in failed if entry.on_reply is not _ignore])
                        result = read_replies(link, write_request(link, request))
                    self._last_read = time.monotonic()
                    return result
                except RETRIED:
                    self._reset("call", retry=True)
                    if attempt == 2 or not stale:
                        raise
                except BROKEN:
                    self._reset("call", retry=False)
                    raise
        raise AssertionError("unreachable")

    def send(self, request: Request, on_reply: ReplyHandler) -> None:
        """Write ``request`` now; ``on_reply`` gets its result when it is read.

        Raises ``redis.RedisError`` if it could not be written (after one more
        try on a new connection when the old one had been closed by the server).
        """
        with self._lock:
            for attempt in (1, 2):
                stale = self._used
                try:
                    written = write_request(self._connect(), request)
                    self._used = True
                    break
                except RETRIED:
                    self._reset("write", retry=True)
                    if attempt == 2 or not stale:
                        raise
                except BROKEN:
                    self._reset("write", retry=False)
                    raise
            self._pending.append(_Pending(written, on_reply))
            if self.oldest is None:
                self.oldest = time.monotonic()
            watched = self.watched
        if not watched:  # under steady load the flusher keeps watching: no lock, no wake-up
            _flusher().watch(self)

    def flush(self) -> None:
        """Read every pending reply now (blocks one round trip at most)."""
        with self._lock:
            if not self._pending:
                return
            try:
                link = self._connect()
                self._redo(link, self._read_pending(link))
                self._last_read = time.monotonic()
            except RETRIED:
                self._reset("flush", retry=True)
            except BROKEN:
                self._reset("flush", retry=False)
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

    @property
    def pending(self) -> int:
        """Requests written whose reply has not been read yet."""
        return len(self._pending)

    # ----------------------------------------------------------------- internals

    def _connect(self) -> SocketLink:
        link = self._link
        if link is not None:
            # A connection idle for a while may have been closed by the server meanwhile.
            if self._pending or time.monotonic() - self._last_read <= IDLE_CHECK or not _closed_by_server(link.sock):
                return link
            self._drop()  # a restart or a proxy closed it while it was idle: a new one
        if self._connection is None:
            # Not pool.make_connection(): it counts each connection it makes against
            # max_connections for good (a ConnectionPool) or keeps it in a list (a
            # BlockingConnectionPool), and never learns that this one was dropped.
            self._connection = self._pool.connection_class(**self._pool.connection_kwargs)
        self._used = False
        self._last_read = time.monotonic()
        ensure_checked(self._connection, server_of(self._client))
        link = self._link = SocketLink(self._connection._sock)
        return link

    def _read_pending(self, link: SocketLink) -> list[_Pending]:
        """Read every pending reply, delivering each; return those that met ``NOSCRIPT``.

        Those are run again by :meth:`_redo` once every reply written before
        the redo has been read (a redo written now would be answered after
        requests already on the wire).
        """
        self.oldest = None
        failed = []
        while self._pending:
            entry = self._pending[0]
            try:
                result = read_replies(link, entry.written)
            except _NoScript:  # a SCRIPT FLUSH: load and run it again, in order
                self._pending.popleft()
                failed.append(entry)
                continue
            except redis.ResponseError as exc:
                self._pending.popleft()
                _deliver(entry.on_reply, None, exc)
                continue
            # Popped only once read: a lost connection leaves it pending for _reset.
            self._pending.popleft()
            if entry.attempts > 1 and not result and entry.written.request.unsure_when_repeated:
                result = None  # its first attempt may have run: unknown, not "not ours"
            _deliver(entry.on_reply, result, None)
        return failed

    def _redo(self, link: SocketLink, failed: list[_Pending]) -> None:
        """Run requests that met ``NOSCRIPT`` again, in their order, and deliver their results."""
        for entry in failed:
            try:
                result = read_replies(link, write_request(link, entry.written.request))
            except redis.ResponseError as exc:
                _deliver(entry.on_reply, None, exc)
                continue
            _deliver(entry.on_reply, result, None)

    def _reset(self, where: str, *, retry: bool) -> None:
        """Drop the connection after an error.

        The requests whose replies were pending were written, but whether Redis
        ran them is unknown. With ``retry`` (the server closed the connection:
        a restart, a proxy), each is written once more on a new connection and
        its outcome reported; otherwise, or if that fails too, its handler gets
        the error (the lock then lapses at its TTL).
        """
        lost, self._pending = list(self._pending), deque()
        self.oldest = None
        self._drop()
        if not (retry and lost):
            _deliver_all(lost, redis.ConnectionError(f"connection lost before the reply ({where})"))
            return
        try:
            fresh = self._connect()
            for entry in lost:
                entry.attempts += 1
                entry.written = write_request(fresh, entry.written.request)
        except BROKEN as exc:
            self._drop()
            _deliver_all(lost, exc)
            return
        self._used = True
        self._pending.extend(lost)
        logger.info("lock connection was closed by the server (%s); %d request(s) sent again on a new "
                    "connection", where, len(lost))
        try:
            self._redo(fresh, self._read_pending(fresh))
        except BROKEN as exc:
            undelivered, self._pending = list(self._pending), deque()
            self.oldest = None
            self._drop()
            _deliver_all(undelivered, exc)

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        self._link = None
        self._used = False
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken
                connection.disconnect()


def _deliver_all(entries: list[_Pending], error: BaseException) -> None:
    for entry in entries:
        _deliver(entry.on_reply, None, error)


def _closed_by_server(sock: Any) -> bool:
    """One non-blocking peek: True if the server closed the connection of ``sock`` (EOF or an error)."""
    try:
        # select first: a socket with a timeout waits that long in recv, flags or not.
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False  # nothing to read: open
        return bool(sock.recv(1, socket.MSG_PEEK) == b"")
    except (BlockingIOError, InterruptedError):
        return False
    except ValueError:  # an SSL socket refuses flags: leave it to the retry on error
        return False
    except OSError:
        return True


def _ignore(reply: Any, error: BaseException | None) -> None:
    """The handler of nothing: marks a request run again by :meth:`Channel.call` itself."""


def _deliver(on_reply: ReplyHandler, reply: Any, error: BaseException | None) -> None:
    try:
        on_reply(reply, error)
    except Exception as exc:  # a handler must not break the next run's acquire
        logger.warning("a deferred lock reply handler failed: %s", exc)


class _Flusher:
    """A daemon thread that reads replies left pending for :data:`FLUSH_AFTER` seconds."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._channels: list[weakref.ref[Channel]] = []
        threading.Thread(target=self._run, name="singleton-flush", daemon=True).start()

    def watch(self, channel: Channel) -> None:
        with self._cond:
            if not channel.watched:
                channel.watched = True
                self._channels.append(weakref.ref(channel))
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._channels:
                    self._cond.wait()
                channels = [c for c in (ref() for ref in self._channels) if c is not None]
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
                for ref in self._channels:
                    alive = ref()
                    if alive is None:
                        continue
                    if alive.unwatch_if_idle():
                        continue  # its next send asks again
                    kept.append(ref)
                self._channels = kept
                self._cond.wait(timeout=max(min(waits, default=FLUSH_AFTER), 0.005))


_flusher_of: dict[int, _Flusher] = {}
_flusher_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A lock copied while another thread held it would stay held in the child.
    global _flusher_lock
    _flusher_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _flusher() -> _Flusher:
    """This process's flusher thread (a forked child starts its own)."""
    pid = os.getpid()
    flusher = _flusher_of.get(pid)
    if flusher is None:
        with _flusher_lock:
            flusher = _flusher_of.get(pid)
            if flusher is None:
                _flusher_of.clear()
                flusher = _flusher_of[pid] = _Flusher()
    return flusher


def read_all_replies() -> None:
    """Read the pending replies of every channel of this process now: it is about to end
    (a prefork child ends with ``os._exit``, where the flusher thread would never run)."""
    flusher = _flusher_of.get(os.getpid())
    if flusher is None:
        return
    with flusher._cond:
        channels = [channel for channel in (ref() for ref in flusher._channels) if channel is not None]
    for channel in channels:
        try:
            channel.flush()
        except Exception as exc:  # reported to the handlers; read the others
            logger.debug("reading lock replies at exit failed: %s", exc)


def supports_channel(client: Any) -> TypeGuard[redis.Redis]:
    """True for clients whose lock requests go through a :class:`Channel`.

    Standalone Redis (a plain connection pool) in a process with real threads;
    Sentinel and Cluster clients, and greenlet pools, keep the pooled path.
    """
    return (isinstance(client, redis.Redis)
            and type(client.connection_pool) in (redis.ConnectionPool, redis.BlockingConnectionPool)
            and not native.green())


_local = threading.local()
#: Bumped in a forked child: every thread-local cache of the parent is stale there.
_generation = 0


def _new_generation_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_new_generation_in_child)


def channel_for(client: redis.Redis) -> Channel:
    """This thread's channel for ``client`` (a new one after a fork)."""
    channel = channel_or_none(client)
    if channel is None:
        raise TypeError(f"{client!r} has no lock channel (see supports_channel)")
    return channel


def channel_or_none(client: Any) -> Channel | None:
    """This thread's channel for ``client``, or None when it has none (:func:`supports_channel`).

    One dictionary look-up per lock request: the verdict is cached with the channel.
    """
    channels: dict[int, tuple[weakref.ref[Any], Channel | None]] | None = getattr(_local, "channels", None)
    if channels is not None and _local.generation == _generation:
        known = channels.get(id(client))
        if known is not None and known[0]() is client:
            return known[1]
    else:
        channels = _local.channels = {}
        _local.generation = _generation
    # A new client, an id reused, or a new process.
    channel = Channel(client) if supports_channel(client) else None
    channels[id(client)] = (weakref.ref(client), channel)
    return channel
