"""What the lock Redis is, learnt once per connection: its version, its native
commands, and whether it may have lost locks that live runs hold.

Before a lock request first uses a connection (and again after it
reconnected), :meth:`LockServer.check` runs one ``INFO`` on it, which tells

* the **version** (Redis or Valkey), hence which lock commands the server has
  natively: ``SET ... NX ... GET`` (7.0+), ``SET ... IFEQ`` (Valkey 8.1+, Redis
  8.4+), ``DELIFEQ`` (Valkey 9.0+), ``DELEX ... IFEQ`` (Redis 8.4+); Lua stands in
  where they are missing (see :mod:`.commands`);
* which **server** this is (its run id, new at every start), whether it keeps
  every acknowledged write across a restart (an append-only file), and whether
  it is a replica promoted by a failover (``master_replid2`` set: it may lack the
  old primary's last writes); with the Sentinel failover epoch the primary was named
  at (:mod:`..connection.sentinel`), held against the record of the data (the server
  last seen serving it, its generation, the longest window its users need) and
  what this process remembers of it, that opens or joins a **recovery window** (see
  :mod:`.window`): :meth:`LockServer.recovery` says whether one is open, until
  when and why, and new acquisitions wait for it (:meth:`LockServer.pause`).

A connection can't outlive a restart or a failover, so a check per connection
is a check after every one of them. A server that refuses ``INFO`` (an ACL
without it) is used with the portable commands only, and no window is opened:
``doctor`` says so.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from redis.exceptions import ResponseError

from ..connection.sentinel import failover_epoch
from ..log import logger
from .records import records_of, server_key
from .window import NO_WINDOW, WINDOW_SLACK, Recovery, ServerMemory, memory_for, notice

__all__ = ["FLOOR", "INFO_SECTIONS", "PORTABLE", "LockServer", "ServerInfo", "ServerMemory", "UnsupportedServer",
           "memory_for", "on_data_lost", "parse_info", "server_of", "version_text"]

#: The oldest server the library runs on: ``SET ... GET`` (the liveness heartbeat)
#: arrived in Redis 6.2.
FLOOR = (6, 2, 0)


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
    #: The append-only file is on: a restart comes back with every acknowledged write.
    aof: bool
    #: A replica promoted by a failover (``master_replid2`` set).
    promoted: bool
    #: A Redis Cluster node (``cluster_enabled``): each shard has records of its own.
    cluster: bool = False
    #: False when ``INFO`` was refused: nothing is known, the portable commands are used.
    known: bool = True
    #: Whole seconds since the server process started (``uptime_in_seconds``: the difference
    #: of two whole-second clocks, so the process started less than ``uptime + 1`` seconds ago).
    uptime: int = 0
    #: False once a native command was refused here (an ACL short of it): portable from then.
    natives: bool = True

    @functools.cached_property
    def set_nx_get(self) -> bool:
        """``SET key value NX PX ms GET`` in one command (Redis 7.0+; 6.2 refuses NX with GET)."""
        return self.redis_version >= (7, 0, 0)

    @property
    def expire_time(self) -> bool:
        """``PEXPIRETIME key``: a key's expiry as stored, in Unix ms (Redis 7.0+, Valkey)."""
        return self.known and self.natives and self.redis_version >= (7, 0, 0)

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
UNKNOWN = ServerInfo("redis", FLOOR, FLOOR, "", True, False, known=False)


#: The ``INFO`` sections the check reads (what :func:`parse_info` needs), asked one per command in
#: one round trip: a single ``INFO`` with several sections needs Redis 7.0, the floor is 6.2.
INFO_SECTIONS = ("server", "persistence", "replication", "cluster")
#: One ``name:value`` line of ``INFO`` (section headers start with ``#``).
_FIELD = re.compile(r"^([^#:\r\n][^:\r\n]*):([^\r\n]*)", re.M)


def parse_info(raw: Any) -> ServerInfo:
    """A :class:`ServerInfo` from the text of ``INFO`` (or redis-py's parsed dict)."""
    if isinstance(raw, dict):
        fields = {str(k): str(v) for k, v in raw.items()}
    else:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        fields = {name.strip(): value.strip() for name, value in _FIELD.findall(text)}
    redis_version = _version(fields.get("redis_version", "0"))
    valkey = fields.get("server_name") == "valkey" or "valkey_version" in fields
    version = _version(fields["valkey_version"]) if valkey and "valkey_version" in fields else redis_version
    replid2 = fields.get("master_replid2", "")
    return ServerInfo(
        flavour="valkey" if valkey else "redis",
        version=version,
        redis_version=redis_version,
        run_id=fields.get("run_id", ""),
        aof=fields.get("aof_enabled") == "1",
        promoted=fields.get("role", "master") == "master" and bool(replid2.strip("0")),
        cluster=fields.get("cluster_enabled") == "1",
        uptime=int(fields.get("uptime_in_seconds", "0") or 0),
    )


#: Called (without arguments) when a process finds its data on a server that may lack its
#: earlier writes: the lease keeper renews every lease at once (see :mod:`.keeper`).
_data_lost_listeners: list[Callable[[], None]] = []


def on_data_lost(listener: Callable[[], None]) -> None:
    """Call ``listener`` each time :attr:`LockServer.epoch` grows, in any server of this process."""
    _data_lost_listeners.append(listener)


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
        #: Seconds this process's holders need to put their locks back after a loss (they renew
        #: every third of ``liveness_ttl`` at least): published in the server record, and the
        #: least a window it opens lasts. A window lasts the longest need this process knows of,
        #: its own, the record's or one it remembers (see :mod:`.window`).
        self.window = liveness_ttl / 3 + WINDOW_SLACK
        #: What the last connection learnt (``None`` before the first one).
        self.info: ServerInfo | None = None
        #: A native command was refused here once (an ACL short of it): every connection's
        #: ``info`` is the portable one from then (see :meth:`downgrade`).
        self._refused = False
        self._lock = threading.Lock()
        #: This thread's last wait for a window (see :meth:`resumed`).
        self._paused = threading.local()
        #: Some thread of this process waited for a window once: until then no thread's
        #: :meth:`resumed` reads ``_paused``. In a gevent worker it is a greenlet-local, and
        #: the first read by each run's greenlet built that greenlet's entry (four objects
        #: and a weak reference kept for the life of the run, each acquire).
        self._ever_paused = False

    @property
    def epoch(self) -> int:
        """Grows each time this process finds its data served by a server that may lack
        writes it made before (see :func:`.window.data_lost`): a lease last confirmed under an
        earlier epoch whose lock is gone may put it back (:meth:`.lock.Lease.may_put_back`),
        whenever its keeper gets there, and a beat writes back its claims (:mod:`.beat.recovery`)."""
        return self._memory.epoch

    def data_lost_since_ms(self) -> int:
        """When the latest recovery window of this server's data opened, on the server's clock
        (Unix ms; 0: none known; always 0 on Redis Cluster, whose shards have records of
        their own): a lock not renewed since may be one its holder no longer keeps
        (:mod:`.lease.stale`)."""
        return self._memory.since_ms(server_key(self.prefix))

    @property
    def lost_by(self) -> float:
        """Monotonic time by which the latest data loss this process found had happened (see
        :attr:`.window.ServerMemory.lost_by`): a lease confirmed within a take-over's reach
        of it may put its lock back (:meth:`.lease.Lease.may_put_back`)."""
        return self._memory.lost_by

    def recovery(self) -> Recovery:
        """Is a recovery window open for this server, until when, and why: the latest window
        this process found for this key prefix (on any connection, any Cluster shard), from
        the records every client shares. New acquisitions and new slot claims wait while
        it is open."""
        return self._memory.windows.get(self.prefix, NO_WINDOW)

    @property
    def recovery_reason(self) -> str:
        """Why the latest window opened (``recovery().reason``), for log lines."""
        return self.recovery().reason

    # ----------------------------------------------------------------- connections

    def on_connect(self, connection: Any) -> None:
        """redis-py's ``redis_connect_func`` for the library's clients: set the new
        connection up as usual (less what this server is known not to need: see
        :func:`_lean_handshake`), then :meth:`check` it (once per socket)."""
        _lean_handshake(connection, self.info)
        connection.on_connect()
        self.check(connection)
        connection.csb_checked = connection._sock

    def check(self, connection: Any) -> ServerInfo:
        """Learn what the server behind ``connection`` is; open or join a recovery window
        if it may have lost locks (see :mod:`.window`)."""
        try:
            info = parse_info(_read_info(connection))
        except ResponseError as exc:  # NOPERM: portable commands, no windows
            logger.debug("INFO refused on the lock Redis (%s): portable lock commands, no restart detection", exc)
            info = UNKNOWN
        if not info.supported:
            raise UnsupportedServer(
                f"the lock Redis is {info.describe()}; celery-singleton-beat needs Redis "
                f"{version_text(FLOOR)} or later (or Valkey)", info)
        records = records_of(connection, self.prefix, cluster=info.cluster) if info.known else None
        lost = False
        if records is not None:
            seen = notice(connection, records, info.run_id, promoted=info.promoted, aof=info.aof, need=self.window,
                          known=self._memory.known(records[0]), failover_epoch=failover_epoch(connection))
            lost, opened = self._memory.learn(self.prefix, records[0], info.run_id, seen,
                                              promoted=info.promoted, aof=info.aof,
                                              started_by=time.monotonic() - info.uptime + 1)
            if opened is not None:
                logger.warning("the lock Redis (%s) may have lost locks (%s): new locks wait %.1fs while running tasks "
                               "put theirs back",
                               info.describe(), opened.reason, opened.left())
        with self._lock:
            if self._refused and info.known:
                info = _portable(info)
            self.info = info
        if lost:
            for listener in _data_lost_listeners:
                listener()
        return info

    # ----------------------------------------------------------------- decisions

    def pause(self) -> float:
        """Wait until no recovery window is open (new acquisitions only); seconds waited."""
        waited = 0.0
        while (left := self.recovery().left()) > 0:
            time.sleep(left)
            waited += left
        if waited:
            self._paused.resumed = time.monotonic()
            self._ever_paused = True  # after the thread's own entry: its resumed() sees it
            logger.info("a new lock waited %.1fs for the lock Redis's recovery window (%s)", waited,
                        self.recovery_reason)
        return waited

    def resumed(self) -> float:
        """When this thread's last :meth:`pause` that waited ended (monotonic; 0.0: never): a
        request written after it runs from then, e.g. a lease's TTL."""
        if not self._ever_paused:  # no thread ever waited: no thread-local to look in
            return 0.0
        return float(getattr(self._paused, "resumed", 0.0))

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
        """A native command was refused: use the portable commands from now on, on this
        connection and every later one (a new connection's check does not grant them again:
        an ACL short of them would refuse, and warn, once per connection)."""
        with self._lock:
            self._refused = True
            self.info = UNKNOWN if self.info is None else _portable(self.info)


def _portable(info: ServerInfo) -> ServerInfo:
    """``info`` without its native lock commands (a refused one: see :meth:`LockServer.downgrade`)."""
    return replace(info, flavour="redis", version=min(info.redis_version, (8, 0, 0)), natives=False)


#: What requests are built for before a connection told what the server is: the
#: commands every supported server has.
PORTABLE = UNKNOWN

_server_lock = threading.Lock()


def _read_info(connection: Any) -> str:
    """The :data:`INFO_SECTIONS` of the server behind ``connection``, in one round trip
    (every reply read before a refusal is raised: the connection stays in step)."""
    connection.send_packed_command(connection.pack_commands([("INFO", section) for section in INFO_SECTIONS]))
    texts: list[str] = []
    refused: ResponseError | None = None
    for _ in INFO_SECTIONS:
        try:
            reply = connection.read_response()
        except ResponseError as exc:
            refused = exc
            continue
        texts.append(reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply))
    if refused is not None:
        raise refused
    return "\r\n".join(texts)


#: The Redis version that knows ``CLIENT SETINFO`` (Valkey has it from its first release).
_SETINFO_SINCE = (7, 2, 0)
#: A connection's client-library details (what redis-py sends with ``CLIENT SETINFO``):
#: ``driver_info`` in redis-py 7+, ``lib_name`` and ``lib_version`` in 5.x and 6.x.
_DRIVER_DETAILS = ("driver_info", "lib_name", "lib_version")


@functools.cache
def _health_clock() -> Callable[[], float]:
    """The clock redis-py's health check compares ``next_health_check`` with: ``time.time``
    up to redis-py 5.0 (``from time import time`` in :mod:`redis.connection`),
    ``time.monotonic`` since (the module ``time`` imported there)."""
    import redis.connection

    found = getattr(redis.connection, "time", None)
    return found if callable(found) else time.monotonic


def _lean_handshake(connection: Any, known: ServerInfo | None) -> None:
    """Leave out of a new connection's handshake what the server is known not to need.

    * redis-py's health check: with ``health_check_interval`` set, a new connection's first
      command is preceded by a ``PING``. The handshake's own replies confirm a connection
      just made, so it counts as the check (the deadline is set on redis-py's own clock:
      see :func:`_health_clock`).
    * ``CLIENT SETINFO`` (the client library's name and version) when the server this
      client last saw (``known``) is a Redis older than 7.2, which refuses it: redis-py
      sends it and ignores the error. Until a check saw the server, it is sent. The details
      left out are kept on the connection (``csb_driver``) and put back when the server
      known is no longer such a Redis (a failover, an upgrade): a pooled connection object
      lives across reconnections, to whatever server its address leads to.

    Each costs a round trip and its Python on every connection: a gevent worker opens
    its pool's connections while its first runs start (see docs/performance.md).
    """
    interval = getattr(connection, "health_check_interval", 0)
    if interval:
        connection.next_health_check = _health_clock()() + interval
    kept: dict[str, Any] | None = getattr(connection, "csb_driver", None)
    if known is not None and known.known and known.flavour == "redis" and known.redis_version < _SETINFO_SINCE:
        if kept is None:
            kept = connection.csb_driver = {name: getattr(connection, name) for name in _DRIVER_DETAILS
                                            if getattr(connection, name, None) is not None}
        for name in kept:
            setattr(connection, name, None)
    elif kept is not None:
        for name, value in kept.items():
            setattr(connection, name, value)
        connection.csb_driver = None


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
