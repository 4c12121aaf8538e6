"""What a new connection of the library's clients costs before its first request (real redis-server).

redis-py 7+ builds the client-library details it sends with CLIENT SETINFO for every
connection it makes, reading the installed ``redis`` package's metadata each time
(``redis.utils.get_lib_version``): milliseconds of CPU per connection. A gevent worker
opens its pool's connections (64 by default) as its first runs start, while it takes in
its messages, so that was paid in the start of its first runs (a third of a second of
the worker's CPU in the leases benchmark). The library's clients build those details once.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.utils

from celery_singleton_beat.connection.client import redis_from_url


def test_new_connections_do_not_read_the_package_metadata_each(redis_db: redis.Redis,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(redis, "driver_info"):
        pytest.skip("redis-py before 7 reads its version once, at import")

    looked_up = [0]
    original = redis.utils.get_lib_version

    def counting() -> Any:
        looked_up[0] += 1
        return original()

    monkeypatch.setattr(redis.utils, "get_lib_version", counting)
    kwargs = redis_db.connection_pool.connection_kwargs
    client = redis_from_url(f"redis://{kwargs['host']}:{kwargs['port']}/0")
    pool = client.connection_pool
    try:
        before = looked_up[0]
        connections = [pool.get_connection() for _ in range(8)]  # eight at once: eight new connections
        assert len({id(connection) for connection in connections}) == 8
        for connection in connections:
            assert connection.driver_info is not None and connection.driver_info.lib_version == original()
            pool.release(connection)
        assert looked_up[0] - before == 0, (
            f"the package metadata was read {looked_up[0] - before} times for 8 new connections")
    finally:
        client.close()
