"""What every admin function shares: its errors, the app's Redis, the key layout, SCAN.

Each public admin function takes the Celery ``app`` and reads the Redis of its
``singleton_redis_url`` (the one the workers and beats use) with the client
the library itself uses (:func:`~celery_singleton_beat.connection.client.get_redis`).
Failures come out as :class:`AdminError` subclasses, never as raw redis-py
exceptions, so a caller (a health endpoint, an admin page) catches one family.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from redis.exceptions import RedisClusterException

from ..beat import history_key as beat_history_key
from ..beat import stats_key as beat_totals_key
from ..config import SingletonSettings, get_settings
from ..connection.client import RedisClient, scan_all
from ..connection.url import sanitize_redis_url
from ..exceptions import SingletonError
from ..lease.commands import legacy_fence_key as fence_key
from ..lease.holder import done_key
from ..lease.liveness import live_key
from ..recovery.lock_redis import get_redis
from ..recovery.window import recovery_key, server_key
from ..task.keys import QUEUED_SUFFIX, beat_stats_key, task_stats_key

__all__ = [
    "AdminError",
    "AdminRedisError",
    "InvalidSettings",
    "KeySpace",
    "RedisUnavailable",
    "Target",
    "connect",
    "glob_escape",
    "load_tasks",
]

#: Errors that mean "the Redis of the locks cannot be used": redis-py reports
#: some Cluster failures as RedisClusterException, which is not a RedisError.
REDIS_ERRORS = (redis.RedisError, RedisClusterException)
#: Of those, the ones that mean the server could not be reached (or not in time).
#: AuthenticationError and Sentinel's MasterNotFoundError are ConnectionErrors.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, RedisClusterException)
#: SCAN page size and keys read back per pipeline round trip.
SCAN_COUNT = 1000
BATCH = 500


# --------------------------------------------------------------------------- errors


class AdminError(SingletonError):
    """Base class of the errors of :mod:`celery_singleton_beat.admin`."""


class InvalidSettings(AdminError, ImproperlyConfigured):
    """The app's ``singleton_*`` settings are invalid (also an ``ImproperlyConfigured``)."""


class AdminRedisError(AdminError):
    """Redis failed a command (e.g. an ACL refused it); ``cause`` is redis-py's exception."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(url, f"{type(cause).__name__}: {cause}")
        self.url, self.cause = url, cause

    def __str__(self) -> str:
        return f"Redis at {self.url} failed: {self.args[1]}"


class RedisUnavailable(AdminRedisError):
    """Redis could not be reached (refused, timed out, a Cluster whose nodes do not answer)."""

    def __str__(self) -> str:
        return f"cannot reach Redis at {self.url}: {self.args[1]}"


class NotALockKey(AdminError, ValueError):
    """A key given to release or read is not a task lock key under the app's prefix."""


# --------------------------------------------------------------------------- the app's Redis


@dataclass(frozen=True)
class Target:
    """An app's validated settings and its Redis client, as the admin functions use them."""

    app: Celery
    settings: SingletonSettings
    client: RedisClient

    @property
    def prefix(self) -> str:
        """The key prefix (``singleton_key_prefix``)."""
        return self.settings.key_prefix

    @property
    def url(self) -> str:
        """The Redis URL with its password masked, for messages."""
        return sanitize_redis_url(self.settings.redis_url)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn redis-py's exceptions into :class:`RedisUnavailable` / :class:`AdminRedisError`."""
        with redis_errors(self.url):
            yield


@contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """See :meth:`Target.guard`."""
    try:
        yield
    except UNREACHABLE as exc:
        raise RedisUnavailable(url, exc) from exc
    except redis.RedisError as exc:
        raise AdminRedisError(url, exc) from exc


def settings_of(app: Celery) -> SingletonSettings:
    """The app's validated settings; :class:`InvalidSettings` if they are not valid."""
    try:
        return get_settings(app)
    except InvalidSettings:
        raise
    except ImproperlyConfigured as exc:
        raise InvalidSettings(str(exc)) from exc


def connect(app: Celery) -> Target:
    """The app's settings and Redis client (the library's own, cached per process).

    Raises :class:`InvalidSettings`, or :class:`RedisUnavailable` for a Redis
    Cluster whose nodes do not answer (its client asks them for the slot
    layout when it is made; other clients connect on their first command).
    """
    settings = settings_of(app)
    with redis_errors(sanitize_redis_url(settings.redis_url)):
        client = get_redis(app)
    return Target(app, settings, client)


def load_tasks(app: Celery) -> None:
    """Import the app's task modules and finalize it, as ``celery worker`` and ``beat`` do.

    ``include``/``imports`` modules and ``autodiscover_tasks()`` packages are
    imported by the loader's ``import_default_modules`` (which also sends
    ``import_modules``, the signal autodiscovery and Django's fix-up listen
    to); ``finalize`` then evaluates pending task decorators. Without this,
    ``app.tasks`` holds only the tasks of modules already imported, which for
    ``celery -A proj.celery_app`` is often none. Errors of the app's own
    modules propagate.
    """
    app.loader.import_default_modules()
    app.finalize()


# --------------------------------------------------------------------------- key layout


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def text(value: bytes | str) -> str:
    """A Redis reply as text."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class KeySpace:
    """What each key under one prefix is, by the library's key layout.

    * ``<p>:{<task>:<sha256>}`` a run lock or publish-time claim; ``:queued``
      the queue claim of ``until_executing``; ``:fence`` the per-key fencing counters
      of releases before 0.3 (deleted by each acquire since);
      ``:done:<task id>`` the done marker of an ``acks_late`` run;
    * ``<p>:live:<boot>`` a worker's liveness key; ``<p>:probe:<random>`` the
      start-up check's probe (deleted at once);
    * ``<p>:{beat:<name>}:<slot>`` a beat slot claim; ``<p>:{beat:<name>}:scheduled``
      since when the entry is scheduled (what makes a slot missed);
    * ``<p>:{stats}:task:<task>`` / ``<p>:{stats}:beat:<entry>`` counters;
    * ``<p>:{beat}:history`` / ``<p>:{beat}:stats`` the beat's capped history
      and its counter totals;
    * ``<p>:server`` the server last seen serving the data, ``<p>:recovery`` an
      open recovery window (on Redis Cluster one of each per shard,
      ``<p>:server:{<n>}`` and ``<p>:recovery:{<n>}``; see :mod:`~celery_singleton_beat.recovery.window`).

    Keys are matched whole (a task named ``beats.x`` is not a beat key).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        p = re.escape(prefix)
        self._lock = re.compile(
            rf"{p}:\{{(?P<task>.+):[0-9a-f]{{64}}\}}(?P<queued>{re.escape(QUEUED_SUFFIX)})?"
            rf"(?:(?P<fence>{re.escape(fence_key(''))})|(?P<done>{re.escape(done_key('', None))}[^{{}}]*))?\Z",
            re.S,
        )
        self._live = live_key(prefix, "")
        self._probe = f"{prefix}:probe:"
        self._slot = re.compile(rf"{p}:\{{beat:(?P<name>.+)\}}:(?P<slot>[0-9][^{{}}]*)\Z", re.S)
        self._record = re.compile(rf"{p}:\{{beat:.+\}}:scheduled\Z", re.S)
        self._fixed = {
            beat_history_key(prefix): "beat-history",
            beat_totals_key(prefix): "beat-stats",
            server_key(prefix): "server-record",
            recovery_key(prefix): "recovery-window",
        }
        #: One per Redis Cluster shard (see :func:`~celery_singleton_beat.recovery.window.records_of`).
        self._shard_record = re.compile(rf"{p}:(?P<kind>server|recovery):\{{[0-9]+\}}\Z", re.S)
        self._task_stats = task_stats_key(prefix, "")
        self._beat_stats = beat_stats_key(prefix, "")

    def lock(self, key: str) -> tuple[str, str] | None:
        """``(task, kind)`` of a lock key (kind ``lock`` or ``queued``); None otherwise."""
        match = self._lock.match(key)
        if match is None or match["fence"] or match["done"] is not None:
            return None
        return match["task"], "queued" if match["queued"] else "lock"

    def slot(self, key: str) -> tuple[str, str] | None:
        """``(name, slot)`` of a beat slot claim key; None otherwise."""
        match = self._slot.match(key)
        if match is None or self.kind(key) != "slot":
            return None
        return match["name"], match["slot"]

    def kind(self, key: str) -> str:
        """``lock``, ``queued``, ``fence``, ``done``, ``slot``, ``beat-record``, ``live``, ``probe``,
        ``task-stats``, ``beat-stats``, ``beat-history``, ``server-record``, ``recovery-window``
        or ``other``."""
        match = self._lock.match(key)
        if match is not None:
            if match["done"] is not None:
                return "done"
            return "fence" if match["fence"] else ("queued" if match["queued"] else "lock")
        if key in self._fixed:
            return self._fixed[key]
        shard_record = self._shard_record.match(key)
        if shard_record is not None:
            return "server-record" if shard_record["kind"] == "server" else "recovery-window"
        if key.startswith(self._live) and re.fullmatch(r"[0-9a-f]+", key[len(self._live):]):
            return "live"
        if key.startswith(self._probe):
            return "probe"
        if key.startswith(self._task_stats):
            return "task-stats"
        if key.startswith(self._beat_stats):
            return "beat-stats"
        if self._slot.match(key):
            return "slot"
        if self._record.match(key):
            return "beat-record"
        return "other"

    @property
    def pattern(self) -> str:
        """``MATCH`` pattern of every key under the prefix."""
        return f"{glob_escape(self.prefix)}:*"


def scan(client: RedisClient, match: str) -> Iterator[list[str]]:
    """Keys matching ``match`` in batches of at most ``BATCH`` (SCAN on each primary, never KEYS).

    ``KEYS`` would block the server for the whole walk, which on a production
    Redis stalls every lock of every worker.
    """
    batch: list[str] = []
    for key in scan_all(client, match, count=SCAN_COUNT):
        batch.append(text(key))
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def read(client: RedisClient, keys: Sequence[str], *commands: str) -> list[list[Any]]:
    """Run ``commands`` (e.g. ``"get", "pttl"``) on each key in one round trip.

    A key of an unexpected type answers with the error instead of its value.
    """
    pipe = client.pipeline(transaction=False)
    for key in keys:
        for command in commands:
            getattr(pipe, command)(key)
    replies: list[Any] = pipe.execute(raise_on_error=False)
    width = len(commands)
    return [replies[i:i + width] for i in range(0, len(replies), width)]


def examples(keys: Sequence[str], limit: int = 5) -> str:
    """The first ``limit`` of ``keys``, and how many more there are."""
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")
