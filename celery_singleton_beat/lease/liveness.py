"""Which worker incarnations are alive: liveness keys and boot ids.

A worker process tree (main process and its pool) is one *incarnation*, named
by a random boot id that pool children inherit. While it runs, the worker's
main process keeps ``<prefix>:live:<boot>`` in Redis with a TTL of
``singleton_liveness_ttl`` seconds, rewritten every third of it by a
:class:`Heartbeat` thread.

Every lock records the boot id of the run that took it and whether that
process publishes liveness (``"live": true``). A lock held by an incarnation
whose liveness key is gone belongs to a process tree that died (a pod or VM
lost with its worker, ``kill -9`` of the main process): any worker may take it
over, whatever node names are involved. Two live workers never free each
other's locks, duplicate node names included, because the decision rests on
the boot id, not the name.

Processes that are not workers (a web process running a task eagerly, a
script) publish no liveness: their locks are only ever freed by their owner
or by the lease TTL.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

import redis

from .. import native
from ..connection.channels import channel_or_none, close_own_channels
from ..connection.pooled import run_pooled
from ..connection.wire import Request
from ..log import logger
from ..recovery.lock_redis import release_thread_client, thread_client
from ..recovery.server import server_of

__all__ = ["Heartbeat", "boot_id", "is_alive", "live_key", "publishes_liveness"]

_boot_id = uuid.uuid4().hex
_publishing = False


def boot_id() -> str:
    """The id of this incarnation (inherited by forked pool children)."""
    return _boot_id


def publishes_liveness() -> bool:
    """True in a worker (and its pool children) whose main process keeps a liveness key."""
    return _publishing


def live_key(prefix: str, boot: str) -> str:
    """The liveness key of the incarnation ``boot``."""
    return f"{prefix}:live:{boot}"


def is_alive(client: Any, prefix: str, boot: str) -> bool:
    """Whether the incarnation ``boot`` still proves it is alive (one ``EXISTS``)."""
    return boot == _boot_id or bool(client.exists(live_key(prefix, boot)))


def _first_reply(replies: list[Any]) -> Any:
    if isinstance(replies[0], Exception):
        raise replies[0]
    return replies[0]


class Heartbeat:
    """Keeps this incarnation's liveness key alive from a daemon thread.

    Started by the worker's boot step before the pool forks or consumes, so
    every lock a run of this worker takes is covered from its first moment.
    The key is never deleted on a warm shutdown: running tasks still finish
    and release their locks, and the key then expires on its own. When the
    thread finds its key gone (Redis restarted, or unreachable for longer
    than the TTL, or this process paused or starved that long), it logs it
    with the seconds since its last successful renewal (monotonic clock): other
    workers may have taken over this worker's locks, and its runs learn it at
    their next renewal (``LockLost``).
    """

    def __init__(self, client: Any, prefix: str, ttl: float, node: str) -> None:
        #: The Redis client, or a callable returning it at each use (a Cluster client
        #: cannot be built while no node answers: a worker started during an outage).
        self._client = client
        self.key = live_key(prefix, _boot_id)
        self.ttl_ms = max(1, int(ttl * 1000))
        self.interval = ttl / 3
        self.value = json.dumps({"node": node, "host": socket.gethostname(), "pid": os.getpid(),
                                 "started": round(time.time(), 3)}, separators=(",", ":"))
        self._stopped = False
        self._wake = native.Wakeup()
        self.beats = 0
        #: ``time.monotonic()`` when the latest write that succeeded was sent (None before one).
        self.renewed_at: float | None = None
        #: Seconds from the previous successful write's sending to the reply of the latest
        #: one, when that found the key expired: how long this worker went unrenewed.
        self.unrenewed: float | None = None
        #: The client the thread used last (its own copy of it is closed when it stops).
        self._last: Any = None

    @property
    def client(self) -> Any:
        return self._client() if callable(self._client) else self._client

    def beat(self, client: Any = None, *, own_connection: bool = False) -> bool:
        """Write the key once; False when an earlier write of it had lapsed.

        Sent like the lock requests (:mod:`.connection.pooled`), so that the connection is
        checked as theirs are: the worker's main process learns which server
        it uses before the pool forks, and its pool processes inherit that
        (how they tell a restart of that server, see :mod:`.server`).
        ``own_connection``: on the calling thread's own lock channel where the client
        has one (the heartbeat thread: a connection of its own, never borrowed from
        the pool the process's other requests use), else a pooled connection.
        """
        client = client or self.client
        server_of(client)  # the record that looks at the connection (a default one for a plain client)
        request = Request([(b"SET", self.key, self.value, b"PX", self.ttl_ms, b"GET")], _first_reply)
        channel = channel_or_none(client) if own_connection else None
        # Measured on the monotonic clock from the sending of the last write that succeeded:
        # an upper bound of the key's life without renewal, so at least the TTL when the key
        # ran out of time (below it when Redis lost the key).
        sent = time.monotonic()
        previous = channel.call(request) if channel is not None else run_pooled(client, self.key, request)
        lapsed = self.beats > 0 and previous is None
        if lapsed and self.renewed_at is not None:
            self.unrenewed = time.monotonic() - self.renewed_at
        self.renewed_at = sent
        self.beats += 1
        return not lapsed

    def start(self) -> Heartbeat:
        """Mark this process as publishing liveness, write the key, start renewing it."""
        global _publishing
        _publishing = True
        try:
            self.beat()
        except redis.RedisError as exc:
            logger.error("cannot write liveness key %s yet (retrying): %s", self.key, exc)
        # A real OS thread (see .native): a task blocking a gevent/eventlet hub
        # must not make this worker look dead.
        native.start_thread(self._run, "singleton-heartbeat")
        return self

    def stop(self) -> None:
        """Stop renewing (the key expires after its TTL)."""
        self._stopped = True
        self._wake.notify()

    def _run(self) -> None:
        try:
            self._beat_until_stopped()
        finally:
            # The thread's own connection goes with it (its lock channel, or in a greenlet
            # process its copy of the client); those of a client dropped meanwhile were
            # closed with it (reset_clients).
            close_own_channels()
            if self._last is not None:
                release_thread_client(self._last)

    def _beat_until_stopped(self) -> None:
        wait = self.interval
        while True:
            self._wake.wait(wait)
            if self._stopped:
                return
            try:
                client = self._last = self.client
                if not self.beat(thread_client(client), own_connection=True):
                    # How long since the last renewal tells a paused or starved process (a
                    # figure past the TTL) from a key lost in Redis (restart, flush: below it).
                    logger.error("liveness key %s had expired (last renewed %.1f s ago, TTL %g s): this "
                                 "worker counted as dead for a while; other workers may have taken over "
                                 "its locks", self.key, self.unrenewed or 0.0, self.ttl_ms / 1000)
                wait = self.interval
            except redis.RedisError as exc:
                logger.error("cannot renew liveness key %s: %s", self.key, exc)
                wait = min(self.interval, 1.0)
            except Exception:  # never let the thread die
                logger.exception("unexpected error renewing liveness key %s", self.key)
                wait = self.interval
