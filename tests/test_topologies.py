"""Deployment topologies: TLS, ACL users, Redis Cluster, Sentinel (with failover).

Every topology runs on loopback, started by these tests (see ``support.topologies``).
On each, the lease (acquire / renew / release), an eager ``SingletonTask`` run,
beat slot claims through ``SingletonSchedulerMixin``, a real prefork worker and
fork safety are checked. The Sentinel failover tests *measure* duplicates and
misses and print them (``-s`` shows them). Both assert that nothing fails and
that locks and beats work again after the failover; a ``SENTINEL FAILOVER``
(the replica has caught up before it is promoted) also asserts what the README
states: no duplicate task run or beat slot, and 3 of 3 leases kept.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import ImproperlyConfigured
from redis.cluster import RedisCluster

from celery_singleton_beat import LockUnavailable, SingletonTask
from celery_singleton_beat.config import clear_settings_cache, get_settings, validate_settings
from celery_singleton_beat.connection.client import (
    ReplicasNotAcknowledged,
    acl_rules,
    call_acknowledged,
    group_by_node,
    mget_any,
    primary_clients,
    redis_from_url,
    scan_all,
)
from celery_singleton_beat.connection.url import CLUSTER, SENTINEL, STANDALONE, parse_redis_url, sanitize_redis_url
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.behalf import read_holder, release_value
from celery_singleton_beat.recovery.lock_redis import get_redis, reset_clients
from celery_singleton_beat.recovery.window import mark_in_use

from .support import CeleryProcess, Owner, RedisServer, owning, start_worker, wait_for
from .support.beat import ManualClock, RecordingScheduler, beat_app, run_ticks, sent_slots
from .support.failover_load import FailoverLoad
from .support.locking import renew, take_lock
from .support.slots import UTC, duplicates_and_misses
from .support.tasks import settled
from .support.topologies import (
    MASTER_NAME,
    Topology,
    set_acl_user,
    start_acl,
    start_cluster,
    start_sentinels,
    start_tls,
    wait_for_new_primary,
)

APP = "tests.apps.tasks_app"
START = datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=UTC)


# ===================================================================== URL forms and settings


@pytest.mark.parametrize(
    ("url", "topology", "nodes", "connection"),
    [
        ("redis://:pw@h:6380/2", STANDALONE, (), {"host": "h", "port": 6380, "db": 2, "password": "pw"}),
        ("rediss://app:pw@h/0?ssl_cert_reqs=CERT_REQUIRED&ssl_ca_certs=/ca.pem", STANDALONE, (),
         {"username": "app", "ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem"}),
        ("unix://:pw@/run/redis.sock?db=3", STANDALONE, (), {"path": "/run/redis.sock", "db": 3}),
        ("sentinel://:pw@s1:26379/1?master_name=main;sentinel://s2;sentinel://s3:26380", SENTINEL,
         (("s1", 26379), ("s2", 26379), ("s3", 26380)), {"password": "pw", "db": 1}),
        ("redis+cluster://app:pw@n1:7000,n2:7001,[::1]:7002", CLUSTER,
         (("n1", 7000), ("n2", 7001), ("::1", 7002)), {"username": "app", "password": "pw"}),
        ("rediss+cluster://n1:7000?ssl_ca_certs=/ca.pem", CLUSTER, (("n1", 7000),),
         {"ssl": True, "ssl_ca_certs": "/ca.pem"}),
    ],
)
def test_url_forms_name_their_topology(url: str, topology: str, nodes: tuple, connection: dict) -> None:
    target = parse_redis_url(url)
    assert target.topology == topology and target.nodes == nodes
    assert connection.items() <= target.connection.items()
    if topology == SENTINEL:
        assert target.master_name == "main"


def _app(**conf: Any) -> Celery:
    app = Celery("cfg", broker=conf.pop("broker", "memory://"), backend=conf.pop("backend", None),
                 set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"singleton_redis_url": "redis+cluster://n1:7000/1"}, "only database 0"),
        ({"singleton_redis_url": "redis+cluster://n1:7000", "singleton_stats": True},
         "singleton_stats must be False with Redis Cluster"),
        ({"singleton_redis_url": "sentinel://s1:26379"}, "needs the primary's name"),
        ({"singleton_redis_url": "redis://h", "singleton_redis_options": {"master_name": "m"}},
         r"\['master_name'\] are for sentinel:// URLs only"),
        ({"singleton_redis_url": "sentinel://s1?master_name=m",
          "singleton_redis_options": {"sentinel_kwargs": "pw"}}, "sentinel_kwargs'\\] must be a dict"),
        ({"singleton_redis_url": "redis://h", "singleton_wait_replicas": -1}, "wait_replicas must be an int"),
        ({"singleton_redis_url": "redis://h", "singleton_wait_replicas": True}, "wait_replicas must be an int"),
        ({"singleton_redis_url": "redis://h", "singleton_wait_replicas": 1, "singleton_wait_timeout": 5},
         "must be below the socket timeout"),
        ({"singleton_redis_url": "redis://h/0?socket_timeout=0.5", "singleton_wait_replicas": 1},
         "must be below the socket timeout"),
        ({"broker": "redis://h/0", "broker_transport_options": {"global_keyprefix": "{t}"}},
         "global_keyprefix .* must not contain braces"),
        ({"singleton_redis_url": "mongodb://h"}, "must be a Redis URL"),
    ],
)
def test_bad_topology_settings_are_named(conf: dict, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):
        validate_settings(_app(**conf))


def test_settings_reused_from_the_broker_and_the_result_backend() -> None:
    """Without singleton_redis_url: the broker's (backend's) Redis, with what Celery knows of it."""
    sentinel = _app(broker="sentinel://s1:26379;sentinel://s2:26379", backend="rpc://",
                    broker_transport_options={"master_name": "main", "global_keyprefix": "tenant-a:",
                                              "sentinel_kwargs": {"password": "spw"}})
    settings = get_settings(sentinel)
    assert settings.redis_url == "sentinel://s1:26379;sentinel://s2:26379"
    assert settings.topology == SENTINEL and settings.stats
    assert settings.redis_options == {"master_name": "main", "sentinel_kwargs": {"password": "spw"}}
    assert settings.key_prefix == "tenant-a:singleton", "kombu's global_keyprefix, as kombu puts it"

    tls = _app(broker="rediss://h:6380/0?ssl_cert_reqs=CERT_REQUIRED", backend="rpc://",
               broker_use_ssl={"ssl_ca_certs": "/ca.pem"},
               singleton_redis_options={"socket_timeout": 2.0}, singleton_key_prefix="locks")
    settings = get_settings(tls)
    assert settings.redis_options == {"socket_timeout": 2.0, "ssl_ca_certs": "/ca.pem"}
    assert settings.key_prefix == "locks"

    backend = _app(broker="redis://h/0", backend="redis://h/1",
                   result_backend_transport_options={"global_keyprefix": "tenant-b"})
    assert get_settings(backend).key_prefix == "tenant-b_singleton", "Celery's rule for result keys"

    explicit = _app(broker="redis://h/0", broker_transport_options={"global_keyprefix": "x:"},
                    singleton_redis_url="redis://other/0")
    assert get_settings(explicit).key_prefix == "singleton", "only the broker's own Redis is prefixed"
    named = _app(singleton_redis_url="sentinel://s1:26379", broker="memory://",
                 broker_transport_options={"master_name": "from-broker"})
    assert get_settings(named).redis_options["master_name"] == "from-broker"


def test_key_prefixes_keep_apps_on_one_redis_apart(redis_db: redis.Redis, redis_server: RedisServer) -> None:
    """Two apps with their own singleton_key_prefix never see each other's locks; a
    third that reuses the broker's Redis writes under kombu's global_keyprefix."""
    apps = [
        _app(singleton_redis_url=redis_server.url(2), singleton_key_prefix="app-a"),
        _app(singleton_redis_url=redis_server.url(2), singleton_key_prefix="app-b"),
        _app(broker=redis_server.url(2), backend="rpc://",
             broker_transport_options={"global_keyprefix": "tenant:"}),
    ]
    # A Redis in use for the three prefixes (see support.servers): a prefix without its
    # record opens a recovery window (~5 s) at its first acquire, long enough on a loaded
    # machine for app-a's 5 s lock to expire before the test takes it again.
    with redis_server.client(2) as locks:
        for prefix in ("app-a", "app-b", "tenant:singleton"):
            mark_in_use(locks, prefix)
    keys = []
    for app in apps:
        @app.task(base=SingletonTask, shared=False, name="proj.sync")
        def sync(customer: int) -> None: ...

        key = app.tasks["proj.sync"].singleton_key((7,), {})
        keys.append(key)
        assert take_lock(get_redis(app), key, 5, task="proj.sync", task_id=f"{app.main}-1").acquired
    assert [k.split(":{")[0] for k in keys] == ["app-a", "app-b", "tenant:singleton"]
    assert not take_lock(get_redis(apps[0]), keys[0], 5, task="proj.sync", task_id="again").acquired
    locks = redis_server.client(2)
    assert sorted(k.decode() for k in locks.scan_iter(match="*{proj.sync:*") if b":fence" not in k) == sorted(keys)


# ===================================================================== the topologies


def _module_topology(start: Callable[[], Topology]) -> Any:
    """A module-scoped fixture running the topology ``start`` makes."""
    @pytest.fixture(scope="module")
    def fixture() -> Iterator[Topology]:
        with owning(Owner("module topology")) as owner:  # not the test that asked first
            topology = start()
        yield topology
        topology.stop()
        owner.close()

    return fixture


tls_topology = _module_topology(start_tls)
acl_topology = _module_topology(lambda: start_acl(acl_rules(wait=True)))  # WAIT is tested on it too
cluster_topology = _module_topology(start_cluster)
sentinel_topology = _module_topology(lambda: start_sentinels(down_after_ms=5000))


@pytest.fixture(scope="module", params=["tls", "acl", "cluster", "sentinel"])
def running(request: pytest.FixtureRequest) -> Topology:
    """Each topology in turn (started once per module)."""
    return request.getfixturevalue(f"{request.param}_topology")


@pytest.fixture
def topology(running: Topology) -> Iterator[Topology]:
    """A topology with no keys and no loaded scripts; clients and settings built afresh."""
    running.flush()
    clear_settings_cache()
    reset_clients()
    yield running
    reset_clients()


def lock_app(topology: Topology, **conf: Any) -> Celery:
    """An app whose locks live in ``topology``, with one singleton task ``topo.sync``."""
    app = Celery(f"topo-{topology.name}", broker="memory://", set_as_current=False)
    app.conf.update(singleton_redis_url=topology.url, task_always_eager=True, **conf)
    admin = topology.admin

    @app.task(base=SingletonTask, bind=True, shared=False, name="topo.sync", lock_ttl=1.0)
    def sync(self: SingletonTask, customer: int) -> dict[str, Any]:
        holder = read_holder(admin, self.singleton.key)
        return {"held": self.singleton.held, "fence": self.singleton.fence,
                "holder": holder.task_id if holder else None, "me": self.request.id}

    return app


def test_the_lease_works(topology: Topology) -> None:
    """Acquire, conflict, renew, release and fencing, and an eager SingletonTask run."""
    app = lock_app(topology)
    client = get_redis(app)
    assert isinstance(client, RedisCluster) == (topology.name == "cluster")
    assert get_settings(app).stats == (topology.name != "cluster")
    key = app.tasks["topo.sync"].singleton_key((1,), {})

    first = take_lock(client, key, 2.0, task="topo.sync", task_id="a", node="n1")
    second = take_lock(client, key, 2.0, task="topo.sync", task_id="b", node="n2")
    assert first.lease is not None and not second.acquired
    assert second.holder is not None and second.holder.task_id == "a"
    assert renew(first.lease) and topology.admin.pttl(key) > 0
    assert first.lease.release() and not topology.admin.exists(key)
    again = take_lock(client, key, 2.0, task="topo.sync", task_id="c")
    assert again.lease is not None and again.lease.fence > first.lease.fence
    assert again.lease.release()

    seen = app.tasks["topo.sync"].delay(2).get()
    assert seen["held"] and seen["holder"] == seen["me"] and seen["fence"]
    assert not topology.admin.exists(app.tasks["topo.sync"].singleton_key((2,), {}))


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
def test_beat_starts_with_every_url_form(kind: str, request: pytest.FixtureRequest) -> None:
    """Beat starts and shows where its claims go (passwords masked), whatever the URL form.

    The user exists (a beat refuses wrong credentials at start: tests/test_startup.py)."""
    topology: Topology = request.getfixturevalue(f"{kind}_topology")
    clear_settings_cache()
    reset_clients()
    for server in topology.servers:  # data servers and sentinels alike
        with contextlib.suppress(redis.ResponseError), server.client() as node:
            node.execute_command("ACL", "SETUSER", "user", "on", ">secret", "~*", "&*", "+@all")
    url = topology.url.replace("://", "://user:secret@", 1)
    app = beat_app(ManualClock(START), {"e": {"task": "t.e", "schedule": 1.0}}, url)
    beat = RecordingScheduler(app=app)
    try:
        assert "secret" not in beat.info and sanitize_redis_url(url) in beat.info
    finally:
        beat.close()
        reset_clients()


def test_beat_sends_each_slot_once(topology: Topology) -> None:
    """Two schedulers claim three entries' slots (several hash slots on Cluster)."""
    clock = ManualClock(START)
    schedule = {f"entry-{i}": {"task": f"topo.e{i}", "schedule": 1.0} for i in range(3)}
    beats = [RecordingScheduler(app=beat_app(clock, schedule, topology.url))
             for _ in range(2)]
    run_ticks(beats, clock, 4, 0.25)
    for i in range(3):
        counts = sent_slots(*beats, task=f"topo.e{i}")  # a first start: from 12:00:01 on
        assert len(counts) == 4 and set(counts.values()) == {1}, counts
    claims = list(scan_all(topology.admin, "singleton:{beat:entry-*}:[0-9]*"))
    assert len(claims) == 12, "every claim is in the topology"
    records = list(scan_all(topology.admin, "singleton:{beat:entry-*}:scheduled"))
    assert len(records) == 3, "since when each entry is scheduled, in the topology too"
    for beat in beats:
        beat.close()  # marks what is left
    states = {json.loads(topology.admin.get(key))["state"] for key in claims}
    assert states == {"sent"}, "the sent marks reach every topology (one hash slot per call on Cluster)"


def _socket_port(client: Any, key: str) -> int:
    """Local port of the pooled connection that serves ``key`` (pools are LIFO: the one just used)."""
    server = client.get_redis_connection(client.get_node_from_key(key)) \
        if isinstance(client, RedisCluster) else client
    server.exists(key)
    connection = server.connection_pool.get_connection()
    try:
        return connection._sock.getsockname()[1]
    finally:
        server.connection_pool.release(connection)


def test_forked_children_never_share_a_connection(topology: Topology) -> None:
    """A child (as a prefork pool process) builds its own client; the parent's socket survives."""
    app = lock_app(topology)
    client = get_redis(app)
    key = "singleton:{fork}"
    client.set(key, "parent")
    parent_port = _socket_port(client, key)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report and leave without running any test machinery
        try:
            child = get_redis(app)
            child.set(key, "child")
            report = {"same_client": child is client, "port": _socket_port(child, key)}
        except BaseException as exc:
            report = {"error": repr(exc)}
        os.write(writer, json.dumps(report).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        report = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert "error" not in report, report
    assert not report["same_client"] and report["port"] != parent_port
    assert client.get(key) == b"child"
    assert _socket_port(client, key) == parent_port, "the parent's connection was left alone"


def test_wait_replicas(topology: Topology) -> None:
    """WAIT on the connection that took the lock: acknowledged where a replica exists,
    else the lock is given back and ReplicasNotAcknowledged (a RedisError) raised."""
    app = lock_app(topology, singleton_wait_replicas=1, singleton_wait_timeout=0.3)
    settings = get_settings(app)
    client = get_redis(app)
    key = app.tasks["topo.sync"].singleton_key((3,), {})

    def take(conn: redis.Redis) -> Any:
        return take_lock(conn, key, 5.0, task="topo.sync", task_id="w")

    def give_back(conn: redis.Redis, result: Any) -> None:
        if result.lease is not None:
            release_value(conn, key, result.lease.value)

    call = lambda: call_acknowledged(client, key, take, replicas=settings.wait_replicas,  # noqa: E731
                                     timeout=settings.wait_timeout, undo=give_back)
    if topology.replicas:
        assert call().acquired and topology.admin.exists(key)
    else:
        with pytest.raises(ReplicasNotAcknowledged) as info:
            call()
        assert isinstance(info.value, redis.RedisError) and info.value.acknowledged == 0
        assert not topology.admin.exists(key), "an unacknowledged lock is given back"


def test_tasks_and_beats_honour_wait_replicas(topology: Topology) -> None:
    """singleton_wait_replicas=1 through the library's own paths: where a replica
    exists, tasks run and slots are sent; where none does, nothing runs or is sent
    (fail closed) and no lock or claim is left behind."""
    topology.flush()
    app = lock_app(topology, singleton_wait_replicas=1, singleton_wait_timeout=0.2,
                   task_eager_propagates=True)
    task = app.tasks["topo.sync"]
    clock = ManualClock(START)
    beat = RecordingScheduler(app=beat_app(clock, {"w": {"task": "topo.w", "schedule": 1.0}}, topology.url,
                                           singleton_wait_replicas=1, singleton_wait_timeout=0.2))
    try:
        if topology.replicas:
            assert task.delay(4).get()["held"]
            run_ticks([beat], clock, 2, 0.5)
            assert sent_slots(beat, task="topo.w"), "acknowledged claims are sent"
        else:
            with pytest.raises(LockUnavailable, match="replica"):
                task.delay(4)
            run_ticks([beat], clock, 2, 0.5)
            assert not sent_slots(beat, task="topo.w"), "unacknowledged slots are not sent"
            assert not list(scan_all(topology.admin, "singleton:{beat:w}:[0-9]*")), "claims were given back"
        assert not topology.admin.exists(task.singleton_key((4,), {}))
    finally:
        beat.close()


@pytest.mark.slow
def test_a_prefork_worker_runs_singleton_tasks(topology: Topology, tasks: ModuleType,
                                               redis_server: RedisServer, records: redis.Redis,
                                               processes: list[CeleryProcess]) -> None:
    """A real worker (prefork, 2 processes) with its locks in the topology: a 2.5 s run
    renews its 1 s lease, a duplicate is skipped, the lock is released at the end."""
    processes.append(start_worker(redis_server, APP, f"w-{topology.name}", concurrency=2,
                                  env={"CSB_LOCK_REDIS": topology.url}))
    first = tasks.long_run.delay("topo", 2.5)
    wait_for(lambda: records.get("fence:topo"), message="the first run started")
    key = tasks.long_run.singleton_key(("topo", 2.5), {})
    holder = read_holder(topology.admin, key)
    assert holder is not None and holder.task_id == first.id
    assert (holder.node or "").startswith(f"w-{topology.name}@"), "the lock lives in the topology"
    second = tasks.long_run.delay("topo", 2.5)
    wait_for(lambda: second.state == "REVOKED", timeout=30, message="the duplicate skipped (REVOKED)")
    assert first.get(timeout=60) == {"lost": False}
    wait_for(lambda: not topology.admin.exists(key), timeout=10, message="the lock released")


# ===================================================================== per-topology specifics


def _commands_used(server: redis.Redis) -> set[str]:
    stats = server.info("commandstats")
    return {name.removeprefix("cmdstat_").lower() for name, value in stats.items()
            if int(value.get("calls", 0)) > 0}


def test_acl_user_needs_exactly_the_documented_commands() -> None:
    """Under acl_rules(wait=True) every path runs, and every granted command is used.

    Locks (with NOSCRIPT reload and counters), take-over of a dead worker's lock, beat
    claims and WAIT run as the ACL user; Redis's own per-command statistics then
    list what was called, scripts' inner commands included.
    """
    topology = start_acl(acl_rules(wait=True))
    try:
        clear_settings_cache()
        reset_clients()
        admin = topology.admin
        admin.config_resetstat()

        app = lock_app(topology, singleton_wait_replicas=1, singleton_wait_timeout=0.05)
        client = get_redis(app)
        key = app.tasks["topo.sync"].singleton_key((1,), {})
        lease = take_lock(client, key, 5, task="topo.sync", task_id="t1", node="n@h", boot="old").lease
        assert lease is not None and renew(lease)
        assert not take_lock(client, key, 5, task="topo.sync", task_id="t2").acquired
        assert lease.release()
        take_lock(client, key, 5, task="topo.sync", task_id="t3", node="n@h", boot="old", live=True,
                  liveness_ttl=0.3)  # renewed every 0.1 s by a keeper that is gone
        wait_for(lambda: admin.pttl(key) < 4700, timeout=10, message="the dead holder's renewals overdue")
        assert take_lock(client, key, 5, task="topo.sync", task_id="t4", boot="new",
                         liveness_prefix="singleton").taken_over is not None
        with pytest.raises(ReplicasNotAcknowledged):
            call_acknowledged(client, key, lambda conn: conn.set(key, "x", nx=True, px=1000),
                              replicas=1, timeout=0.05, undo=lambda conn, _: conn.delete(key))

        clock = ManualClock(START)
        schedule = {"e": {"task": "t.e", "schedule": 1.0}}
        beats = [RecordingScheduler(app=beat_app(clock, schedule, topology.url)) for _ in range(2)]
        run_ticks(beats, clock, 2, 0.5)
        assert sent_slots(*beats) and set(sent_slots(*beats).values()) == {1}
        counters.flush()  # the counts of this process, written in one batch

        # AUTH (or HELLO) opens every connection and is always allowed; the rest is the admin's.
        used = _commands_used(admin) - {"auth", "hello", "config|resetstat", "acl|setuser", "flushall", "script|flush"}
        granted = {rule[1:] for rule in acl_rules(wait=True) if rule.startswith("+")}
        assert used == granted, f"used but not granted: {used - granted}; granted but unused: {granted - used}"
        assert admin.acl_log() == [], "no command was refused"
    finally:
        reset_clients()
        topology.stop()


def test_acl_user_on_cluster(cluster_topology: Topology) -> None:
    """acl_rules(cluster=True): slot discovery and the lease with a limited user on every node."""
    cluster_topology.flush()
    for node in cluster_topology.primaries():
        set_acl_user(node, acl_rules(cluster=True))
    url = cluster_topology.url.replace("://", "://singleton-app:s3cret-app@")
    client = redis_from_url(url)
    try:
        key = "singleton:{topo.sync:acl}"
        lease = take_lock(client, key, 5, task="topo.sync", task_id="a").lease
        assert lease is not None and renew(lease) and lease.release()
    finally:
        client.close()


def test_cluster_helpers_reach_every_primary(cluster_topology: Topology) -> None:
    """Locks spread over the primaries; scan_all, mget_any and group_by_node see them all."""
    cluster_topology.flush()
    client = redis_from_url(cluster_topology.url)
    try:
        keys = [f"singleton:{{topo.sync:{i}}}" for i in range(30)]
        for key in keys:
            assert take_lock(client, key, 30, task="topo.sync", task_id=key).acquired
        per_node = [sum(1 for _ in node.scan_iter(match="singleton:{*")) for node in primary_clients(client)]
        assert len(per_node) == 3 and all(per_node), f"locks and fences on every primary: {per_node}"
        found = sorted(k.decode() for k in scan_all(client, "singleton:{*") if not k.endswith(b":fence"))
        assert found == sorted(keys)
        values = mget_any(client, keys)
        assert [json.loads(v)["task_id"] for v in values] == keys
        groups = group_by_node(client, keys)
        assert len(groups) == 3 and sorted(i for g in groups for i in g) == list(range(30))
    finally:
        client.close()


def test_dead_workers_locks_are_taken_over_on_cluster(cluster_topology: Topology) -> None:
    """The liveness key lives in another slot than the locks: the check still works on Cluster
    (locks on every node: 12 keys spread over the 3 primaries)."""
    cluster_topology.flush()
    client = redis_from_url(cluster_topology.url)
    task = lock_app(cluster_topology).tasks["topo.sync"]
    keys = [task.singleton_key((i,), {}) for i in range(12)]
    assert len({client.get_node_from_key(key).name for key in keys}) == 3, "every primary holds some"
    try:
        for i, key in enumerate(keys):  # renewed every 0.1 s by a keeper that died with its worker
            take_lock(client, key, 30, task="topo.sync", task_id=str(i), node="w1@h", boot="before", live=True,
                      liveness_ttl=0.3)
        wait_for(lambda: all(client.pttl(key) < 29_700 for key in keys), timeout=10,
                 message="the dead holders' renewals to be overdue")
        taken = [take_lock(client, key, 30, task="topo.sync", task_id=f"n{i}", boot="after",
                           liveness_prefix="singleton") for i, key in enumerate(keys)]
        assert all(t.taken_over is not None and t.taken_over.task_id == str(i) for i, t in enumerate(taken))
    finally:
        client.close()


def test_a_cluster_outage_is_redis_unavailable() -> None:
    """With every node down, tasks, leases and beats see a RedisError (ClusterUnavailable)
    and follow fail closed, instead of crashing on redis-py's RedisClusterException."""
    topology = start_cluster()
    try:
        clear_settings_cache()
        reset_clients()
        app = lock_app(topology, task_eager_propagates=True)
        lease = take_lock(get_redis(app), "singleton:{topo.sync:x}", 30, task="topo.sync", task_id="a").lease
        assert lease is not None
        beat = RecordingScheduler(app=beat_app(ManualClock(START), {"e": {"task": "t.e", "schedule": 1.0}},
                                               topology.url))
        for server in topology.servers:
            server.kill()
        with pytest.raises(redis.ConnectionError):  # ClusterUnavailable from the client, or the node's own
            renew(lease)
        with pytest.raises(LockUnavailable):
            app.tasks["topo.sync"].delay(1)
        beat.tick()
        assert beat.sent == [], "fail closed: a slot that cannot be claimed is not sent"
        beat.close()
    finally:
        reset_clients()
        topology.stop()


def test_sentinel_and_primary_passwords() -> None:
    """The primary's password in the URL, the sentinels' own in sentinel_kwargs."""
    group = start_sentinels(down_after_ms=5000, password="data-pw", sentinel_password="sentinel-pw")
    try:
        assert ":data-pw@" in group.url
        client = redis_from_url(group.url, sentinel_kwargs={"password": "sentinel-pw"})
        lease = take_lock(client, "singleton:{topo.sync:auth}", 5, task="topo.sync", task_id="a").lease
        assert lease is not None and renew(lease) and lease.release()
        client.close()
        refused = redis_from_url(group.url)  # the sentinels refuse a client without their password
        with pytest.raises(redis.RedisError):
            take_lock(refused, "singleton:{topo.sync:auth}", 5, task="topo.sync", task_id="b")
        refused.close()
    finally:
        group.stop()


def test_async_replication_loses_a_lock_and_wait_refuses_it() -> None:
    """The failover window, made deterministic with a hand-made promotion.

    Sentinel promotes the replica, then reconfigures the old primary: a client
    still connected to the old primary in between (or across a partition) writes
    a lock that the new primary never sees. The holder is told at its next renewal;
    with WAIT the write is refused at once (0 replicas acknowledge it).
    """
    group = start_sentinels(sentinels=0)  # no sentinel: the promotion is made by hand
    try:
        primary = redis.Redis(port=group.servers[0].port, socket_timeout=5)
        replica = redis.Redis(port=group.servers[1].port, socket_timeout=5)
        before = take_lock(primary, "singleton:{k:before}", 30, task="k", task_id="before").lease
        assert before is not None and primary.wait(1, 5000) == 1

        replica.replicaof("NO", "ONE")  # promoted; the old primary does not know yet
        lost = take_lock(primary, "singleton:{k:lost}", 30, task="k", task_id="split").lease
        assert lost is not None, "the old primary still takes writes"
        with pytest.raises(ReplicasNotAcknowledged):
            call_acknowledged(primary, "singleton:{k:wait}",
                              lambda conn: take_lock(conn, "singleton:{k:wait}", 30, task="k", task_id="w"),
                              replicas=1, timeout=0.2,
                              undo=lambda conn, r: r.lease and release_value(conn, "singleton:{k:wait}", r.lease.value))
        assert not primary.exists("singleton:{k:wait}")

        primary.replicaof("127.0.0.1", group.servers[1].port)  # demoted: resyncs from the new primary
        wait_for(lambda: primary.info("replication").get("master_link_status") == "up", timeout=30,
                 message="the old primary resynced")
        assert replica.exists("singleton:{k:before}"), "a replicated lock survives the failover"
        rival = take_lock(replica, "singleton:{k:lost}", 30, task="k", task_id="rival").lease
        assert rival is not None, "the unreplicated lock is gone: a second holder gets it"
        lost.client = before.client = replica  # what a Sentinel-managed client does by itself
        assert renew(before) and not renew(lost), "the first holder learns it at its next renewal"
    finally:
        group.stop()


# ===================================================================== Sentinel failover, measured


@pytest.mark.slow
@pytest.mark.timeout(600)  # every wait inside has its own, shorter deadline
@pytest.mark.parametrize("how", ["sentinel-failover", "kill-primary"])
def test_failover_while_tasks_and_beats_run(how: str, tasks: ModuleType, records: redis.Redis,
                                            redis_server: RedisServer,
                                            processes: list[CeleryProcess]) -> None:
    """Tasks (3 long runs with 1 s leases + a stream on 3 hot keys) and two beats (a slot
    every 0.5 s) run while the Sentinel primary fails over; the outcome is measured."""
    group = start_sentinels(down_after_ms=1000)
    load: FailoverLoad | None = None
    try:
        clear_settings_cache()
        reset_clients()
        processes.append(start_worker(redis_server, APP, f"fo-{how}", concurrency=6,
                                      env={"CSB_LOCK_REDIS": group.url, "CSB_BACKOFF_MAX": "1",
                                           "CSB_LOCK_TTL": "3"}))
        load = FailoverLoad(tasks, group.url, seed=7)
        beats, published, beat_errors = load.beats, load.published, load.beat_errors
        long_runs = [tasks.long_run.delay(f"lease{i}", 8.0) for i in range(3)]
        load.start()
        wait_for(lambda: all(records.get(f"fence:lease{i}") for i in range(3)), timeout=60,
                 message="the long runs hold their leases")
        wait_for(lambda: len(sent_slots(*beats)) >= 2, timeout=30, message="beats sending")

        old = group.master_address()
        if how == "sentinel-failover":
            group.sentinel().execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        else:
            group.server_on(old[1]).kill()
        failed_at = datetime.now(UTC)
        failover_seconds = wait_for_new_primary(group, old)
        promoted_at = datetime.now(UTC)

        # Keep going until both kinds of work are seen to succeed on the new primary.
        def task_after_promotion() -> bool:
            return any(json.loads(r)["start"] > promoted_at.timestamp()
                       for k in ("hot0", "hot1", "hot2") for r in records.lrange(f"runs:{k}", 0, -1))

        wait_for(task_after_promotion, timeout=60, message="a task run on the new primary")
        wait_for(lambda: any(s > promoted_at.strftime("%Y-%m-%dT%H:%M:%S") for s in sent_slots(*beats)),
                 timeout=60, message="a slot sent after the promotion")
        load.finish()
        everything = published + long_runs
        wait_for(lambda: settled(everything), timeout=120, message="every task settled")

        states = Counter(r.state for r in everything)
        outcome = {
            "how": how,
            "failover_seconds": round(failover_seconds, 2),
            "tasks": {"published": len(everything), **states,
                      "duplicates (overlapping runs of one key)": sum(
                          int(records.get(f"overlap:{k}") or 0) for k in ("hot0", "hot1", "hot2")),
                      "lock unavailable -> retried": processes[-1].output().count("Redis unavailable for")},
            "leases held across the failover (1 s TTL)": {
                "kept": sum(1 for r in long_runs if r.result == {"lost": False}),
                "reported lost (LockLost)": sum(1 for r in long_runs if r.result == {"lost": True})},
            "beat (slot every 0.5 s)": {**duplicates_and_misses(sent_slots(*beats).elements(),
                                                                timedelta(seconds=0.5)),
                                        "failed_at": failed_at.isoformat(), "errors": beat_errors},
        }
        print(f"\nFAILOVER OUTCOME {json.dumps(outcome, indent=2)}")
        assert states["FAILURE"] == 0, f"no task fails (fail closed retries): {outcome}"
        assert not beat_errors
        if how == "sentinel-failover":
            # What README and docs/deployment.md state for SENTINEL FAILOVER (the old primary
            # hands over only once the replica has caught up): 0 duplicates, 3 of 3 leases kept.
            tasks_outcome = outcome["tasks"]
            assert tasks_outcome["duplicates (overlapping runs of one key)"] == 0, outcome
            assert outcome["leases held across the failover (1 s TTL)"]["kept"] == 3, outcome
            assert outcome["beat (slot every 0.5 s)"]["duplicates"] == 0, outcome
    finally:
        if load is not None:
            load.close()
        reset_clients()
        group.stop()
        # AsyncResults unsubscribe when collected: do it while the result backend is up.
        load = None
        published = long_runs = everything = []
        gc.collect()
