"""A loopback proxy that speaks RESP and injects faults, command by command.

:class:`FaultProxy` relays ``127.0.0.1:<port>`` to a redis-server. It reads each
command a client writes (RESP arrays) and each reply the server sends, so that
it knows which reply answers which command, and it decides the fate of every
command with its own seeded random generator, as a sick network or server would:

========================  =================================================================
fate                      what the client sees (what the server did)
========================  =================================================================
``pass``                  the reply
``refuse``                an error reply in the command's place (``-BUSY``, ``-LOADING``,
                          ``-NOPERM``, ``-OOM``, ``-ERR``); the server never got the command
``delay``                 the reply (and every reply behind it) late
``close_before``          the connection closed; the server got neither this command nor
                          anything after it
``close_after``           the connection closed once the server answered (the command ran)
``cut``                   part of the reply, then the connection closed
``silence``               nothing more on the connection (the command ran); the client
                          times out
========================  =================================================================

Nothing is ever reordered, duplicated or invented inside a connection: what a
real server and a real TCP stream can do, and nothing they cannot. No command
inside a ``MULTI`` block is refused (a server refusing a queued command aborts
the transaction; a proxy cannot).

``faults`` counts each fate that happened. :meth:`FaultProxy.pause` stops new
faults (the checker's own requests, set-ups); :meth:`FaultProxy.close` stops it.
For deterministic tests, :meth:`FaultProxy.force` gives the next command of a name
a fate (with every random rate at 0, nothing else happens), and
:meth:`FaultProxy.inject` writes bytes no command asked for to every idle client
connection (a broken middlebox: what no real server does).
"""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .loopback import LoopbackProxy, close_socket

__all__ = ["FATES", "FaultProxy", "Rates", "command_length", "reply_length"]

FATES = ("refuse", "delay", "close_before", "close_after", "cut", "silence")

_REFUSALS = (
    b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.\r\n",
    b"-LOADING Redis is loading the dataset in memory\r\n",
    b"-NOPERM this user has no permissions to run this command (injected)\r\n",
    b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
    b"-ERR injected by the fault proxy\r\n",
)


@dataclass(frozen=True)
class Rates:
    """The probability of each fate per command (the rest pass), and the delays."""

    refuse: float = 0.01
    delay: float = 0.02
    close_before: float = 0.002
    close_after: float = 0.002
    cut: float = 0.002
    silence: float = 0.0005
    #: A delayed reply waits up to this long (seconds)...
    delay_max: float = 0.01
    #: ... or, one time in ``long_delay_every``, this long (past the client's timeout).
    long_delay: float = 0.0
    long_delay_every: int = 50


def _line_end(data: bytes | bytearray, at: int) -> int:
    end = data.find(b"\r\n", at)
    if end < 0:
        raise IndexError
    return end


def command_length(data: bytes | bytearray) -> int:
    """Length of the first complete command (a RESP array of bulk strings) in ``data``, 0 if incomplete."""
    try:
        end = _line_end(data, 0)
        if data[:1] != b"*":
            raise ValueError(f"not a RESP array: {bytes(data[:20])!r}")
        at = end + 2
        for _ in range(int(data[1:end])):
            end = _line_end(data, at)
            at = end + 2 + int(data[at + 1:end]) + 2
            if at > len(data):
                return 0
        return at
    except IndexError:
        return 0


def reply_length(data: bytes | bytearray, at: int = 0) -> int:
    """End offset of the complete reply (RESP2 or RESP3) that starts at ``at``, 0 if incomplete."""
    try:
        return _reply_end(data, at)
    except IndexError:
        return 0


def _reply_end(data: bytes | bytearray, at: int) -> int:
    end = _line_end(data, at)
    kind = data[at:at + 1]
    if kind in (b"$", b"=", b"!"):
        size = int(data[at + 1:end])
        if size < 0:
            return end + 2
        stop = end + 2 + size + 2
        if stop > len(data):
            raise IndexError
        return stop
    if kind in (b"*", b"~", b">", b"%", b"|"):
        count = int(data[at + 1:end])
        at = end + 2
        for _ in range(max(count, 0) * (2 if kind in (b"%", b"|") else 1)):
            at = _reply_end(data, at)
        return at
    return end + 2  # + - : , # _ (


class _Connection:
    """One client connection and its own connection to the server."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        #: What answers each forwarded or refused command, in order: ("server", fate, delay) or ("inject", bytes).
        self.plan: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self.in_multi = False
        self.closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._from_client, daemon=True, name="fault-proxy-up").start()
        threading.Thread(target=self._from_server, daemon=True, name="fault-proxy-down").start()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            close_socket(sock)
        self.plan.put(None)

    def _from_client(self) -> None:
        buffer = bytearray()

        def commands(data: bytes) -> bool:
            buffer.extend(data)
            out = bytearray()
            try:
                while (size := command_length(buffer)) > 0:
                    command = bytes(buffer[:size])
                    del buffer[:size]
                    name = command.split(b"\r\n", 3)[2].upper()
                    fate = self.proxy.fate(self.in_multi, name)
                    if fate == "close_before":
                        if out:
                            self.upstream.sendall(out)
                        self.close()
                        return False
                    if fate == "refuse":
                        self.plan.put(("inject", self.proxy.refusal()))
                    else:
                        out += command
                        self.plan.put(("server", fate, self.proxy.delay() if fate == "delay" else 0.0))
                    if name == b"MULTI":
                        self.in_multi = True
                    elif name in (b"EXEC", b"DISCARD"):
                        self.in_multi = False
                if out:
                    self.upstream.sendall(out)
            except OSError:
                self.close()
                return False
            return not self.closed

        LoopbackProxy.relay(self.client, commands, self.close)

    def _from_server(self) -> None:
        buffer = bytearray()
        try:
            while True:
                step = self.plan.get()
                if step is None:
                    return
                if step[0] == "inject":
                    self.client.sendall(step[1])
                    continue
                _, fate, delay = step
                while (size := reply_length(buffer)) == 0:
                    data = self.upstream.recv(65536)
                    if not data:
                        self.close()
                        return
                    buffer += data
                reply = bytes(buffer[:size])
                del buffer[:size]
                if fate == "delay":
                    time.sleep(delay)  # the fault itself: this reply (and those behind it) late
                elif fate == "close_after":
                    self.close()
                    return
                elif fate == "cut":
                    self.client.sendall(reply[:self.proxy.random.randrange(1, len(reply))] if len(reply) > 1 else b"")
                    self.close()
                    return
                elif fate == "silence":
                    return  # nothing more; the client times out and closes, which closes the rest
                self.client.sendall(reply)
        except OSError:
            self.close()


class FaultProxy(LoopbackProxy):
    """``127.0.0.1:port`` -> a redis-server, with faults (see the module docstring)."""

    nodelay = True

    def __init__(self, upstream_port: int, rates: Rates, seed: int) -> None:
        super().__init__(upstream_port, "fault-proxy")
        self.rates = rates
        self.random = random.Random(seed)
        self._random_lock = threading.Lock()
        self.faults: Counter[str] = Counter()
        self.connections = 0
        self.active = True
        self._open: list[_Connection] = []
        self._forced: dict[bytes, str] = {}
        self._start_accepting()

    def __enter__(self) -> FaultProxy:
        return self

    @contextlib.contextmanager
    def pause(self) -> Any:
        """No new faults while inside (what is already planned still happens)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def force(self, name: bytes, fate: str) -> None:
        """The next command called ``name`` (e.g. ``b"EVALSHA"``) meets ``fate``."""
        assert fate in FATES, fate
        self._forced[name.upper()] = fate

    def inject(self, data: bytes) -> int:
        """Write ``data`` to every client connection now; how many got it."""
        reached = 0
        for connection in list(self._open):
            if not connection.closed:
                with contextlib.suppress(OSError):
                    connection.client.sendall(data)
                    reached += 1
        return reached

    def fate(self, in_multi: bool, name: bytes = b"") -> str:
        """The fate of the next command (counted)."""
        forced = self._forced.pop(name, None)
        if forced is not None:
            self.faults[forced] += 1
            return forced
        if not self.active:
            return "pass"
        rates = self.rates
        with self._random_lock:
            draw = self.random.random()
        for name in FATES:
            chance = getattr(rates, name)
            if draw < chance:
                if name == "refuse" and in_multi:
                    return "pass"
                self.faults[name] += 1
                return name
            draw -= chance
        return "pass"

    def refusal(self) -> bytes:
        with self._random_lock:
            return self.random.choice(_REFUSALS)

    def delay(self) -> float:
        rates = self.rates
        with self._random_lock:
            if rates.long_delay and self.random.randrange(rates.long_delay_every) == 0:
                self.faults["long_delay"] += 1
                return rates.long_delay
            return self.random.uniform(0, rates.delay_max)

    def close(self) -> None:
        super().close()
        for connection in list(self._open):
            connection.close()

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        self.connections += 1
        connection = _Connection(self, client, upstream)
        self._open = [c for c in self._open if not c.closed] + [connection]
        connection.start()
