"""Container health checks: ``python -m example_project.shop.health worker|beat|flower``.

Exit status 0 when healthy, 1 otherwise, with one line saying why.

* ``worker [NODE]``: the worker answers a broadcast ping (default node name
  ``worker@<hostname>``, as compose.yaml names its workers).
* ``beat``: the broker and the Redis for slot claims answer. A beat runs
  fail-closed, so without the claims Redis it sends nothing: unhealthy.
* ``flower [PORT]``: Flower's ``/healthcheck`` answers ``OK`` (default port 5555).
"""

from __future__ import annotations

import socket
import sys
import urllib.request

import redis

from .celery_app import LOCK_REDIS_URL, app

TIMEOUT = 5.0


def check_worker(node: str | None = None) -> str:
    """Ping one worker node through the broker; raise if it does not answer."""
    node = node or f"worker@{socket.gethostname()}"
    replies = app.control.ping(destination=[node], timeout=TIMEOUT)
    if not any(node in reply for reply in replies):
        raise RuntimeError(f"{node} did not answer a ping within {TIMEOUT:.0f}s")
    return f"{node} answers"


def check_beat() -> str:
    """Check that a beat here could claim and send slots."""
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1, timeout=TIMEOUT)
    client = redis.Redis.from_url(LOCK_REDIS_URL, socket_timeout=TIMEOUT,
                                  socket_connect_timeout=TIMEOUT)
    try:
        client.ping()
    finally:
        client.close()
    return "broker and slot-claim Redis reachable"


def check_flower(port: str | None = None) -> str:
    """Ask Flower's health endpoint."""
    url = f"http://127.0.0.1:{int(port or 5555)}/healthcheck"
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        body = response.read().decode(errors="replace").strip()
    if response.status != 200 or body != "OK":
        raise RuntimeError(f"{url} answered {response.status} {body!r}")
    return f"{url} OK"


CHECKS = {"worker": check_worker, "beat": check_beat, "flower": check_flower}


def main(argv: list[str]) -> int:
    """Run the check named by ``argv[0]`` (with its optional argument)."""
    if not argv or argv[0] not in CHECKS or len(argv) > 2:
        print(f"usage: python -m example_project.shop.health {{{'|'.join(CHECKS)}}} [ARG]",
              file=sys.stderr)
        return 2
    try:
        print(CHECKS[argv[0]](*argv[1:]))
    except Exception as exc:  # any failure is "unhealthy", said in one line
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
