"""RESP2/RESP3 replies read off a socket: hiredis's C reader when installed, else
:class:`PyReader`; both give error replies as :class:`ReplyError` objects (not raised)
and tell RESP3 push frames apart (:data:`PUSH_TYPES`), which no request asked for.
Used by :class:`.wire.SocketLink` (a thread's channel, a borrowed connection)."""

from __future__ import annotations

from typing import Any

import redis

__all__ = ["INCOMPLETE", "NOT_YET", "PUSH_TYPES", "PyReader", "ReplyError", "reply_reader"]


class PyReader:
    """A RESP2/RESP3 reply parser for when hiredis is not installed (``feed``/``gets`` as hiredis's).

    Error replies become :class:`ReplyError` objects; ``gets()`` returns
    ``incomplete`` while a reply is not complete (:data:`INCOMPLETE`, as hiredis's,
    unless told otherwise: on RESP3, ``False`` is a reply).
    """

    def __init__(self, incomplete: Any = False) -> None:
        #: Received and not parsed yet (read directly by :meth:`.wire.SocketLink.read_short`).
        self.buffer = bytearray()
        self._incomplete = incomplete

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def has_data(self) -> bool:
        return bool(self.buffer)

    def gets(self) -> Any:
        try:
            reply, end = self._parse(0)
        except _Short:
            return self._incomplete
        del self.buffer[:end]
        return reply

    def _line(self, at: int) -> tuple[bytes, int]:
        end = self.buffer.find(b"\r\n", at)
        if end < 0:
            raise _Short
        return bytes(self.buffer[at:end]), end + 2

    def _parse(self, at: int) -> tuple[Any, int]:
        line, at = self._line(at)
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b"("):
            return rest, at
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace")), at
        if kind == b":":
            return int(rest), at
        if kind == b",":
            return float(rest), at
        if kind == b"#":
            return rest == b"t", at
        if kind == b"_":
            return None, at
        if kind in (b"$", b"=", b"!"):  # a bulk string, verbatim string, bulk error (RESP3)
            size = int(rest)
            if size < 0:
                return None, at
            if len(self.buffer) < at + size + 2:
                raise _Short
            value = bytes(self.buffer[at:at + size])
            if kind == b"!":
                return ReplyError(value.decode("utf-8", "replace")), at + size + 2
            return (value[4:] if kind == b"=" else value), at + size + 2
        if kind == b"|":  # attributes: about the reply that follows, which is the reply
            for _ in range(int(rest) * 2):
                _, at = self._parse(at)
            return self._parse(at)
        if kind in (b"*", b"~", b">", b"%"):
            count = int(rest)
            if count < 0:
                return None, at
            items = []
            for _ in range(count * 2 if kind == b"%" else count):
                item, at = self._parse(at)
                items.append(item)
            if kind == b"%":
                return dict(zip(items[::2], items[1::2], strict=True)), at
            return (_Push(items) if kind == b">" else items), at
        raise redis.InvalidResponse(f"unknown reply type {line[:20]!r}")


class _Short(Exception):
    """The buffer ends inside a reply."""


class _Push(list):  # type: ignore[type-arg]
    """A RESP3 push frame (``>``), as :class:`PyReader` gives it: no reply to any request."""


def _push_types() -> tuple[type, ...]:
    """The types the reply parsers give RESP3 push frames: :class:`_Push`, and hiredis's
    ``PushNotification`` (hiredis 3.2 and later, see :func:`reply_reader`)."""
    try:
        from hiredis import PushNotification
    except ImportError:  # not installed, or too old to tell a push frame from an array
        return (_Push,)
    return (_Push, PushNotification)


#: See :func:`_push_types`.
PUSH_TYPES = _push_types()


#: What a reader's ``gets()`` returns while its reply is not complete.
INCOMPLETE: Any = False
#: The same for a RESP3 connection, whose replies include ``False`` (``#f``).
NOT_YET: Any = object()


def _hiredis() -> Any:
    """The hiredis module, or None when it is not installed."""
    try:
        import hiredis
    except ImportError:
        return None
    return hiredis


#: Looked for once: a borrowed connection makes a reader for each request (and a failed
#: import searches the whole path each time).
_HIREDIS = _hiredis()


class ReplyError(redis.ResponseError):
    """An error reply as the reply readers give it (hiredis's ``replyError``): a
    ``ResponseError``, except ``-LOADING``, which is redis-py's ``BusyLoadingError`` (a
    ``ConnectionError``): a server loading its data answers nothing yet, an outage as
    redis-py's own reads report it, not the request's error."""

    def __new__(cls, message: str = "", *args: Any) -> Any:
        if message.startswith("LOADING"):
            return redis.BusyLoadingError(message)
        return super().__new__(cls, message, *args)


def reply_reader(resp3: bool = False) -> Any:
    """A reply parser with ``feed(bytes)`` and ``gets()``: hiredis's C one when installed.

    ``resp3``: for a connection that may receive push frames, which a hiredis older
    than 3.2 gives as plain arrays: the Python parser then, which tells them apart.
    Its ``gets()`` returns :data:`NOT_YET` while a reply is not complete (else
    :data:`INCOMPLETE`): on RESP3 ``False`` is a reply.
    """
    hiredis = _HIREDIS
    if hiredis is None:
        return PyReader(NOT_YET if resp3 else INCOMPLETE)
    if resp3:
        if len(PUSH_TYPES) == 1:
            return PyReader(NOT_YET)
        try:
            return hiredis.Reader(protocolError=redis.InvalidResponse, replyError=ReplyError,
                                  notEnoughData=NOT_YET)
        except TypeError:  # a hiredis without that option
            return PyReader(NOT_YET)
    return hiredis.Reader(protocolError=redis.InvalidResponse, replyError=ReplyError)
