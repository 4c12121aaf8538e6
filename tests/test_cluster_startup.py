"""The start-up check (``recovery/startup.py``) on a Redis Cluster whose layout is changing.

A worker and a beat check the lock Redis when they start, and again every second
after an outage until it answers (``StartupCheck``); what cannot be fixed by waiting
(a wrong password, an ACL, a replica named as the lock Redis) stops them with exit
code 78. ``make chaos LOCK=cluster`` found two passing states of a Cluster taken for
such a configuration error, each stopping workers and beats with 78 in the middle of
a failover:

* a failover after the client read the layout: its slot map still names the old
  primary, which answers ``INFO`` as a replica (``Redis 7.0.15 is a slave: locks must
  be written to the primary``);
* the cluster down (``CLUSTERDOWN``, while no node serves some slot: a failed primary
  not yet replaced): redis-py's ``ClusterDownError`` carries the reply without its
  ``CLUSTERDOWN`` word, so it was read as a command the server refuses.

And a run's first use of the lock Redis in a process (a pool child's first run): the
Cluster client is built then, talking to the cluster, outside the run's fail-closed
handling, so a node answering ``-BUSY`` (another client's script) failed the run instead
of making it wait for the lock Redis.

Real Clusters of the tests' own on loopback (3 primaries; with a replica each for the
failover), the check in process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery
from redis.exceptions import RedisClusterException

from celery_singleton_beat import LockUnavailable, SingletonTask
from celery_singleton_beat.config import clear_settings_cache, get_settings
from celery_singleton_beat.connection.client import RedisClient, redis_from_url
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.recovery.startup import LockRedisDown, check_lock_redis
from harness.redis_cluster import cluster_nodes

from .support import wait_for
from .support.breaks import documented_break
from .support.servers import RedisServer
from .support.topologies import Topology, fail_over_shard, start_cluster


@pytest.fixture
def app_of() -> Iterator[dict[str, Celery]]:
    made: dict[str, Celery] = {}
    yield made
    for app in made.values():
        clear_settings_cache(app)


def settings_for(apps: dict[str, Celery], url: str) -> object:
    app = Celery("cluster-startup", set_as_current=False)
    app.conf.update(singleton_redis_url=url)
    apps[url] = app
    return get_settings(app)


def test_a_failover_after_the_client_read_the_layout_is_no_configuration_error(app_of: dict[str, Celery]) -> None:
    """The client's slot map names a primary that a ``CLUSTER FAILOVER`` has since made a
    replica: the check reads the layout again and finds the new primary."""
    cluster = start_cluster(primaries=3, replicas=1)
    client: RedisClient | None = None
    try:
        settings = settings_for(app_of, cluster.url)
        client = redis_from_url(cluster.url)
        check_lock_redis(lambda: client, settings)  # the slot map is read
        fail_over_shard(cluster, 0)
        server = check_lock_redis(lambda: client, settings)
        assert len(server.servers) == 3, server
    finally:
        if client is not None:
            client.close()
        cluster.stop()


def test_a_cluster_that_is_down_is_an_outage(app_of: dict[str, Celery]) -> None:
    """Every node has a slot nobody serves in its own view (``cluster_state:fail``): keys
    are answered ``CLUSTERDOWN``. The check says the lock Redis does not answer yet."""
    cluster: Topology = start_cluster(primaries=3)
    removed: list[tuple[redis.Redis, int]] = []
    try:
        settings = settings_for(app_of, cluster.url)
        for server in cluster.servers:
            with server.client() as node:
                mine = next(line for line in cluster_nodes(node) if line.is_self)
                slot = mine.slots[0][0]
                node.execute_command("CLUSTER", "DELSLOTS", slot)
                removed.append((server, slot))
        wait_for(lambda: all(s.client().cluster("info")["cluster_state"] == "fail" for s in cluster.servers),
                 timeout=30, message="every node down (a slot it does not see served)")
        with pytest.raises(LockRedisDown) as raised:
            check_lock_redis(lambda: redis_from_url(cluster.url), settings)
        assert "ClusterDownError" in str(raised.value), raised.value
    finally:
        for server, slot in removed:
            with server.client() as node:
                node.execute_command("CLUSTER", "ADDSLOTS", slot)
        cluster.stop()


@pytest.mark.xfail(strict=True, raises=(redis.ResponseError, RedisClusterException),
                   reason="the Cluster client is built outside the run's fail-closed handling")
def test_a_runs_first_use_of_a_busy_cluster_waits_for_it(
        busy_script: Callable[[RedisServer], Callable[[], None]]) -> None:
    """Another client's script runs on every primary (``-BUSY``) when a run is the first use
    of the lock Redis in its process. An eager run (``task_eager_propagates``) raises
    ``LockUnavailable`` at once when the lock Redis cannot be asked, as on one server; a
    worker's run retries. It raised what building the client raised: here, every node
    answering ``CLUSTER SLOTS`` with ``-BUSY``, redis-py's ``RedisClusterException`` ("Cluster
    mode is not enabled on this node"); in the chaos run, with one node busy, the
    ``ResponseError`` of its ``-BUSY`` to ``COMMAND``, which failed 5 worker runs."""
    cluster = start_cluster(primaries=3)
    app = Celery("cluster-first-use", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, singleton_redis_url=cluster.url)
    ran: list[int] = []

    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> None:
        ran.append(x)

    try:
        reset_clients()
        kills = [busy_script(server) for server in cluster.servers]  # type: ignore[arg-type]  # a node has .client() too
        try:
            with documented_break(), pytest.raises(LockUnavailable):
                job.delay(1)
        finally:
            for kill in kills:
                kill()
        assert ran == []
    finally:
        reset_clients()
        clear_settings_cache(app)
        cluster.stop()
