"""A loopback TCP relay in front of a server, to reorder traffic between connections.

TCP orders bytes within one connection, never across two: a command written on
one connection can reach the server after a command written later on another.
:class:`HoldingProxy` makes that happen on purpose. It relays bytes both ways;
while *holding*, it keeps what clients send on a connection (in order) from the
first chunk that names a given text on, instead of forwarding it;
:meth:`HoldingProxy.let_go` then forwards the held bytes of the connections it
is given first, each one only after the server answered the
previous one, and the rest in the order they arrived. Nothing is dropped or
altered; only the moment bytes reach the server changes, as with a slow network.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

from .loopback import LoopbackProxy, shut_write

__all__ = ["HoldingProxy"]


@dataclass
class _Link:
    """One client connection and its own connection to the server."""

    number: int
    client: socket.socket
    upstream: socket.socket
    #: Bytes the client sent while the proxy held them: (time received, bytes).
    held: list[tuple[float, bytes]] = field(default_factory=list)
    #: Bytes the server sent back so far.
    answered: int = 0
    #: The client closed its side (passed on once its held bytes are forwarded).
    closed: bool = False


class HoldingProxy(LoopbackProxy):
    """Relays ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``; see the module docstring."""

    def __init__(self, upstream_port: int, name: str = "proxy") -> None:
        super().__init__(upstream_port, name)
        self._cond = threading.Condition()
        self._links: list[_Link] = []
        self._holding: bytes | None = None
        self._start_accepting()

    def __enter__(self) -> HoldingProxy:
        return self
    # ----------------------------------------------------------------- control

    def hold(self, naming: bytes = b"") -> None:
        """From now on keep what clients send on a connection, from its first chunk that
        contains ``naming`` on (every chunk when empty); the rest passes."""
        with self._cond:
            self._holding = naming

    def held_with(self, text: bytes) -> list[tuple[float, int]]:
        """(time received, connection number) of each held chunk that contains ``text``."""
        with self._cond:
            return sorted((at, link.number) for link in self._links for at, data in link.held if text in data)

    def let_go(self, first: list[int], timeout: float = 10.0) -> None:
        """Forward what is held: connections ``first`` in that order, each once the server
        answered the one before, then the others in arrival order; then relay freely."""
        with self._cond:
            for number in first:
                link = self._links[number]
                before = link.answered
                self._flush(link)
                if not self._cond.wait_for(lambda link=link, before=before: link.answered > before, timeout):
                    raise AssertionError(f"{self.name}: no answer on connection {number} within {timeout}s")
            for link in sorted((lk for lk in self._links if lk.held), key=lambda lk: lk.held[0][0]):
                self._flush(link)
            for link in self._links:
                if link.closed:
                    self._flush(link)
            self._holding = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            links = list(self._links)
        super().close()
        for link in links:
            for sock in (link.client, link.upstream):
                with contextlib.suppress(OSError):
                    sock.close()

    # ----------------------------------------------------------------- relay

    def _flush(self, link: _Link) -> None:
        for _, data in link.held:
            self.forward(link.upstream, data)
        link.held.clear()
        if link.closed:
            shut_write(link.upstream)

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._cond:
            link = _Link(len(self._links), client, upstream)
            self._links.append(link)
        self.spawn(self._from_client, link, name=f"{self.name}-{link.number}-up")
        self.spawn(self._from_server, link, name=f"{self.name}-{link.number}-down")

    def _from_client(self, link: _Link) -> None:
        def chunk(data: bytes) -> bool:
            with self._cond:
                if link.held or (self._holding is not None and self._holding in data):
                    link.held.append((time.time(), data))
                else:
                    self.forward(link.upstream, data)
            return True

        def end() -> None:
            with self._cond:
                link.closed = True
                if not link.held:
                    self._flush(link)

        self.relay(link.client, chunk, end)

    def _from_server(self, link: _Link) -> None:
        def chunk(data: bytes) -> bool:
            self.forward(link.client, data)
            with self._cond:
                link.answered += len(data)
                self._cond.notify_all()
            return True

        self.relay(link.upstream, chunk, lambda: shut_write(link.client))
