"""How each lock operation is spelled on a given server, and what its replies mean.

The common path is one request per operation and uses no Lua where the
server has the command (see :class:`~.server.ServerInfo`):

==============  ==============================================  ==========================
operation       Redis 7.0+ / Valkey                              fallback
==============  ==============================================  ==========================
acquire         ``MULTI TIME; SET k v NX PX ttl GET; EXEC``       6.2: ``SET NX PX`` + ``GET``
release         ``DELIFEQ k v`` / ``DELEX k IFEQ v``              :data:`.scripts.RELEASE`
renew           ``SET k v IFEQ v PX ttl``                         :data:`.scripts.RENEW`
==============  ==============================================  ==========================

The acquire also carries, in the same ``MULTI``, an ``EXISTS`` of the done
marker (``acks_late`` tasks) and a ``DEL`` of the per-key fencing counter of
releases before 0.3 (so that workers of both during an upgrade keep issuing
growing tokens: an old worker's next token is then seeded from the clock).
The fencing token is the server's clock in microseconds at the acquisition
(``TIME`` in the same transaction): it grows with every acquisition of a key,
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

__all__ = ["acquire_request", "legacy_fence_key", "put_back_request", "release_request", "renew_request",
           "time_token"]


def legacy_fence_key(key: str) -> str:
    """The per-key fencing counter that releases before 0.3 kept beside each lock."""
    return f"{key}:fence"


def time_token(seconds: Any, microseconds: Any) -> int:
    """A fencing token from a ``TIME`` reply: the server clock in microseconds."""
    return int(seconds) * 1_000_000 + int(microseconds)


def _raise_first(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


class NativeRefused(ResponseError):
    """A native lock command the server was thought to have was refused (use the fallback)."""


def _refused(error: Exception) -> bool:
    text = str(error).lower()
    return ("unknown command" in text or "syntax error" in text or "unknown subcommand" in text
            or text.startswith("noperm") or "no permissions" in text)


def acquire_request(info: ServerInfo, key: str, value: str, ttl_ms: int,
                    done_key: str | None) -> Request:
    """Try to take ``key``: ``(token, previous value or None if taken, done marker exists)``."""
    commands: list[tuple[Any, ...]] = [(b"MULTI",), (b"TIME",)]
    one_command = info.set_nx_get
    if one_command:
        commands.append((b"SET", key, value, b"NX", b"PX", ttl_ms, b"GET"))
    else:
        commands += [(b"SET", key, value, b"NX", b"PX", ttl_ms), (b"GET", key)]
    if done_key is not None:
        commands.append((b"EXISTS", done_key))
    commands += [(b"DEL", legacy_fence_key(key)), (b"EXEC",)]

    def finish(replies: list[Any]) -> tuple[int, Any, bool]:
        _raise_first(replies)
        executed = replies[-1]
        if executed is None:  # EXEC of a transaction WATCH aborted: never here
            raise ResponseError("the acquire transaction was aborted")
        _raise_first(executed)
        token = time_token(*executed[0])
        if one_command:
            previous = executed[1]
            at = 2
        else:
            previous = None if executed[1] is not None else executed[2]
            at = 3
        done = done_key is not None and bool(executed[at])
        return token, previous, done

    return Request(commands, finish)


def release_request(info: ServerInfo, key: str, value: str, done_key: str | None = None,
                    done_ttl_ms: int | None = None) -> Request:
    """Delete ``key`` if its value is still ``value`` (True), and leave the done marker."""
    native = info.delifeq or info.delex
    if info.delifeq:
        commands: list[tuple[Any, ...]] = [(b"DELIFEQ", key, value)]
    elif info.delex:
        commands = [(b"DELEX", key, b"IFEQ", value)]
    else:
        commands = [RELEASE.command([key], [value])]
    if done_key is not None and done_ttl_ms:
        commands.append((b"SET", done_key, b"1", b"PX", done_ttl_ms))

    def finish(replies: list[Any]) -> bool:
        if native and isinstance(replies[0], ResponseError) and _refused(replies[0]):
            raise NativeRefused(str(replies[0]))
        _raise_first(replies)
        return bool(replies[0])

    return Request(commands, finish, scripts=() if native else (RELEASE,), unsure_when_repeated=True)


def renew_request(info: ServerInfo, key: str, value: str, ttl_ms: int) -> Request:
    """Extend ``key`` if it is still ``value``: 1 renewed, 0 held by another, -1 gone, None: not renewed."""
    if info.set_ifeq:
        def native_finish(replies: list[Any]) -> int | None:
            if isinstance(replies[0], ResponseError) and _refused(replies[0]):
                raise NativeRefused(str(replies[0]))
            _raise_first(replies)
            return 1 if replies[0] is not None else None  # None: gone or another's (rare: ask)

        return Request([(b"SET", key, value, b"IFEQ", value, b"PX", ttl_ms)], native_finish)

    def finish(replies: list[Any]) -> int | None:
        _raise_first(replies)
        return int(replies[0])

    return Request([RENEW.command([key], [value, ttl_ms])], finish, scripts=(RENEW,))


def put_back_request(key: str, value: str, ttl_ms: int) -> Request:
    """Write ``value`` back into a lock the server lost (True if it was still free)."""
    def finish(replies: list[Any]) -> bool:
        _raise_first(replies)
        return replies[0] is not None

    return Request([(b"SET", key, value, b"NX", b"PX", ttl_ms)], finish)


def look_request(key: str) -> Request:
    """The lock's value, its remaining ms and the server's clock in ms, at one instant."""
    def finish(replies: list[Any]) -> tuple[Any, int, int]:
        _raise_first(replies)
        executed = replies[-1]
        _raise_first(executed)
        seconds, micros = executed[0]
        return executed[1], int(executed[2]), int(seconds) * 1000 + int(micros) // 1000

    return Request([(b"MULTI",), (b"TIME",), (b"GET", key), (b"PTTL", key), (b"EXEC",)], finish)


def script_request(command: tuple[Any, ...], script: Any, finish: Callable[[list[Any]], Any]) -> Request:
    """One Lua script call as a request."""
    return Request([command], finish, scripts=(script,))
