"""Lock commands on the wire: a request is commands written together, replies read in order.

The lock operations (:mod:`.commands`) are built as :class:`Request` objects:
the RESP bytes of one or more commands (a ``MULTI`` block, a native
compare-and-delete with the done marker's ``SET`` ahead of it, a Lua script)
and the function that turns their replies into the operation's result. Two
executors send them:

* :class:`~.channel.Channel`, a connection of its own per thread, which can
  also write a request and read its replies later (a run's release);
* :func:`run_pooled`, which borrows a connection of the client's pool (of the
  right node on Redis Cluster) for one request: Sentinel, Cluster, greenlet
  pools, the lease keeper, tools.

Both load a request's Lua scripts on a connection before their first use
there (``SCRIPT LOAD`` written just ahead), run a request again after a
``SCRIPT FLUSH`` (every script here compares before it writes, so running one
twice changes nothing), and retry once on a new connection when a connection
the server had closed (a restart, an idle timeout) fails on first use. Every
request is safe to send twice: a repeated acquire finds its own value
(:func:`.lock.acquire` takes that as taken), a repeated compare-and-delete
finds nothing to delete.

**Every reply is read where it belongs.** A :class:`Link` counts the replies
written on it and not read yet (:attr:`Link.outstanding`). A request reads all
of its replies, error replies included (a refused ``SCRIPT LOAD`` ahead of it
too), or its connection is dropped: an exception of any kind (a timeout, a
signal handler's ``SoftTimeLimitExceeded``, ``SystemExit``) that leaves a
connection with replies outstanding ends that connection, and a pooled one
never goes back to its pool with them. Otherwise the next request on it would
read them as its own.

On Redis Cluster, :func:`.pooled.run_pooled` follows ``-MOVED`` (the layout is read
again, the request sent to the new owner) and ``-ASK`` (a slot migrating: each
command the source answered with ``ASK`` is sent to the target behind
``ASKING``; what the source served stays served: see :mod:`.redirects`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import redis
from redis.exceptions import AskError, NoScriptError

from .replies import INCOMPLETE, NOT_YET, PUSH_TYPES, PyReader, reply_reader

__all__ = [
    "NOT_SHORT", "Link", "LuaScript", "PoolLink", "Request", "Short", "SocketLink", "Written", "bulk", "command_head",
           "ensure_checked", "looker_of", "own_replies", "pack", "read_own", "read_replies", "run_on", "write_request"]

#: Connection errors after which a request is tried once more on a new connection.
RETRIED = (redis.ConnectionError, OSError)
#: Errors after which a connection is dropped.
BROKEN = (redis.ConnectionError, redis.TimeoutError, OSError)


class LuaScript:
    """A Lua script run with EVALSHA, loaded on each connection before its first call."""

    def __init__(self, source: str) -> None:
        self.source = source.encode("utf-8")
        self.sha = hashlib.sha1(self.source).hexdigest()

    def command(self, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        """The ``EVALSHA`` command of a call of this script."""
        return (b"EVALSHA", self.sha, len(keys), *keys, *args)


class Request:
    """Commands written in one go, and ``finish(replies)`` giving their meaning.

    ``replies`` holds one entry per command, in order; a command's error
    reply is there as the exception (``finish`` decides), so a request never
    leaves replies unread on its connection. ``data``: the commands already
    in RESP (the hot path builds them so), with ``count`` replies.
    """

    __slots__ = ("count", "data", "finish", "scripts", "short", "unsure_when_repeated")

    def __init__(self, commands: list[tuple[Any, ...]] | None, finish: Callable[[list[Any]], Any],
                 scripts: Sequence[LuaScript] = (), *, unsure_when_repeated: bool = False,
                 data: bytes | None = None, count: int = 0, short: Short | None = None) -> None:
        if commands is not None:
            data = b"".join([pack(*command) for command in commands])
            count = len(commands)
        assert data is not None
        self.data = data
        self.count = count
        self.finish = finish
        self.scripts = scripts
        #: A compare-and-delete sent again after a lost connection: "not ours" may mean
        #: the first attempt ran. Its result is then reported unknown (None).
        self.unsure_when_repeated = unsure_when_repeated
        #: The usual reply's bytes and its result, read without the reply parser (see
        #: :meth:`SocketLink.read_short`); None: always the general path.
        self.short = short


class Short(NamedTuple):
    """A request's usual reply, read in one step where the bytes received are exactly it.

    ``pattern`` must match the whole of the request's replies (every one of them, in
    RESP2 and RESP3 spellings) and nothing else; ``result(match)`` is what ``finish``
    would return for those replies. Any other reply (an error, another value, a reply
    still arriving) goes through the general parser and ``finish``.
    """

    pattern: re.Pattern[bytes]
    result: Callable[[re.Match[bytes]], Any]


class Written:
    """A request on a connection whose replies are still to be read."""

    __slots__ = ("loads", "request")

    def __init__(self, request: Request, loads: int) -> None:
        self.request = request
        #: ``SCRIPT LOAD`` replies written ahead of the request's own.
        self.loads = loads


def _pack_python(*parts: Any) -> bytes:
    """One command in RESP, for the argument types the lock commands use (bytes, str, int).

    redis-py's general packer costs more than the round trip on these calls.
    """
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        if type(part) is not bytes:
            part = str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def _hiredis_packer() -> Callable[..., bytes] | None:
    """hiredis's C packer (the ``fast`` extra), if installed: 2.5x faster than :func:`_pack_python`."""
    try:
        from hiredis import pack_command
    except ImportError:  # not installed, or too old to have it
        return None

    def pack(*parts: Any) -> bytes:
        return pack_command(parts)  # type: ignore[no-any-return]

    # Same bytes for every argument type the commands pass (checked once, here).
    sample = (b"EVALSHA", "x" * 40, 2, "k:{a}", "\u00e9", 0, -1, b"\x00\xff")
    return pack if pack(*sample) == _pack_python(*sample) else None


pack: Callable[..., bytes] = _hiredis_packer() or _pack_python


def bulk(part: bytes | str | int) -> bytes:
    """One argument of a command in RESP (``$<length>\r\n<bytes>\r\n``), as :func:`pack`
    writes each: for a command written in parts that are encoded once, kept and joined
    later (a lease's arguments of the keeper's many-lease renewal; see :func:`command_head`)."""
    if type(part) is not bytes:
        part = str(part).encode()
    return b"$%d\r\n%s\r\n" % (len(part), part)


def command_head(length: int, *first: bytes | str | int) -> bytes:
    """The start of a command of ``length`` arguments in all: their count and the ``first``
    of them; the others follow as :func:`bulk` parts. With ``length == len(first) + len(rest)``,
    ``command_head(length, *first) + b"".join(map(bulk, rest))`` is ``pack(*first, *rest)``."""
    return b"*%d\r\n" % length + b"".join([bulk(part) for part in first])


class Link(Protocol):
    """One connection as the lock requests use it: write bytes, read one reply at a time."""

    #: SHAs of the scripts loaded through this connection.
    loaded: set[str]
    #: Replies written for and not read yet. Counted up before the bytes are written and
    #: down once a reply (or a request's every reply, for :meth:`read_many`) was read, so
    #: a write or read cut short by any exception leaves it above zero: the connection
    #: must then be dropped (its stream holds replies, or half of one, nobody will read).
    outstanding: int

    def send(self, data: bytes, replies: int = 1) -> None:
        """Write ``data``: commands that will be answered with ``replies`` replies."""

    def read(self) -> Any:
        """The next reply; an error reply is returned as a ``ResponseError``, not raised."""

    def read_many(self, count: int) -> list[Any]:
        """The next ``count`` replies, as :meth:`read` gives them."""

    def unread(self) -> bool:
        """Bytes were received that no request asked for (the connection must not be reused)."""


class PoolLink:
    """A redis-py connection (from a pool) as a :class:`Link`, for one borrowing."""

    __slots__ = ("connection", "loaded", "outstanding")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.loaded = loaded_on(connection)
        self.outstanding = 0

    def send(self, data: bytes, replies: int = 1) -> None:
        self.outstanding += replies
        self.connection.send_packed_command([data], check_health=False)

    def read(self) -> Any:
        try:
            reply = self.connection.read_response()
        except redis.ResponseError as exc:
            reply = exc
        self.outstanding -= 1
        return reply

    def read_many(self, count: int) -> list[Any]:
        return [self.read() for _ in range(count)]

    def unread(self) -> bool:
        return False  # redis-py's parser keeps what it received; ``get_connection`` checks it


def loaded_on(connection: Any) -> set[str]:
    """SHAs of the scripts loaded through ``connection`` since it (re)connected."""
    sock = getattr(connection, "_sock", None)
    known: tuple[Any, set[str]] | None = getattr(connection, "csb_scripts", None)
    if known is None or known[0] is not sock:
        known = connection.csb_scripts = (sock, set())
    return known[1]


def looker_of(client: Any) -> Any:
    """What looks at each new connection of ``client``: the server record that
    :func:`.recovery.server.server_of` attached to it (None before that)."""
    return getattr(client, "csb_server", None)


def ensure_checked(connection: Any, server: Any) -> None:
    """Connect if needed, and let ``server`` (what :func:`looker_of` gives: a
    :class:`~.recovery.server.LockServer`, or None) look at a new connection once."""
    try:
        if getattr(connection, "_sock", None) is None:
            connection.connect()  # the handshake, and the check where it is redis_connect_func
        sock = connection._sock
        if server is not None and getattr(connection, "csb_checked", None) is not sock:
            server.check(connection)
            connection.csb_checked = sock
    except BaseException:
        connection.disconnect()  # the handshake's or the check's replies may be unread: never used half-set-up
        raise


def write_request(link: Link, request: Request) -> Written:
    """Write ``request`` (its scripts loaded first where needed) in one ``sendall``."""
    scripts = request.scripts
    if not scripts:
        link.send(request.data, request.count)
        return Written(request, 0)
    loaded = link.loaded
    parts = []
    for script in scripts:
        if script.sha not in loaded:
            parts.append(pack(b"SCRIPT", b"LOAD", script.source))
            loaded.add(script.sha)
    loads = len(parts)
    parts.append(request.data)
    link.send(b"".join(parts), loads + request.count)
    return Written(request, loads)


class SocketLink:
    """A connected socket as a :class:`Link`, read with :func:`reply_reader` (no redis-py layers).

    For the lock channel's own connection once redis-py made it (handshake,
    ``AUTH``, ``SELECT``) and the server was looked at: nothing of redis-py's
    reads it from then on. Socket errors become redis-py's (a timeout is
    ``TimeoutError``, anything else ``ConnectionError``).

    On a RESP3 connection (``resp3``) the server may send push frames between
    replies, answering no request: client-side caching's invalidations (``CLIENT
    TRACKING``), a managed Redis's maintenance notices. They are skipped: the
    connection has no cache to invalidate, and a maintenance that moves the
    server closes it, which the channel handles as any lost connection.
    """

    __slots__ = ("_incomplete", "_reader", "loaded", "outstanding", "sock")

    def __init__(self, sock: Any, resp3: bool = False) -> None:
        self.sock = sock
        self.loaded: set[str] = set()
        self.outstanding = 0
        self._reader = reply_reader(resp3)
        #: What the reader's ``gets()`` returns while a reply is not complete.
        self._incomplete = NOT_YET if resp3 else INCOMPLETE

    def send(self, data: bytes, replies: int = 1) -> None:
        self.outstanding += replies
        try:
            self.sock.sendall(data)
        except TimeoutError as exc:
            raise redis.TimeoutError(f"Timeout writing to the lock Redis: {exc}") from exc
        except OSError as exc:
            raise redis.ConnectionError(f"Error writing to the lock Redis: {exc}") from exc

    def read(self) -> Any:
        reader, incomplete = self._reader, self._incomplete
        reply = reader.gets()
        while reply is incomplete or type(reply) in PUSH_TYPES:
            if reply is incomplete:
                self._receive()
            reply = reader.gets()
        self.outstanding -= 1
        return reply

    def read_many(self, count: int) -> list[Any]:
        """The next ``count`` replies: one call for a request's replies (the hot path reads 1 to 4)."""
        gets, incomplete = self._reader.gets, self._incomplete
        replies = []
        while True:
            reply = gets()
            if reply is incomplete:
                self._receive()
                continue
            if type(reply) in PUSH_TYPES:  # no reply: see the class's docstring
                continue
            replies.append(reply)
            if len(replies) == count:
                self.outstanding -= count
                return replies

    def read_short(self, short: Short, count: int) -> Any:
        """The result of ``count`` replies that are exactly ``short``'s usual reply, read
        without the reply parser; :data:`NOT_SHORT` (nothing consumed) for anything else:
        another reply, more bytes than that, or a reply not complete yet -- the general
        path (:meth:`read_many`) then reads them, receiving the rest as it needs.

        Only with the pure-Python parser (hiredis's is fast already) and when nothing
        received is waiting in it: at most one ``recv`` here.
        """
        reader = self._reader
        if type(reader) is not PyReader:
            return NOT_SHORT
        buffer = reader.buffer
        if not buffer:
            self._receive()
        match = short.pattern.fullmatch(buffer)
        if match is None:
            return NOT_SHORT
        result = short.result(match)
        buffer.clear()
        self.outstanding -= count
        return result

    def unread(self) -> bool:
        """Bytes already received that no reply was read from (nothing is expected while idle)."""
        reader = self._reader
        return bool(reader.has_data()) if hasattr(reader, "has_data") else False

    def _receive(self) -> None:
        try:
            data = self.sock.recv(65536)
        except TimeoutError as exc:
            raise redis.TimeoutError("Timeout reading from the lock Redis") from exc
        except OSError as exc:
            raise redis.ConnectionError(f"Error reading from the lock Redis: {exc}") from exc
        if not data:
            raise redis.ConnectionError("Connection closed by server.")
        self._reader.feed(data)


#: :meth:`SocketLink.read_short` found another reply than the usual one.
NOT_SHORT: Any = object()


class _NoScript(NoScriptError):
    """A reply of the request was ``NOSCRIPT`` (a ``SCRIPT FLUSH``): load and run it again.

    A ``NoScriptError`` for callers that see it (a script missing twice in a row).
    """


def _missing_script(reply: Any) -> bool:
    return isinstance(reply, NoScriptError) or (
        isinstance(reply, redis.ResponseError) and str(reply).startswith("NOSCRIPT"))


def read_own(link: Link, written: Written) -> list[Any]:
    """Read every reply of ``written`` (the ``SCRIPT LOAD`` replies ahead of it too) and
    return the request's own.

    Raises, once all are read: :class:`_NoScript` when a script was missing (a
    ``SCRIPT FLUSH``: load and run it again), or the refusal of its ``SCRIPT LOAD``
    (``-BUSY``, ``-NOPERM``) when the script could not run without it.
    """
    return own_replies(link, written, link.read_many(written.loads + written.request.count))


def own_replies(link: Link, written: Written, replies: list[Any]) -> list[Any]:
    """The request's own of ``replies``, every reply of ``written`` read from ``link``
    (:func:`read_own`, for a reader that read them one at a time)."""
    request = written.request
    loads = written.loads
    if not loads:
        refused = None
    else:
        refused = next((reply for reply in replies[:loads] if isinstance(reply, Exception)), None)
        replies = replies[loads:]
        if refused is not None:  # not loaded through this connection: load it again next time
            link.loaded.difference_update(script.sha for script in request.scripts)
    if request.scripts and any(_missing_script(reply) for reply in replies):
        link.loaded.clear()
        if refused is not None:
            raise refused
        raise _NoScript(str(next(reply for reply in replies if _missing_script(reply))))
    return replies


def read_replies(link: Link, written: Written) -> Any:
    """Read every reply of ``written`` and return ``finish(replies)`` (see :func:`read_own`)."""
    return written.request.finish(read_own(link, written))


def run_on(link: Link, request: Request,
           redirected: Callable[[Request, list[Any]], list[Any]] | None = None) -> Any:
    """Write ``request``, read its replies; once more after a ``SCRIPT FLUSH``.

    ``redirected(request, replies)``, when given, is called with replies of which
    one at least is ``-ASK`` (Cluster), and returns them with the redirected
    commands' replies in their place.
    """
    try:
        written = write_request(link, request)
        short = request.short
        if short is not None and not written.loads and isinstance(link, SocketLink):
            # The usual reply, read in one step off the socket (see SocketLink.read_short).
            result = link.read_short(short, request.count)
            if result is not NOT_SHORT:
                return result
        replies = read_own(link, written)
    except _NoScript:
        replies = read_own(link, write_request(link, request))
    if redirected is not None and any(isinstance(reply, AskError) for reply in replies):
        replies = redirected(request, replies)
    return request.finish(replies)
