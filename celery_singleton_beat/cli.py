"""``celery -A proj singleton <command>``: see and manage locks, beat slots and counters.

Commands (each has ``--help``):

* ``locks [--task NAME] [--json]``: the task locks held now, with their holder.
* ``release KEY | --task NAME [--all] [--yes]``: force-release locks.
* ``slots [--entry NAME] [--last N] [--json]``: recent beat slot claims.
* ``stats [--json]``: counters per task and per beat entry.
* ``doctor [--json]``: check the configuration and the Redis server.

The commands read the Redis of ``singleton_redis_url`` (the one the workers
and beats use) with ``SCAN``, never ``KEYS``: ``KEYS`` blocks the server for the
whole walk, which on a production Redis stalls every lock of every worker.

Exit codes (every command, ``doctor`` included): 0 success (also "nothing
held"; ``doctor`` with warnings only); 1 ``doctor`` found a problem, or
``release`` refused, was declined or found a lock re-taken; 2 usage error;
69 Redis unreachable (a Redis Cluster whose nodes do not answer too);
78 invalid ``singleton_*`` settings.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import click
import redis
from celery import Celery
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from celery.exceptions import CeleryCommandException, ImproperlyConfigured
from redis.exceptions import RedisClusterException

from .beat import history_key as beat_history_key
from .beat import stats_key as beat_totals_key
from .client import get_redis, primaries, scan_all
from .config import SingletonSettings, get_settings, sanitize_redis_url
from .keys import QUEUED_SUFFIX, beat_stats_key, task_stats_key
from .lock import Holder, LuaScript, fence_key, parse_holder, release_value

__all__ = [
    "Check",
    "HeldLock",
    "KeySpace",
    "SlotClaim",
    "active_tasks",
    "doctor_exit_code",
    "read_lock",
    "read_slots",
    "read_stats",
    "run_checks",
    "scan_locks",
    "singleton",
    "version_check",
]

EX_FAILURE = 1
EX_UNAVAILABLE = getattr(os, "EX_UNAVAILABLE", 69)
EX_CONFIG = getattr(os, "EX_CONFIG", 78)

#: Task counters every ``stats`` table shows (others appear in its OTHER column).
TASK_COUNTERS = ("acquired", "skipped", "released", "renewed", "lost", "reclaimed", "taken_over",
                 "redelivered")
#: Beat counters: slot claims won and lost (another beat held the slot), unsent
#: slots of a dead beat taken over and sent, second copies dropped by workers.
#: A claim won ahead of its turn in a burst and handed back unsent still counts as won.
BEAT_COUNTERS = ("won", "lost", "taken_over", "duplicates_dropped")
#: Oldest Redis the lock scripts run on: they write after calling TIME, which
#: needs effects replication (the default from 5.0 on).
MIN_REDIS = (5, 0)
#: Oldest Redis this project tests with; beat's ``SET NX GET`` (which names the
#: holder of a lost slot in the log) needs 7.0, older servers get ``SET NX``.
TESTED_REDIS = (7, 0)
#: Errors that mean "the Redis of the locks cannot be used": redis-py reports
#: some Cluster failures as RedisClusterException, which is not a RedisError.
REDIS_ERRORS = (redis.RedisError, RedisClusterException)
#: Eviction policies under which Redis never deletes a key to make room.
SAFE_EVICTION = ("noeviction",)
#: SCAN page size and keys read back per pipeline round trip.
SCAN_COUNT = 1000
BATCH = 500


# --------------------------------------------------------------------------- key layout


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class KeySpace:
    """What each key under one prefix is, by the library's key layout.

    * ``<p>:{<task>:<sha256>}`` a run lock or publish-time claim; ``:queued``
      the queue claim of ``until_executing``; ``:fence`` their fencing counters;
    * ``<p>:{beat:<name>}:<slot>`` a beat slot claim;
    * ``<p>:{stats}:task:<task>`` / ``<p>:{stats}:beat:<entry>`` counters;
    * ``<p>:{beat}:history`` / ``<p>:{beat}:stats`` the beat's capped history
      and its counter totals.

    Keys are matched whole (a task named ``beats.x`` is not a beat key).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        p = re.escape(prefix)
        self._lock = re.compile(
            rf"{p}:\{{(?P<task>.+):[0-9a-f]{{64}}\}}(?P<queued>{re.escape(QUEUED_SUFFIX)})?"
            rf"(?P<fence>{re.escape(fence_key(''))})?\Z",
            re.S,
        )
        self._slot = re.compile(rf"{p}:\{{beat:(?P<name>.+)\}}:(?P<slot>[^{{}}]+)\Z", re.S)
        self._fixed = {
            beat_history_key(prefix): "beat-history",
            beat_totals_key(prefix): "beat-stats",
        }
        self._task_stats = task_stats_key(prefix, "")
        self._beat_stats = beat_stats_key(prefix, "")

    def lock(self, key: str) -> tuple[str, str] | None:
        """``(task, kind)`` of a lock key (kind ``lock`` or ``queued``); None otherwise."""
        match = self._lock.match(key)
        if match is None or match["fence"]:
            return None
        return match["task"], "queued" if match["queued"] else "lock"

    def slot(self, key: str) -> tuple[str, str] | None:
        """``(name, slot)`` of a beat slot claim key; None otherwise."""
        match = self._slot.match(key)
        if match is None or self.kind(key) != "slot":
            return None
        return match["name"], match["slot"]

    def kind(self, key: str) -> str:
        """``lock``, ``queued``, ``fence``, ``slot``, ``task-stats``, ``beat-stats``,
        ``beat-history`` or ``other``."""
        match = self._lock.match(key)
        if match is not None:
            return "fence" if match["fence"] else ("queued" if match["queued"] else "lock")
        if key in self._fixed:
            return self._fixed[key]
        if key.startswith(self._task_stats):
            return "task-stats"
        if key.startswith(self._beat_stats):
            return "beat-stats"
        if self._slot.match(key):
            return "slot"
        return "other"

    @property
    def pattern(self) -> str:
        """``MATCH`` pattern of every key under the prefix."""
        return f"{glob_escape(self.prefix)}:*"


def _scan(client: redis.Redis, match: str) -> Iterator[list[str]]:
    """Keys matching ``match`` in batches of at most ``BATCH`` (SCAN, never KEYS)."""
    batch: list[str] = []
    for key in scan_all(client, match, count=SCAN_COUNT):
        batch.append(_text(key))
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _read(client: redis.Redis, keys: Sequence[str], *commands: str) -> list[list[Any]]:
    """Run ``commands`` (e.g. ``"get", "pttl"``) on each key in one round trip.

    A key of an unexpected type answers with the error instead of its value.
    """
    pipe = client.pipeline(transaction=False)
    for key in keys:
        for command in commands:
            getattr(pipe, command)(key)
    replies = pipe.execute(raise_on_error=False)
    width = len(commands)
    return [replies[i:i + width] for i in range(0, len(replies), width)]


# --------------------------------------------------------------------------- locks


@dataclass(frozen=True)
class HeldLock:
    """A task lock as read from Redis."""

    key: str
    task: str
    #: ``run`` (a running task), ``claim`` (a queued message, ``until_executed``),
    #: ``queued`` (the queue claim of ``until_executing``) or ``unknown`` (a
    #: value that is not a lock record).
    kind: str
    holder: Holder
    #: The value read, for compare-and-delete.
    value: bytes | str
    #: Seconds left, or None for a lock that never expires (a problem).
    ttl: float | None

    def as_json(self) -> dict[str, Any]:
        h = self.holder
        return {
            "task": self.task, "key": self.key, "kind": self.kind, "task_id": h.task_id,
            "node": h.node, "pid": h.pid, "boot": h.boot, "acquired_at": h.acquired_at,
            "ttl": self.ttl, "fence": h.fence,
        }


def scan_locks(client: redis.Redis, prefix: str, task: str | None = None) -> list[HeldLock]:
    """Every task lock and claim under ``prefix`` (of ``task`` only, if given).

    Sorted by task, then acquisition time. A lock that expires between the
    SCAN and the read is left out.
    """
    space = KeySpace(prefix)
    match = f"{glob_escape(prefix)}:{{{glob_escape(task) + ':' if task else ''}*"
    found: list[HeldLock] = []
    for batch in _scan(client, match):
        keys = [(key, parsed) for key in batch
                if (parsed := space.lock(key)) is not None and (task is None or parsed[0] == task)]
        for (key, (name, kind)), (value, pttl) in zip(keys, _read(client, [k for k, _ in keys], "get", "pttl")):
            lock = _held(key, name, kind, value, pttl)
            if lock is not None:
                found.append(lock)
    found.sort(key=lambda lock: (lock.task, lock.holder.acquired_at or 0.0, lock.key))
    return found


def read_lock(client: redis.Redis, prefix: str, key: str) -> HeldLock | None:
    """The lock at ``key`` if it is held; ``ValueError`` if ``key`` is not a task lock key."""
    parsed = KeySpace(prefix).lock(key)
    if parsed is None:
        raise ValueError(f"{key} is not a task lock under the prefix '{prefix}' (expected "
                         f"{prefix}:{{<task>:<sha256>}}, optionally followed by {QUEUED_SUFFIX})")
    [(value, pttl)] = _read(client, [key], "get", "pttl")
    return _held(key, *parsed, value, pttl)


def _held(key: str, task: str, kind: str, value: Any, pttl: Any) -> HeldLock | None:
    """A :class:`HeldLock` from a GET and a PTTL reply; None if the key is gone or not a string."""
    if value is None or isinstance(value, Exception) or not isinstance(pttl, int) or pttl == -2:
        return None
    holder = parse_holder(value)
    if holder.token is None and holder.task_id is None:
        kind = "unknown"  # not a lock record (written by something else?)
    elif kind == "lock":
        kind = "claim" if holder.claim else "run"
    return HeldLock(key, task, kind, holder, value, None if pttl < 0 else pttl / 1000)


def active_tasks(app: Celery, nodes: Sequence[str], timeout: float) -> tuple[dict[str, set[str]], str | None]:
    """Ask the worker ``nodes`` which task ids they are running.

    Returns the ids by node that answered within ``timeout`` seconds, and an
    error text when the broker could not be reached (then nobody answered).
    The broker connection is tried once: the command must not hang for
    Celery's default of 100 reconnection attempts.
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


# --------------------------------------------------------------------------- slots


@dataclass(frozen=True)
class SlotClaim:
    """One beat slot claim: which beat instance won the right to send it."""

    entry: str
    slot: str
    winner: str | None
    claimed_at: float | None
    key: str | None
    task: str | None

    def as_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "slot": self.slot, "winner": self.winner,
                "claimed_at": self.claimed_at, "key": self.key, "task": self.task}


def _claim_from_history(record: Any) -> SlotClaim | None:
    if not isinstance(record, dict) or "entry" not in record or "slot" not in record:
        return None
    return SlotClaim(str(record["entry"]), str(record["slot"]), record.get("winner"),
                     record.get("at"), record.get("key"), record.get("task"))


def _slot_instant(claim: SlotClaim) -> float:
    try:
        return datetime.fromisoformat(claim.slot.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("-inf")


def read_slots(client: redis.Redis, prefix: str, entry: str | None = None,
               last: int = 20) -> tuple[list[SlotClaim], str]:
    """The ``last`` most recent slot claims (of ``entry``), newest first, and their source.

    The source is the beat's capped history list (``"history"``), which names
    entries and tasks; without one (no beat recorded any yet, or an older
    scheduler), the live claim keys (``"claims"``): they name the claim key's
    entry part (the entry name, or its ``singleton`` key option) and disappear
    when they expire.
    """
    history = beat_history_key(prefix)
    if client.exists(history):
        found: list[SlotClaim] = []
        start = 0
        while len(found) < last:
            page = client.lrange(history, start, start + BATCH - 1)
            if not page:
                break
            start += len(page)
            for raw in page:
                try:
                    claim = _claim_from_history(json.loads(raw))
                except ValueError:
                    continue
                if claim is not None and (entry is None or claim.entry == entry):
                    found.append(claim)
        return found[:last], "history"

    space = KeySpace(prefix)
    name_glob = glob_escape(entry) if entry is not None else ""
    claims: list[SlotClaim] = []
    for batch in _scan(client, f"{glob_escape(prefix)}:{{beat:{name_glob}*"):
        keys = []
        for key in batch:
            parsed = space.slot(key)
            # entries with include_args claim under "<name>:<digest>"
            if parsed and (entry is None or parsed[0] == entry or parsed[0].startswith(entry + ":")):
                keys.append((key, *parsed))
        for (key, name, slot), (value,) in zip(keys, _read(client, [k for k, _, _ in keys], "get")):
            if value is None or isinstance(value, Exception):
                continue
            try:
                data = json.loads(value)
            except ValueError:
                data = {}
            data = data if isinstance(data, dict) else {}
            claims.append(SlotClaim(name, slot, data.get("instance"), data.get("at"), key, None))
    claims.sort(key=lambda c: (_slot_instant(c), c.claimed_at or 0.0), reverse=True)
    return claims[:last], "claims"


# --------------------------------------------------------------------------- counters


def _counters(raw: dict[Any, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for field, value in raw.items():
        try:
            out[_text(field)] = int(value)
        except (TypeError, ValueError):
            continue
    return out


def _hashes(client: redis.Redis, match: str, name_from: int) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for batch in _scan(client, match):
        for key, (raw,) in zip(batch, _read(client, batch, "hgetall")):
            if isinstance(raw, dict) and raw:
                out[key[name_from:]] = _counters(raw)
    return dict(sorted(out.items()))


def read_stats(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Counters kept in Redis under ``prefix``.

    ``{"tasks": {task: {counter: n}}, "beat": {"entries": {entry: {...}},
    "total": {...}}}``; the task counters of :data:`TASK_COUNTERS` and beat
    ``won``/``lost`` are always present (0 when never bumped).
    """
    task_base = task_stats_key(prefix, "")
    beat_base = beat_stats_key(prefix, "")
    tasks = _hashes(client, glob_escape(task_base) + "*", len(task_base))
    entries = _hashes(client, glob_escape(beat_base) + "*", len(beat_base))
    total = _counters(client.hgetall(beat_totals_key(prefix)))

    def filled(counts: dict[str, int], names: Sequence[str]) -> dict[str, int]:
        return {**{name: 0 for name in names}, **counts}

    return {
        "tasks": {name: filled(c, TASK_COUNTERS) for name, c in tasks.items()},
        "beat": {
            "entries": {name: filled(c, BEAT_COUNTERS) for name, c in entries.items()},
            "total": filled(total, BEAT_COUNTERS) if total else {},
        },
    }


# --------------------------------------------------------------------------- doctor


@dataclass(frozen=True)
class Check:
    """One ``doctor`` finding: ``status`` is ``OK``, ``WARN`` or ``FAIL``."""

    name: str
    status: str
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "detail": self.detail}


def _examples(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _check_eviction(client: redis.Redis) -> Check:
    """Locks must never be evicted: an evicted lock is a duplicate run waiting to happen."""
    try:
        memory = client.info("memory")
        policy = memory.get("maxmemory_policy")
        limit = memory.get("maxmemory_human") if int(memory.get("maxmemory", 0) or 0) else None
        if policy is None:  # servers whose INFO lacks it
            policy = _text(client.config_get("maxmemory-policy")["maxmemory-policy"])
    except redis.ConnectionError:
        raise
    except (redis.RedisError, KeyError) as exc:  # INFO / CONFIG denied by an ACL, or renamed
        return Check("eviction", "WARN", f"cannot read maxmemory-policy ({exc}); "
                                         "make sure it is noeviction")
    if policy in SAFE_EVICTION:
        return Check("eviction", "OK", f"maxmemory-policy {policy}: locks are never evicted "
                                       "(a full Redis refuses new locks instead, and tasks wait)")
    scope = "any key" if policy.startswith("allkeys") else "any key with a TTL, and every lock has one"
    if policy == "volatile-ttl":
        scope = "keys with the shortest TTL first, which are the locks"
    when = f"when memory reaches {limit}" if limit else "once maxmemory is set (it is 0 now)"
    return Check("eviction", "FAIL", f"maxmemory-policy {policy} evicts {scope} {when}: an evicted "
                                     "lock lets a duplicate run. Use noeviction (a dedicated Redis "
                                     "or database server for locks if this one is a cache)")


def _check_expiry(client: redis.Redis, prefix: str) -> Check:
    """Every lock, claim and fencing counter must expire; counters and history are bounded."""
    space = KeySpace(prefix)
    scanned = 0
    stuck: list[str] = []
    foreign: list[str] = []
    for batch in _scan(client, space.pattern):
        scanned += len(batch)
        for key, (pttl,) in zip(batch, _read(client, batch, "pttl")):
            if pttl != -1:
                continue
            kind = space.kind(key)
            if kind in ("lock", "queued", "fence", "slot"):
                stuck.append(key)
            elif kind == "other":
                foreign.append(key)
    if stuck:
        return Check("expiry", "FAIL", f"{len(stuck)} of {scanned} key(s) under '{prefix}:' never "
                                       f"expire: {_examples(stuck)}. A lock without TTL blocks its "
                                       "task for good: free it with `celery singleton release KEY`")
    if foreign:
        return Check("expiry", "WARN", f"{len(foreign)} key(s) under '{prefix}:' that this library "
                                       f"does not write have no TTL: {_examples(foreign)}")
    if not scanned:
        return Check("expiry", "OK", f"no keys under '{prefix}:' (nothing held)")
    return Check("expiry", "OK", f"{scanned} key(s) under '{prefix}:'; every lock and claim expires")


#: A script using what the lock scripts use: Lua and its cjson library.
_LUA_PROBE = "return cjson.decode(ARGV[1])['lua']"


def version_check(version: str, role: str, mode: str = "standalone") -> Check:
    """The ``version`` check of a server from its ``INFO`` fields.

    FAIL for a replica (locks must be written to the primary) and for Redis
    older than :data:`MIN_REDIS`; WARN below :data:`TESTED_REDIS`.
    """
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if role != "master":
        return Check("version", "FAIL", f"Redis {version} is a {role}: locks must be written to the "
                                        "primary (a replica's keys are not shared with the others)")
    if numbers and numbers < MIN_REDIS:
        return Check("version", "FAIL", f"Redis {version} is too old: the lock scripts need "
                                        f"{MIN_REDIS[0]}.{MIN_REDIS[1]} or later (they write after "
                                        "TIME, which needs effects replication)")
    if numbers and numbers < TESTED_REDIS:
        return Check("version", "WARN", f"Redis {version} ({mode}, {role}) is older than the "
                                        f"{TESTED_REDIS[0]}.{TESTED_REDIS[1]} this library is tested "
                                        "with; beat cannot name the holder of a slot it lost "
                                        "(SET NX GET needs 7.0)")
    return Check("version", "OK", f"Redis {version} ({mode}, {role})")


def _check_version(client: redis.Redis) -> Check:
    """Locks need a primary (a replica's writes stay local) running Redis 5.0 or later."""
    try:
        server = client.info("server")
        role = client.info("replication").get("role", "?")
    except redis.ConnectionError:
        raise
    except redis.RedisError as exc:  # INFO denied by an ACL, or renamed
        return Check("version", "WARN", f"cannot read INFO ({exc}); check by hand that this is a "
                                        f"primary running Redis {MIN_REDIS[0]}.{MIN_REDIS[1]} or "
                                        "later (7.0 or later is tested)")
    return version_check(str(server.get("redis_version", "?")), str(role),
                         str(server.get("redis_mode", "standalone")))


def _redis_checks(client: redis.Redis, prefix: str) -> Iterator[Check]:
    started = time.perf_counter()
    try:
        client.ping()
    except REDIS_ERRORS as exc:
        yield Check("redis", "FAIL", f"unreachable: {type(exc).__name__}: {exc}")
        return
    yield Check("redis", "OK", f"reachable (PING {1000 * (time.perf_counter() - started):.1f} ms)")

    servers = primaries(client)
    yield _on_each(servers, _check_version)
    try:
        # The library's own path: EVALSHA, loading the script on NOSCRIPT.
        reply = LuaScript(_LUA_PROBE)(client, [], ['{"lua":"ok"}'])
        lua_ok = _text(reply) == "ok"
        yield Check("lua", "OK" if lua_ok else "FAIL",
                    "scripts with cjson run" if lua_ok else f"the probe script returned {reply!r}")
    except redis.ConnectionError:
        raise
    except redis.RedisError as exc:
        yield Check("lua", "FAIL", f"cannot run a script ({exc}): the lock scripts cannot run either")
    yield _on_each(servers, _check_eviction)
    yield _check_expiry(client, prefix)


_SEVERITY = {"OK": 0, "WARN": 1, "FAIL": 2}


def _on_each(servers: Sequence[tuple[str, redis.Redis]], check: Callable[[redis.Redis], Check]) -> Check:
    """Run a per-server check on every server; the worst outcome, naming its servers."""
    results = [(name, check(server)) for name, server in servers]
    if len(results) == 1:
        return results[0][1]
    worst = max(_SEVERITY[result.status] for _, result in results)
    shown = [(name, result) for name, result in results if _SEVERITY[result.status] == worst]
    return Check(shown[0][1].name, shown[0][1].status,
                 "; ".join(f"{name}: {result.detail}" for name, result in shown))


def run_checks(app: Celery) -> tuple[list[Check], SingletonSettings | None]:
    """Every ``doctor`` check of ``app``, in order; the settings if they are valid.

    Redis checks run only with a valid configuration, and stop after an
    unreachable server.
    """
    try:
        settings = get_settings(app)
    except ImproperlyConfigured as exc:
        return [Check("configuration", "FAIL", str(exc))], None
    names = sorted(name for name, task in app.tasks.items() if hasattr(task, "singleton_key"))
    listed = f": {_examples(names, 3)}" if names else ""
    checks = [Check("configuration", "OK",
                    f"singleton_* settings valid; {len(names)} singleton task(s) registered{listed}")]
    try:
        checks.extend(_redis_checks(get_redis(app), settings.key_prefix))
    except REDIS_ERRORS as exc:  # unreachable from the start (Cluster), or lost in the middle
        checks.append(Check("redis", "FAIL", f"unreachable: {type(exc).__name__}: {exc}"))
    return checks, settings


def doctor_exit_code(checks: Sequence[Check]) -> int:
    """0 without FAIL; 78 for invalid settings, 69 for an unreachable Redis, else 1."""
    failed = {check.name for check in checks if check.status == "FAIL"}
    if not failed:
        return 0
    if "configuration" in failed:
        return EX_CONFIG
    if "redis" in failed:
        return EX_UNAVAILABLE
    return EX_FAILURE


# --------------------------------------------------------------------------- output


def _utc(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "never expires"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    """A plain text table; columns in ``numeric`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [cell.rjust(w) if i in numeric else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _json(data: Any) -> str:
    return json.dumps(data, indent=2)


class _Session:
    """Settings and Redis client of the command's app, with errors turned into exit codes."""

    def __init__(self, ctx: click.Context) -> None:
        self.ctx = ctx
        self.app: Celery = ctx.obj.app
        try:
            self.settings = get_settings(self.app)
        except ImproperlyConfigured as exc:
            raise CeleryCommandException(f"invalid configuration: {exc}", EX_CONFIG) from exc
        self.prefix = self.settings.key_prefix
        self.url = sanitize_redis_url(self.settings.redis_url)
        # A Cluster client asks its nodes for the slot layout when it is made.
        self.client = self.run(lambda: get_redis(self.app))

    def run(self, read: Callable[[], Any]) -> Any:
        """Call ``read`` (which talks to Redis); an unreachable Redis ends the command (69)."""
        try:
            return read()
        except REDIS_ERRORS as exc:
            raise CeleryCommandException(
                f"cannot reach Redis at {self.url}: {type(exc).__name__}: {exc}", EX_UNAVAILABLE
            ) from exc

    def echo(self, message: str = "") -> None:
        self.ctx.obj.echo(message)

    def note(self, message: str) -> None:
        """A remark for the human reader, on stderr (keeps ``--json`` output clean)."""
        self.ctx.obj.error(message)

    def show(self, records: Sequence[HeldLock] | Sequence[SlotClaim], as_json: bool, empty: str,
             headers: Sequence[str], row: Callable[[Any], Sequence[Any]], numeric: Sequence[int] = ()) -> None:
        """Print ``records`` as a JSON list, or as a table (``empty`` when there are none)."""
        if as_json:
            self.echo(_json([record.as_json() for record in records]))
        elif not records:
            self.echo(f"{empty} (prefix '{self.prefix}', {self.url}).")
        else:
            self.echo(_table(headers, [row(record) for record in records], numeric))


_JSON = click.option("--json", "as_json", cls=CeleryOption, is_flag=True, help_group="Output Options",
                     help="Print JSON instead of a table.")


# --------------------------------------------------------------------------- commands


@click.group(name="singleton")
@click.pass_context
@handle_preload_options
def singleton(ctx: click.Context, **kwargs: Any) -> None:
    """celery-singleton-beat: locks, beat slots, counters and health checks.

    Reads the Redis of singleton_redis_url with SCAN (never KEYS).
    """


@singleton.command(cls=CeleryCommand)
@click.option("--task", "task_name", cls=CeleryOption, metavar="NAME", help_group="Lock Options",
              help="Only the locks of this task (its registered name).")
@_JSON
@click.pass_context
def locks(ctx: click.Context, task_name: str | None, as_json: bool) -> None:
    """List held task locks and publish-time claims.

    Columns: task, kind (run: a running task; claim/queued: a message
    waiting in the queue), holder task id, node, pid, acquisition time (UTC),
    TTL left, fencing token, key. JSON: a list of objects with task, key,
    kind, task_id, node, pid, boot, acquired_at (epoch seconds), ttl
    (seconds, null if the lock never expires) and fence.
    """
    session = _Session(ctx)
    held = session.run(lambda: scan_locks(session.client, session.prefix, task_name))
    session.show(
        held, as_json, f"No lock of task {task_name} is held" if task_name else "No task lock is held",
        ("TASK", "KIND", "HOLDER TASK ID", "NODE", "PID", "ACQUIRED (UTC)", "TTL", "FENCE", "KEY"),
        lambda lock: (lock.task, lock.kind, lock.holder.task_id, lock.holder.node, lock.holder.pid,
                      _utc(lock.holder.acquired_at), _duration(lock.ttl), lock.holder.fence, lock.key),
        numeric=(4, 6, 7),
    )
    if held and not as_json:
        session.echo(f"\n{len(held)} lock(s) held.")


@singleton.command(cls=CeleryCommand)
@click.argument("key", required=False)
@click.option("--task", "task_name", cls=CeleryOption, metavar="NAME", help_group="Release Options",
              help="Release the lock of this task (the only one held, or all with --all).")
@click.option("--all", "release_all", cls=CeleryOption, is_flag=True, help_group="Release Options",
              help="With --task: release every lock of the task.")
@click.option("-y", "--yes", cls=CeleryOption, is_flag=True, help_group="Release Options",
              help="Do not ask for confirmation (needed when not run from a terminal).")
@click.option("-t", "--timeout", cls=CeleryOption, type=float, default=1.0, show_default=True,
              help_group="Release Options",
              help="Seconds to wait for the holders' workers to say whether the holder still runs.")
@click.pass_context
def release(ctx: click.Context, key: str | None, task_name: str | None, release_all: bool,
            yes: bool, timeout: float) -> None:
    """Force-release a stuck lock: KEY, or the lock(s) of --task NAME.

    Use it when a lock outlives its holder and its TTL is long. The workers
    of running holders are asked first: releasing the lock of a task that is
    still running lets a duplicate start beside it (the running task learns
    at its next renewal, and sends task-lock-lost when it ends), so that case
    is warned about. Each lock is deleted only if it still has the value shown
    (compare-and-delete): a lock re-taken meanwhile is left alone. Releases
    are counted as force_released in the task's counters.
    """
    if (key is None) == (task_name is None):
        raise click.UsageError("give either a KEY or --task NAME")
    if release_all and task_name is None:
        raise click.UsageError("--all goes with --task NAME")
    session = _Session(ctx)
    if key is not None:
        try:
            lock = session.run(lambda: read_lock(session.client, session.prefix, key))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        targets = [lock] if lock is not None else []
        if not targets:
            session.echo(f"{key} is not held; nothing to release.")
            return
    else:
        assert task_name is not None
        targets = session.run(lambda: scan_locks(session.client, session.prefix, task_name))
        if not targets:
            session.echo(f"No lock of task {task_name} is held; nothing to release.")
            return
        if len(targets) > 1 and not release_all:
            session.echo(f"Held:\n{_lock_list(targets)}")
            raise CeleryCommandException(
                f"{len(targets)} locks of {task_name} are held: pass --all to release them all, "
                "or give one KEY", EX_FAILURE)

    session.echo(f"To release ({len(targets)}):\n{_lock_list(targets)}")
    if not yes and not sys.stdin.isatty():
        raise CeleryCommandException(
            "not releasing: confirmation needed and this is not an interactive terminal "
            "(pass --yes)", EX_FAILURE)
    _warn_if_running(session, targets, timeout)
    if not yes and not click.confirm(f"Release {len(targets)} lock(s)?", default=False):
        raise CeleryCommandException("not released", EX_FAILURE)

    changed = 0
    for lock in targets:
        # Counted like the scripts count (same round trip), for real lock records only.
        counted = session.settings.stats and lock.kind != "unknown"
        stats_key = task_stats_key(session.prefix, lock.task) if counted else None
        freed = session.run(lambda: release_value(session.client, lock.key, lock.value,
                                                  stats_key=stats_key, counter="force_released"))
        if freed:
            session.echo(f"released {_describe(lock)}")
        else:
            changed += 1
            session.note(f"NOT released {lock.key}: it changed since it was read "
                         "(expired, released or re-taken by another run)")
    if changed:
        raise CeleryCommandException(f"{changed} lock(s) changed before release; run `locks` again",
                                     EX_FAILURE)


def _describe(lock: HeldLock) -> str:
    holder = lock.holder
    if lock.kind == "unknown":
        return f"{lock.key}  (not a lock record), TTL {_duration(lock.ttl)}"
    return (f"{lock.key}  {lock.kind} of task {holder.task_id} on {holder.node} (pid {holder.pid}), "
            f"acquired {_utc(holder.acquired_at)}, TTL {_duration(lock.ttl)}")


def _lock_list(targets: Sequence[HeldLock]) -> str:
    return "\n".join(f"  {_describe(lock)}" for lock in targets)


def _warn_if_running(session: _Session, targets: Sequence[HeldLock], timeout: float) -> None:
    """Warn about holders still running on a worker that answers, and about silent nodes."""
    runs = [lock for lock in targets if lock.kind == "run" and lock.holder.node]
    nodes = sorted({lock.holder.node for lock in runs if lock.holder.node})
    if not nodes:
        return
    replies, error = active_tasks(session.app, nodes, timeout)
    if error:
        session.note(f"WARNING: cannot ask the workers whether the holders still run "
                     f"(broker unreachable: {error})")
        return
    for lock in runs:
        node = lock.holder.node
        if node not in replies:
            session.note(f"note: worker {node} did not answer within {timeout:g}s: the holder "
                         f"{lock.holder.task_id} is probably gone (or that worker is busy or has "
                         "remote control disabled)")
        elif lock.holder.task_id in replies[node]:
            session.note(f"WARNING: task {lock.holder.task_id} is RUNNING on {node} "
                         f"(pid {lock.holder.pid}): releasing {lock.key} lets a duplicate start "
                         "while it runs")
        else:
            session.note(f"note: {node} answered and is not running {lock.holder.task_id}: "
                         "the lock is stale")


@singleton.command(cls=CeleryCommand)
@click.option("--entry", cls=CeleryOption, metavar="NAME", help_group="Slot Options",
              help="Only the claims of this beat entry.")
@click.option("--last", cls=CeleryOption, type=click.IntRange(min=1), default=20, show_default=True,
              metavar="N", help_group="Slot Options", help="How many claims to show, newest first.")
@_JSON
@click.pass_context
def slots(ctx: click.Context, entry: str | None, last: int, as_json: bool) -> None:
    """List recent beat slot claims: entry, slot (UTC), winning beat instance.

    Read from the beat's capped history list; without one, from the live claim
    keys (each expires the entry's period plus singleton_beat_claim_margin
    after it was claimed). JSON: a list of objects
    with entry, slot, winner, claimed_at (epoch seconds), key and task.
    """
    session = _Session(ctx)
    claims, source = session.run(lambda: read_slots(session.client, session.prefix, entry, last))
    if source == "claims" and claims:
        session.note("note: no beat history list; showing the live claim keys (entries are "
                     "named as in their keys)")
    session.show(
        claims, as_json, f"No beat slot claim {f'of entry {entry} ' if entry else ''}is recorded",
        ("SLOT (UTC)", "ENTRY", "WON BY", "CLAIMED AT (UTC)", "TASK"),
        lambda claim: (claim.slot, claim.entry, claim.winner, _utc(claim.claimed_at), claim.task),
    )


@singleton.command(cls=CeleryCommand)
@_JSON
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Show counters per task and per beat entry.

    Tasks: acquired, skipped, released, renewed, lost, reclaimed (and, in
    OTHER, refused, deferred, claimed, publish_deduplicated, force_released
    when not zero). Beat: slot claims won and lost. Counters are kept in Redis
    by the lock scripts, and expire 30 days after their last update. JSON:
    {"tasks": {task: {counter: n}}, "beat": {"entries": {...}, "total": {...}}}.
    """
    session = _Session(ctx)
    data = session.run(lambda: read_stats(session.client, session.prefix))
    if as_json:
        session.echo(_json(data))
        return
    beat = data["beat"]
    if not data["tasks"] and not beat["entries"] and not beat["total"]:
        session.echo(f"No counters recorded (prefix '{session.prefix}', {session.url}).")
    if data["tasks"]:
        rows = []
        for name, counts in data["tasks"].items():
            other = " ".join(f"{k}={v}" for k, v in sorted(counts.items()) if k not in TASK_COUNTERS and v)
            rows.append((name, *(counts[c] for c in TASK_COUNTERS), other or "-"))
        headers = ("TASK", *(c.upper() for c in TASK_COUNTERS), "OTHER")
        session.echo(_table(headers, rows, numeric=range(1, len(TASK_COUNTERS) + 1)))
    if beat["entries"] or beat["total"]:
        rows = [(name, *(counts[c] for c in BEAT_COUNTERS)) for name, counts in beat["entries"].items()]
        if beat["total"]:
            rows.append(("(all entries)", *(beat["total"][c] for c in BEAT_COUNTERS)))
        if data["tasks"]:
            session.echo()
        headers = ("BEAT ENTRY", "SLOTS WON", "SLOTS LOST", "TAKEN OVER", "COPIES DROPPED")
        session.echo(_table(headers, rows, numeric=range(1, len(BEAT_COUNTERS) + 1)))
    if not session.settings.stats:
        session.note("note: singleton_stats is False: tasks keep no counters")


@singleton.command(cls=CeleryCommand)
@_JSON
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check the configuration and the Redis server.

    Exit code: 0 when no check fails (warnings allowed), 78 when the
    singleton_* settings are invalid, 69 when Redis is unreachable, 1 for
    any other failed check.

    Checks: singleton_* settings; Redis reachable; version (5.0 or later, 7.0
    or later tested) and role (a primary); Lua (a cjson script, run as the lock scripts are); eviction policy (anything but noeviction
    can evict locks, and an evicted lock lets a duplicate run); keys under
    the prefix that never expire (a lock without TTL blocks its task for
    good). FAIL is a problem, WARN worth a look.
    """
    app: Celery = ctx.obj.app
    checks, settings = run_checks(app)
    problems = sum(check.status == "FAIL" for check in checks)
    warnings = sum(check.status == "WARN" for check in checks)
    if as_json:
        ctx.obj.echo(_json({"ok": not problems, "checks": [check.as_json() for check in checks]}))
    else:
        if settings is not None:
            ctx.obj.echo(f"celery-singleton-beat doctor: {sanitize_redis_url(settings.redis_url)}, "
                         f"key prefix '{settings.key_prefix}'")
        width = max(len(check.name) for check in checks)
        colors = {"OK": "green", "WARN": "yellow", "FAIL": "red"}
        for check in checks:
            status = ctx.obj.style(check.status.ljust(4), fg=colors[check.status], bold=True)
            ctx.obj.echo(f"{status}  {check.name.ljust(width)}  {check.detail}")
        ctx.obj.echo(f"{problems} problem(s), {warnings} warning(s)")
    code = doctor_exit_code(checks)
    if code:
        ctx.exit(code)
