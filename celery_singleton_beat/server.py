"""What the lock Redis is, learnt once per connection: its version, its native
commands, and whether it just lost locks (a restart or a failover).

Before a lock request first uses a connection (and again after it
reconnected), :meth:`LockServer.check` runs one ``INFO`` on it, which tells

* the **version** (Redis or Valkey), hence which lock commands the server has
  natively: ``SET ... NX ... GET`` (7.0+), ``SET ... IFEQ`` (Valkey 8.1+, Redis
  8.4+), ``DELIFEQ`` (Valkey 9.0+), ``DELEX ... IFEQ`` (Redis 8.4+); Lua stands in
  where they are missing (see :mod:`.commands`);
* whether the server may have **lost locks that live runs still hold**:

  - it restarted without an append-only file (no persistence, or an RDB
    snapshot older than the locks), as a process that had used it before
    finds out on its next connection (a new run id behind the same address):
    until the server has been up for :attr:`LockServer.window` seconds;
  - it is a replica promoted by a failover (its replication id changed: it may
    lack the primary's last writes): for as long after the first client
    noticed.

  The first client to notice records the window in ``<prefix>:recovery``, so
  that every client sees it, processes started since included
  (``<prefix>:server`` names the server last seen serving the data).
  Inside the window new acquisitions wait (:meth:`LockServer.pause`) and
  holders put their locks back (:meth:`LockServer.may_put_back`): the keeper
  renews every lease at least every ``singleton_liveness_ttl / 3``, so every
  live holder looks within the window.

  A process that never used the server before it restarted (started during the
  outage) learns of the restart only from the record, once a process that did
  use it reconnected (its heartbeat or keeper, within ``liveness_ttl / 3``): in
  that gap it does not wait. A new Redis, or a new deployment, opens no window.

A connection can't outlive a restart or a failover, so a check per connection
is a check after every one of them. A server that refuses ``INFO`` (an ACL
without it) is used with the portable commands only, and no window is opened:
``doctor`` says so.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from redis.exceptions import ResponseError

from .events import logger

__all__ = ["FLOOR", "PORTABLE", "LockServer", "ServerInfo", "ServerMemory", "UnsupportedServer", "on_data_lost",
           "parse_info", "server_of", "version_text"]

#: The oldest server the library runs on: ``SET ... GET`` (the liveness heartbeat)
#: arrived in Redis 6.2.
FLOOR = (6, 2, 0)

#: Seconds added to a third of ``singleton_liveness_ttl`` for the recovery window:
#: a keeper's reconnection and its retry after the failed first attempt.
WINDOW_SLACK = 1.5


class UnsupportedServer(ResponseError):
    """The lock Redis is older than :data:`FLOOR` (a configuration error, not an outage)."""

    def __init__(self, message: str, info: ServerInfo | None = None) -> None:
        super().__init__(message)
        #: What the server said of itself.
        self.info = info


def version_text(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def _version(text: str) -> tuple[int, int, int]:
    parts = [*(int(p) if p.isdigit() else 0 for p in text.split(".")[:3]), 0, 0, 0]
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class ServerInfo:
    """One server as ``INFO`` describes it, and the lock commands it has natively."""

    #: ``"redis"`` or ``"valkey"``.
    flavour: str
    #: The flavour's own version (Valkey reports Redis 7.2.4 compatibility besides).
    version: tuple[int, int, int]
    #: Redis-compatible version (``redis_version``): what the command set follows.
    redis_version: tuple[int, int, int]
    run_id: str
    uptime: float
    #: The append-only file is on: a restart comes back with every acknowledged write.
    aof: bool
    #: A replica promoted by a failover (``master_replid2`` set).
    promoted: bool
    #: A Redis Cluster node (``cluster_enabled``): keys of the recovery record may live elsewhere.
    cluster: bool = False
    #: False when ``INFO`` was refused: nothing is known, the portable commands are used.
    known: bool = True

    @functools.cached_property
    def set_nx_get(self) -> bool:
        """``SET key value NX PX ms GET`` in one command (Redis 7.0+; 6.2 refuses NX with GET)."""
        return self.redis_version >= (7, 0, 0)

    @functools.cached_property
    def release_kind(self) -> str:
        """How a release is spelled here: ``"delifeq"``, ``"delex"`` or ``"lua"`` (asked per run)."""
        return "delifeq" if self.delifeq else "delex" if self.delex else "lua"

    @property
    def set_ifeq(self) -> bool:
        """``SET key value IFEQ old PX ms``: a compare-and-set renewal without Lua."""
        return (self.flavour == "valkey" and self.version >= (8, 1, 0)) or \
            (self.flavour == "redis" and self.version >= (8, 4, 0))

    @property
    def delifeq(self) -> bool:
        """``DELIFEQ key value`` (Valkey 9.0+)."""
        return self.flavour == "valkey" and self.version >= (9, 0, 0)

    @property
    def delex(self) -> bool:
        """``DELEX key IFEQ value`` (Redis 8.4+)."""
        return self.flavour == "redis" and self.version >= (8, 4, 0)

    @property
    def supported(self) -> bool:
        return not self.known or self.redis_version >= FLOOR

    def describe(self) -> str:
        if not self.known:
            return "server version unknown (INFO refused)"
        return f"{self.flavour.capitalize()} {version_text(self.version)}"


#: What is assumed of a server that refuses ``INFO``.
UNKNOWN = ServerInfo("redis", FLOOR, FLOOR, "", float("inf"), True, False, known=False)


def parse_info(raw: Any) -> ServerInfo:
    """A :class:`ServerInfo` from the text of ``INFO`` (or redis-py's parsed dict)."""
    if isinstance(raw, dict):
        fields = {str(k): str(v) for k, v in raw.items()}
    else:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        fields = {}
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and not name.startswith("#"):
                fields[name.strip()] = value.strip()
    redis_version = _version(fields.get("redis_version", "0"))
    valkey = fields.get("server_name") == "valkey" or "valkey_version" in fields
    version = _version(fields["valkey_version"]) if valkey and "valkey_version" in fields else redis_version
    replid2 = fields.get("master_replid2", "")
    return ServerInfo(
        flavour="valkey" if valkey else "redis",
        version=version,
        redis_version=redis_version,
        run_id=fields.get("run_id", ""),
        uptime=float(fields.get("uptime_in_seconds", "0") or 0),
        aof=fields.get("aof_enabled") == "1",
        promoted=fields.get("role", "master") == "master" and bool(replid2.strip("0")),
        cluster=fields.get("cluster_enabled") == "1",
    )


# KEYS: <prefix>:server, <prefix>:recovery. ARGV: this server's run id, ms of a
# window the client found (a restart behind an address it used), ms of the
# window of a promoted replica (0 if not promoted).
# Records this server; opens the window (a promoted replica whose data names
# another server, or what the client found); returns its remaining ms (< 0: none).
_RECOVERY_CHECK = """
local known = redis.call('GET', KEYS[1])
local open = tonumber(ARGV[2])
if known ~= ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1])
  if known and tonumber(ARGV[3]) > open then open = tonumber(ARGV[3]) end
end
if open > 0 and redis.call('PTTL', KEYS[2]) < open then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', open)
end
return redis.call('PTTL', KEYS[2])
"""

#: The memory's entry for the run id of the server last seen serving the data (any address).
_SERVING: tuple[Any, ...] = ("serving",)

#: Called (without arguments) when a process finds its data on a server that may lack its
#: earlier writes: the lease keeper renews every lease at once (see :mod:`.keeper`).
_data_lost_listeners: list[Callable[[], None]] = []


def on_data_lost(listener: Callable[[], None]) -> None:
    """Call ``listener`` each time :attr:`LockServer.epoch` grows, in any server of this process."""
    _data_lost_listeners.append(listener)


class ServerMemory:
    """What this process saw of the servers behind one lock Redis URL, shared by every
    client of it (inherited by forked children, so that a pool child knows what its
    parent saw)."""

    def __init__(self) -> None:
        #: The run id last seen behind each address, and (``_SERVING``) serving the data.
        self.seen: dict[tuple[Any, ...], str] = {}
        #: Grows each time the data is found on a server that may lack earlier writes
        #: (see :attr:`LockServer.epoch`).
        self.epoch = 0


#: Per lock Redis URL (see :class:`ServerMemory`).
_memories: dict[str, ServerMemory] = {}


def server_key(prefix: str) -> str:
    """The key naming the server last seen serving the lock data (never expires)."""
    return f"{prefix}:server"


def recovery_key(prefix: str) -> str:
    """The key whose TTL is an open recovery window (see the module docstring)."""
    return f"{prefix}:recovery"


def memory_for(url: str) -> ServerMemory:
    """The process-wide memory of the servers seen behind ``url``."""
    return _memories.setdefault(url, ServerMemory())


def _address(connection: Any) -> tuple[Any, ...]:
    return (getattr(connection, "host", None), getattr(connection, "port", None),
            getattr(connection, "path", None), getattr(connection, "db", 0))


class LockServer:
    """The lock Redis as one process's client knows it; one per client (see :func:`.client.get_redis`).

    Thread-safe: connections of every thread report to it.
    """

    def __init__(self, prefix: str, liveness_ttl: float,
                 memory: ServerMemory | None = None,
                 factory: Callable[[], Any] | None = None) -> None:
        self.prefix = prefix
        #: Builds another client of the same server and settings (see :meth:`copy_of`).
        self._factory = factory
        #: What this process saw behind the same URL (see :func:`memory_for`).
        self._memory = ServerMemory() if memory is None else memory
        self._seen = self._memory.seen
        #: Seconds a restart or failover keeps new acquisitions waiting.
        self.window = liveness_ttl / 3 + WINDOW_SLACK
        #: What the last connection learnt (``None`` before the first one).
        self.info: ServerInfo | None = None
        #: Monotonic time until which new acquisitions wait (holders put their locks back).
        self.recovering_until = 0.0
        self.recovery_reason = ""
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        """Grows each time this process finds its data served by a server that may lack
        writes it made before (restarted without an append-only file, a promoted
        replica): a lease last confirmed under an earlier epoch whose lock is gone may
        put it back (:meth:`.lock.Lease.may_put_back`), whenever its keeper gets there,
        and a beat writes back its claims (:mod:`.beat.recovery`)."""
        return self._memory.epoch

    # ----------------------------------------------------------------- connections

    def on_connect(self, connection: Any) -> None:
        """redis-py's ``redis_connect_func`` for the library's clients: set the new
        connection up as usual, then :meth:`check` it (once per socket)."""
        connection.on_connect()
        self.check(connection)
        connection.csb_checked = connection._sock

    def check(self, connection: Any) -> ServerInfo:
        """Learn what the server behind ``connection`` is; open a recovery window if it lost locks."""
        try:
            connection.send_command("INFO")
            info = parse_info(connection.read_response())
        except ResponseError as exc:  # NOPERM: portable commands, no windows
            logger.debug("INFO refused on the lock Redis (%s): portable lock commands, no restart detection", exc)
            info = UNKNOWN
        connection.csb_server = info
        if not info.supported:
            raise UnsupportedServer(
                f"the lock Redis is {info.describe()}; celery-singleton-beat needs Redis "
                f"{version_text(FLOOR)} or later (or Valkey)", info)
        remaining, reason, lost = (self._recovery(connection, info) if info.known else (0.0, "", False))
        with self._lock:
            self.info = info
            if lost:
                self._memory.epoch += 1
            if remaining > 0:
                until = time.monotonic() + remaining
                if until > self.recovering_until:
                    if self.recovering_until < time.monotonic():
                        logger.warning("lock Redis %s (%s): new locks wait %.1fs while running tasks put theirs "
                                       "back", info.describe(), reason, remaining)
                    self.recovering_until, self.recovery_reason = until, reason
        if lost:
            for listener in _data_lost_listeners:
                listener()
        return info

    def _recovery(self, connection: Any, info: ServerInfo) -> tuple[float, str, bool]:
        """Seconds of recovery window left for this server, why (0 when none), and whether
        this process now finds its data on a server that may lack its earlier writes."""
        address = _address(connection)
        previous = self._seen.get(address)
        self._seen[address] = info.run_id
        found = 0.0
        reason = ""
        lost = False
        if previous is not None and previous != info.run_id and not info.aof:
            found = max(0.0, self.window - info.uptime)
            reason = f"restarted {info.uptime:.0f}s ago without an append-only file"
            lost = True
        if info.cluster:
            return found, reason, lost  # the record keys may live on another node: this process's view only
        serving = self._seen.get(_SERVING)
        self._seen[_SERVING] = info.run_id
        if info.promoted:
            reason = reason or "a replica promoted by a failover"
            lost = lost or (serving is not None and serving != info.run_id)
        connection.send_command("EVAL", _RECOVERY_CHECK, 2, server_key(self.prefix), recovery_key(self.prefix),
                                info.run_id, round(found * 1000), round(self.window * 1000) if info.promoted else 0)
        left = int(connection.read_response())
        if left > 0:
            return left / 1000, reason or "another client found the lock Redis restarted or failed over", lost
        return 0.0, "", lost

    # ----------------------------------------------------------------- decisions

    def pause(self) -> float:
        """Wait until no recovery window is open (new acquisitions only); seconds waited."""
        left = self.recovering_until - time.monotonic()
        if left <= 0:
            return 0.0
        waited = 0.0
        while left > 0:
            time.sleep(left)
            waited += left
            left = self.recovering_until - time.monotonic()
        logger.info("a new lock waited %.1fs for the lock Redis's recovery window (%s)", waited,
                    self.recovery_reason)
        return waited

    def copy_of(self, client: Any) -> Any:
        """A new client of the same server and settings as ``client``, sharing this record.

        For threads that must not share connections with others (greenlet pools:
        see :mod:`.native`). Clients the library did not build are copied from
        their connection pool's settings (one server; Sentinel and Cluster
        clients are built from the app's settings by :func:`.client.get_redis`).
        """
        if self._factory is not None:
            copy = self._factory()
        else:
            pool = client.connection_pool
            copy = type(client)(connection_pool=type(pool)(connection_class=pool.connection_class,
                                                           **pool.connection_kwargs))
        copy.csb_server = self
        return copy

    def downgrade(self) -> None:
        """A native command was refused: use the portable commands from now on."""
        with self._lock:
            self.info = UNKNOWN if self.info is None else replace(
                self.info, flavour="redis", version=min(self.info.redis_version, (8, 0, 0)))


#: What requests are built for before a connection told what the server is: the
#: commands every supported server has.
PORTABLE = UNKNOWN

_server_lock = threading.Lock()


def server_of(client: Any) -> LockServer:
    """The :class:`LockServer` of ``client`` (set by :func:`.client.get_redis`; defaults otherwise)."""
    server: LockServer | None = getattr(client, "csb_server", None)
    if server is None:
        with _server_lock:
            server = getattr(client, "csb_server", None)
            if server is None:
                server = LockServer("singleton", 10.0)
                client.csb_server = server
    return server
