"""What a new connection of the library's clients costs before its first request (real redis-server).

redis-py 7+ builds the client-library details it sends with CLIENT SETINFO for every
connection it makes, reading the installed ``redis`` package's metadata each time
(``redis.utils.get_lib_version``): milliseconds of CPU per connection. A gevent worker
opens its pool's connections (64 by default) as its first runs start, while it takes in
its messages, so that was paid in the start of its first runs (a third of a second of
the worker's CPU in the leases benchmark). The library's clients build those details once.
"""

from __future__ import annotations

from collections.abc import Callable
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


def _lock_client(server: Any) -> Any:
    """The lock client a worker of an app using ``server`` builds (its connections checked)."""
    from celery import Celery

    from celery_singleton_beat.recovery.lock_redis import get_redis

    app = Celery("setup-cost", set_as_current=False)
    app.conf.singleton_redis_url = server.url(0)
    return get_redis(app)


def _calls(client: redis.Redis) -> dict[str, int]:
    return {name[len("cmdstat_"):]: int(stats["calls"]) for name, stats in client.info("commandstats").items()}


def _error_replies(client: redis.Redis) -> int:
    return int(client.info("stats")["total_error_replies"])


def _open(lock_client: Any, count: int) -> None:
    """``count`` new connections of ``lock_client``'s pool, each made and looked at as a lock
    request's is (:func:`~celery_singleton_beat.connection.wire.ensure_checked`), all at once;
    closed afterwards, so that the next call's are new too."""
    from celery_singleton_beat.connection.wire import ensure_checked, looker_of

    pool = lock_client.connection_pool
    # redis-py before 5.3 wants a command name (ignored); 5.3+ deprecates it
    connections = [pool.get_connection() if hasattr(redis, "driver_info") else pool.get_connection("_")
                   for _ in range(count)]
    assert len({id(connection) for connection in connections}) == count
    for connection in connections:
        ensure_checked(connection, looker_of(lock_client))
        pool.release(connection)
    pool.disconnect()


def test_a_new_connection_is_checked_in_four_round_trips(make_redis: Callable[..., Any]) -> None:
    """No health-check PING before the handshake (the handshake's reply confirms the new
    connection), and ``INFO`` asked for the four sections the check reads, not all of it."""
    server = make_redis()
    admin = server.client(0)
    lock_client = _lock_client(server)
    try:
        _open(lock_client, 1)  # the first look at the server
        before, reads_before = _calls(admin), int(admin.info("stats")["total_reads_processed"])
        _open(lock_client, 8)
        after = _calls(admin)
        grew = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
        assert grew.get("ping", 0) == 0, f"new connections were pinged before their handshake: {grew}"
        assert grew.get("info", 0) == 8 * 4 + 2, grew  # four sections each; the two INFOs of this test's reads
        reads = int(admin.info("stats")["total_reads_processed"]) - reads_before
        # per connection: four round trips and the read of its close; this test's two reads
        assert reads <= 8 * 5 + 2, f"{reads} reads for 8 new connections: more than four round trips each"
    finally:
        lock_client.close()
        admin.close()


def test_client_setinfo_is_not_sent_to_a_redis_that_refuses_it(make_redis: Callable[..., Any]) -> None:
    """redis-py sends ``CLIENT SETINFO`` on every new connection and ignores a Redis older than
    7.2 refusing it; once the check knows the server is such a Redis, it is not sent. On a
    server that knows it, every connection still names its library."""
    server = make_redis()
    admin = server.client(0)
    lock_client = _lock_client(server)
    try:
        _open(lock_client, 1)
        info = admin.info("server")
        version = tuple(int(part) for part in str(info["redis_version"]).split(".")[:2])
        pool = lock_client.connection_pool
        options = {name: value for name, value in pool.connection_kwargs.items() if name != "redis_connect_func"}
        errors_before = _error_replies(admin)
        bare = pool.connection_class(**options)  # the same connection, set up by redis-py alone
        bare.connect()
        bare.disconnect()
        refused_by_redis_py = _error_replies(admin) - errors_before
        errors_before = _error_replies(admin)
        _open(lock_client, 8)
        refused = (_error_replies(admin) - errors_before) / 8
        if version < (7, 2) and "valkey_version" not in info:
            assert refused_by_redis_py >= 2  # CLIENT SETINFO lib-name and lib-ver, refused
            assert refused == refused_by_redis_py - 2, "CLIENT SETINFO sent to a Redis that refuses it"
        else:
            assert refused == refused_by_redis_py
            libraries = [entry.get("lib-name") for entry in admin.client_list() if entry.get("name") != "probe"]
            assert libraries.count("redis-py") >= 8, libraries
    finally:
        lock_client.close()
        admin.close()
