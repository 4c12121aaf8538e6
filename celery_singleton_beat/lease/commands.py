"""How each lock operation is spelled on a given server, and what its replies mean.

The common path is one request per operation and uses no Lua where the
server has the command (see :class:`~.server.ServerInfo`):

==============  ==============================================  ==========================
operation       Redis 7.0+ / Valkey                              fallback
==============  ==============================================  ==========================
acquire         ``SET k v NX PX ttl GET`` + ``TIME`` (one write)   6.2: ``SET NX PX`` + ``GET``
release         ``DELIFEQ k v`` / ``DELEX k IFEQ v``              :data:`.scripts.RELEASE`
renew           ``SET k v IFEQ v PX ttl``                         :data:`.scripts.RENEW`
put back        ``SET k v NX PX ttl GET``                         6.2: ``SET NX PX`` + ``GET``
==============  ==============================================  ==========================

A native command the server refuses (unknown to it, or denied by an ACL:
for good; out of memory: for that call) raises :class:`NativeRefused`, and
the caller sends the fallback. Under ``maxmemory`` a server refuses every
command that may grow its memory, ``SET ... IFEQ`` included, while
:data:`.scripts.RENEW` (``GET`` and ``PEXPIRE``) still runs: a live lease is
kept on a full server; only new locks are refused.

The acquire also carries, in the same write, a ``DEL`` of the per-key
fencing counter of releases before 0.3 (so that workers of both during an
upgrade keep issuing growing tokens: an old worker's next token is then
seeded from the clock), and the done marker's ``EXISTS`` for ``acks_late``
runs. A delivery known to be a copy (redelivered) sends one script instead,
:data:`.scripts.ACQUIRE_UNLESS_DONE`: it reads the done marker first and takes
nothing when it exists.
The fencing token is the server's clock in microseconds at the acquisition
(``TIME`` right behind the ``SET``): it grows with every acquisition of a key,
across restarts and failovers, whatever counters a server lost.

**Sent twice.** Any request may be sent again after its reply was lost (see
:mod:`.wire`). Every compare-and-set here takes finding its own value as
success (:func:`finds_own`): an acquire, an adoption, a take-over, a claim left
for a retry or a put-back whose first attempt ran finds the value it writes.
A compare-and-delete that finds nothing after a re-send cannot tell whether
its first attempt ran: its requests are marked ``unsure_when_repeated``, and
their outcome is then unknown (None), never "the lock was lost".

A done marker is a plain ``SET`` written just ahead of the release, in the same write
(on Redis Cluster, a request of its own answered first: :meth:`.lease.Lease.release`).
"""

from __future__ import annotations

import enum
import re
from typing import Any, NamedTuple

from redis.exceptions import OutOfMemoryError, ResponseError

from ..connection.wire import Request, Short
from ..log import logger
from ..recovery.server import ServerInfo
from .holder import text_of
from .scripts import ACQUIRE_UNLESS_DONE, ADOPT, CLAIM_ON_RETRY, RELEASE, RELEASE_FOR, RENEW, TAKE_OVER

__all__ = ["AcquireReply", "Look", "NativeRefused", "Renewal", "Replaced", "acquire_request", "adopt_request",
           "claim_on_retry_request", "done_marker_request", "finds_own", "legacy_fence_key", "look_request",
           "put_back_request", "raise_errors", "release_for_request", "release_request", "renew_request",
           "take_over_request", "time_token"]


_LEGACY_FENCE_SUFFIX = b":fence"


def legacy_fence_key(key: str) -> str:
    """The per-key fencing counter that releases before 0.3 kept beside each lock (with a
    TTL: left over after an upgrade, it expires on its own; the admin tools know it)."""
    return f"{key}{_LEGACY_FENCE_SUFFIX.decode()}"


def time_token(seconds: Any, microseconds: Any) -> int:
    """A fencing token from a ``TIME`` reply: the server clock in microseconds."""
    return int(seconds) * 1_000_000 + int(microseconds)


def finds_own(reply: Any, value: str) -> bool:
    """The value a compare-and-set found is the one it writes: the request ran before (its
    reply was lost, and it was sent again), so it succeeded. The one place this is decided."""
    return reply is not None and text_of(reply) == value


def raise_errors(replies: list[Any]) -> None:
    """Raise the first error reply among ``replies`` (a request's ``finish`` when only success matters)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


class NativeRefused(ResponseError):
    """A native lock command the server was thought to have was refused: use the fallback.

    ``lasting``: the server lacks it or an ACL denies it (use the fallback from
    now on); else it refused this call only (out of memory).
    """

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


def _refusal(reply: Any) -> NativeRefused | None:
    """``reply`` as a :class:`NativeRefused`, if it is a native command's refusal."""
    if not isinstance(reply, ResponseError):
        return None
    text = str(reply)
    lowered = text.lower()
    # A command the server lacks: "unknown command" ("Unknown Redis command called from Lua
    # script" inside a script on Redis 6.2). An ACL's refusal: NOPERM; inside a script, "no
    # permissions" (Redis 7.2+, Valkey) or "can't run this command" (Redis 7.0).
    if ("unknown command" in lowered or "unknown redis command" in lowered or "syntax error" in lowered
            or "unknown subcommand" in lowered or lowered.startswith("noperm") or "no permissions" in lowered
            or "can't run this command" in lowered):
        return NativeRefused(text)
    if _out_of_memory(reply):
        return NativeRefused(text, lasting=False)
    return None


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


# -------------------------------------------------------------------- acquire


class AcquireReply(NamedTuple):
    """What an acquire found when it did not simply take the key (see :func:`acquire_request`)."""

    #: The server's clock in microseconds right behind the ``SET`` (the fencing token if taken).
    token: int
    #: The key is ours: it was free, or held our own value (the request ran twice).
    taken: bool
    #: The value found (None when taken; also when, on 6.2, the key was freed between
    #: ``SET NX`` and ``GET``: try again).
    previous: Any
    #: The done marker of this task id exists.
    completed: bool


def acquire_request(info: ServerInfo, key: str, value: str, ttl_ms: int,
                    done_key: str | None, *, done_first: bool = False) -> Request:
    """Try to take ``key``: the fencing token (an ``int``) when it was taken, the common
    case, else an :class:`AcquireReply` (held by another, or this task id completed):
    the common path builds no reply object.

    One write: ``SET key value NX PX ttl GET`` (6.2: ``SET NX PX`` then
    ``GET``), ``TIME``. No ``MULTI``: the token
    only has to come from the server's clock after the ``SET`` took the key
    and before anything can free it again, and ``TIME`` runs right behind the
    ``SET`` on this connection, before this process has read the reply it needs
    to release the lock (a take-over or an expiry comes seconds later).

    With a ``done_key`` (``acks_late`` runs) the marker's ``EXISTS`` follows
    the ``SET`` in the same write: a copy of a completed message that took the
    key gives it back, one round trip later. With ``done_first`` (a delivery
    known to be a copy) it is :data:`.scripts.ACQUIRE_UNLESS_DONE` instead,
    which takes nothing when the marker exists. Only copies pay for a script:
    run on every ``acks_late`` acquire it took the server's instructions per
    task from 1.63x to 2.05x plain Celery on Redis 7.0.
    """
    if done_key is not None and done_first:
        return _acquire_unless_done(key, value, ttl_ms, done_key)
    k, v = key.encode(), value.encode()
    one_command = info.set_nx_get
    ttl = b"%d" % ttl_ms
    if one_command:
        data = _ACQUIRE % (len(k), k, len(v), v, len(ttl), ttl)
    else:
        data = _ACQUIRE_62 % (len(k), k, len(v), v, len(ttl), ttl, len(k), k)
    if done_key is not None:
        d = done_key.encode()
        data += b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(d), d)
    count = (3 if one_command else 4) - (done_key is None)

    def finish(replies: list[Any]) -> int | AcquireReply:
        raise_errors(replies)
        if one_command:
            at, taken, previous = 1, replies[0] is None, replies[0]
        else:
            at, taken = 2, replies[0] is not None
            previous = None if taken else replies[1]
        return _acquired(time_token(*replies[at]), taken, previous,
                         done_key is not None and bool(replies[at + 1]), value)

    return Request(None, finish, data=data, count=count,
                   short=_TAKEN if one_command and done_key is None else None)


def _token_of(match: re.Match[bytes]) -> int:
    return int(match[1]) * 1_000_000 + int(match[2])


#: The usual reply of an acquire on Redis 7.0+ / Valkey (no done marker): the key was
#: free (a nil ``GET``, RESP2 or RESP3), then ``TIME``: the fencing token.
_TAKEN = Short(re.compile(rb"(?:\$-1|_)\r\n\*2\r\n\$\d+\r\n(\d+)\r\n\$\d+\r\n(\d+)\r\n"), _token_of)


def _acquired(token: int, taken: bool, previous: Any, completed: bool, value: str) -> int | AcquireReply:
    """An acquire's replies as its result: the token when the key is ours and the run not
    completed. Finding its own value means the request ran before (its reply was lost)."""
    if not taken and finds_own(previous, value):
        taken, previous = True, None
    if taken and not completed:
        return token
    return AcquireReply(token, taken, previous, completed)


def _acquire_unless_done(key: str, value: str, ttl_ms: int, done_key: str) -> Request:
    """:func:`acquire_request` of a copy of an ``acks_late`` message: one script, the done marker read first."""
    command = ACQUIRE_UNLESS_DONE.command([key, done_key], [value, ttl_ms])

    def finish(replies: list[Any]) -> int | AcquireReply:
        raise_errors(replies)
        reply = replies[0]
        return _acquired(time_token(reply[0], reply[1]), int(reply[2]) == 1,
                         reply[4] if len(reply) > 4 else None, int(reply[3]) == 1, value)

    return Request([command], finish, scripts=(ACQUIRE_UNLESS_DONE,))


#: ``SET key value NX PX ttl GET`` then ``TIME``, as RESP (``%`` fills key, value, ttl).
_ACQUIRE = (b"*7\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n"
            b"$3\r\nGET\r\n*1\r\n$4\r\nTIME\r\n")
#: Redis 6.2: ``SET key value NX PX ttl``, ``GET key``, ``TIME``.
_ACQUIRE_62 = (b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n"
               b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n*1\r\n$4\r\nTIME\r\n")


class Replaced(NamedTuple):
    """What a compare-and-replace script (:data:`.scripts.ADOPT`, :data:`.scripts.TAKE_OVER`) did."""

    #: The server's clock in microseconds (the fencing token) when the new value holds
    #: the key now (replaced, or found there: the script ran before); else None.
    token: int | None
    #: The value found when not replaced.
    current: Any


def _replace_request(command: tuple[Any, ...], script: Any, value: str, *, native: bool = False) -> Request:
    def finish(replies: list[Any]) -> Replaced:
        if native and (refusal := _refusal(replies[0])) is not None:
            raise refusal
        raise_errors(replies)
        reply = replies[0]
        current = reply[3] if len(reply) > 3 else None
        if int(reply[0]) == 1 or finds_own(current, value):
            return Replaced(time_token(reply[1], reply[2]), None)
        return Replaced(None, current)

    return Request([command], finish, scripts=(script,))


def adopt_request(key: str, claim: str, value: str, ttl_ms: int) -> Request:
    """Replace the publish-time claim ``claim`` by the run's lock ``value``: :class:`Replaced`."""
    return _replace_request(ADOPT.command([key], [claim, value, ttl_ms]), ADOPT, value)


def take_over_request(info: ServerInfo, key: str, holder: str, look: Look, value: str, ttl_ms: int) -> Request:
    """Replace a dead holder's value if the lock stayed unrenewed since ``look`` (its
    expiry did not move): :class:`Replaced`. ``PEXPIRETIME`` where ``info`` has it; a
    refusal of it (an ACL short of it) raises :class:`NativeRefused`."""
    arguments = [holder, look.expires_ms, value, ttl_ms, "1" if info.expire_time else "0"]
    return _replace_request(TAKE_OVER.command([key], arguments), TAKE_OVER, value, native=info.expire_time)


# -------------------------------------------------------------------- release


def release_request(info: ServerInfo, key: str, value: str, done_key: str | None = None,
                    done_ttl_ms: int | None = None) -> Request:
    """Delete ``key`` if its value is still ``value`` (True), with the done marker written
    just before: Redis may run another client's command between the two (a write that
    reached it in two segments, a proxy forwarding commands one by one), and a copy of
    the message acquiring there must find the run completed, never a free key."""
    k, v = key.encode(), value.encode()
    kind = info.release_kind
    data = _RELEASES[kind] % (len(k), k, len(v), v)
    count = 1
    if done_key is not None and done_ttl_ms:
        d, ttl = done_key.encode(), b"%d" % done_ttl_ms
        data = _DONE_MARKER % (len(d), d, len(ttl), ttl) + data
        count = 2
    short = _RELEASED if count == 1 else _RELEASED_MARKED
    if kind == "lua":
        return Request(None, _released, scripts=(RELEASE,),
                       unsure_when_repeated=True, data=data, count=count, short=short)
    return Request(None, _native_released, unsure_when_repeated=True, data=data, count=count, short=short)


def _deleted(match: re.Match[bytes]) -> bool:
    return match[1] == b"1"


#: The usual replies of a release: deleted (1) or not ours (0); behind the done marker's ``OK``.
_RELEASED = Short(re.compile(rb":([01])\r\n"), _deleted)
_RELEASED_MARKED = Short(re.compile(rb"\+OK\r\n:([01])\r\n"), _deleted)


def _released(replies: list[Any]) -> bool:
    """A release's outcome (its last reply). A done marker the server refused ahead of it
    because it is out of memory does not undo the release: it is logged (a later copy of
    the message may then run again). Refused for any other reason (``-BUSY`` for a
    segment of the write that reached Redis while another client's script ran, the
    compare-and-delete behind it arriving once the script ended; ``-LOADING``), the
    marker is raised: the release is then sent again (the keeper) until the marker is
    written, as when the whole release was refused."""
    outcome = replies[-1]
    if isinstance(outcome, Exception):
        raise outcome
    if len(replies) > 1:
        _marker_written(replies[:1])
    return bool(outcome)


def _out_of_memory(reply: Exception) -> bool:
    """The lock channel's reader keeps the "OOM" prefix; redis-py's parser drops it."""
    return isinstance(reply, OutOfMemoryError) or str(reply).startswith("OOM ")


def done_marker_request(done_key: str, done_ttl_ms: int) -> Request:
    """The done marker alone (a Cluster's release writes it first, in a request of its own:
    see :meth:`.lease.Lease.release`). True when written; refused because the server is
    out of memory, False (logged); any other refusal is raised (the release is sent again)."""
    d, ttl = done_key.encode(), b"%d" % done_ttl_ms
    return Request(None, _marker_written, data=_DONE_MARKER % (len(d), d, len(ttl), ttl), count=1)


def _marker_written(replies: list[Any]) -> bool:
    """The done marker's reply: True when written; out of memory, False (logged); any other
    refusal raised (the release is sent again until the marker is written)."""
    marker = replies[0]
    if not isinstance(marker, Exception):
        return True
    if not _out_of_memory(marker):
        raise marker
    logger.warning("the lock Redis refused a done marker (%s): a later copy of the same message is not "
                   "recognised as done", marker)
    return False


def _native_released(replies: list[Any]) -> bool:
    if isinstance(replies[-1], ResponseError):
        refused = _refusal(replies[-1])
        if refused is not None:
            raise refused
    return _released(replies)


#: The release per :attr:`.ServerInfo.release_kind`, as RESP (``%`` fills key and value).
_RELEASES = {
    "delifeq": b"*3\r\n$7\r\nDELIFEQ\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n",
    "delex": b"*4\r\n$5\r\nDELEX\r\n$%d\r\n%s\r\n$4\r\nIFEQ\r\n$%d\r\n%s\r\n",
    "lua": b"*5\r\n$7\r\nEVALSHA\r\n" + _bulk(RELEASE.sha.encode()) + b"$1\r\n1\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n",
}
#: The done marker: ``SET marker 1 PX ttl`` (``%`` fills the marker and its ttl).
_DONE_MARKER = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\n1\r\n$2\r\nPX\r\n$%d\r\n%s\r\n"


def claim_on_retry_request(key: str, value: str, claim: str, ttl_ms: int) -> Request:
    """Replace the run's lock ``value`` by the publish-time claim ``claim`` of its retry (True
    if the lock was ours)."""
    def finish(replies: list[Any]) -> bool:
        raise_errors(replies)
        reply = replies[0]
        return int(reply[0]) == 1 or finds_own(reply[1] if len(reply) > 1 else None, claim)

    return Request([CLAIM_ON_RETRY.command([key], [value, claim, ttl_ms])], finish, scripts=(CLAIM_ON_RETRY,))


def release_for_request(key: str, task_id: str, boot: str | None, pid: int | None, claims_only: bool) -> Request:
    """Delete ``key`` if its value names that very holder (True); on someone else's behalf."""
    def finish(replies: list[Any]) -> bool:
        raise_errors(replies)
        return bool(replies[0])

    args = [task_id, boot or "", "" if pid is None else pid, "1" if claims_only else ""]
    return Request([RELEASE_FOR.command([key], args)], finish, scripts=(RELEASE_FOR,), unsure_when_repeated=True)


# -------------------------------------------------------------------- renew, put back, look


class Renewal(enum.Enum):
    """What one renewal found."""

    RENEWED = "renewed"
    #: Another value holds the key (taken over, or another run's lock).
    HELD_BY_ANOTHER = "held by another"
    #: The key is gone (released, expired, deleted, or lost by the server).
    GONE = "gone"


_RENEWALS = {1: Renewal.RENEWED, 0: Renewal.HELD_BY_ANOTHER, -1: Renewal.GONE}


def renew_request(info: ServerInfo, key: str, value: str, ttl_ms: int) -> Request:
    """Extend ``key`` if it is still ``value``: a :class:`Renewal`, or None when the native
    command did not renew and does not say why (gone or another's: ask with :func:`look_request`)."""
    if info.set_ifeq:
        def native_finish(replies: list[Any]) -> Renewal | None:
            refused = _refusal(replies[0])
            if refused is not None:
                raise refused
            raise_errors(replies)
            return Renewal.RENEWED if replies[0] is not None else None

        return Request([(b"SET", key, value, b"IFEQ", value, b"PX", ttl_ms)], native_finish)

    def finish(replies: list[Any]) -> Renewal | None:
        raise_errors(replies)
        return _RENEWALS[int(replies[0])]

    return Request([RENEW.command([key], [value, ttl_ms])], finish, scripts=(RENEW,))


def put_back_request(info: ServerInfo, key: str, value: str, ttl_ms: int) -> Request:
    """Write ``value`` back into a lock the server lost: True if it was free (or already ours)."""
    if info.set_nx_get:
        def finish(replies: list[Any]) -> bool:
            raise_errors(replies)
            return replies[0] is None or finds_own(replies[0], value)

        return Request([(b"SET", key, value, b"NX", b"PX", ttl_ms, b"GET")], finish)

    def finish_62(replies: list[Any]) -> bool:
        raise_errors(replies)
        return replies[0] is not None or finds_own(replies[1], value)

    return Request([(b"SET", key, value, b"NX", b"PX", ttl_ms), (b"GET", key)], finish_62)


class Look(NamedTuple):
    """A lock as seen at one instant."""

    #: Its value (None: free).
    current: Any
    #: Its remaining ms (-2: missing, -1: no expiry).
    pttl: int
    #: The server's clock in ms.
    server_ms: int
    #: The raw ``<prefix>:server`` record, when asked for (``record_key``).
    record: Any = None
    #: A recovery window is open on the server now, when asked for (``window_key``).
    window: bool = False
    #: When it expires on the server's clock (Unix ms), never earlier than the server holds
    #: it: ``PEXPIRETIME`` where the server has it, else ``server_ms + pttl`` (see
    #: :func:`look_request`). Meaningful only when ``pttl >= 0``.
    expires_ms: int = 0


def look_request(key: str, record_key: str | None = None, window_key: str | None = None, *,
                 info: ServerInfo | None = None) -> Request:
    """The lock's value, its remaining ms and the server's clock in ms, at one instant: a
    :class:`Look`; with ``record_key`` and ``window_key`` (one server: the same transaction),
    also the server record and whether a recovery window is open.

    The expiry: on a server ``info`` says has ``PEXPIRETIME`` (Redis 7.0+), read as
    stored (refused by an ACL: :class:`NativeRefused`, the portable form from then).
    Elsewhere the clock is read after ``PTTL``, so that ``server_ms + pttl`` can only
    come out later than the stored expiry, never earlier (clock first, the sum was a
    millisecond early on every look on Redis 7.0, and earlier still when Redis was
    descheduled between the two reads): a lock looked at as renewed before a moment
    was renewed before it.
    """
    extra = [(b"GET", record_key), (b"EXISTS", window_key)] if record_key and window_key else []
    exact = info is not None and info.expire_time
    expiry = [(b"PEXPIRETIME", key)] if exact else []

    def finish(replies: list[Any]) -> Look:
        refusal = next(filter(None, map(_refusal, replies)), None) if exact else None
        if refusal is not None:
            raise refusal
        raise_errors(replies)
        executed = replies[-1]
        raise_errors(executed)
        current, pttl, (seconds, micros) = executed[0], int(executed[1]), executed[2]
        server_ms = int(seconds) * 1000 + int(micros) // 1000
        rest = executed[3:]
        expires_ms = int(rest.pop(0)) if exact else server_ms + pttl
        found = Look(current, pttl, server_ms, expires_ms=expires_ms)
        return found._replace(record=rest[0], window=bool(rest[1])) if extra else found

    return Request([(b"MULTI",), (b"GET", key), (b"PTTL", key), (b"TIME",), *expiry, *extra, (b"EXEC",)],
                   finish)

