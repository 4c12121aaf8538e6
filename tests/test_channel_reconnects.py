"""A lock channel reconnects as often as it must, on a real redis-server.

Each thread's lock channel makes its connection from the client's pool settings,
outside the pool: an outage in which every attempt reconnects (a run waiting for
its lock Redis tries again every back-off) must never leave the process unable to
reach Redis once it answers again.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from .support import RedisServer
from .support.locking import take_lock


def test_a_process_reaches_redis_again_after_more_failed_connects_than_max_connections(
    make_redis: Callable[..., RedisServer],
) -> None:
    """Six attempts during an outage, with ``max_connections=5``: the seventh, once the
    server is back, takes its lock (it did not: "Too many connections" for good)."""
    server = make_redis()
    client = redis.Redis.from_url(server.url(), socket_timeout=1, socket_connect_timeout=1, max_connections=5)

    def take(task_id: str) -> object:
        return take_lock(client, f"t:{{demo.task:{task_id}}}", 30, task="demo.task", task_id=task_id,
                         node="w1@host", boot="b1")

    assert take("before").acquired  # type: ignore[attr-defined]
    server.stop()
    for attempt in range(6):
        with pytest.raises(redis.ConnectionError, match=r"Connection refused|connecting"):
            take(f"during-{attempt}")
    server.start()
    assert take("after").acquired  # type: ignore[attr-defined]
    client.close()
