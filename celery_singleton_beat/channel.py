"""One Redis connection per process and thread for the lock commands of runs.

A run's critical path has two lock commands: acquire (its reply decides
whether the body runs) and release (nobody waits for its reply). The channel
writes a release at once -- Redis executes it as soon as it reads it, so other
processes see the key free without delay -- and reads its reply later, in the
same round trip as the next command it waits for (the next acquire, under
steady load). A run therefore costs one blocking round trip, not two, and
commands stay in order on the connection: a run of the same key right after
its predecessor always finds the predecessor's release already executed.

When no next command comes, a background thread reads the pending replies
:data:`FLUSH_AFTER` seconds after they were written, so the outcome of a
release (was the lock still ours?) is always reported within that bound.

Used for standalone Redis clients without ``singleton_wait_replicas``, in
processes whose sockets are not green (Sentinel, Cluster, ``WAIT`` and the
gevent / eventlet pools keep the plain path, two round trips). The connection
is made from the client's own pool settings, belongs to one thread and process
(a forked child makes its own), and is rebuilt after an error.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeGuard

import redis
from redis.exceptions import NoScriptError

from .events import logger

__all__ = ["Channel", "channel_for", "channel_or_none", "supports_channel"]

#: Called with the reply of a command sent without waiting (or the error it got).
ReplyHandler = Callable[[Any, BaseException | None], None]

#: Seconds after which a pending reply is read even if no next command comes.
FLUSH_AFTER = 0.1


class _Script(Protocol):
    """What the channel needs of a Lua script (:class:`~.scripts.LuaScript`): its SHA and source."""

    sha: str
    source: bytes


class Channel:
    """A dedicated connection: blocking calls, and sends whose replies are read later.

    Replies are read strictly in the order the commands were written. A script
    is loaded (``SCRIPT LOAD``, written just before its first call) once per
    connection, so a call written without waiting never meets ``NOSCRIPT``:
    re-running it later could reorder it after the next acquire. Should a
    ``SCRIPT FLUSH`` happen anyway, the scripts are loaded again and the
    commands that met ``NOSCRIPT`` run again in their order (a release ahead
    of the acquire that follows it, when both failed).
    """

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        # Held by the owning thread for each call, and by the flusher thread.
        self._lock = threading.Lock()
        #: Monotonic time the oldest unread reply was written (None: nothing pending).
        self.oldest: float | None = None
        self._connection: Any = None
        self._loaded: set[str] = set()
        self._pending: deque[tuple[_Script | None, Sequence[Any], Sequence[Any], ReplyHandler]] = deque()
        #: True while the flusher thread watches this channel (set and cleared by it).
        self.watched = False

    # ----------------------------------------------------------------- public

    def call(self, script: _Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run ``script`` and return its reply; earlier sends' replies are read first.

        One round trip: the command is written before the pending replies are read.
        """
        with self._lock:
            return self._call(script, keys, args)

    def _call(self, script: _Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        connection = self._write(script, keys, args)
        try:
            failed = self._read_pending(connection)
            try:
                reply = connection.read_response()
            except NoScriptError:  # SCRIPT FLUSH: load again, redo in order
                self._loaded.clear()
                self._redo(connection, failed)
                return self._run_now(connection, script, keys, args)
            self._redo(connection, failed)
            return reply
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._reset("call")
            raise

    def send(self, script: _Script, keys: Sequence[Any], args: Sequence[Any],
             on_reply: ReplyHandler) -> None:
        """Write ``script``'s call now; ``on_reply`` gets its reply when it is read.

        Raises ``redis.RedisError`` if the command could not be written.
        """
        with self._lock:
            self._write(script, keys, args)
            self._pending.append((script, keys, args, on_reply))
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
            connection = self._connect()
            try:
                self._redo(connection, self._read_pending(connection))
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._reset("flush")
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
        """Calls written whose reply has not been read yet."""
        return sum(1 for script, *_ in self._pending if script is not None)

    # ----------------------------------------------------------------- internals

    def _connect(self) -> Any:
        if self._connection is None:
            self._connection = self._pool.make_connection()
        return self._connection

    def _write(self, script: _Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        connection = self._connect()
        try:
            # A health check (PING) would read a pending reply as its own: only when none is.
            if script.sha not in self._loaded:
                connection.send_command("SCRIPT", "LOAD", script.source, check_health=not self._pending)
                self._pending.append((None, (), (), _ignore))
                self._loaded.add(script.sha)
            connection.send_packed_command([_pack(b"EVALSHA", script.sha, len(keys), *keys, *args)],
                                           check_health=not self._pending)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._reset("write")
            raise
        return connection

    def _read_pending(self, connection: Any) -> list[tuple[_Script, Sequence[Any], Sequence[Any], ReplyHandler]]:
        """Read every pending reply; return the calls that met ``NOSCRIPT`` (not run)."""
        self.oldest = None
        failed = []
        while self._pending:
            script, keys, args, on_reply = self._pending.popleft()
            try:
                reply = connection.read_response()
            except NoScriptError:
                self._loaded.clear()
                if script is not None:
                    failed.append((script, keys, args, on_reply))
                continue
            except redis.ResponseError as exc:
                _deliver(on_reply, None, exc)
                continue
            _deliver(on_reply, reply, None)
        return failed

    def _redo(self, connection: Any,
              failed: list[tuple[_Script, Sequence[Any], Sequence[Any], ReplyHandler]]) -> None:
        for script, keys, args, on_reply in failed:
            try:
                reply = self._run_now(connection, script, keys, args)
            except redis.ResponseError as exc:
                _deliver(on_reply, None, exc)
                continue
            _deliver(on_reply, reply, None)

    def _run_now(self, connection: Any, script: _Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Write and read one call with nothing pending (after a ``NOSCRIPT``)."""
        self._write(script, keys, args)
        self._read_pending(connection)  # the SCRIPT LOAD written ahead, if any
        return connection.read_response()

    def _reset(self, where: str) -> None:
        """Drop the connection after an error; pending replies are lost (their
        commands were written, so Redis ran them unless it went away first)."""
        lost, self._pending = list(self._pending), deque()
        self.oldest = None
        self._loaded.clear()
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):  # already broken
                connection.disconnect()
        for _, _, _, on_reply in lost:
            _deliver(on_reply, None, redis.ConnectionError(f"connection lost before the reply ({where})"))


def _pack_python(*parts: Any) -> bytes:
    """One command in RESP, for the few argument types the lock scripts use.

    redis-py's general packer costs far more than the round trip on these
    ~15-argument calls; this one does the same for bytes, str and int.
    """
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        if type(part) is not bytes:
            part = str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def _hiredis_packer() -> Callable[..., bytes] | None:
    """hiredis's C packer (the ``fast`` extra), if installed: 2.5x faster than :func:`_pack_python`."""
    try:
        from hiredis import pack_command
    except ImportError:  # not installed, or too old to have it
        return None

    def pack(*parts: Any) -> bytes:
        return pack_command(parts)  # type: ignore[no-any-return]

    # Same bytes for every argument type the scripts pass (checked once, here).
    sample = (b"EVALSHA", "x" * 40, 2, "k:{a}", "\u00e9", 0, -1, b"\x00\xff")
    return pack if pack(*sample) == _pack_python(*sample) else None


_pack: Callable[..., bytes] = _hiredis_packer() or _pack_python


def _ignore(reply: Any, error: BaseException | None) -> None:
    """Reply handler of a ``SCRIPT LOAD`` written ahead of a call."""


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


def _green() -> bool:
    """True when gevent or eventlet patched the sockets (greenlet pools)."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("socket"):
        return True
    eventlet = sys.modules.get("eventlet.patcher")
    return eventlet is not None and bool(eventlet.is_monkey_patched("socket"))


def supports_channel(client: Any) -> TypeGuard[redis.Redis]:
    """True for clients whose lock commands go through a :class:`Channel`.

    Standalone Redis (a plain connection pool) in a process with real threads;
    Sentinel and Cluster clients, and greenlet pools, keep the plain path.
    """
    return (isinstance(client, redis.Redis)
            and type(client.connection_pool) in (redis.ConnectionPool, redis.BlockingConnectionPool)
            and not _green())


_local = threading.local()


def channel_for(client: redis.Redis) -> Channel:
    """This thread's channel for ``client`` (a new one after a fork)."""
    channel = channel_or_none(client)
    if channel is None:
        raise TypeError(f"{client!r} has no lock channel (see supports_channel)")
    return channel


def channel_or_none(client: Any) -> Channel | None:
    """This thread's channel for ``client``, or None when it has none (:func:`supports_channel`).

    One dictionary look-up per lock command: the verdict is cached with the channel.
    """
    channels: dict[int, tuple[weakref.ref[Any], Channel | None]] | None = getattr(_local, "channels", None)
    if channels is not None and _local.pid == os.getpid():
        known = channels.get(id(client))
        if known is not None and known[0]() is client:
            return known[1]
    else:
        channels = _local.channels = {}
        _local.pid = os.getpid()
    # A new client, an id reused, or a new process.
    channel = Channel(client) if supports_channel(client) else None
    channels[id(client)] = (weakref.ref(client), channel)
    return channel
