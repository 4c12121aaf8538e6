"""Counters (acquired, skipped, released, ...) counted in the process, written in batches.

A run never pays a request for its counters: each outcome adds one to a
dictionary of this process, and a daemon thread writes what accumulated, one
write of ``HINCRBY`` and ``PEXPIRE`` for every counter hash, at most :data:`FLUSH_EVERY` seconds
after the first count. The hashes expire :data:`~.scripts.STATS_TTL_MS` after
their last write.

When the process ends (interpreter exit; a prefork pool child, which ends with
``os._exit``, at Celery's ``worker_process_shutdown``: see :mod:`.worker`),
:func:`flush_at_exit` first reads the replies of releases still unread (a
release is counted when its reply says whether the lock was still ours), then
writes what is left, after any write already under way.

What a process counted and had not written yet is lost with it when it is
SIGKILLed: at most one batch, the counts of its last second.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import threading
from collections import defaultdict, deque
from typing import Any

import redis

from .. import native
from ..connection.channels import channel_or_none
from ..connection.flusher import read_all_replies
from ..connection.wire import Request, Short
from ..log import logger
from ..recovery.lock_redis import thread_client
from .commands import raise_errors
from .scripts import STATS_TTL_MS

__all__ = ["FLUSH_EVERY", "count", "flush", "flush_at_exit"]

#: Seconds after a first count that the batch is written.
FLUSH_EVERY = 1.0


class _Batch:
    """This process's counts not yet written: a queue of counts, drained by its writer.

    Counting appends to a ``deque`` (atomic): no lock on the run's path, so a signal
    handler's exception (a soft time limit) can never leave one held. The writer is
    a real OS thread (see :mod:`.native`), with a Redis client of its own in
    greenlet pools.
    """

    def __init__(self) -> None:
        self.lock = native.allocate_lock()
        #: Held while a batch is written: a flush at the process's end waits for one under way.
        self.writing = native.allocate_lock()
        #: ``(client, counter hash, field, amount)`` counted and not yet written.
        self.pending: deque[tuple[Any, str, str, int]] = deque()
        self.wake = native.Wakeup()
        self.started = False
        #: The writer was woken for the counts queued (it writes them within a second).
        self.waiting = False

    def wake_writer(self) -> None:
        """The first count of a batch: start the writer (once) and have it write within a second."""
        with self.lock:
            if self.waiting:
                return
            self.waiting = True
            start, self.started = not self.started, True
        if start:
            native.start_thread(self._run, "singleton-counters")
        self.wake.notify()

    def _run(self) -> None:
        pause = native.Wakeup()  # never notified: a sleep of the OS thread
        while True:
            self.wake.wait(3600.0)
            pause.wait(FLUSH_EVERY)  # let the batch fill for a second
            self.flush()

    def flush(self) -> None:
        with self.writing:
            while True:
                self._write()
                with self.lock:
                    if not self.pending:  # a count queued while waiting was still set: write it too
                        self.waiting = False
                        return

    def _write(self) -> None:
        pending, popleft = self.pending, self.pending.popleft
        counts: dict[tuple[int, str], defaultdict[str, int]] = {}
        clients: dict[int, Any] = {}
        while pending:
            client, key, field, amount = popleft()
            slot = (id(client), key)
            fields = counts.get(slot)
            if fields is None:
                fields = counts[slot] = defaultdict(int)
                clients[slot[0]] = client
            fields[field] += amount
        by_client: dict[int, list[tuple[str, dict[str, int]]]] = defaultdict(list)
        for (client_id, key), counted in counts.items():
            by_client[client_id].append((key, dict(counted)))
        for client_id, hashes in by_client.items():
            try:
                # One write on the writer thread's own lock channel where the client
                # has one (standalone Redis), its commands spelt in RESP here and their
                # replies (integers) read in one step: a redis-py pipeline on a pooled
                # connection cost ~295k instructions per batch, this ~77k. Sentinel,
                # Cluster and greenlet pools keep redis-py's pipeline (its failover handling).
                client = thread_client(clients[client_id])
                channel = channel_or_none(client)
                if channel is not None:
                    data, count = _resp(hashes)
                    channel.call(Request(None, raise_errors, data=data, count=count, short=_integers(count)))
                else:
                    pipe = client.pipeline(transaction=False)
                    for key, hashed in hashes:
                        for name, value in hashed.items():
                            pipe.execute_command(b"HINCRBY", key, name, value)
                        pipe.execute_command(b"PEXPIRE", key, STATS_TTL_MS)
                    pipe.execute()
            except (redis.RedisError, OSError) as exc:  # counters are best effort
                logger.debug("could not write %d counter hash(es): %s", len(hashes), exc)
            except Exception as exc:  # never let the thread die
                logger.warning("could not write counters: %s", exc)


#: ``HINCRBY key field amount`` and ``PEXPIRE key ttl`` in RESP (``%`` fills the rest).
_HINCRBY = b"*4\r\n$7\r\nHINCRBY\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
_PEXPIRE = b"*3\r\n$7\r\nPEXPIRE\r\n$%%d\r\n%%s\r\n$%d\r\n%d\r\n" % (len(b"%d" % STATS_TTL_MS), STATS_TTL_MS)


def _resp(hashes: list[tuple[str, dict[str, int]]]) -> tuple[bytes, int]:
    """The batch's commands in RESP, and how many replies they get."""
    parts: list[bytes] = []
    for key, hashed in hashes:
        k = key.encode()
        for name, amount in hashed.items():
            f, a = name.encode(), b"%d" % amount
            parts.append(_HINCRBY % (len(k), k, len(f), f, len(a), a))
        parts.append(_PEXPIRE % (len(k), k))
    return b"".join(parts), len(parts)


@functools.lru_cache(maxsize=64)
def _integers(count: int) -> Short:
    """``count`` integer replies, nothing else: the usual replies of a batch (any error goes
    through the general reader, and ``raise_errors`` raises it)."""
    return Short(re.compile(rb"(?::-?\d+\r\n){%d}" % count), _nothing)


def _nothing(_match: re.Match[bytes]) -> None:
    return None


_batches: dict[int, _Batch] = {}
_batches_lock = threading.Lock()


_current: _Batch | None = None


def _batch() -> _Batch:
    global _current
    batch = _current
    if batch is None:
        with _batches_lock:
            batch = _current
            if batch is None:
                batch = _current = _batches[os.getpid()] = _Batch()
    return batch


def _after_fork_in_child() -> None:
    global _batches_lock, _current
    _batches_lock = threading.Lock()
    _current = None  # a forked child counts for itself
    _batches.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def count(client: Any, key: str | None, field: str, amount: int = 1) -> None:
    """Add ``amount`` to ``field`` of the counter hash ``key`` (nothing when ``key`` is None)."""
    if not (key and field):
        return
    batch = _current or _batch()
    batch.pending.append((client, key, field, amount))
    if not batch.waiting:  # the first count of a batch wakes the writer; the rest ride along
        batch.wake_writer()


def flush() -> None:
    """Write this process's pending counts now (tests, tools); after a write under way."""
    batch = _batches.get(os.getpid())
    if batch is not None:
        batch.flush()


def flush_at_exit() -> None:
    """This process ends: read every release reply still unread (each is counted), then
    write the counts. At interpreter exit, and in a prefork child as it ends."""
    read_all_replies()
    flush()


atexit.register(flush_at_exit)
