"""How each lock operation is spelled on a given server, and what its replies mean.

The common path is one request per operation and uses no Lua where the
server has the command (see :class:`~.server.ServerInfo`):

==============  ==============================================  ==========================
operation       Redis 7.0+ / Valkey                              fallback
==============  ==============================================  ==========================
acquire         ``SET k v NX PX ttl GET`` + ``TIME`` (one write)   6.2: ``SET NX PX`` + ``GET``
release         ``DELIFEQ k v`` / ``DELEX k IFEQ v``              :data:`.scripts.RELEASE`
renew           ``SET k v IFEQ v PX ttl``                         :data:`.scripts.RENEW`
==============  ==============================================  ==========================

The acquire also carries, in the same write, an ``EXISTS`` of the done
marker (``acks_late`` tasks) and a ``DEL`` of the per-key fencing counter of
releases before 0.3 (so that workers of both during an upgrade keep issuing
growing tokens: an old worker's next token is then seeded from the clock).
The fencing token is the server's clock in microseconds at the acquisition
(``TIME`` right behind the ``SET``): it grows with every acquisition of a key,
across restarts and failovers, whatever counters a server lost.

A done marker is a plain ``SET`` written behind the release in the same write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from .scripts import RELEASE, RENEW
from .server import ServerInfo
from .wire import Request

__all__ = ["acquire_request", "legacy_fence_key", "put_back_request", "raise_errors", "release_request",
           "renew_request", "time_token"]


_LEGACY_FENCE_SUFFIX = b":fence"


def legacy_fence_key(key: str) -> str:
    """The per-key fencing counter that releases before 0.3 kept beside each lock."""
    return f"{key}{_LEGACY_FENCE_SUFFIX.decode()}"


def time_token(seconds: Any, microseconds: Any) -> int:
    """A fencing token from a ``TIME`` reply: the server clock in microseconds."""
    return int(seconds) * 1_000_000 + int(microseconds)


def raise_errors(replies: list[Any]) -> None:
    """Raise the first error reply among ``replies`` (a request's ``finish`` when only success matters)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


class NativeRefused(ResponseError):
    """A native lock command the server was thought to have was refused (use the fallback)."""


def _refused(error: Exception) -> bool:
    text = str(error).lower()
    return ("unknown command" in text or "syntax error" in text or "unknown subcommand" in text
            or text.startswith("noperm") or "no permissions" in text)


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def acquire_request(info: ServerInfo, key: str, value: str, ttl_ms: int,
                    done_key: str | None) -> Request:
    """Try to take ``key``: ``(token, taken, previous value, done marker exists)``.

    One write: ``SET key value NX PX ttl GET`` (6.2: ``SET NX PX`` then
    ``GET``), ``TIME``, the done marker's ``EXISTS``, the legacy counter's
    ``DEL``. No ``MULTI``: the token only has to come from the server's clock
    after the ``SET`` took the key and before anything can free it again, and
    ``TIME`` runs right behind the ``SET`` on this connection, before this
    process has read the reply it needs to release the lock (a take-over or an
    expiry comes seconds later). ``taken`` False with ``previous`` None: the
    key was freed between the 6.2 ``SET`` and ``GET`` (try again).
    """
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
    data += _DEL_LEGACY_FENCE % (len(k) + len(_LEGACY_FENCE_SUFFIX), k)
    count = (4 if one_command else 5) - (done_key is None)

    def finish(replies: list[Any]) -> tuple[int, bool, Any, bool]:
        raise_errors(replies)
        if one_command:
            previous = replies[0]
            taken = previous is None
            at = 1
        else:
            taken = replies[0] is not None
            previous = None if taken else replies[1]
            at = 2
        token = time_token(*replies[at])
        return token, taken, previous, done_key is not None and bool(replies[at + 1])

    return Request(None, finish, data=data, count=count)


#: ``SET key value NX PX ttl GET`` then ``TIME``, as RESP (``%`` fills key, value, ttl).
_ACQUIRE = (b"*7\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n"
            b"$3\r\nGET\r\n*1\r\n$4\r\nTIME\r\n")
#: The ``DEL`` of a lock's fencing counter of releases before 0.3 (``%`` fills the key).
_DEL_LEGACY_FENCE = b"*2\r\n$3\r\nDEL\r\n$%d\r\n%s" + _LEGACY_FENCE_SUFFIX + b"\r\n"
#: Redis 6.2: ``SET key value NX PX ttl``, ``GET key``, ``TIME``.
_ACQUIRE_62 = (b"*6\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n"
               b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n*1\r\n$4\r\nTIME\r\n")


def release_request(info: ServerInfo, key: str, value: str, done_key: str | None = None,
                    done_ttl_ms: int | None = None) -> Request:
    """Delete ``key`` if its value is still ``value`` (True), and leave the done marker."""
    k, v = key.encode(), value.encode()
    kind = info.release_kind
    data = _RELEASES[kind] % (len(k), k, len(v), v)
    count = 1
    if done_key is not None and done_ttl_ms:
        d, ttl = done_key.encode(), b"%d" % done_ttl_ms
        data += _DONE_MARKER % (len(d), d, len(ttl), ttl)
        count = 2
    if kind == "lua":
        return Request(None, _released, scripts=(RELEASE,),
                       unsure_when_repeated=True, data=data, count=count)
    return Request(None, _native_released, unsure_when_repeated=True, data=data, count=count)


def _released(replies: list[Any]) -> bool:
    """A release's outcome (the done marker's ``SET`` behind it, if any, must have run too)."""
    raise_errors(replies)
    return bool(replies[0])


def _native_released(replies: list[Any]) -> bool:
    if isinstance(replies[0], ResponseError) and _refused(replies[0]):
        raise NativeRefused(str(replies[0]))
    return _released(replies)


#: The release per :attr:`.ServerInfo.release_kind`, as RESP (``%`` fills key and value).
_RELEASES = {
    "delifeq": b"*3\r\n$7\r\nDELIFEQ\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n",
    "delex": b"*4\r\n$5\r\nDELEX\r\n$%d\r\n%s\r\n$4\r\nIFEQ\r\n$%d\r\n%s\r\n",
    "lua": b"*5\r\n$7\r\nEVALSHA\r\n" + _bulk(RELEASE.sha.encode()) + b"$1\r\n1\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n",
}
#: The done marker: ``SET marker 1 PX ttl`` (``%`` fills the marker and its ttl).
_DONE_MARKER = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\n1\r\n$2\r\nPX\r\n$%d\r\n%s\r\n"


def renew_request(info: ServerInfo, key: str, value: str, ttl_ms: int) -> Request:
    """Extend ``key`` if it is still ``value``: 1 renewed, 0 held by another, -1 gone, None: not renewed."""
    if info.set_ifeq:
        def native_finish(replies: list[Any]) -> int | None:
            if isinstance(replies[0], ResponseError) and _refused(replies[0]):
                raise NativeRefused(str(replies[0]))
            raise_errors(replies)
            return 1 if replies[0] is not None else None  # None: gone or another's (rare: ask)

        return Request([(b"SET", key, value, b"IFEQ", value, b"PX", ttl_ms)], native_finish)

    def finish(replies: list[Any]) -> int | None:
        raise_errors(replies)
        return int(replies[0])

    return Request([RENEW.command([key], [value, ttl_ms])], finish, scripts=(RENEW,))


def put_back_request(info: ServerInfo, key: str, value: str, ttl_ms: int) -> Request:
    """Write ``value`` back into a lock the server lost: True if it is there now.

    ``SET key value NX PX ttl GET`` (6.2: ``SET NX PX`` then ``GET``): a key found
    holding ``value`` itself is success too (this request sent again after its reply
    was lost), a key holding another value is not.
    """
    if info.set_nx_get:
        def finish(replies: list[Any]) -> bool:
            raise_errors(replies)
            return replies[0] is None or _text(replies[0]) == value

        return Request([(b"SET", key, value, b"NX", b"PX", ttl_ms, b"GET")], finish)

    def finish_62(replies: list[Any]) -> bool:
        raise_errors(replies)
        return replies[0] is not None or _text(replies[1]) == value

    return Request([(b"SET", key, value, b"NX", b"PX", ttl_ms), (b"GET", key)], finish_62)


def _text(reply: Any) -> str | None:
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply


def look_request(key: str) -> Request:
    """The lock's value, its remaining ms and the server's clock in ms, at one instant."""
    def finish(replies: list[Any]) -> tuple[Any, int, int]:
        raise_errors(replies)
        executed = replies[-1]
        raise_errors(executed)
        seconds, micros = executed[0]
        return executed[1], int(executed[2]), int(seconds) * 1000 + int(micros) // 1000

    return Request([(b"MULTI",), (b"TIME",), (b"GET", key), (b"PTTL", key), (b"EXEC",)], finish)


def script_request(command: tuple[Any, ...], script: Any, finish: Callable[[list[Any]], Any]) -> Request:
    """One Lua script call as a request."""
    return Request([command], finish, scripts=(script,))
