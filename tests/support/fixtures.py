"""The fixtures of the test suite (``tests/conftest.py`` registers them).

Each name means one thing everywhere:

``redis_server`` (session)
    The session's own redis-server (:class:`.servers.RedisServer`).
``redis_db``
    That server emptied for this test: FLUSHALL, only after checking on the same
    connection that the server on the port is ours; settings cache and clients
    reset. A client of database 0.
``processes``
    The processes and servers this test started (they register themselves):
    all stopped when the test ends, whatever happened. ``processes.append(p)``
    still works (an item is kept once).
``rabbitmq_server`` (session, lazy)
    A RabbitMQ node (:class:`.servers.RabbitMQServer`), started by the first
    test that asks for it (so the others never pay its boot); a skip where
    ``rabbitmq-server`` is not installed (a failure in CI).
``rabbitmq``
    That node's broker URL, the default ``celery`` queue deleted first.
``make_redis``
    ``make_redis(*redis_args, start=True)``: another redis-server for this test
    (to stop, restart or misconfigure), closed when the test ends.
``tasks`` / ``ops``
    ``tests.apps.tasks_app`` / ``tests.apps.ops_app`` on a clean session server
    (they need ``redis_db``).
``broker`` / ``backend`` / ``locks`` / ``records``
    Clients of databases 0 / 1 / 2 / 3 of the session server.
``client_apps``
    A list to put the Celery apps a test publishes with: closed when the test ends.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import kombu
import pytest
import redis

from celery_singleton_beat.config import clear_settings_cache
from celery_singleton_beat.lease import counters
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .owners import EVERYTHING, Owner, owning, register
from .paths import set_scratch_dir
from .servers import BACKEND_DB, BROKER_DB, LOCK_DB, RECORD_DB, RabbitMQServer, RedisServer, flushdb, server_busy
from .tasks import load_ops_app, load_tasks_app
from .topologies import ACL_PASSWORD, ACL_USER, Topology, set_acl_user, start_cluster
from .waiting import wait_for

__all__ = [
    "OWNER_KEY", "backend", "broker", "cluster", "cluster_client", "delivery_env", "harness_session", "locks",
    "make_redis", "names", "ops", "processes", "rabbitmq", "rabbitmq_server", "records", "redis_db", "redis_server",
    "tasks", "test_owner",
]

#: Where a test item keeps its owner (for the failure report in conftest.py).
OWNER_KEY = pytest.StashKey[Owner]()


@pytest.fixture(scope="session", autouse=True)
def harness_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Logs and server directories go to the session's temporary directory; at the end
    of the session whatever is still running is stopped."""
    set_scratch_dir(tmp_path_factory.mktemp("harness", numbered=False))
    yield
    gc.collect()  # AsyncResults unsubscribe when collected: while the result backend still runs
    EVERYTHING.close()


@pytest.fixture(autouse=True)
def test_owner(request: pytest.FixtureRequest) -> Iterator[Owner]:
    """Owner of what this test starts (see :mod:`.owners`); closed after the test."""
    owner = Owner(request.node.nodeid)
    request.node.stash[OWNER_KEY] = owner
    with owning(owner):
        yield owner
    owner.close()


@pytest.fixture
def processes(test_owner: Owner) -> Owner:
    """The processes and servers this test started; all stopped when it ends."""
    return test_owner


@pytest.fixture(scope="session")
def redis_server(harness_session: None) -> Iterator[RedisServer]:
    """One real redis-server for the whole session, on a loopback port checked to be ours."""
    with owning(Owner("session redis-server")) as owner:
        server = RedisServer(name="session-redis").start()
        # Its records written from the start, as a Redis in use: a test that reaches the
        # locks' database before any flush (without ``redis_db``) must not open a recovery
        # window that later tests of the same process would find open.
        server.flushall()
    yield server
    gc.collect()  # AsyncResults unsubscribe when collected: while the result backend still runs
    owner.close()


@pytest.fixture(scope="session")
def rabbitmq_server(harness_session: None) -> Iterator[RabbitMQServer]:
    """One RabbitMQ node for the session, started when a test first needs it."""
    with owning(Owner("session rabbitmq-server")) as owner:
        server = RabbitMQServer(name="session-rabbitmq").start()
    yield server
    owner.close()


@pytest.fixture
def rabbitmq(rabbitmq_server: RabbitMQServer) -> str:
    """The session node's broker URL; Celery's default queue is deleted first, so no
    message of an earlier test is delivered (workers declare it again)."""
    with kombu.Connection(rabbitmq_server.url, connect_timeout=10) as connection:
        connection.default_channel.queue_delete("celery")
    return rabbitmq_server.url


@pytest.fixture
def redis_db(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """The session's redis-server, every database flushed (only if it is ours), as a client of db 0."""
    # Counts an earlier test made in this process are written in batches, up to a second
    # later: written now, before the flush, they cannot land in this test's database.
    counters.flush()
    redis_server.flushall()
    clear_settings_cache()
    reset_clients()
    client = redis_server.client(BROKER_DB)
    yield client
    client.close()
    reset_clients()


@pytest.fixture
def make_redis() -> Callable[..., RedisServer]:
    """A factory of extra redis-servers for this test: ``make_redis(*args, start=True, **client_options)``
    (``password=`` for a server started with ``--requirepass``). An append-only file is
    written with ``appendfsync always`` unless the test says otherwise."""
    def make(*redis_args: str, start: bool = True, **options: Any) -> RedisServer:
        if "--appendonly" in redis_args and "--appendfsync" not in redis_args:
            # Tests SIGKILL servers and expect every acknowledged write back with the file:
            # with the default everysec, a server may hold a write back while an fsync runs.
            redis_args += ("--appendfsync", "always")
        server = register(RedisServer(*redis_args, name="redis-extra", options=options))  # its directory goes too
        return server.start() if start else server

    return make


@pytest.fixture
def tasks(redis_db: redis.Redis, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.tasks_app`` configured for the session's redis-server (clean)."""
    return load_tasks_app(redis_server)


@pytest.fixture
def ops(redis_db: redis.Redis, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.ops_app`` (CLI and Flower tests) on the session's redis-server (clean)."""
    return load_ops_app(redis_server)


@pytest.fixture
def broker(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis_server.client(BROKER_DB) as client:
        yield client


@pytest.fixture
def backend(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis_server.client(BACKEND_DB) as client:
        yield client


@pytest.fixture
def locks(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis_server.client(LOCK_DB) as client:
        yield client


@pytest.fixture
def records(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis_server.client(RECORD_DB) as client:
        yield client


@pytest.fixture
def client_apps() -> Iterator[list[Any]]:
    """Celery apps the test publishes or reads results with; closed at its end."""
    made: list[Any] = []
    yield made
    for app in made:
        app.close()


@pytest.fixture
def order(redis_db: redis.Redis, redis_server: RedisServer) -> ModuleType:
    """``tests.apps.order_app`` (runs whose end causes more work on the same key) on the
    session's (emptied) redis-server."""
    os.environ["CSB_TEST_REDIS"] = base = f"redis://127.0.0.1:{redis_server.port}"
    from ..apps import order_app

    assert base == order_app.BASE, "order_app was imported for another server"
    return order_app


@pytest.fixture
def busy_script() -> Iterator[Callable[[RedisServer], Callable[[], None]]]:
    """``busy_script(server)`` starts a script that runs until killed; it returns the kill.
    Scripts still running when the test ends are killed then."""
    kills: list[Callable[[], None]] = []

    def start(server: RedisServer) -> Callable[[], None]:
        admin = server.client()
        admin.config_set("lua-time-limit", 10)  # ms before other clients are answered -BUSY
        runner = server.client()
        thread = threading.Thread(target=_run_until_killed, args=(runner,), daemon=True)
        thread.start()

        def kill() -> None:
            # NOTBUSY: killed already; refused: the server was stopped (the script ended with it).
            with contextlib.suppress(redis.ResponseError, redis.ConnectionError):
                admin.script_kill()
            thread.join(10)

        kills.append(kill)
        wait_for(lambda: server_busy(admin), timeout=10, interval=0.01, message="the lock Redis busy with a script")
        return kill

    yield start
    for kill in kills:
        kill()


def _run_until_killed(client: redis.Redis) -> None:
    # "Script killed by user with SCRIPT KILL"; or the server was stopped under it.
    with contextlib.suppress(redis.ResponseError, redis.ConnectionError):
        client.eval("while true do end", 0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Topology]:
    """A 3-primary Redis Cluster for a test module, with the documented ACL user
    (``acl_rules(cluster=True)``) on every node, each marked in use (a new Cluster of the
    tests' own: no recovery window)."""
    with owning(Owner("module cluster")) as owner:
        topology = prepared_cluster()
    yield topology
    topology.stop()
    owner.close()


@pytest.fixture
def cluster_client(cluster: Topology) -> Iterator[Any]:
    """The library's client of :func:`cluster`, as the limited user."""
    from celery_singleton_beat.connection.client import redis_from_url

    clear_settings_cache()
    client = redis_from_url(cluster.url.replace("://", f"://{ACL_USER}:{ACL_PASSWORD}@"))
    yield client
    client.close()


@pytest.fixture
def names(redis_server: RedisServer) -> Iterator[str]:
    """Fresh claims, records and queue for a beat test; yields a unique entry-name prefix."""
    for db in (BROKER_DB, LOCK_DB, RECORD_DB):
        flushdb(redis_server.client(db))
    yield f"k{uuid.uuid4().hex[:6]}-"


@pytest.fixture
def delivery_env(redis_db: redis.Redis) -> Iterator[dict[str, str]]:
    """Environment of ``tests/apps/delivery_app.py``'s workers; the client side reads the
    same (from ``os.environ``), cleared after the test."""
    env: dict[str, str] = {}
    yield env
    for name in ("CSB_VISIBILITY", "CSB_BROKER", "CSB_LOCK_REDIS", "CSB_LIVENESS_TTL", "CSB_BACKEND"):
        os.environ.pop(name, None)


def prepared_cluster() -> Topology:
    """A new 3-primary Redis Cluster with the documented ACL user (``acl_rules(cluster=True)``)
    on every node, each marked in use (a Cluster of the tests' own: no recovery window)."""
    from celery_singleton_beat.connection.client import acl_rules
    from celery_singleton_beat.recovery.window import mark_in_use

    topology = start_cluster()
    for node in topology.primaries():
        set_acl_user(node, acl_rules(cluster=True))
        mark_in_use(node)
    return topology
