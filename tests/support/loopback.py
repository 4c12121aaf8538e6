"""The base of the tests' loopback proxies: listen on a free ``127.0.0.1`` port, open a
connection to the server for each client connection, relay bytes.

:class:`LoopbackProxy` owns the listener, the accept loop and the byte relay loop
(:meth:`LoopbackProxy.relay`); each proxy is a subclass with its own behaviour:
:meth:`LoopbackProxy.connected` starts what relays a new pair of connections.

* :class:`.fault_proxy.FaultProxy`: injects faults, command by command;
* :class:`.holding_proxy.HoldingProxy`: holds a connection's bytes to reorder
  traffic between connections;
* :class:`.cutting_proxy.CuttingProxy`: cuts a connection right after the server ran a request.

(The delaying proxy, :mod:`.proxy`, is the harness's: the chaos runs use it too.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LoopbackProxy", "QuietRelay", "close_socket", "shut_write"]


def shut_write(sock: socket.socket) -> None:
    """Pass an end of stream on (the other side reads EOF); errors ignored."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def close_socket(sock: socket.socket) -> None:
    """Shut both directions and close (the peer sees the connection end at once); errors ignored."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class LoopbackProxy:
    """Relays ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``; subclasses say how."""

    #: Seconds to wait for the server's connection.
    connect_timeout = 5.0
    #: Set ``TCP_NODELAY`` on both connections of a pair.
    nodelay = False

    def __init__(self, upstream_port: int, name: str) -> None:
        self.name = name
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False

    def _start_accepting(self) -> None:
        """Accept connections (from a daemon thread); subclasses call it once set up."""
        threading.Thread(target=self._accept, name=f"{self.name}-accept", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting; subclasses close their connections too."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        """A client connected and its connection to the server is open: start relaying."""
        raise NotImplementedError

    def spawn(self, target: Callable[..., Any], *args: Any, name: str) -> None:
        """Run ``target(*args)`` in a daemon thread."""
        threading.Thread(target=target, args=args, daemon=True, name=name).start()

    @staticmethod
    def relay(source: socket.socket, on_data: Callable[[bytes], bool],
              on_end: Callable[[], None] | None = None) -> None:
        """Read ``source`` until it ends or fails (then ``on_end()``), each chunk handed to
        ``on_data`` (False: stop reading at once)."""
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                if on_end is not None:
                    on_end()
                return
            if not on_data(data):
                return

    @staticmethod
    def forward(sink: socket.socket, data: bytes) -> None:
        """Write ``data`` to ``sink``; a broken connection is ignored (its reader notices)."""
        with contextlib.suppress(OSError):
            sink.sendall(data)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=self.connect_timeout)
                upstream.settimeout(None)
            except OSError:
                if self._closed:
                    return
                continue
            if self.nodelay:
                for sock in (client, upstream):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connected(client, upstream)


class QuietRelay(LoopbackProxy):
    """A relay a test drives itself, with no log of its own (what the owners' reports read)."""

    log = "(no log)"

    @property
    def running(self) -> bool:
        return not self._closed

    def tail(self, lines: int = 15) -> str:
        return ""
