"""Redis Cluster growing and shrinking: a slot migrating to a node being added, a node removed.

A real 3-primary Cluster on loopback (``start_cluster``, one per test), then one more
cluster-enabled server met by the cluster (``add_cluster_node``: ``CLUSTER MEET``,
as ``redis-cli --cluster add-node`` does). Such a node serves no slot until the first
slot finished migrating to it, so ``CLUSTER SLOTS`` does not list it and the client's
slot map has no node at that address. The slot of the locks is moved to it by hand
(:class:`.support.resharding.SlotMove`): the source answers ``-ASK <slot> <new node>``
for the keys it no longer has, and the library must follow that address all the same
(with the client's connection settings, each new connection looked at by the library's
connect hook), then ``-MOVED`` to it once the slot is the new node's. The other way
round, a node removed once its slot moved away may still be in a client's slot map:
its refused connection makes the client read the layout again.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import TryAgainError

from celery_singleton_beat.connection.client import ClusterUnavailable, acl_rules, redis_from_url
from celery_singleton_beat.lease.lock import AcquireResult
from celery_singleton_beat.recovery.lock_redis import reset_clients
from celery_singleton_beat.recovery.records import shard_records
from celery_singleton_beat.recovery.server import LockServer
from celery_singleton_beat.recovery.window import mark_in_use

from .support.beat import ManualClock, RecordingScheduler, beat_app, run_ticks, sent_slots
from .support.breaks import documented_break
from .support.fixtures import prepared_cluster
from .support.locking import renew, take_lock
from .support.owners import Owner
from .support.resharding import SlotMove
from .support.topologies import (
    ACL_PASSWORD,
    ACL_USER,
    ServerProcess,
    Topology,
    add_cluster_node,
    set_acl_user,
)

_tags = itertools.count()
#: The beat's clock in the tests that run a scheduler in process.
START = datetime(2024, 5, 1, 12, 0, 0, 300000, tzinfo=timezone.utc)


def tag() -> str:
    """A hash tag no other test uses: its slot is moved by this test only."""
    return f"demo.task:growing-{next(_tags)}"


def take(client: Any, key: str, task_id: str, ttl: float = 30) -> AcquireResult:
    return take_lock(client, key, ttl, task="demo.task", task_id=task_id, node="w1@host", boot="b1")


def task_id_in(raw: bytes | None) -> str | None:
    return None if raw is None else str(json.loads(raw)["task_id"])


class HookedClient:
    """The library's client of the cluster as the limited user, set up as
    :func:`.recovery.lock_redis.get_redis` sets it up (a :class:`LockServer` looks at every
    new connection, through ``redis_connect_func``), with the port of each connection the
    hook ran on."""

    def __init__(self, cluster: Topology) -> None:
        self.server = LockServer("singleton", 3.0)
        self.ports: list[int] = []
        url = cluster.url.replace("://", f"://{ACL_USER}:{ACL_PASSWORD}@")
        self.client: RedisCluster = redis_from_url(url, redis_connect_func=self._on_connect)  # type: ignore[assignment]
        self.client.csb_server = self.server  # type: ignore[attr-defined]

    def _on_connect(self, connection: Any) -> None:
        self.ports.append(int(connection.port))
        self.server.on_connect(connection)


@pytest.fixture
def cluster(test_owner: Owner) -> Iterator[Topology]:
    """A 3-primary Redis Cluster of this test's own (the shared module one is not grown or
    shrunk), with the documented ACL user on every node, each marked in use (as
    :func:`.support.fixtures.cluster`). Stopped with the nodes added to it when the test ends."""
    topology = prepared_cluster()
    yield topology
    topology.stop()


@pytest.fixture
def hooked(cluster: Topology) -> Iterator[HookedClient]:
    made = HookedClient(cluster)
    yield made
    made.client.close()


def new_node(cluster: Topology) -> tuple[ServerProcess, ClusterNode]:
    """A node added to ``cluster``, serving no slot, with the tests' ACL user."""
    server = add_cluster_node(cluster)
    with server.client() as admin:
        set_acl_user(admin, acl_rules(cluster=True))
    assert server.port is not None
    return server, ClusterNode("127.0.0.1", server.port)


def test_a_slot_migrating_to_a_node_being_added_is_followed(cluster: Topology, hooked: HookedClient) -> None:
    """The slot of held locks migrates to a node that serves no slot yet (not in the client's
    slot map): a held lease whose key moved there is renewed there, another is released
    there, a new lock of the slot is taken there; the connect hook looked at the library's
    connections to it. Once the slot is the new node's (the source answers ``-MOVED``), the
    lease still renews there and is released there."""
    client = hooked.client
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    t = tag()
    kept_key, gone_key, fresh_key = (f"singleton:{n}:{{{t}}}" for n in ("kept", "gone", "fresh"))
    kept = take(client, kept_key, "kept").lease
    gone = take(client, gone_key, "gone").lease
    assert kept is not None and gone is not None
    server, node = new_node(cluster)
    assert client.get_node(host=node.host, port=node.port) is None, "the new node is not in the client's slot map"

    move = SlotMove(admin, kept_key, target=node).start()
    move.migrate(kept_key, gone_key)  # the source answers -ASK <slot> <new node> for them now
    assert move.keys_on(move.source) == [] and sorted(move.keys_on(move.target)) == sorted([kept_key, gone_key])

    # (a) The held lease is renewed on the new node (its TTL back at its full 30 s).
    before = move.on_target("PTTL", kept_key)
    assert renew(kept), "the lease whose key migrated to the new node is renewed"
    assert move.on_target("PTTL", kept_key) > before and task_id_in(move.on_target("GET", kept_key)) == "kept"
    assert kept_key not in move.keys_on(move.source)

    # (b) A release frees the key on the new node.
    assert gone.release(), "the lease whose key migrated to the new node is released"
    assert move.on_target("EXISTS", gone_key) == 0 and gone_key not in move.keys_on(move.source)

    # (c) A new lock of the slot, a key the source does not have: created on the new node.
    fresh = take(client, fresh_key, "fresh")
    assert fresh.acquired and task_id_in(move.on_target("GET", fresh_key)) == "fresh"
    assert fresh_key not in move.keys_on(move.source)
    assert server.port in hooked.ports, "the library's connect hook looked at the connections to the new node"

    # (d) The slot is the new node's: the source answers -MOVED to it.
    move.finish()
    with server.client() as on_new:
        before = on_new.pttl(kept_key)
        assert renew(kept), "the lease is renewed on the new node, now the slot's owner"
        assert on_new.pttl(kept_key) > before
        assert client.get_node_from_key(kept_key).name == node.name, "-MOVED: the layout read again"
        assert kept.release() and fresh.lease is not None and fresh.lease.release()
        assert on_new.exists(kept_key, fresh_key) == 0


def test_a_slot_moved_to_a_node_added_since_the_client_read_the_layout(cluster: Topology,
                                                                        hooked: HookedClient) -> None:
    """The slot of held locks moved, all of it, to a node added after the client read the
    layout (not in its node table): the source answers ``-MOVED`` to it, and the lease is
    renewed there, released there, and a new lock of the slot is taken there."""
    client = hooked.client
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    t = tag()
    kept_key, fresh_key = (f"singleton:{n}:{{{t}}}" for n in ("kept", "fresh"))
    kept = take(client, kept_key, "kept").lease
    assert kept is not None
    server, node = new_node(cluster)
    assert client.get_node(host=node.host, port=node.port) is None, "the new node is not in the client's node table"
    move = SlotMove(admin, kept_key, target=node).start()
    move.finish()
    with server.client() as on_new:
        before = on_new.pttl(kept_key)
        assert renew(kept), "the lease is renewed on the node the slot moved to"
        assert on_new.pttl(kept_key) > before and task_id_in(on_new.get(kept_key)) == "kept"
        assert client.get_node_from_key(kept_key).name == node.name, "-MOVED: the layout read again"
        fresh = take(client, fresh_key, "fresh")
        assert fresh.acquired and task_id_in(on_new.get(fresh_key)) == "fresh"
        assert kept.release() and fresh.lease is not None and fresh.lease.release()
        assert on_new.exists(kept_key, fresh_key) == 0
    assert server.port in hooked.ports, "the library's connect hook looked at the connections to the new node"


def test_a_slot_moved_off_a_node_then_removed(cluster: Topology, hooked: HookedClient) -> None:
    """A node added, given the slot of a held lock, then emptied (the slot moved back to an
    original node) and removed as ``redis-cli --cluster del-node`` removes one (``CLUSTER
    FORGET`` on every other node, then shut down), while the client's slot map still names
    it for that slot (no request of the slot in between): its connection refused, the
    layout is read again, and the lease is renewed on the slot's owner, released there,
    and a new lock of the slot is taken there."""
    client = hooked.client
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    t = tag()
    kept_key, fresh_key = (f"singleton:{n}:{{{t}}}" for n in ("kept", "fresh"))
    owner = admin.get_node_from_key(kept_key)
    server, node = new_node(cluster)
    with server.client() as added:  # emptied, it stays a primary (else it turns into a replica of the slot's owner)
        added.config_set("cluster-allow-replica-migration", "no")
    SlotMove(admin, kept_key, target=node).start().finish()
    admin.nodes_manager.initialize()
    kept = take(client, kept_key, "kept").lease  # the client's map: the slot on the new node
    assert kept is not None
    assert client.get_node_from_key(kept_key).name == node.name
    SlotMove(admin, kept_key, target=owner).start().finish()
    admin.nodes_manager.initialize()
    with server.client() as removed:
        removed_id = removed.execute_command("CLUSTER", "MYID").decode()
    for each in admin.get_primaries():
        admin.get_redis_connection(each).execute_command("CLUSTER", "FORGET", removed_id)
    server.stop(timeout=10)
    assert client.get_node_from_key(kept_key).name == node.name, "the client's map still names the removed node"
    on_owner = admin.get_redis_connection(owner)
    before = on_owner.pttl(kept_key)
    assert renew(kept), "the lease is renewed on the slot's owner"
    assert on_owner.pttl(kept_key) > before
    fresh = take(client, fresh_key, "fresh")
    assert fresh.acquired and task_id_in(on_owner.get(fresh_key)) == "fresh"
    assert kept.release() and fresh.lease is not None and fresh.lease.release()
    assert on_owner.exists(kept_key, fresh_key) == 0


# ----------------------------------------------------------------- found by make chaos LOCK=cluster


def test_a_beat_records_its_claims_while_their_history_moves_to_a_node_being_added(cluster: Topology) -> None:
    """The beat's history of won claims (``<prefix>:{beat}:history``, one key of its own
    slot) has migrated to a node being added; the source answers ``-ASK <slot> <new node>``
    for it. A beat that wins a slot appends to it with a redis-py pipeline, which follows an
    ``-ASK`` only to a node of its node table: it found none, and the beat's tick raised
    ``AttributeError: 'NoneType' object has no attribute 'redis_connection'`` (a ``celery
    beat`` exits on it; in the chaos run, a slot then went unsent when the other beat died
    before taking the claim over). The slots must be sent and recorded on the new node.
    (The beat starts at 12:00:00.3 and ticks until 12:00:03: slots 12:00:01 and 12:00:02.)"""
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    history = "singleton:{beat}:history"
    admin.lpush(history, "earlier")
    _, node = new_node(cluster)
    move = SlotMove(admin, history, target=node).start()
    move.migrate(history)  # the source answers -ASK for it now
    clock = ManualClock(START)
    beat = RecordingScheduler(app=beat_app(clock, {"e": {"task": "grow.e", "schedule": 1.0}}, cluster.url))
    try:
        run_ticks([beat], clock, 3, 0.5)
        assert sent_slots(beat, task="grow.e") == {"2024-05-01T12:00:01Z": 1, "2024-05-01T12:00:02Z": 1}, \
            "every slot sent, once"
        assert move.on_target("LLEN", history) == 3, "the claims recorded where the history is"
        assert history not in move.keys_on(move.source)
    finally:
        beat.close()
        reset_clients()


def test_a_beat_claims_slots_while_the_slot_of_its_claims_moves_to_a_node_being_added(cluster: Topology) -> None:
    """The hash slot of an entry's claims (``<prefix>:{beat:<entry>}:<slot>``) migrates to a
    node being added: each new claim is a key the source does not have, so it answers
    ``-ASK <slot> <new node>`` to the claim's ``SET NX`` (and to the script that reads the
    entry's record, ``<prefix>:{beat:<entry>}:scheduled``, also a key it does not have).
    Before, that script ran through the node's own pipeline, which does not follow an
    ``-ASK``: the beat failed closed, and sent no slot until the migration ended (its claims
    went through redis-py's cluster pipeline, the path that crashed in the test above). The
    claims are made on the new node, each slot is sent once, and once the slot is the new
    node's (the source answers ``-MOVED``) the beat goes on claiming there."""
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    claim = "singleton:{beat:e}:2024-05-01T12:00:00Z"  # a key of the claims' slot
    admin.set(claim, "earlier")
    server, node = new_node(cluster)
    move = SlotMove(admin, claim, target=node).start()
    move.migrate(claim)
    clock = ManualClock(START)
    beat = RecordingScheduler(app=beat_app(clock, {"e": {"task": "grow.e", "schedule": 1.0}}, cluster.url))
    try:
        run_ticks([beat], clock, 3, 0.5)
        assert sent_slots(beat, task="grow.e") == {"2024-05-01T12:00:01Z": 1, "2024-05-01T12:00:02Z": 1}, \
            "every slot sent, once"
        on_target = move.keys_on(move.target)
        assert {"singleton:{beat:e}:2024-05-01T12:00:01Z", "singleton:{beat:e}:2024-05-01T12:00:02Z"} <= set(on_target)
        assert move.keys_on(move.source) == [], "no claim made on the source"
        move.finish()
        with server.client() as on_new:
            # Serving a slot now, the new node has a shard's record to find: without one, the
            # beat's next look at it opens a recovery window there (a new Redis: claims of its
            # keys wait ~5 s of real time), as for any new node; this test is about -MOVED.
            mark_in_use(on_new)
        run_ticks([beat], clock, 2, 0.5)  # -MOVED to the new node now
        assert sent_slots(beat, task="grow.e") == {f"2024-05-01T12:00:0{n}Z": 1 for n in (1, 2, 3, 4)}
        with server.client() as on_new:
            assert on_new.exists("singleton:{beat:e}:2024-05-01T12:00:04Z") == 1
    finally:
        beat.close()
        reset_clients()


def test_redis_py_commands_on_a_key_moved_to_a_node_being_added_fail_as_an_outage(cluster: Topology,
                                                                                  hooked: HookedClient) -> None:
    """redis-py's own commands and pipelines (the admin tools', the counters', a worker-run
    beat's start-up look at the history) follow an ``-ASK`` only to a node of the client's
    node table: for a key migrated to a node being added they crashed with
    ``AttributeError: 'NoneType' object has no attribute 'redis_connection'``. They fail as
    the cluster momentarily unavailable now (:class:`ClusterUnavailable`, a
    ``redis.ConnectionError``: callers fail closed and try again), and the client still
    serves the slot's other keys and the other slots."""
    client = hooked.client
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    t = tag()
    moved, stays = (f"singleton:{n}:{{{t}}}" for n in ("moved", "stays"))
    admin.set(moved, "1")
    admin.set(stays, "1")
    _, node = new_node(cluster)
    move = SlotMove(admin, moved, target=node).start()
    move.migrate(moved)
    with pytest.raises(ClusterUnavailable):
        client.get(moved)
    pipe = client.pipeline(transaction=False)
    pipe.get(stays)
    pipe.get(moved)
    with pytest.raises(ClusterUnavailable):
        pipe.execute()
    assert client.get(stays) == b"1", "the source still serves the keys it has"
    assert client.set("singleton:other", "1") and client.get("singleton:other") == b"1"
    move.finish()
    assert client.get(moved) == b"1", "-MOVED to the new node once the slot is its"


@pytest.mark.xfail(strict=True, raises=(AttributeError, TryAgainError),
                   reason="the connection's look at the server is refused with TRYAGAIN (and redis-py, "
                          "when it made the connection, cannot record that error without one)")
def test_a_connection_made_while_its_nodes_record_slot_migrates(cluster: Topology) -> None:
    """A node's server record (``<prefix>:server:{<n>}``, in the lowest slot the node
    serves) and its window key share a slot, which is migrating (``MIGRATING`` on the node,
    the record not moved yet; no window open, so the window key exists nowhere). A new
    connection's look at the server runs one script on both keys: the node answers
    ``-TRYAGAIN`` (a request on keys of a migrating slot of which only some are there), the
    connection is refused with it, and redis-py, recording the error of a connection it did
    not get, raised ``AttributeError: 'NoneType' object has no attribute 'host'`` (a worker
    starting in the chaos run exited on it); a connection the library's own request path
    made raises the ``TryAgainError`` itself. The request must be answered."""
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    t = tag()
    key = f"singleton:k:{{{t}}}"
    owner = admin.get_node_from_key(key)
    with admin.get_redis_connection(owner) as on_owner:
        records = shard_records("singleton", on_owner.execute_command("CLUSTER", "NODES"))
    assert records is not None and admin.exists(records[0]), "the owner's record is in place"
    move = SlotMove(admin, records[0]).start()  # to another primary; the record stays on the source
    try:
        with documented_break():  # building the client connects to the nodes (COMMAND): the break may come here
            client = redis_from_url(cluster.url, redis_connect_func=LockServer("singleton", 3.0).on_connect)
        try:
            with documented_break():
                assert take(client, key, "fresh").acquired, "a lock taken through a new connection to the node"
        finally:
            client.close()
    finally:
        move.abort()
