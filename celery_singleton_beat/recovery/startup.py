"""The lock Redis at start: which server it is, and whether it can be used at all.

A worker and a beat call :func:`check_lock_redis` before they take any task or
slot. It tells two kinds of failure apart, because they call for opposite
reactions:

* **an outage** (connection refused, a timeout, a server still loading its
  data, a Cluster or Sentinel that does not answer): the setting may be right
  and the server coming. :class:`LockRedisDown` is raised; the worker and the
  beat start anyway and retry, as they do for an outage later on.
* **a configuration error** (a wrong password or user, an ACL that refuses a
  command or the key prefix, a database index the server does not have, a TLS
  handshake that fails, a replica named as the lock Redis, a server older than
  :data:`MIN_REDIS`):
  retrying cannot help, and a worker that started anyway would keep every
  singleton run in ``RETRY`` for ever. :class:`LockRedisUnusable` is raised;
  the worker and the beat stop with its one line (:func:`refuse_to_start`).

The words are those of ``celery singleton doctor`` (:func:`explain` and
:func:`version_problem` are what its ``redis`` and ``version`` checks say).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import current_process
from typing import Any, NoReturn

import redis
from celery.exceptions import ImproperlyConfigured
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError

from ..config import SingletonSettings
from ..connection.client import RedisClient, cluster_reread, is_cluster_outage, primaries
from ..connection.pooled import run_script
from ..connection.url import sanitize_redis_url
from ..connection.wire import LuaScript
from ..exceptions import SingletonError
from ..log import logger
from .server import UnsupportedServer, version_text

__all__ = [
    "EX_CONFIG",
    "LUA_PROBE",
    "MIN_REDIS",
    "TESTED_REDIS",
    "LockRedisDown",
    "LockRedisUnusable",
    "ServerInfo",
    "StartupCheck",
    "check_lock_redis",
    "explain",
    "is_outage",
    "probe_lua",
    "probe_set_get",
    "refuse_to_start",
    "server_name",
    "version_problem",
]

#: Exit code of a worker or beat that refuses to start, and of ``doctor`` for
#: invalid settings: ``EX_CONFIG`` of sysexits.h.
EX_CONFIG = 78
#: Oldest Redis the library runs on: the worker's heartbeat writes its liveness
#: key with ``SET ... GET`` (and the lock path ``SET NX PX GET``), new in 6.2.
#: Below it no liveness key is ever written, and every other worker would take
#: every lock over.
MIN_REDIS = (6, 2)
#: Oldest Redis whose every feature the library uses: beat's ``SET NX GET``,
#: which names the holder of a slot it lost, needs 7.0 (older servers get ``SET NX``).
TESTED_REDIS = (7, 0)
#: A script using what the lock scripts use: Lua and its cjson library.
LUA_PROBE = LuaScript("return cjson.decode(ARGV[1])['lua']")
#: How long the probe key lives (milliseconds).
_PROBE_TTL_MS = 10_000


class LockRedisUnusable(SingletonError, ImproperlyConfigured):
    """The lock Redis cannot be used as configured; retrying will not help.

    ``reason`` is the one line an operator needs (what is wrong, and where to
    look); ``url`` the Redis URL with its password masked.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url, self.reason = url, reason

    def __str__(self) -> str:
        return f"cannot use the lock Redis {self.url}: {self.reason}"


class LockRedisDown(SingletonError):
    """The lock Redis did not answer (an outage): worth retrying. ``cause`` is redis-py's error."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(url, f"{type(cause).__name__}: {cause}")
        self.url, self.cause = url, cause

    def __str__(self) -> str:
        return f"the lock Redis {self.url} does not answer yet ({self.args[1]})"


@dataclass(frozen=True)
class ServerInfo:
    """What the lock Redis is: for the start-up log line and the banner."""

    url: str
    topology: str
    #: One entry per primary: ``Redis 7.0.15``, ``Valkey 8.1.8``, or ``Redis (version not readable)``.
    servers: tuple[str, ...]

    def describe(self) -> str:
        """``redis://:**@host:6379/2 (standalone, Redis 7.0.15)``."""
        names = sorted(set(self.servers))
        shown = names[0] if len(names) == 1 else ", ".join(names)
        count = f"{len(self.servers)} primaries, " if len(self.servers) > 1 else ""
        return f"{self.url} ({self.topology}, {count}{shown})"


# --------------------------------------------------------------------------- classifying errors


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (redis-py wraps socket and TLS errors)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 10:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _is_tls_failure(exc: BaseException) -> bool:
    return any(isinstance(cause, ssl.SSLError) for cause in _causes(exc)) or "[SSL" in str(exc)


#: Error replies of a server that works but cannot serve this request now.
_BUSY_REPLIES = ("BUSY ", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "OOM ")


def is_outage(exc: BaseException) -> bool:
    """True for a failure that retrying may cure (the server down, slow, loading or failing over).

    An error reply of a server that works but cannot answer now (``BUSY``: another
    client's script; ``OOM``: full; ``MASTERDOWN``/``TRYAGAIN``/``CLUSTERDOWN``: a
    failover or resharding) is an outage too.
    False for a configuration error: authentication (``AuthenticationError``,
    ``AuthenticationWrongNumberOfArgsError``), an ACL refusal (``NOPERM``), a
    missing database, a failed TLS handshake, a replica, a command the server
    does not know, or any other error reply.
    """
    if isinstance(exc, redis.AuthenticationError) or _is_tls_failure(exc):
        return False  # both are ConnectionErrors to redis-py
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return True  # refused, reset, timed out, LOADING, no Sentinel or Cluster node answering
    if isinstance(exc, (ClusterDownError, TryAgainError)):
        return True  # CLUSTERDOWN, MASTERDOWN, TRYAGAIN: redis-py strips the word from the message
    if isinstance(exc, redis.ResponseError) and str(exc).startswith(_BUSY_REPLIES):
        return True  # another client's script, a full server, a failover under way: it passes
    if isinstance(exc, RedisClusterException):
        return is_cluster_outage(exc)  # the Cluster client's own rule
    return False


def explain(exc: BaseException) -> str:
    """What a redis-py error means for the lock Redis, in ``doctor``'s words."""
    name = f"{type(exc).__name__}: {exc}"
    message = str(exc)
    if isinstance(exc, (redis.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)):
        if "wrong number of arguments" in message:
            return (f"the server does not accept a user name with the password ({name}): Redis before "
                    "6.0 has no ACL users; put only the password in singleton_redis_url")
        if "no password is set" in message:
            return f"a password was given, but the server has none ({name}); remove it from the URL"
        return (f"authentication failed: wrong password or user name, or the user is disabled ({name}); "
                "check the credentials in singleton_redis_url")
    if isinstance(exc, UnsupportedServer) and exc.info is not None:
        return version_problem(version_text(exc.info.redis_version), "master", exc.info.describe()) or name
    if _is_tls_failure(exc):
        return (f"the TLS handshake failed ({name}); check the rediss:// URL and its ssl_* options "
                "(certificate authority, host name, a TLS port)")
    if (isinstance(exc, redis.exceptions.NoPermissionError) or message.startswith("NOPERM")
            or "user executing the script can't run this command" in message):  # a command inside a script
        return (f"the ACL user may not do what the library needs ({name}); give it the rules of "
                "celery_singleton_beat.connection.client.acl_rules() (docs/deployment.md)")
    if isinstance(exc, redis.ResponseError) and re.search(r"invalid DB index|DB index is out of range", message):
        return (f"the database in singleton_redis_url does not exist on this server ({name}); use an "
                "index below the server's `databases` setting (16 by default)")
    if isinstance(exc, redis.ResponseError) and re.search(r"unknown command .?HELLO", message, re.I):
        return version_problem("5", "master", f"this server (it does not know HELLO, new in Redis 6.0: {name})") \
            or name
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return (f"this server is a read-only replica ({name}): locks must be written to the primary; "
                "point singleton_redis_url at the primary (or use sentinel://)")
    if is_outage(exc):
        return f"unreachable: {name}"
    return f"the server refused a command the library needs ({name})"


# --------------------------------------------------------------------------- versions


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def server_name(info: dict[str, Any]) -> str:
    """``Redis 7.0.15`` or ``Valkey 8.1.8`` (Valkey reports ``redis_version`` 7.2.x too)."""
    if info.get("valkey_version"):
        return f"Valkey {info['valkey_version']}"
    if info.get("server_name") and str(info["server_name"]).lower() != "redis":
        return f"{str(info['server_name']).capitalize()} {info.get('redis_version', '?')}"
    return f"Redis {info.get('redis_version', '?')}"


def version_problem(version: str, role: str, name: str | None = None) -> str | None:
    """Why a server with this ``redis_version`` and ``role`` cannot hold locks, or None.

    A replica: locks must be written to the primary. Older than
    :data:`MIN_REDIS`: ``SET ... GET`` (the heartbeat) is a syntax error there.
    """
    shown = name or f"Redis {version}"
    if role not in ("master", "?"):
        return (f"{shown} is a {role}: locks must be written to the primary (a replica's keys are "
                "not shared with the others)")
    numbers = _numbers(version)
    if numbers and numbers < MIN_REDIS:
        return (f"{shown} is too old: the library needs Redis {MIN_REDIS[0]}.{MIN_REDIS[1]} or later "
                "(the liveness heartbeat and the locks use SET ... GET, a syntax error before 6.2)")
    return None


# --------------------------------------------------------------------------- the check


class StaleLayout(redis.ConnectionError):
    """A node the Cluster client's slot map names as a primary answers as a replica: the
    map is older than a failover (``CLUSTER SLOTS`` names primaries only). An outage while
    it lasts, never a configuration error."""


def _server_info(server: redis.Redis, url: str, *, cluster: bool = False) -> str:
    """The name of one primary; raises :class:`LockRedisUnusable` for a replica or an old
    server (``cluster``: :class:`StaleLayout` for a replica)."""
    try:
        info: dict[str, Any] = server.info("server")
        role = str(server.info("replication").get("role", "?"))
    except (redis.ConnectionError, redis.TimeoutError, UnsupportedServer):
        raise  # UnsupportedServer: the connection's own look at the server (see .server)
    except redis.RedisError:  # INFO refused by an ACL: the SET ... GET probe decides instead
        return "Redis (version not readable: INFO refused)"
    name = server_name(info)
    if cluster and role not in ("master", "?"):
        raise StaleLayout(f"{name}, a primary in the client's slot map, is a {role} now (a failover)")
    problem = version_problem(str(info.get("redis_version", "?")), role, name)
    if problem:
        raise LockRedisUnusable(url, problem)
    return name


def probe_set_get(client: RedisClient, prefix: str, url: str) -> None:
    """One ``SET`` of a probe key under ``prefix`` with ``PX`` and ``GET`` (10 s TTL).

    What the heartbeat sends: it needs Redis 6.2 (a syntax error before, which
    raises :class:`LockRedisUnusable`) and an ACL that lets the user write
    under the prefix. The key is deleted right after.
    """
    key = f"{prefix}:probe:{secrets.token_hex(8)}"
    try:
        client.set(key, "1", px=_PROBE_TTL_MS, get=True)
    except redis.ResponseError as exc:
        if "syntax error" in str(exc).lower():
            raise LockRedisUnusable(url, version_problem(
                "6.0", "master", f"this server (SET ... GET answered {exc})") or str(exc)) from exc
        raise
    with contextlib.suppress(redis.ResponseError):  # leave nothing behind (it would expire anyway)
        client.delete(key)


def probe_lua(client: RedisClient, url: str) -> None:
    """Run a script using Lua and cjson, as the lock scripts do (``EVALSHA``, loaded on ``NOSCRIPT``)."""
    reply = run_script(client, LUA_PROBE, [], ['{"lua":"ok"}'])
    if (reply.decode() if isinstance(reply, bytes) else reply) != "ok":
        raise LockRedisUnusable(url, f"a Lua script returned {reply!r} instead of 'ok': "
                                     "the lock scripts cannot run on this server")


def check_lock_redis(client_of: Callable[[], RedisClient], settings: SingletonSettings) -> ServerInfo:
    """Check that the lock Redis answers and can hold locks; say which server it is.

    Sends ``PING``, ``INFO server`` / ``INFO replication`` on each primary (an
    ACL may refuse them: then only the probe decides), one ``SET`` of a probe
    key under the prefix with ``PX`` and ``GET`` (deleted again), and one Lua
    script. Raises :class:`LockRedisDown` for an outage and
    :class:`LockRedisUnusable` for everything retrying cannot fix.
    """
    url = sanitize_redis_url(settings.redis_url)
    try:
        client = client_of()  # a Cluster client asks its nodes for the slots here
        client.ping()
        names = _primary_names(client, url)
        probe_set_get(client, settings.key_prefix, url)
        probe_lua(client, url)
    except LockRedisUnusable:
        raise
    except (redis.RedisError, RedisClusterException) as exc:
        if is_outage(exc):
            raise LockRedisDown(url, exc) from exc
        raise LockRedisUnusable(url, explain(exc)) from exc
    return ServerInfo(url, settings.topology, names)


def _primary_names(client: RedisClient, url: str) -> tuple[str, ...]:
    """The name of each primary (:func:`_server_info`). On Cluster, a replica among them
    means the client's slot map is older than a failover: the layout is read again, once,
    and a replica still named then is :class:`StaleLayout` (an outage: the next check reads
    it again)."""
    if not isinstance(client, RedisCluster):
        return tuple(_server_info(server, url) for _, server in primaries(client))
    try:
        return tuple(_server_info(server, url, cluster=True) for _, server in primaries(client))
    except StaleLayout:
        cluster_reread(client)
        return tuple(_server_info(server, url, cluster=True) for _, server in primaries(client))


class StartupCheck:
    """The start-up check of one process (``"worker w1@host"``, ``"beat host:12:a1b2c3"``).

    :meth:`run` at start: the server, or None during an outage (logged with
    ``consequence``, what the process does meanwhile); a configuration error
    ends the process (:func:`refuse_to_start`). After an outage, :meth:`poll`
    (at most once per ``interval``) checks again until the server answers,
    logs when it does, and raises :class:`LockRedisUnusable` (after logging
    why the process stops) when the server that came back cannot be used:
    the outage had hidden a wrong password, a missing database... How the
    process then stops is the caller's (a worker's thread, a beat's tick).
    """

    def __init__(self, what: str, client_of: Callable[[], RedisClient], settings: SingletonSettings,
                 interval: float = 1.0) -> None:
        self.what, self.client_of, self.settings, self.interval = what, client_of, settings, interval
        #: True from an outage at start until the server answered.
        self.pending = False
        self._next = 0.0

    def run(self, consequence: str) -> ServerInfo | None:
        """Check at start; see the class."""
        try:
            return check_lock_redis(self.client_of, self.settings)
        except LockRedisUnusable as exc:
            refuse_to_start(self.what, exc)
        except LockRedisDown as exc:
            logger.error("%s: %s; %s", self.what, exc, consequence)
            self.pending, self._next = True, time.monotonic() + self.interval
            return None

    def wait(self) -> float:
        """Seconds until :meth:`poll` is due."""
        return max(self._next - time.monotonic(), 0.0)

    def poll(self) -> ServerInfo | None:
        """The server once it answers and passes (logged), None while it is down or not due."""
        now = time.monotonic()
        if not self.pending or now < self._next:
            return None
        self._next = now + self.interval
        try:
            server = check_lock_redis(self.client_of, self.settings)
        except LockRedisDown as exc:
            logger.debug("%s: %s; checking again in %.1fs", self.what, exc, self.interval)
            return None
        except LockRedisUnusable as exc:
            self.pending = False
            logger.critical("%s stops: %s. `celery -A <app> singleton doctor` checks the settings and "
                            "the server", self.what, exc)
            raise
        self.pending = False
        logger.info("%s: lock Redis %s answers now", self.what, server.describe())
        return server


def refuse_to_start(what: str, error: object) -> NoReturn:
    """Log the one line that says why ``what`` (a worker, a beat) stops, and exit with 78.

    ``error``: the unusable lock Redis, or an invalid ``singleton_*`` setting
    (``ImproperlyConfigured``). ``SystemExit`` passes through Celery's start-up
    code without a traceback, and 78 (``EX_CONFIG``) tells a supervisor that
    restarting will not help. Before Celery has set up logging (``celery beat``
    builds its scheduler for the banner first) the line is written to stderr
    as Celery would, level name included.
    """
    message = (f"{what} refuses to start: {error}. `celery -A <app> singleton doctor` checks the "
               "settings and the server")
    if logger.hasHandlers():
        logger.critical("%s", message)
    else:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}: CRITICAL/{current_process().name}] {message}",
              file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(EX_CONFIG)
