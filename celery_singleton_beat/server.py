"""What the lock Redis is, learnt once per connection: its version, its native
commands, and whether it may have lost locks that live runs hold (a recovery window).

Before a lock request first uses a connection (and again after it
reconnected), :meth:`LockServer.check` runs one ``INFO`` on it, which tells

* the **version** (Redis or Valkey), hence which lock commands the server has
  natively: ``SET ... NX ... GET`` (7.0+), ``SET ... IFEQ`` (Valkey 8.1+, Redis
  8.4+), ``DELIFEQ`` (Valkey 9.0+), ``DELEX ... IFEQ`` (Redis 8.4+); Lua stands in
  where they are missing (see :mod:`.commands`);
* which **server** this is (its run id, new at every start), whether it keeps
  every acknowledged write across a restart (an append-only file), and whether
  it is a replica promoted by a failover (``master_replid2`` set: it may lack the
  old primary's last writes).

Then one small script, on the same connection, holds that server against
``<prefix>:server``, the record of the server last seen serving the data (on
Redis Cluster, one record per shard, kept on that shard: see :func:`records_of`),
and writes this server in. What the record says decides, by :func:`opening`:

==========================================  ===========================================
the record                                  the check
==========================================  ===========================================
names this server                           nothing new (reads a window another client
                                            opened, if one is still open)
is missing (a new Redis, or emptied data)   opens a window
names another server, this one promoted     opens a window (a failover)
names another server, no append-only file   opens a window (a restart that lost data)
names another server, append-only file      opens none (every write was kept)
==========================================  ===========================================

A window is the TTL of ``<prefix>:recovery`` (its value says why), written in the
same script as the record: so it is anchored at the **first client that notices**
the new server, whenever that happens (after a snapshot that took long to load,
once a server becomes reachable), and every client, processes started since
included, finds it there on its own connections. Inside it new acquisitions and
new slot claims wait (:meth:`LockServer.pause`), and live holders put their locks
back: the keeper renews every lease at least every ``singleton_liveness_ttl / 3``,
so every holder gets there within the window.

States of one record (the data of one server, or of one Cluster shard)::

               a check: record missing, or naming another server
               that is promoted or has no append-only file
    SERVED  ----------------------------------------------->  OPEN (until, why)
      ^  |                                                        |
      |  +-- a check: another server, append-only file            |
      |      (record rewritten, no window)                        |
      +-------------------- the window's TTL ends ----------------+

Per process, :class:`ServerMemory` remembers the server it last saw serving each
record, once that check's script has run (never before: a check cut in between is
made again on the next connection); its :attr:`~ServerMemory.epoch` grows when the
process finds its data on a server that may lack writes it made, which makes its
holders put their locks back and its beats write back their claims.
:meth:`LockServer.recovery` answers whether a window is open for the server, until
when and why.

A missing record costs one window, once, on a new Redis as on a lost one: the
library cannot tell them apart, and a window of a few seconds that only new
acquisitions of those seconds wait for is cheaper than a duplicate run.

A connection can't outlive a restart or a failover, so a check per connection
is a check after every one of them. A server that refuses ``INFO`` (an ACL
without it) is used with the portable commands only, and no window is opened:
``doctor`` says so.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ResponseError

from .log import logger

__all__ = ["FLOOR", "PORTABLE", "Finding", "LockServer", "Recovery", "ServerInfo", "ServerMemory",
           "UnsupportedServer", "data_lost", "on_data_lost", "opening", "parse_info", "records_of",
           "recovery_key", "server_key", "server_of", "shard_records", "shard_tag", "version_text"]

#: The oldest server the library runs on: ``SET ... GET`` (the liveness heartbeat)
#: arrived in Redis 6.2.
FLOOR = (6, 2, 0)

#: Seconds added to a third of ``singleton_liveness_ttl`` for the recovery window:
#: a keeper's reconnection and its retry after the failed first attempt.
WINDOW_SLACK = 1.5


class UnsupportedServer(ResponseError):
    """The lock Redis is older than :data:`FLOOR` (a configuration error, not an outage)."""


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
UNKNOWN = ServerInfo("redis", FLOOR, FLOOR, "", True, False, known=False)


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
        aof=fields.get("aof_enabled") == "1",
        promoted=fields.get("role", "master") == "master" and bool(replid2.strip("0")),
        cluster=fields.get("cluster_enabled") == "1",
    )


# ====================================================================== the recovery window

#: Why a window opens (the value of ``<prefix>:recovery``, read by every client).
NEW_OR_EMPTIED = "no record of the server serving the lock data: a new or emptied Redis"
PROMOTED = "a replica promoted by a failover"
RESTARTED = "restarted without an append-only file"


class Finding(enum.Enum):
    """What a check found in the record of the server serving the data."""

    #: The record names this server: nothing new.
    SAME = "same"
    #: No record: the data is new, or was lost with it.
    MISSING = "missing"
    #: The record names another server: a restart or a failover since.
    OTHER = "other"


def opening(finding: Finding, info: ServerInfo) -> str | None:
    """Why a check that found ``finding`` on the server ``info`` describes opens a recovery
    window; None when it opens none. The one rule of the window (see the module docstring)."""
    if finding is Finding.MISSING:
        return NEW_OR_EMPTIED
    if finding is Finding.OTHER:
        if info.promoted:
            return PROMOTED
        if not info.aof:
            return RESTARTED
    return None


def data_lost(seen: str | None, finding: Finding, info: ServerInfo) -> bool:
    """Whether a process that last saw the server ``seen`` serving its data (None: none)
    may now find that data without writes it made: its holders put their locks back."""
    if seen is None:
        return False
    if finding is Finding.MISSING:
        return True
    return (seen != info.run_id or finding is Finding.OTHER) and (info.promoted or not info.aof)


@dataclass(frozen=True)
class Recovery:
    """A recovery window as this process knows it: open until ``until`` (monotonic
    seconds), because ``reason`` (the last reason stays once it closed)."""

    until: float = 0.0
    reason: str = ""

    def left(self) -> float:
        """Seconds until it closes (0.0 once closed)."""
        return max(0.0, self.until - time.monotonic())

    @property
    def open(self) -> bool:
        return self.until > time.monotonic()


_NO_WINDOW = Recovery()


# KEYS: the server record, the recovery record. ARGV: this server's run id; the ms and
# reason of the window opened when the record is missing (ARGV[2], ARGV[3]), and when it
# names another server (ARGV[4], ARGV[5]; 0 ms: none), as :func:`opening` says.
# Writes this server in; returns what the record held before, and the window's ms left
# (< 0: none) and reason.
_NOTICE = """
local found = redis.call('GET', KEYS[1])
if found ~= ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1])
  local ms, why = tonumber(ARGV[2]), ARGV[3]
  if found then ms, why = tonumber(ARGV[4]), ARGV[5] end
  if ms > 0 and redis.call('PTTL', KEYS[2]) < ms then
    redis.call('SET', KEYS[2], why, 'PX', ms)
  end
end
return {found, redis.call('PTTL', KEYS[2]), redis.call('GET', KEYS[2])}
"""

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
        #: Per server record (see :func:`records_of`): the run id of the server this process
        #: last saw serving that data, written only once its check's script has run.
        self.serving: dict[str, str] = {}
        #: Grows each time the data is found on a server that may lack earlier writes
        #: (see :attr:`LockServer.epoch`).
        self.epoch = 0
        #: Per key prefix, the latest recovery window this process found (see
        #: :meth:`LockServer.recovery`): apps with prefixes of their own on one Redis have
        #: records, and windows, of their own.
        self.windows: dict[str, Recovery] = {}
        self.lock = threading.Lock()


#: Per lock Redis URL (see :class:`ServerMemory`).
_memories: dict[str, ServerMemory] = {}


def memory_for(url: str) -> ServerMemory:
    """The process-wide memory of the servers seen behind ``url``."""
    return _memories.setdefault(url, ServerMemory())


def server_key(prefix: str, tag: str | None = None) -> str:
    """The key naming the server last seen serving the lock data (never expires);
    ``tag``: of one Redis Cluster shard (see :func:`records_of`)."""
    return f"{prefix}:server" if tag is None else f"{prefix}:server:{{{tag}}}"


def recovery_key(prefix: str, tag: str | None = None) -> str:
    """The key whose TTL is an open recovery window (see the module docstring)."""
    return f"{prefix}:recovery" if tag is None else f"{prefix}:recovery:{{{tag}}}"


@functools.lru_cache(maxsize=64)
def shard_tag(slot: int) -> str:
    """The first decimal number whose keys (as a hash tag) live in Redis Cluster ``slot``."""
    number = 0
    while key_slot(str(number).encode()) != slot:
        number += 1
    return str(number)


def shard_records(prefix: str, nodes: Any) -> tuple[str, str] | None:
    """The server and recovery records of the Cluster node whose ``CLUSTER NODES`` reply is
    ``nodes``: tagged with the lowest slot it serves (None: it serves none)."""
    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 8 and "myself" in fields[2].split(","):
            slots = [int(f.split("-")[0]) for f in fields[8:] if not f.startswith("[")]
            if not slots:
                return None
            tag = shard_tag(min(slots))
            return server_key(prefix, tag), recovery_key(prefix, tag)
    return None


def records_of(connection: Any, prefix: str, info: ServerInfo) -> tuple[str, str] | None:
    """The server and recovery records of the data behind ``connection``; None when it has none.

    One server: ``<prefix>:server`` and ``<prefix>:recovery``. Redis Cluster: one pair
    per shard, ``<prefix>:server:{<tag>}`` and ``<prefix>:recovery:{<tag>}``, the tag
    hashing to the lowest slot the node serves (``CLUSTER NODES``), so the records live
    with the data they speak for and move to the replica promoted for it. A node that
    serves no slot, or an ACL without ``CLUSTER NODES``, has none.
    """
    if not info.cluster:
        return server_key(prefix), recovery_key(prefix)
    try:
        connection.send_command("CLUSTER", "NODES")
        return shard_records(prefix, connection.read_response())
    except ResponseError as exc:  # NOPERM
        logger.debug("CLUSTER NODES refused on the lock Redis (%s): no recovery windows on this node", exc)
        return None


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


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
        #: Seconds a recovery window keeps new acquisitions waiting.
        self.window = liveness_ttl / 3 + WINDOW_SLACK
        #: What the last connection learnt (``None`` before the first one).
        self.info: ServerInfo | None = None
        self._lock = threading.Lock()
        #: This thread's last wait for a window (see :meth:`resumed`).
        self._paused = threading.local()

    @property
    def epoch(self) -> int:
        """Grows each time this process finds its data served by a server that may lack
        writes it made before (see :func:`data_lost`): a lease last confirmed under an
        earlier epoch whose lock is gone may put it back (:meth:`.lock.Lease.may_put_back`),
        whenever its keeper gets there, and a beat writes back its claims (:mod:`.beat.recovery`)."""
        return self._memory.epoch

    def recovery(self) -> Recovery:
        """Is a recovery window open for this server, until when, and why: the latest window
        this process found (on any connection, any shard), from the records every client
        shares. New acquisitions and new slot claims wait while it is open."""
        return self._memory.windows.get(self.prefix, _NO_WINDOW)

    @property
    def recovery_reason(self) -> str:
        """Why the latest window opened (``recovery().reason``), for log lines."""
        return self.recovery().reason

    # ----------------------------------------------------------------- connections

    def on_connect(self, connection: Any) -> None:
        """redis-py's ``redis_connect_func`` for the library's clients: set the new
        connection up as usual, then :meth:`check` it (once per socket)."""
        connection.on_connect()
        self.check(connection)
        connection.csb_checked = connection._sock

    def check(self, connection: Any) -> ServerInfo:
        """Learn what the server behind ``connection`` is; open or join a recovery window
        if it may have lost locks (see the module docstring)."""
        try:
            connection.send_command("INFO")
            info = parse_info(connection.read_response())
        except ResponseError as exc:  # NOPERM: portable commands, no windows
            logger.debug("INFO refused on the lock Redis (%s): portable lock commands, no restart detection", exc)
            info = UNKNOWN
        if not info.supported:
            raise UnsupportedServer(
                f"the lock Redis is {info.describe()}; celery-singleton-beat needs Redis "
                f"{version_text(FLOOR)} or later (or Valkey)")
        records = records_of(connection, self.prefix, info) if info.known else None
        lost = False
        if records is not None:
            finding, left, why = self._notice(connection, info, records)
            lost = self._learn(records[0], info, finding, left, why)
        with self._lock:
            self.info = info
        if lost:
            for listener in _data_lost_listeners:
                listener()
        return info

    def _notice(self, connection: Any, info: ServerInfo, records: tuple[str, str]) -> tuple[Finding, float, str]:
        """Run the record's script: what it found, the window's seconds left (0.0: none) and why."""
        missing, other = opening(Finding.MISSING, info), opening(Finding.OTHER, info)
        ms = round(self.window * 1000)
        connection.send_command("EVAL", _NOTICE, 2, *records, info.run_id,
                                ms if missing else 0, missing or "", ms if other else 0, other or "")
        found, left_ms, why = connection.read_response()
        found = _text(found)
        finding = Finding.MISSING if found is None else Finding.SAME if found == info.run_id else Finding.OTHER
        return finding, max(0, int(left_ms)) / 1000, _text(why) or ""

    def _learn(self, record: str, info: ServerInfo, finding: Finding, left: float, why: str) -> bool:
        """Remember what a check's script did (only now that it ran); True if the data is lost."""
        memory = self._memory
        with memory.lock:
            lost = data_lost(memory.serving.get(record), finding, info)
            memory.serving[record] = info.run_id
            if lost:
                memory.epoch += 1
            window = memory.windows.get(self.prefix, _NO_WINDOW)
            if left > 0 and time.monotonic() + left > window.until:
                if not window.open:
                    logger.warning("lock Redis %s (%s): new locks wait %.1fs while running tasks put "
                                   "theirs back", info.describe(), why, left)
                memory.windows[self.prefix] = Recovery(time.monotonic() + left, why)
        return lost

    # ----------------------------------------------------------------- decisions

    def pause(self) -> float:
        """Wait until no recovery window is open (new acquisitions only); seconds waited."""
        waited = 0.0
        while (left := self.recovery().left()) > 0:
            time.sleep(left)
            waited += left
        if waited:
            self._paused.resumed = time.monotonic()
            logger.info("a new lock waited %.1fs for the lock Redis's recovery window (%s)", waited,
                        self.recovery_reason)
        return waited

    def resumed(self) -> float:
        """When this thread's last :meth:`pause` that waited ended (monotonic; 0.0: never): a
        request written after it runs from then, e.g. a lease's TTL."""
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
