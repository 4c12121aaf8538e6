"""A delaying TCP proxy on loopback: one server whose bytes arrive late, or not at all, on purpose.

:class:`DelayProxy` listens on a free loopback port and forwards every
connection to an upstream port (a redis-server), both ways, each chunk of
bytes ``delay`` seconds after the proxy read it; order within a connection is
kept, as on a slow link (a TCP retransmit, a remote host). Only the clients
pointed at the proxy see the delay: the same server stays reachable directly.

:meth:`DelayProxy.hold` stops forwarding client-to-server bytes (they are read
and kept, so the client's writes never block: ``held_bytes`` counts them) until
:meth:`DelayProxy.resume`: a test can then tell "the client wrote X and went on"
from "the client waited for X's reply" (or gave up waiting and closed the
connection: ``clients_closed``), without reading clocks.

:meth:`DelayProxy.cut` drops every connection and refuses new ones (accepted,
then closed at once) until :meth:`DelayProxy.mend`: the link is down, the
server is not. ``delay`` may be changed while the proxy runs; it applies to
the bytes read from then on.

The proxy runs an asyncio loop in a daemon thread of the process that started
it (the tests register theirs with an owner: ``tests/support/proxy.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from .processes import ProcessError
from .redis_server import free_port

__all__ = ["DelayProxy"]


class DelayProxy:
    """``127.0.0.1:port`` -> ``127.0.0.1:upstream_port``, every chunk ``delay`` seconds late."""

    #: Raised when the proxy cannot listen.
    error: type[Exception] = ProcessError

    def __init__(self, upstream_port: int, delay: float, *, log: Path, name: str = "delay-proxy") -> None:
        self.upstream_port = upstream_port
        self.delay = delay
        self.name = name
        self.log = Path(log)
        self.port = free_port()
        #: Connections accepted so far; those whose client closed its end (counted when
        #: the proxy reads the end, even while bytes before it are held).
        self.connections = 0
        self.clients_closed = 0
        #: Client-to-server bytes read and kept by :meth:`hold`, not forwarded yet.
        self.held_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: While True (:meth:`cut`), connections are refused and none is open.
        self._refusing = False
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<DelayProxy {self.port}->{self.upstream_port} delay={self.delay}s>"

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ control

    def start(self) -> DelayProxy:
        """Listen on ``port`` (returns once it does)."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                self._flowing = asyncio.Event()
                self._flowing.set()
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._accept, "127.0.0.1", self.port))
            except BaseException as exc:  # reported by start()
                failed.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(10) or failed:
            raise self.error(f"{self} could not listen: {failed[0] if failed else 'timed out'}")
        self._note(f"listening on {self.port}, forwarding to {self.upstream_port}, delay {self.delay}s")
        return self

    def hold(self) -> None:
        """Keep every client-to-server byte in the proxy from now on (read, not forwarded)."""
        self._set_flowing(False)
        self._note("holding client-to-server bytes")

    def resume(self) -> None:
        """Forward what was held (each chunk no earlier than its delay) and go on forwarding."""
        self._set_flowing(True)
        self._note("forwarding again")

    def cut(self) -> None:
        """Drop every connection (both ends closed) and refuse new ones until :meth:`mend`."""
        self._in_loop(self._cut())
        self._note("cut: connections dropped, new ones refused")

    def mend(self) -> None:
        """Accept connections again after :meth:`cut`."""
        self._refusing = False
        self._note("mended: accepting connections")

    async def _cut(self) -> None:
        self._refusing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _in_loop(self, work: Any) -> None:
        loop = self._loop
        assert loop is not None, "the proxy is not running"
        asyncio.run_coroutine_threadsafe(work, loop).result(10)

    def _set_flowing(self, flowing: bool) -> None:
        """Set or clear the flow in the proxy's loop; returns once it is done there."""
        event = self._flowing
        assert event is not None, "the proxy is not running"

        async def apply() -> None:
            if flowing:
                event.set()
            else:
                event.clear()

        self._in_loop(apply())

    def close(self) -> None:
        """Stop listening, drop every connection, end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            self._note("closed")

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ----------------------------------------------------------------- forwarding

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        if self._refusing:
            self._note(f"connection {number}: refused (cut)")
            client_writer.close()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError as exc:
            self._note(f"connection {number}: upstream refused ({exc})")
            client_writer.close()
            return
        self._note(f"connection {number} opened")
        pipes = [asyncio.ensure_future(self._pipe(client_reader, server_writer, held=True)),
                 asyncio.ensure_future(self._pipe(server_reader, client_writer, held=False))]
        self._tasks.update(pipes)
        try:
            # One side closed (or failed): close both, as a proxy does.
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._tasks.difference_update(pipes)
            for writer in (client_writer, server_writer):
                writer.close()
            self._note(f"connection {number} closed")

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, held: bool) -> None:
        """Forward ``reader`` to ``writer``, each chunk ``delay`` after it was read, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await reader.read(65536):
                    queue.put_nowait((loop.time() + self.delay, data))
            finally:
                if held:
                    self.clients_closed += 1
                queue.put_nowait(None)

        reading = asyncio.ensure_future(read())
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - loop.time()))
                if held and self._flowing is not None and not self._flowing.is_set():
                    self.held_bytes += len(data)
                    try:
                        await self._flowing.wait()
                    finally:
                        self.held_bytes -= len(data)
                writer.write(data)
                await writer.drain()
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)

    # ------------------------------------------------------------------ reports

    def _note(self, line: str) -> None:
        with self._lock:
            self._lines.append(f"{time.strftime('%H:%M:%S')} {line}")
            with self.log.open("a") as out:
                out.write(self._lines[-1] + "\n")

    def tail(self, lines: int = 15) -> str:
        with self._lock:
            return "\n".join(self._lines[-lines:])
