"""Task locks held now: list them, ask whether their holders still run, release them.

A release is always a compare-and-delete of the value that was read (and
shown): a lock re-taken meanwhile by another run is left alone and reported
as changed, never deleted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from celery import Celery

from ..connection.client import is_cluster
from ..lease.behalf import release_value
from ..lease.holder import Holder, parse_holder
from ..lease.stale import unconfirmed
from ..recovery.records import ServerRecord, recovery_key, server_key
from ..task.keys import QUEUED_SUFFIX, task_stats_key
from ._common import AdminError, KeySpace, NotALockKey, Progress, Target, connect, read, walk

__all__ = [
    "AmbiguousRelease",
    "HeldLock",
    "HolderReport",
    "HolderState",
    "HolderStatus",
    "LockKind",
    "ReleaseResult",
    "check_holders",
    "find_release_targets",
    "force_release",
    "iter_locks",
    "list_locks",
    "read_lock",
    "release",
    "release_lock",
]

#: ``run`` a running task; ``claim`` a queued message (``until_executed``);
#: ``queued`` the queue claim of ``until_executing``; ``unknown`` a value that
#: is not a lock record (written by something else?).
LockKind = Literal["run", "claim", "queued", "unknown"]
#: What a holder's worker said: ``running`` (releasing lets a duplicate start
#: beside it), ``stale`` (answered, not running it), ``silent`` (did not answer
#: in time: probably gone, or busy, or without remote control).
HolderState = Literal["running", "stale", "silent"]


@dataclass(frozen=True)
class HeldLock:
    """A task lock as read from Redis: ``celery singleton locks`` shows one per row."""

    #: The lock's key, ``<prefix>:{<task>:<sha256>}`` (``...:queued`` for a queue claim).
    key: str
    #: The task's registered name.
    task: str
    #: ``run`` (a running task), ``claim`` (a queued ``until_executed`` message),
    #: ``queued`` (the queue claim of ``until_executing``) or ``unknown`` (not a lock record).
    kind: LockKind
    #: Who holds it, from its value: ``task_id``, ``node``, ``pid``, ``boot`` (the worker
    #: incarnation), ``acquired_at`` (Unix time), ``ttl`` and ``every`` (its lease and renewal
    #: interval, seconds), ``claim``.
    holder: Holder
    #: The value read, for compare-and-delete.
    value: bytes | str
    #: Seconds left, or None for a lock that never expires (a problem).
    ttl: float | None
    #: Its holder did not confirm it in the recovery window after the lock Redis may have
    #: lost data (a restart from a snapshot, a failover), and that window has closed: the
    #: lock is free to the next acquire of its key, which replaces it (the rule of
    #: :func:`~celery_singleton_beat.lease.stale.unconfirmed`, on the server's clock).
    stale: bool = False

    @property
    def renewed_ago(self) -> float | None:
        """Seconds since the holder last renewed the lock (its lease minus the TTL left);
        None for a claim, or a value that does not record its lease (written by 0.2). A run
        lock whose ``renewed_ago`` keeps growing past a few renewal intervals has a holder
        that stopped renewing."""
        lease = self.holder.ttl
        if lease is None or self.ttl is None or self.holder.claim:
            return None
        return max(0.0, round(lease - self.ttl, 3))

    def as_json(self) -> dict[str, Any]:
        """The ``locks --json`` object of this lock."""
        h = self.holder
        return {
            "task": self.task, "key": self.key, "kind": self.kind, "task_id": h.task_id,
            "node": h.node, "pid": h.pid, "boot": h.boot, "acquired_at": h.acquired_at,
            "ttl": self.ttl, "renewed_ago": self.renewed_ago, "stale": self.stale,
        }


class AmbiguousRelease(AdminError):
    """Several locks of a task are held and the caller asked for one; ``locks`` lists them."""

    def __init__(self, task: str, locks: Sequence[HeldLock]) -> None:
        super().__init__(task, len(locks))
        self.task, self.locks = task, tuple(locks)

    def __str__(self) -> str:
        return f"{len(self.locks)} locks of {self.task} are held: release them all, or one key"


@dataclass(frozen=True)
class ReleaseResult:
    """What :func:`release` did: ``released``, and ``changed`` (left alone: not what was read)."""

    released: tuple[HeldLock, ...]
    changed: tuple[HeldLock, ...]

    @property
    def ok(self) -> bool:
        """True when every lock asked for was released."""
        return not self.changed


@dataclass(frozen=True)
class HolderStatus:
    """The answer about one running holder (see :data:`HolderState`)."""

    lock: HeldLock
    state: HolderState


@dataclass(frozen=True)
class HolderReport:
    """What :func:`check_holders` learnt; ``error`` when the broker could not be reached."""

    holders: tuple[HolderStatus, ...]
    error: str | None = None

    @property
    def running(self) -> tuple[HeldLock, ...]:
        """Locks whose holder is still running: releasing one lets a duplicate start."""
        return tuple(status.lock for status in self.holders if status.state == "running")


# --------------------------------------------------------------------------- reading


def _held(key: str, task: str, kind: str, value: Any, pttl: Any, server_ms: int | None = None,
          since_ms: int = 0) -> HeldLock | None:
    """A :class:`HeldLock` from a GET and a PTTL reply; None if the key is gone or not a string.
    ``server_ms``: the server's clock after they were read (None: not asked, never stale);
    ``since_ms``: when the latest recovery window opened, which has closed (0: none)."""
    if not isinstance(value, (bytes, str)) or not isinstance(pttl, int) or pttl == -2:
        return None
    holder = parse_holder(value)
    assert holder is not None  # value is not None
    if holder.token is None and holder.task_id is None:
        kind = "unknown"
    elif kind == "lock":
        kind = "claim" if holder.claim else "run"
    stale = server_ms is not None and unconfirmed(holder, pttl, server_ms + pttl, since_ms, False)
    return HeldLock(key, task, cast(LockKind, kind), holder, value, None if pttl < 0 else pttl / 1000, stale)


def _closed_window_since(target: Target) -> int:
    """When the latest recovery window opened (the server record's ``since_ms``), if one did
    and it has closed; else 0: no lock is stale. Read once per walk (one round trip).

    A window that closes during the walk leaves its locks shown as held: stale means free
    to the next acquire now, and the next ``locks`` shows them. Redis Cluster keeps a
    record per shard, which the rule does not read (such a lock waits for its TTL): 0.
    """
    client = target.client
    if is_cluster(client):
        return 0
    pipe = client.pipeline(transaction=False)
    pipe.get(server_key(target.prefix))
    pipe.exists(recovery_key(target.prefix))
    raw, window_open = pipe.execute()
    record = ServerRecord.decode(raw)
    return 0 if window_open or record is None else record.since_ms


def _lock_commands(since_ms: int) -> tuple[str, ...]:
    """What is read of each lock: its value and TTL, and the server's clock after them
    when a closed window can have left stale locks (:func:`_held`)."""
    return ("get", "pttl", "time") if since_ms else ("get", "pttl")


def _walk_locks(target: Target, task: str | None, kinds: Collection[str] | None, node: str | None,
                progress: Progress | None) -> Iterator[HeldLock]:
    space = KeySpace(target.prefix)

    def pick(key: str) -> tuple[str, str] | None:
        parsed = space.lock(key)
        return parsed if parsed is not None and (task is None or parsed[0] == task) else None

    with target.guard():
        since_ms = _closed_window_since(target)
        for found in walk(target.client, space.lock_pattern(task), pick, _lock_commands(since_ms), progress):
            for key, (name, kind), (value, pttl, *clock) in found:
                lock = _held(key, name, kind, value, pttl, clock[0] if clock else None, since_ms)
                if lock is not None and (kinds is None or lock.kind in kinds) and (
                        node is None or lock.holder.node == node):
                    yield lock


def _kinds(kind: LockKind | Collection[LockKind] | None) -> set[str] | None:
    return None if kind is None else {kind} if isinstance(kind, str) else set(kind)


def iter_locks(app: Celery, *, task: str | None = None, kind: LockKind | Collection[LockKind] | None = None,
               node: str | None = None, progress: Progress | None = None) -> Iterator[HeldLock]:
    """Every task lock and claim held now, each yielded as soon as it is read, in the order found.

    What :func:`list_locks` returns, streamed: the keys are walked with SCAN (never KEYS;
    ``MATCH <prefix>:{<task>:*`` with ``task``, so the server filters by task), and each
    SCAN call's locks are read in the same round trip as the next call and yielded at once.
    Memory holds the locks' keys, not the other keys. Filters as in :func:`list_locks`.
    ``progress`` (a :data:`Progress`) is called with a :class:`ScanProgress` after each
    SCAN call. A key SCAN lists twice is yielded once; a lock that expires between the
    SCAN and the read is left out. A lock its holder did not confirm after the lock Redis
    may have lost data, free to the next acquire of its key, is marked
    :attr:`HeldLock.stale` (the server's record of the recovery window is read once per
    walk, its clock once per SCAN call's reads). The call raises :class:`InvalidSettings`;
    the iteration :class:`RedisUnavailable` or :class:`AdminRedisError`.
    """
    target = connect(app)
    return _walk_locks(target, task, _kinds(kind), node, progress)


def list_locks(app: Celery, *, task: str | None = None, kind: LockKind | Collection[LockKind] | None = None,
               node: str | None = None, progress: Progress | None = None) -> list[HeldLock]:
    """Every task lock and claim held now, sorted by task then acquisition time.

    Filters: ``task`` (its registered name), ``kind`` (one or several of
    :data:`LockKind`), ``node`` (the holder's worker node name). Read with
    SCAN (never KEYS); a lock that expires between the SCAN and the read is
    left out. :func:`iter_locks` yields the same locks as they are found
    (``progress`` is passed to it). Raises :class:`InvalidSettings`,
    :class:`RedisUnavailable` or :class:`AdminRedisError`.
    """
    return sorted(iter_locks(app, task=task, kind=kind, node=node, progress=progress),
                  key=lambda lock: (lock.task, lock.holder.acquired_at or 0.0, lock.key))


def read_lock(app: Celery, key: str) -> HeldLock | None:
    """The lock at ``key`` if it is held, None if not.

    :class:`NotALockKey` (a ``ValueError``) if ``key`` is not a task lock key
    under the app's prefix.
    """
    target = connect(app)
    parsed = KeySpace(target.prefix).lock(key)
    if parsed is None:
        raise NotALockKey(f"{key} is not a task lock under the prefix '{target.prefix}' (expected "
                          f"{target.prefix}:{{<task>:<sha256>}}, optionally followed by {QUEUED_SUFFIX})")
    with target.guard():
        since_ms = _closed_window_since(target)
        [(value, pttl, *clock)] = read(target.client, [key], *_lock_commands(since_ms))
    return _held(key, *parsed, value, pttl, clock[0] if clock else None, since_ms)


# --------------------------------------------------------------------------- releasing


def find_release_targets(app: Celery, *, key: str | None = None, task: str | None = None,
                         every: bool = False) -> list[HeldLock]:
    """The locks a forced release of ``key``, or of ``task``'s lock(s), would delete.

    Give exactly one of ``key`` and ``task``. For a task, several held locks
    raise :class:`AmbiguousRelease` unless ``every`` is true. An empty list when
    nothing is held. Show the result, then pass it to :func:`release`: only
    those values are deleted.
    """
    if (key is None) == (task is None):
        raise TypeError("give either key or task")
    if every and task is None:
        raise TypeError("every goes with task")
    if key is not None:
        lock = read_lock(app, key)
        return [lock] if lock is not None else []
    assert task is not None
    found = list_locks(app, task=task)
    if len(found) > 1 and not every:
        raise AmbiguousRelease(task, found)
    return found


def release_lock(app: Celery, lock: HeldLock) -> bool:
    """Delete ``lock.key`` if it still holds ``lock.value`` (compare-and-delete).

    True if deleted; False if it changed since it was read (expired, released
    or re-taken by another run), which leaves it alone. Counted as
    ``force_released`` in the task's counters (``singleton_stats``) in the
    same round trip, for real lock records only.
    """
    target = connect(app)
    counted = target.settings.stats and lock.kind != "unknown"
    stats_key = task_stats_key(target.prefix, lock.task) if counted else None
    with target.guard():
        # Cluster clients run the script too (a lock's keys share one hash slot).
        return release_value(cast(Any, target.client), lock.key, lock.value, stats_key=stats_key,
                             counter="force_released")


def release(app: Celery, locks: Iterable[HeldLock]) -> ReleaseResult:
    """Release each of ``locks`` with :func:`release_lock`; what was released and what changed.

    A Redis failure part way raises (:class:`RedisUnavailable`): locks
    released before it stay released; call :func:`release_lock` one by one
    to report progress.
    """
    released: list[HeldLock] = []
    changed: list[HeldLock] = []
    for lock in locks:
        (released if release_lock(app, lock) else changed).append(lock)
    return ReleaseResult(tuple(released), tuple(changed))


def force_release(app: Celery, *, key: str | None = None, task: str | None = None,
                  every: bool = False) -> ReleaseResult:
    """:func:`find_release_targets` then :func:`release`, without asking anyone.

    Releasing the lock of a task that still runs lets a duplicate start
    beside it: see :func:`check_holders` first when that matters.
    """
    return release(app, find_release_targets(app, key=key, task=task, every=every))


# --------------------------------------------------------------------------- holders


def active_tasks(app: Celery, nodes: Sequence[str], timeout: float) -> tuple[dict[str, set[str]], str | None]:
    """Ask the worker ``nodes`` which task ids they are running.

    Returns the ids by node that answered within ``timeout`` seconds, and an
    error text when the broker could not be reached (then nobody answered).
    The broker connection is tried once: a caller must not hang for Celery's
    default of 100 reconnection attempts.
    """
    if not nodes:
        return {}, None
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
            replies = app.control.inspect(destination=list(nodes), timeout=timeout,
                                          connection=conn).active() or {}
    except Exception as exc:  # kombu raises several families (OperationalError, OSError, ...)
        return {}, f"{type(exc).__name__}: {exc}"
    return {node: {task.get("id") for task in tasks or ()} for node, tasks in replies.items()}, None


def check_holders(app: Celery, locks: Iterable[HeldLock], *, timeout: float = 1.0) -> HolderReport:
    """Ask the workers of the ``run`` locks' holders whether those still run (remote control).

    Claims and foreign values have no running holder and are not asked about.
    The broker is tried once; when it cannot be reached, ``error`` says why
    and no holder is listed.
    """
    runs = [lock for lock in locks if lock.kind == "run" and lock.holder.node]
    nodes = sorted({lock.holder.node for lock in runs if lock.holder.node})
    replies, error = active_tasks(app, nodes, timeout)
    if error:
        return HolderReport((), error)
    statuses: list[HolderStatus] = []
    for lock in runs:
        node = lock.holder.node
        assert node is not None
        state: HolderState = ("silent" if node not in replies
                              else "running" if lock.holder.task_id in replies[node] else "stale")
        statuses.append(HolderStatus(lock, state))
    return HolderReport(tuple(statuses))
