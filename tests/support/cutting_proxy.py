"""A loopback TCP relay that cuts a connection right after the server ran a request.

The fault it makes: a client writes a request, the server executes it, and the
connection breaks before the reply arrives (a proxy or a load balancer dropping
the connection, a network partition, a server-side idle timeout at the wrong
moment). The client knows only that the connection broke; whatever it sends
again on a new connection meets the effects of the first attempt.

:meth:`CuttingProxy.cut_after` arms the relay with texts: the next chunk a
client sends that contains one of them is forwarded to the server; once the server
answered every command sent on that connection so far (so every one has run),
the proxy drops the chunk of replies that completed them and closes both sides
of the connection.
Every other byte, and every connection made afterwards, is relayed as is.
``cuts`` counts the connections cut so far.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_singleton_beat.connection.replies import reply_reader

from .loopback import LoopbackProxy, close_socket, shut_write
from .owners import register
from .paths import scratch_file

__all__ = ["CuttingProxy"]


@dataclass
class _Link:
    """One client connection, its connection to the server, and the RESP counted on each."""

    client: socket.socket
    upstream: socket.socket
    commands: Any = field(default_factory=reply_reader)
    replies: Any = field(default_factory=reply_reader)
    #: Commands forwarded and replies read so far.
    sent: int = 0
    answered: int = 0
    #: Cut once this many replies were read (None: relay freely).
    cut_at: int | None = None


def _count(reader: Any, data: bytes) -> int:
    """Feed ``data`` to ``reader``; the RESP messages it completed."""
    reader.feed(data)
    count = 0
    while reader.gets() is not False:
        count += 1
    return count


class CuttingProxy(LoopbackProxy):
    """Relays ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``; see the module docstring."""

    connect_timeout = 10.0

    def __init__(self, upstream_port: int, name: str = "cutting-proxy") -> None:
        super().__init__(upstream_port, name)
        self.log: Path = scratch_file(name)
        self._lock = threading.Lock()
        self._armed: tuple[bytes, ...] = ()
        self._sockets: list[socket.socket] = []
        #: Connections cut after the server answered an armed request.
        self.cuts = 0
        self.cut_done = threading.Event()
        register(self)
        self._start_accepting()

    def cut_after(self, *texts: bytes) -> None:
        """Cut the connection of the next client chunk naming any of ``texts``, once its
        commands ran (their replies are dropped). Once: later chunks pass."""
        with self._lock:
            self._armed = texts
            self.cut_done.clear()

    # ----------------------------------------------------------------- owner protocol

    @property
    def running(self) -> bool:
        return not self._closed

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:]) if self.log.exists() else ""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._sockets)
        super().close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    # ----------------------------------------------------------------- relay

    def _note(self, line: str) -> None:
        with self._lock, self.log.open("a") as out:
            out.write(line + "\n")

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        link = _Link(client, upstream)
        with self._lock:
            self._sockets += [client, upstream]
        self.spawn(self.relay, client, functools.partial(self._up, link), functools.partial(shut_write, upstream),
                   name=f"{self.name}-up")
        self.spawn(self.relay, upstream, functools.partial(self._down, link), functools.partial(shut_write, client),
                   name=f"{self.name}-down")

    def _up(self, link: _Link, data: bytes) -> bool:
        """A client's chunk: counted before it is forwarded (its replies can only come after)."""
        with self._lock:
            link.sent += _count(link.commands, data)
            if self._armed and any(text in data for text in self._armed):
                self._armed = ()
                link.cut_at = link.sent
        self.forward(link.upstream, data)
        return True

    def _down(self, link: _Link, data: bytes) -> bool:
        """The server's chunk: relayed, unless it completes the replies of an armed chunk
        (every command of it ran): then dropped, and the connection cut."""
        with self._lock:
            link.answered += _count(link.replies, data)
            cut = link.cut_at is not None and link.answered >= link.cut_at
        if not cut:
            self.forward(link.client, data)
            return True
        # Counted before the sockets close: the client sees the cut as soon as they do, and a
        # test reading ``cuts`` right after its request came back must find it counted.
        self.cuts += 1
        self.cut_done.set()
        for sock in (link.client, link.upstream):
            close_socket(sock)
        self._note(f"cut a connection after {link.answered} replies (the last ones dropped)")
        return False
