"""What every admin function shares: its errors, the app's Redis, the key layout, SCAN.

Each public admin function takes the Celery ``app`` and reads the Redis of its
``singleton_redis_url`` (the one the workers and beats use) with the client
the library itself uses (:func:`~celery_singleton_beat.connection.client.get_redis`).
Failures come out as :class:`AdminError` subclasses, never as raw redis-py
exceptions, so a caller (a health endpoint, an admin page) catches one family.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from redis.exceptions import RedisClusterException

from ..beat import history_key as beat_history_key
from ..beat import stats_key as beat_totals_key
from ..config import SingletonSettings, get_settings
from ..connection.client import RedisClient, is_cluster, primary_clients
from ..connection.url import sanitize_redis_url
from ..exceptions import SingletonError
from ..lease.commands import legacy_fence_key as fence_key
from ..lease.holder import done_key
from ..lease.liveness import live_key
from ..recovery.lock_redis import get_redis
from ..recovery.records import recovery_key, server_key
from ..task.keys import QUEUED_SUFFIX, beat_stats_key, task_stats_key

__all__ = [
    "AdminError",
    "AdminRedisError",
    "InvalidSettings",
    "KeySpace",
    "Progress",
    "RedisUnavailable",
    "ScanProgress",
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
T = TypeVar("T")

#: The COUNT of each SCAN call: about how many keys the server looks at per call (one
#: round trip each), matching or not. See :func:`scan`.
SCAN_COUNT = 5000
#: Keys read back per pipeline round trip.
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
        #: One per Redis Cluster shard (see :func:`~celery_singleton_beat.recovery.records.records_of`).
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

    def lock_pattern(self, task: str | None = None) -> str:
        """``MATCH`` pattern of the lock keys (``<prefix>:{<task>:*``), of ``task`` only if given:
        the server filters the walk by task. Other keys may match too (use :meth:`lock`)."""
        return f"{glob_escape(self.prefix)}:{{{glob_escape(task) + ':' if task else ''}*"

    def slot_pattern(self, entry: str | None = None) -> str:
        """``MATCH`` pattern of the beat slot claim keys, of ``entry`` only if given (which also
        matches entries whose name starts with it: use :meth:`slot`)."""
        return f"{glob_escape(self.prefix)}:{{beat:{glob_escape(entry) if entry is not None else ''}*"

    @property
    def stats_pattern(self) -> str:
        """``MATCH`` pattern of the counter hashes of tasks and beat entries."""
        return f"{glob_escape(self.prefix)}:{{stats}}:*"


@dataclass(frozen=True)
class ScanProgress:
    """How far a walk of the keyspace has come: given to a ``progress`` callback after each SCAN call.

    ``scanned``: keys the server has looked at so far, matching or not (an estimate, about
    ``SCAN_COUNT`` per call; exact once ``done``); ``total``: keys in the database(s) when the
    walk began (``DBSIZE``), None when the server does not say; ``matched``: keys the walk
    returned so far; ``done``: the last SCAN call has answered.
    """

    #: Keys the server has looked at so far, matching or not: an estimate (a SCAN call looks
    #: at about :data:`SCAN_COUNT` keys), exact once ``done``.
    scanned: int
    #: Keys in the database when the walk began (``DBSIZE``; on Cluster, of every primary);
    #: None when the server does not say (e.g. an ACL user without ``DBSIZE``).
    total: int | None
    #: Keys the walk returned so far (those matching its pattern).
    matched: int
    #: True after the last SCAN call.
    done: bool


#: A callback given each :class:`ScanProgress` of a walk (``progress=`` of the admin functions).
Progress = Callable[[ScanProgress], None]


def _dbsize(server: Any) -> int | None:
    try:
        return int(server.dbsize())
    except redis.ResponseError:  # refused (ACL, a proxy without it): the walk goes on without it
        return None


def walk(client: RedisClient, match: str, pick: Callable[[str], T | None], commands: Sequence[str] = (),
         progress: Progress | None = None, *, unique: bool = True) -> Iterator[list[tuple[str, T, list[Any]]]]:
    """The keys matching ``match`` that ``pick`` accepts, with the replies of ``commands`` on each.

    ``SCAN <cursor> MATCH <match> COUNT`` :data:`SCAN_COUNT` on each primary in turn, never
    ``KEYS``: ``KEYS`` would block the server for the whole walk, which on a production Redis
    stalls every lock of every worker, while each SCAN call looks at about ``SCAN_COUNT`` keys.
    The server filters with ``match`` (give the narrowest pattern: only the matching keys cross
    the network); ``pick(key)`` returns what to keep of a key (e.g. its parsed name), None to
    skip it. Yields ``(key, picked, replies)`` for the keys of each SCAN call as soon as they are
    read: the ``commands`` (e.g. ``"get", "pttl"``) on one call's keys are sent in the same
    pipeline as the next SCAN call, the GETs as one ``MGET`` (on Cluster, in a round trip of
    their own through the Cluster client), so reading costs no round trip of its own. A key of
    another type answers with an error (None for a GET). A key SCAN returns twice (it may,
    while the server resizes its table) is given once when ``unique``, which keeps the
    matching keys in memory (not the others).
    ``progress`` is called after each SCAN call, once its keys were handed out (``DBSIZE`` is
    asked first).
    """
    servers = primary_clients(client)
    sizes = [_dbsize(server) for server in servers] if progress is not None else []
    total = None if progress is None or None in sizes else sum(size or 0 for size in sizes)
    piggyback = bool(commands) and not is_cluster(client)
    seen: set[str] = set()
    scanned = matched = 0
    for index, server in enumerate(servers):
        cursor = 0
        calls = 0
        pending: list[tuple[str, T]] = []  # picked from the last SCAN call, read with the next one
        while True:
            pipe = server.pipeline(transaction=False)
            pipe.scan(cursor=cursor, match=match, count=SCAN_COUNT)
            if piggyback:
                _queue(pipe, [key for key, _ in pending], commands, mget=True)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            if isinstance(replies[0], Exception):
                raise replies[0]
            cursor, found = replies[0]
            calls += 1
            if pending:
                yield _joined(pending, _rows(replies[1:], len(pending), commands, mget=True))
            keys = [text(key) for key in found]
            if unique:
                keys = [key for key in keys if key not in seen]
                seen.update(keys)
            matched += len(keys)
            picked = [(key, kept) for key in keys if (kept := pick(key)) is not None]
            pending = []
            if piggyback and cursor != 0:
                pending = picked
            else:  # no commands; or the last call's keys, or a Cluster's: a round trip of their own
                for start in range(0, len(picked), BATCH):
                    chunk = picked[start:start + BATCH]
                    rows = read(client, [key for key, _ in chunk], *commands) if commands else [[]] * len(chunk)
                    yield _joined(chunk, rows)
            if progress is not None:
                size = sizes[index]
                here = calls * SCAN_COUNT if size is None else size if cursor == 0 else min(calls * SCAN_COUNT, size)
                progress(ScanProgress(scanned + here, total, matched, cursor == 0 and index == len(servers) - 1))
                if cursor == 0:
                    scanned += here
            if cursor == 0:
                break


def _queue(pipe: Any, keys: Sequence[str], commands: Sequence[str], *, mget: bool = False) -> None:
    """Queue each of ``commands`` on every key; with ``mget``, the GETs as one ``MGET`` (keys
    of one server only: not on Cluster). ``"time"`` is the server's clock, asked once after
    the commands before it (one server only): each key's row gets it, in Unix ms."""
    for command in commands:
        if command == "time":
            if keys:
                pipe.time()
        elif mget and command == "get":
            if keys:
                pipe.mget(list(keys))
        else:
            for key in keys:
                getattr(pipe, command)(key)


def _rows(replies: Sequence[Any], count: int, commands: Sequence[str], *, mget: bool = False) -> list[list[Any]]:
    """The replies of :func:`_queue` on ``count`` keys, as one row per key."""
    columns: list[Sequence[Any]] = []
    at = 0
    for command in commands:
        if command == "time":
            if count:
                if isinstance(replies[at], Exception):
                    raise replies[at]
                seconds, micros = replies[at]
                columns.append([int(seconds) * 1000 + int(micros) // 1000] * count)
                at += 1
            else:
                columns.append([])
        elif mget and command == "get":
            if count:
                if isinstance(replies[at], Exception):
                    raise replies[at]
                columns.append(replies[at])
                at += 1
            else:
                columns.append([])
        else:
            columns.append(replies[at:at + count])
            at += count
    return [list(row) for row in zip(*columns, strict=True)] if columns else [[] for _ in range(count)]


def _joined(picked: Sequence[tuple[str, T]], rows: Sequence[list[Any]]) -> list[tuple[str, T, list[Any]]]:
    return [(key, kept, row) for (key, kept), row in zip(picked, rows, strict=True)]


def scan(client: RedisClient, match: str, progress: Progress | None = None, *,
         unique: bool = True) -> Iterator[list[str]]:
    """Keys matching ``match``, each SCAN call's as they come, in lists of at most ``BATCH``
    (see :func:`walk`)."""
    for found in walk(client, match, _itself, (), progress, unique=unique):
        yield [key for key, _, _ in found]


def _itself(key: str) -> str:
    return key


def read(client: RedisClient, keys: Sequence[str], *commands: str) -> list[list[Any]]:
    """Run ``commands`` (e.g. ``"get", "pttl"``) on each key in one round trip.

    A key of an unexpected type answers with the error instead of its value.
    """
    pipe = client.pipeline(transaction=False)
    _queue(pipe, keys, commands)
    return _rows(pipe.execute(raise_on_error=False), len(keys), commands)


def examples(keys: Sequence[str], limit: int = 5) -> str:
    """The first ``limit`` of ``keys``, and how many more there are."""
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")
