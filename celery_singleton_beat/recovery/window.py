"""The recovery window: after the lock Redis may have lost locks that live runs hold,
no key is given to anyone else until every live holder had its chance to put its lock back.

Each connection the library makes is looked at once (:meth:`.server.LockServer.check`):
``INFO`` says which server it is (its run id, new at every start), whether it keeps
every acknowledged write across a restart (an append-only file) and whether it is a
replica promoted by a failover. Then :func:`notice` runs one small script on the same
connection that holds this server against ``<prefix>:server``, the record of the data
(on Redis Cluster one per shard, kept on that shard: see :func:`.records.records_of`): a small
JSON object (:class:`ServerRecord`) naming the server last seen serving the data, the
data's **generation** (an integer that only grows: each time the record is written for
another server, or found missing or older, it becomes one more than any its writer has
seen) and the longest window a process using it needs (its ``need``). What the record
says, held against what this process remembers of it (:class:`ServerMemory`), decides,
by :func:`opening`:

=============================================  ==========================================
the record                                     the check
=============================================  ==========================================
names this server                              nothing new (reads a window another client
                                               opened, if one is still open)
is missing (a new Redis, or emptied data)      opens a window
is older than this process has seen           opens a window (a former primary serving
                                               again: it lacks the writes made since)
names another server, this one promoted        opens a window (a failover)
names another server, no append-only file      opens a window (a restart that lost data)
names another server, append-only file         opens none (every write was kept)
was written at another failover epoch          opens a window (a primary elected again may
(Sentinel)                                     lack the interim primary's writes)
=============================================  ==========================================

Older: a lower generation than the one this process saw, or the same generation naming
another server than the one it saw at it (two histories that reached it apart).
Another failover epoch: the record carries the Sentinel failover epoch
(``config-epoch``) its writer was told, and the sentinels now name the primary at another
one (:mod:`..connection.sentinel`; the last row applies only where no other opened a
window, and never to clients that are not Sentinel's): after a failover the data may be a
former primary's, elected again without replicating from the interim one, which the
record alone does not tell a process that never saw the interim primary. Another, not
only a higher one: sentinels deployed anew count from 0 again, and a sentinel that lags
behind costs a window rather than a miss.
A check that finds anything but "names this server" writes the record anew: this server,
the generation one above the highest its process or the record knew (a missing record
counts as 0), and the larger of the record's need and the need this process brings; one
that finds it naming this server writes it only to raise its need or its failover epoch,
and keeps its generation (a process that saw the interim primary's finds it older).

A window is the TTL of ``<prefix>:recovery`` (its value says why), written by the same
script as the record: so it is anchored at the **first client that notices** the new
server, whenever that happens (after a snapshot that took long to load, once a server
becomes reachable), and every client, processes started since included, finds it on
its own connections. Inside it new acquisitions and new slot claims wait, and live
holders put their locks back: the keeper renews every lease at least every
``singleton_liveness_ttl / 3``, so a holder needs ``singleton_liveness_ttl / 3 +``
:data:`WINDOW_SLACK` to get there. Processes may run with different liveness TTLs,
so the window lasts what the **slowest** one needs as far as the noticing process can
know: each check publishes its process's need in the record (the record keeps the
largest), each process remembers the largest need it read there (the record is lost with
the data it speaks for), and a window lasts the largest of the noticing process's own
need, the record's and the one it remembers. A process that never saw the record
before the loss knows only its own need and the record's (none, when the record is lost
too), and one whose last look at the record predates a slower process's first
connection does not know that process's need.

States of one record (the data of one server, or of one Cluster shard)::

               a check: record missing or older than the process has
               seen, or naming another server that is promoted or has
               no append-only file (generation + 1)
    SERVED  ----------------------------------------------->  OPEN (until, why)
      ^  |                                                        |
      |  +-- a check: another server, append-only file            |
      |      (record rewritten, generation + 1, no window)        |
      +-------------------- the window's TTL ends ----------------+

Per process, :class:`ServerMemory` remembers the record it last saw for each record key
(the server, its generation, the largest need), once that check's script ran (never
before: a check cut in between is made again on the next connection); its
:attr:`~ServerMemory.epoch` grows when the process finds its data on a server that may
lack writes it made (:func:`data_lost`), which makes its holders put their locks back and
its beats write back their claims. :meth:`.server.LockServer.recovery` answers whether a
window is open, until when and why.

A missing record costs one window, once, on a new Redis as on a lost one: the library
cannot tell them apart, and a window of a few seconds that only the new acquisitions of
those seconds wait for is cheaper than a duplicate run. The same holds for the first
check after a failover (Sentinel): the first client that reaches the primary the
sentinels name opens a window, whether or not that primary lacks writes.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Any

from .records import READ_RECORD, ServerRecord, server_key, shard_records, text_of

__all__ = ["FAILED_OVER", "NEW_OR_EMPTIED", "OLDER", "PROMOTED", "RESTARTED", "WINDOW_SLACK", "Finding", "Notice",
           "Recovery", "ServerMemory", "data_lost", "mark_in_use", "memory_for", "notice", "opening"]

#: Seconds added to a third of ``singleton_liveness_ttl`` for the recovery window:
#: a keeper's reconnection and its retry after the failed first attempt.
WINDOW_SLACK = 1.5

#: Why a window opens (the value of ``<prefix>:recovery``, read by every client).
NEW_OR_EMPTIED = "no record of the server serving the lock data: a new or emptied Redis"
OLDER = "the data is older than this client has seen: a former primary serving again"
FAILED_OVER = "a failover since the record was written: the primary may lack the interim primary's writes"
PROMOTED = "a replica promoted by a failover"
RESTARTED = "restarted without an append-only file"


class Finding(enum.Enum):
    """What a check found in the record of the server serving the data."""

    #: The record names this server: nothing new.
    SAME = "same"
    #: No record: the data is new, or was lost with it.
    MISSING = "missing"
    #: The record is older than what this process saw (a lower generation, or the same
    #: one naming another server): the data lacks writes made since.
    OLDER = "older"
    #: The record names another server: a restart or a failover since.
    OTHER = "other"
    #: The record was written at another Sentinel failover epoch than the one the sentinels
    #: name the primary at now, and nothing above opened a window: a failover since, maybe
    #: back to a former primary.
    FAILED_OVER = "failed-over"


def opening(finding: Finding, *, promoted: bool, aof: bool) -> str | None:
    """Why a check that found ``finding`` on a server (``promoted`` by a failover, with an
    append-only file or not) opens a recovery window; None when it opens none. The one
    rule of the window (see the module docstring)."""
    if finding is Finding.MISSING:
        return NEW_OR_EMPTIED
    if finding is Finding.OLDER:
        return OLDER
    if finding is Finding.FAILED_OVER:
        return FAILED_OVER
    if finding is Finding.OTHER:
        if promoted:
            return PROMOTED
        if not aof:
            return RESTARTED
    return None


def data_lost(seen: str | None, finding: Finding, run_id: str, *, promoted: bool, aof: bool,
              window_open: bool = False) -> bool:
    """Whether a process that last saw the server ``seen`` serving its data (None: none) may
    now find that data, served by ``run_id``, without writes it made: its holders put
    their locks back.

    A server with an append-only file keeps every acknowledged write, unless the file
    itself is gone (a pod back on a fresh volume): then the first client found no record
    and opened a window, and ``window_open`` tells every later client of the same new
    server that the data may be lost, although the record they find names it. Data older
    than the process has seen lacks what it wrote since, whatever the server, and after a
    failover the primary may be one that missed it."""
    if seen is None:
        return False
    if finding in (Finding.MISSING, Finding.OLDER, Finding.FAILED_OVER):
        return True
    return (seen != run_id or finding is Finding.OTHER) and (promoted or not aof or window_open)


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


#: No window was ever found.
NO_WINDOW = Recovery()


@dataclass(frozen=True)
class Notice:
    """What a check's script did: what it found in the server record, the record it left
    (naming this server), and the window's seconds ``left`` (0.0: none open) and
    ``reason``, as every client now sees them."""

    finding: Finding
    left: float
    reason: str
    record: ServerRecord


# KEYS: the server record, the recovery record. ARGV: this server's run id; the record
# this process last saw (server, '' if none, and generation, 0 if none); the window this
# process needs (ms); the reasons of the window opened when the record is missing, names
# another server ('': none, as opening() says) and is older than the process has seen;
# the Sentinel failover epoch this process was told (0: none) and the reason of the
# window opened when it differs from the record's and no other reason opened one.
# Writes the record (this server, the generation, the larger need, the epoch told)
# unless it named this server already with a need as large and that epoch; opens the
# window (the larger need) where the reason says so. Returns the finding, the record's
# generation and need (ms), the window's ms left (< 0: none) and reason, when the latest
# window opened (ms) and the record's epoch.
_NOTICE = READ_RECORD + """
local seen, brought = tonumber(ARGV[3]), tonumber(ARGV[4])
local finding, why = 'same', ''
if not raw then
  finding, why = 'missing', ARGV[5]
elseif generation < seen or (seen > 0 and generation == seen and server ~= ARGV[2]) then
  finding, why = 'older', ARGV[7]
elseif server ~= ARGV[1] then
  finding, why = 'other', ARGV[6]
end
if finding ~= 'same' then generation = math.max(generation, seen) + 1 end
-- A failover since the record was written keeps the generation when the record names
-- this server: a process that saw the interim primary's (higher) one finds it older.
local told = tonumber(ARGV[8])
if why == '' and raw and told > 0 and told ~= epoch then
  finding, why = 'failed-over', ARGV[9]
end
local ms = math.max(need, brought)
local written = epoch
if told > 0 then written = told end
if why ~= '' then
  local now = redis.call('TIME')
  since = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
if finding ~= 'same' or ms > need or written ~= epoch then
  redis.call('SET', KEYS[1], cjson.encode({server = ARGV[1], generation = generation, need_ms = ms,
                                           since_ms = since, epoch = written}))
end
if why ~= '' and redis.call('PTTL', KEYS[2]) < ms then
  redis.call('SET', KEYS[2], why, 'PX', ms)
end
return {finding, generation, ms, redis.call('PTTL', KEYS[2]), redis.call('GET', KEYS[2]), since, written}
"""


def notice(connection: Any, records: tuple[str, str], run_id: str, *, promoted: bool, aof: bool,
           need: float, known: ServerRecord | None = None, failover_epoch: int = 0) -> Notice:
    """Hold the server ``run_id`` against its record on ``connection`` (the script above),
    given ``known``, the record this process last saw (None: none), and ``failover_epoch``,
    the Sentinel failover epoch the connection's primary was named at (0: not Sentinel):
    write it in, open a window where :func:`opening` says so, lasting the largest of
    ``need`` (this process's own, in seconds), the need ``known`` remembers and the record's."""
    missing = opening(Finding.MISSING, promoted=promoted, aof=aof) or ""
    other = opening(Finding.OTHER, promoted=promoted, aof=aof) or ""
    older = opening(Finding.OLDER, promoted=promoted, aof=aof) or ""
    failed_over = opening(Finding.FAILED_OVER, promoted=promoted, aof=aof) or ""
    brought = max(need, known.need if known else 0.0)
    connection.send_command("EVAL", _NOTICE, 2, *records, run_id, known.server if known else "",
                            known.generation if known else 0, round(brought * 1000), missing, other, older,
                            failover_epoch, failed_over)
    finding, generation, need_ms, left_ms, why, since_ms, epoch = connection.read_response()
    record = ServerRecord(run_id, int(generation), int(need_ms) / 1000, int(since_ms), int(epoch))
    # The window's key lives through the millisecond its PTTL ends in (Redis drops a key
    # once its clock is past the expiry, read in whole ms): this process's window ends a
    # millisecond later, so that a look once it has closed never finds the key still there.
    left = (int(left_ms) + 1) / 1000 if int(left_ms) >= 0 else 0.0
    return Notice(Finding(text_of(finding)), left, text_of(why) or "", record)


class ServerMemory:
    """What this process saw of the servers behind one lock Redis URL, shared by every
    client of it (inherited by forked children, so that a pool child knows what its
    parent saw)."""

    def __init__(self) -> None:
        #: Per server record (see :func:`records_of`): the record this process last saw (the
        #: server serving that data, its generation), with the largest need it ever read
        #: there; written only once its check's script ran.
        self.records: dict[str, ServerRecord] = {}
        #: Grows each time the data is found on a server that may lack earlier writes
        #: (see :attr:`.server.LockServer.epoch`).
        self.epoch = 0
        #: Monotonic time by which the data behind the latest epoch was lost: the new
        #: server's start when another server process serves it now (the one that had the
        #: data was gone by then; not a promoted replica, whose old primary may have lived
        #: on), else the moment this process noticed (an emptied or an older data set:
        #: lost at some moment before).
        self.lost_by = float("-inf")
        #: Per key prefix, the latest recovery window this process found: apps with
        #: prefixes of their own on one Redis have records, and windows, of their own.
        self.windows: dict[str, Recovery] = {}
        self._lock = threading.Lock()

    def known(self, record: str) -> ServerRecord | None:
        """The record ``record`` as this process last saw it (None: never)."""
        return self.records.get(record)

    def since_ms(self, record: str) -> int:
        """When the latest window this process knows of opened for ``record`` (the server's
        clock, Unix ms; 0: none): locks not renewed since are unconfirmed."""
        known = self.records.get(record)
        return known.since_ms if known else 0

    def learn(self, prefix: str, record: str, run_id: str, seen: Notice, *, promoted: bool,
              aof: bool, started_by: float | None = None) -> tuple[bool, Recovery | None]:
        """Remember what a check's script did, only now that it ran: whether the data may be
        lost (the epoch grew), and the window if this made one newly open for ``prefix``.
        ``started_by``: monotonic time by which the server process started (its uptime)."""
        with self._lock:
            known = self.records.get(record)
            before = known.server if known else None
            lost = data_lost(before, seen.finding, run_id, promoted=promoted, aof=aof,
                             window_open=seen.left > 0)
            self.records[record] = ServerRecord(
                run_id, max(seen.record.generation, known.generation if known else 0),
                max(seen.record.need, known.need if known else 0.0),
                max(seen.record.since_ms, known.since_ms if known else 0),
                seen.record.epoch)
            if lost:
                self.epoch += 1
                now = time.monotonic()
                restarted = before != run_id and not promoted
                self.lost_by = min(now, started_by) if restarted and started_by is not None else now
            window = self.windows.get(prefix, NO_WINDOW)
            until = time.monotonic() + seen.left
            if seen.left <= 0 or until <= window.until:
                return lost, None
            self.windows[prefix] = Recovery(until, seen.reason)
            return lost, None if window.open else self.windows[prefix]


#: Per lock Redis URL (see :class:`ServerMemory`).
_memories: dict[str, ServerMemory] = {}


def memory_for(url: str) -> ServerMemory:
    """The process-wide memory of the servers seen behind ``url``."""
    return _memories.setdefault(url, ServerMemory())


# KEYS: the server record. ARGV: the server's run id, the lowest generation to write, the
# failover epoch to record (0: the record's). Leaves a record naming this server at that
# epoch as it is; else names it, one generation up (at least ARGV[2]), keeping its need.
_MARK = READ_RECORD + """
local told = tonumber(ARGV[3])
if told == 0 then told = epoch end
if raw and server == ARGV[1] and epoch == told then return 0 end
redis.call('SET', KEYS[1], cjson.encode({server = ARGV[1], generation = math.max(generation + 1,
  tonumber(ARGV[2])), need_ms = need, epoch = told}))
return 1
"""


def mark_in_use(client: Any, prefix: str = "singleton", failover_epoch: int = 0) -> None:
    """Write the record naming the server behind ``client`` (one server or one Cluster node,
    a :class:`redis.Redis`) as the one serving ``prefix``'s lock data, as its first client
    would: the next clients find it in use and open no window. A record that names it
    already is left as it is; otherwise the generation written is above both the record's
    and any this process saw under that key (a process that used an earlier server on
    the same address does not find this data older). ``failover_epoch``: the Sentinel
    failover epoch the sentinels name this server at, recorded so that Sentinel clients
    find no failover since (see :func:`notice`).

    Only for a Redis known to hold no lock of a live run (a test's or a benchmark's own
    server, just started or emptied): on a Redis that may have lost locks, the window is
    what keeps their holders' keys from running twice.
    """
    info = client.info("server")
    if info.get("redis_mode") == "cluster":
        records = shard_records(prefix, client.execute_command("CLUSTER", "NODES"))
        if records is None:
            return
        key = records[0]
    else:
        key = server_key(prefix)
    highest = max((m.records[key].generation for m in list(_memories.values()) if key in m.records), default=0)
    client.eval(_MARK, 1, key, str(info["run_id"]), highest + 1, failover_epoch)
