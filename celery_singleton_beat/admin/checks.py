"""``doctor``: check the configuration, the app's singleton tasks and the Redis server.

Each check is a :class:`Check` with status ``OK``, ``WARN`` (worth a look)
or ``FAIL`` (a problem). :func:`doctor` never raises for an unreachable Redis
or invalid settings: those are its ``redis`` and ``configuration`` checks.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import redis
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from ..config import SingletonSettings, get_settings
from ..connection.client import RedisClient, primaries
from ..recovery.lock_redis import get_redis
from ..recovery.startup import (
    EX_CONFIG,
    MIN_REDIS,
    TESTED_REDIS,
    LockRedisUnusable,
    explain,
    is_outage,
    probe_lua,
    probe_set_get,
    server_name,
    version_problem,
)
from ._common import REDIS_ERRORS, KeySpace, examples, load_tasks, text, walk

__all__ = [
    "EX_CONFIG",
    "EX_FAILURE",
    "EX_UNAVAILABLE",
    "MIN_REDIS",
    "TESTED_REDIS",
    "Check",
    "DoctorReport",
    "Status",
    "doctor",
    "doctor_exit_code",
    "singleton_tasks",
    "version_check",
]

#: ``OK``; ``WARN`` worth a look; ``FAIL`` a problem.
Status = Literal["OK", "WARN", "FAIL"]

#: Exit codes of ``doctor`` (and of every ``celery singleton`` command).
EX_FAILURE = 1
EX_UNAVAILABLE: int = getattr(os, "EX_UNAVAILABLE", 69)
#: Keys the library always writes with a TTL: one without is stuck for good (a lock
#: blocks its task, a done marker refuses its task id, a liveness key keeps a dead
#: worker's locks from being taken over).
STUCK_KINDS = ("lock", "queued", "fence", "done", "slot", "live", "probe")
#: Eviction policies under which Redis never deletes a key to make room.
SAFE_EVICTION = ("noeviction",)
_SEVERITY = {"OK": 0, "WARN": 1, "FAIL": 2}


@dataclass(frozen=True)
class Check:
    """One ``doctor`` finding: its ``name``, ``status`` and a ``detail`` for a human."""

    name: str
    status: Status
    detail: str
    #: For a FAIL: the exit code it calls for, when its name does not say (see :func:`doctor_exit_code`).
    exit_code: int | None = field(default=None, compare=False)

    def as_json(self) -> dict[str, str]:
        """The ``doctor --json`` object of this check."""
        return {"check": self.name, "status": self.status, "detail": self.detail}


@dataclass(frozen=True)
class DoctorReport:
    """Every check, in order; the settings when valid; the singleton tasks registered."""

    checks: tuple[Check, ...]
    settings: SingletonSettings | None
    tasks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return not self.problems

    @property
    def problems(self) -> int:
        """How many checks failed."""
        return sum(check.status == "FAIL" for check in self.checks)

    @property
    def warnings(self) -> int:
        """How many checks warned."""
        return sum(check.status == "WARN" for check in self.checks)

    @property
    def exit_code(self) -> int:
        """See :func:`doctor_exit_code`."""
        return doctor_exit_code(self.checks)

    def check(self, name: str) -> Check | None:
        """The check called ``name``, if it ran."""
        return next((check for check in self.checks if check.name == name), None)

    def as_json(self) -> dict[str, Any]:
        """The ``doctor --json`` document."""
        return {"ok": self.ok, "checks": [check.as_json() for check in self.checks]}


def doctor_exit_code(checks: Sequence[Check]) -> int:
    """0 without FAIL; 78 for invalid settings or a Redis that refuses them (wrong password,
    ACL, missing database, TLS), 69 for an unreachable Redis, else 1."""
    failed = {check.name for check in checks if check.status == "FAIL"}
    if not failed:
        return 0
    if any(check.status == "FAIL" and check.exit_code == EX_CONFIG for check in checks):
        return EX_CONFIG
    if "configuration" in failed:
        return EX_CONFIG
    if "redis" in failed:
        return EX_UNAVAILABLE
    return EX_FAILURE


def singleton_tasks(app: Celery, *, load: bool = True) -> list[str]:
    """Names of the app's singleton tasks, sorted; with ``load``, after
    :func:`load_tasks` (the app's task modules imported, as a worker does)."""
    if load:
        load_tasks(app)
    return sorted(name for name, task in app.tasks.items() if hasattr(task, "singleton_key"))


# --------------------------------------------------------------------------- Redis checks


def _check_eviction(client: redis.Redis) -> Check:
    """Locks must never be evicted: an evicted lock is a duplicate run waiting to happen."""
    try:
        memory: dict[str, Any] = client.info("memory")
        policy = memory.get("maxmemory_policy")
        limit = memory.get("maxmemory_human") if int(memory.get("maxmemory", 0) or 0) else None
        if policy is None:  # servers whose INFO lacks it
            config: dict[str, Any] = client.config_get("maxmemory-policy")  # type: ignore[assignment]
            policy = text(config["maxmemory-policy"])
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


def _check_expiry(client: RedisClient, prefix: str) -> Check:
    """Every lock, claim, fencing counter, done marker and liveness key must expire;
    counters and history are bounded."""
    space = KeySpace(prefix)
    scanned = 0
    stuck: list[str] = []
    foreign: list[str] = []
    # Not unique: a key SCAN lists twice is counted twice, rather than every key kept in memory.
    for found in walk(client, space.pattern, str, ("pttl",), unique=False):
        for key, _, (pttl,) in found:
            kind = space.kind(key)
            if kind in ("server-record", "recovery-window"):
                continue  # the library's own record of the server (never expires by design)
            scanned += 1
            if pttl != -1:
                continue
            kind = space.kind(key)
            if kind in STUCK_KINDS:
                stuck.append(key)
            elif kind == "other":
                foreign.append(key)
    if stuck:
        return Check("expiry", "FAIL", f"{len(stuck)} of {scanned} key(s) under '{prefix}:' never "
                                       f"expire: {examples(stuck)}. A lock without TTL blocks its "
                                       "task for good: free it with `celery singleton release KEY`; "
                                       "a done marker (:done:) or liveness key (:live:) without TTL: "
                                       "delete it")
    if foreign:
        return Check("expiry", "WARN", f"{len(foreign)} key(s) under '{prefix}:' that this library "
                                       f"does not write have no TTL: {examples(foreign)}")
    if not scanned:
        return Check("expiry", "OK", f"no keys under '{prefix}:' (nothing held)")
    return Check("expiry", "OK", f"{scanned} key(s) under '{prefix}:'; every lock and claim expires")


def version_check(version: str, role: str, mode: str = "standalone", name: str | None = None) -> Check:
    """The ``version`` check of a server from its ``INFO`` fields (``name``: ``Valkey 8.1.8``).

    FAIL for a replica (locks must be written to the primary) and for Redis
    older than :data:`MIN_REDIS` (``SET ... GET``); WARN below :data:`TESTED_REDIS`.
    Valkey reports ``redis_version`` 7.2.x and is judged by it.
    """
    shown = name or f"Redis {version}"
    problem = version_problem(version, role, shown)
    if problem:  # a worker refuses to start on it: a configuration error (78)
        return Check("version", "FAIL", problem, exit_code=EX_CONFIG)
    numbers = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if numbers and numbers < TESTED_REDIS:
        return Check("version", "WARN", f"{shown} ({mode}, {role}) works; beat cannot name the holder "
                                        "of a slot it lost (SET NX GET needs 7.0)")
    return Check("version", "OK", f"{shown} ({mode}, {role})")


def _check_version(client: redis.Redis) -> Check:
    """Locks need a primary (a replica's writes stay local) running Redis 6.2 or later."""
    try:
        server: dict[str, Any] = client.info("server")
        replication: dict[str, Any] = client.info("replication")
    except redis.ConnectionError:
        raise
    except redis.RedisError as exc:  # INFO denied by an ACL, or renamed: `access` tries SET ... GET
        return Check("version", "WARN", f"cannot read INFO ({exc}); the access check runs SET ... GET "
                                        f"(Redis {MIN_REDIS[0]}.{MIN_REDIS[1]} or later): check by hand "
                                        "that this is a primary")
    return version_check(str(server.get("redis_version", "?")), str(replication.get("role", "?")),
                         str(server.get("redis_mode", "standalone")), server_name(server))


def _check_access(client: RedisClient, prefix: str) -> Check:
    """The heartbeat's own command works: ``SET ... PX ... GET`` of a probe key under the prefix.

    It fails on Redis before 6.2 (a syntax error) and for an ACL user that may
    not write there: both stop a worker at start, so both are FAIL (exit 78).
    """
    try:
        probe_set_get(client, prefix, "")
    except LockRedisUnusable as exc:
        return Check("access", "FAIL", exc.reason, exit_code=EX_CONFIG)
    except redis.ConnectionError:
        raise
    except redis.RedisError as exc:
        return Check("access", "FAIL", explain(exc), exit_code=None if is_outage(exc) else EX_CONFIG)
    return Check("access", "OK", f"SET ... PX ... GET under '{prefix}:' works (liveness keys and locks)")


def _on_each(servers: Sequence[tuple[str, redis.Redis]], check: Callable[[redis.Redis], Check]) -> Check:
    """Run a per-server check on every server; the worst outcome, naming its servers."""
    results = [(name, check(server)) for name, server in servers]
    if len(results) == 1:
        return results[0][1]
    worst = max(_SEVERITY[result.status] for _, result in results)
    shown = [(name, result) for name, result in results if _SEVERITY[result.status] == worst]
    return Check(shown[0][1].name, shown[0][1].status,
                 "; ".join(f"{name}: {result.detail}" for name, result in shown))


def _unreachable(exc: BaseException) -> Check:
    """The ``redis`` check of a server that failed: unreachable (69), or refusing the settings (78)."""
    if is_outage(exc):
        return Check("redis", "FAIL", explain(exc))
    return Check("redis", "FAIL", explain(exc), exit_code=EX_CONFIG)


def _redis_checks(client: RedisClient, prefix: str) -> Iterator[Check]:
    started = time.perf_counter()
    try:
        client.ping()
    except REDIS_ERRORS as exc:
        yield _unreachable(exc)
        return
    yield Check("redis", "OK", f"reachable (PING {1000 * (time.perf_counter() - started):.1f} ms)")

    servers = primaries(client)
    yield _on_each(servers, _check_version)
    yield _check_access(client, prefix)
    try:
        probe_lua(client, "")
        yield Check("lua", "OK", "scripts with cjson run")
    except LockRedisUnusable as exc:
        yield Check("lua", "FAIL", exc.reason)
    except redis.ConnectionError:
        raise
    except redis.RedisError as exc:
        yield Check("lua", "FAIL", f"cannot run a script ({exc}): the lock scripts cannot run either")
    yield _on_each(servers, _check_eviction)
    yield _check_expiry(client, prefix)


# --------------------------------------------------------------------------- doctor


def _configuration(app: Celery, load: bool) -> tuple[Check, SingletonSettings | None, tuple[str, ...]]:
    try:
        settings = get_settings(app)
    except ImproperlyConfigured as exc:
        return Check("configuration", "FAIL", str(exc)), None, ()
    try:
        names = singleton_tasks(app, load=load)
    except Exception as exc:  # the app's own modules: anything can fail at import
        return Check("configuration", "FAIL", f"singleton_* settings valid; cannot import the app's "
                                              f"task modules: {type(exc).__name__}: {exc}"), settings, ()
    listed = f": {examples(names, 3)}" if names else ""
    return (Check("configuration", "OK",
                  f"singleton_* settings valid; {len(names)} singleton task(s) registered{listed}"),
            settings, tuple(names))


def doctor(app: Celery, *, load: bool = True) -> DoctorReport:
    """Every ``doctor`` check of ``app``, in order: ``configuration``, ``redis``, ``version``,
    ``access``, ``lua``, ``eviction``, ``expiry``.

    ``configuration``: the ``singleton_*`` settings, and the app's task
    modules imported (``load``, as a worker does) to count its singleton
    tasks. ``redis``: reachable; the others run only then (they stop where
    the server stops answering; a wrong password, an ACL refusal, a missing
    database or a TLS failure is a FAIL with exit code 78, as it stops a
    worker). ``version``: a primary, 6.2 or later (Valkey by its
    ``redis_version``; 7.0 or later for every feature). ``access``: the
    heartbeat's ``SET ... PX ... GET`` under the prefix works (a 10 s probe
    key): it fails below 6.2 and for an ACL user that may not write there.
    ``lua``: a cjson script runs as the lock scripts do.
    ``eviction``: ``noeviction``, else an evicted lock lets a duplicate run.
    ``expiry``: no lock, claim, fence, done marker, liveness or slot key
    under the prefix without TTL.
    With invalid settings, only ``configuration`` runs.
    """
    first, settings, tasks = _configuration(app, load)
    if settings is None:
        return DoctorReport((first,), None)
    checks = [first]
    try:
        checks.extend(_redis_checks(get_redis(app), settings.key_prefix))
    except REDIS_ERRORS as exc:  # unreachable from the start (Cluster), or lost in the middle
        checks.append(_unreachable(exc))
    return DoctorReport(tuple(checks), settings, tasks)
