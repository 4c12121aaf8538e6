"""Adversarial attacks on the ``acks_late`` acquire script and the marker-first release,
each against a real redis-server.

A reviewer who did not write the change (the acquire of an ``acks_late`` run as one
script that reads the done marker first; the release's done marker written just ahead of
its compare-and-delete) tried to break its promises. Two broke (both fixed since; each
test failed before):

* a release whose marker met ``-BUSY`` (the segment of the write that reached Redis while
  another client's script ran) and whose compare-and-delete ran once the script ended was
  reported done: the key free, no marker, never sent again; a copy ran the completed task;
* on Redis Cluster, in a slot that migrates, the source answered the new marker ``-ASK``
  and ran the compare-and-delete behind it at once; the marker reached the target a round
  trip later, and a copy acquiring in between ran the completed task again.

Attacks that held, kept because each asserts something the change promises: a completed
copy in a migrating slot (separate commands) gives the key back; an acquire whose reply was
cut after the script ran, sent again, keeps its outcome (taken; completed); every server
(Redis 6.2, 7.0, 8.2, Valkey 9.1), full or not.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from benchmarks.servers import available_servers
from celery_singleton_beat.connection.redirects import AskFollower
from celery_singleton_beat.lease.holder import done_key
from celery_singleton_beat.lease.keeper import get_keeper
from celery_singleton_beat.lease.lock import AcquireResult
from celery_singleton_beat.lease.scripts import ACQUIRE_UNLESS_DONE
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, wait_for
from .support.cutting_proxy import CuttingProxy
from .support.fault_proxy import FaultProxy, Rates
from .support.locking import take_lock
from .support.owners import register
from .support.resharding import SlotMove
from .support.servers import fill_up
from .support.topologies import Topology

KEY = "singleton:{adversary-acquire:k}"
NO_FAULTS = Rates(refuse=0, delay=0, close_before=0, close_after=0, cut=0, silence=0)
BUSY = b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.\r\n"


_tags = itertools.count()


def take(client: Any, task_id: str = "a", ttl: float = 30.0, *, boot: str = "b1", key: str = KEY,
         **spec: Any) -> AcquireResult:
    """An ``acks_late`` run's acquire (``check_done``), as a delivery known to be a copy
    (``copy``: the script that reads the done marker first)."""
    return take_lock(client, key, ttl, task="demo.task", task_id=task_id, node="w1@host", boot=boot,
                     check_done=True, copy=True, **spec)


class BusyProxy(FaultProxy):
    """A :class:`FaultProxy` whose refusals are all ``-BUSY``."""

    def refusal(self) -> bytes:
        return BUSY


@pytest.fixture
def busy_proxy(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[FaultProxy]:
    mark_in_use(redis_db)  # db 0 serves the locks here: no recovery window
    with BusyProxy(redis_server.port, NO_FAULTS, seed=0) as proxy:
        yield proxy


# -------------------------------------------------------------------- 1. the marker refused, the delete run


def test_a_release_whose_marker_met_busy_but_whose_delete_ran_still_leaves_the_marker(
        busy_proxy: FaultProxy, redis_db: redis.Redis) -> None:
    """The release's done marker now goes first: when its write reaches Redis in two segments
    while another client's script runs, the marker can be answered ``-BUSY`` (never run) and
    the compare-and-delete, arriving once the script ended, run. The key is then free and
    there is no marker: unless the release is sent again (the keeper does that for a
    release that raised), a copy of the message runs the completed task again.

    (Before the change the order was the other way round and a delete refused raised.) The
    proxy refuses the marker's ``SET`` alone, as the server does for a segment that arrives
    while a script runs. Whatever the library reports, as ``task.py`` handles it (a
    ``RedisError``: the keeper sends it again), the marker must end up written."""
    client = redis.Redis(host="127.0.0.1", port=busy_proxy.port, socket_timeout=10)
    lease = take(client).lease
    assert lease is not None
    busy_proxy.force(b"SET", "refuse")  # the marker's SET; the compare-and-delete behind it runs
    try:
        lease.release(done_ttl=60)
    except redis.RedisError:
        get_keeper().retry_release(lease, 60)  # what task.py does with a release that raised
    assert busy_proxy.faults["refuse"] == 1
    assert not redis_db.exists(KEY)
    wait_for(lambda: redis_db.exists(done_key(KEY, "a")), timeout=10,
             message="the done marker written (a release sent again)")
    copy = take(redis_db, boot="b2")
    assert copy.completed and not copy.acquired, "a copy of the completed message ran it again"


# -------------------------------------------------------------------- 2. a release in a migrating slot


def test_a_release_in_a_migrating_slot_writes_its_marker_before_the_key_is_free(
        cluster: Topology, cluster_client: RedisCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker goes ahead of the compare-and-delete so that no command of another client
    can find the key free and the marker missing. In a slot that migrates, the lock still
    on the source and the marker (new) due on the target, the source answers the marker's
    ``SET`` with ``-ASK`` and runs the compare-and-delete behind it at once; the marker
    follows to the target one round trip later (:class:`.redirects.AskFollower`). A copy of
    the message acquiring right then (here: while the follower is about to write) finds
    the key free and no marker, and runs the completed task again (it acquired, before the
    fix). It must find the original's lock, or the run completed."""
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    key = f"singleton:{{adversary-acquire:migrating-{next(_tags)}}}"
    lease = take(cluster_client, key=key).lease
    assert lease is not None
    move = SlotMove(admin, key).start()
    copies: list[AcquireResult] = []
    releasing: list[bool] = []
    follow = AskFollower.__call__

    def copy_acquires_first(self: AskFollower, request: Any, replies: list[Any]) -> list[Any]:
        if releasing and not releasing.pop():  # the release's first redirect
            copies.append(take(cluster_client, key=key, boot="b2"))  # a copy of the message, right now
        return follow(self, request, replies)

    monkeypatch.setattr(AskFollower, "__call__", copy_acquires_first)
    try:
        releasing.append(False)
        assert lease.release(done_ttl=60)
        assert copies, "the release's marker was answered -ASK (the slot migrates)"
        copy = copies[0]
        if copy.lease is not None:
            copy.lease.release()
        assert not copy.acquired, "a copy of the completed message ran it again"
        later = take(cluster_client, key=key, boot="b3")
        assert later.completed and not later.acquired
    finally:
        move.finish()



@pytest.mark.parametrize("marker_on", ["source", "target"])
def test_a_completed_copy_in_a_migrating_slot_is_not_left_holding_the_key(
        cluster: Topology, cluster_client: RedisCluster, marker_on: str) -> None:
    """A free key, its run's marker on one side of a migrating slot: the script is answered
    ``-TRYAGAIN`` and the acquire goes as separate commands, which take the key (on the
    target) before the marker is seen. The copy must report the run completed and give
    the key back: nothing of the slot held on either node."""
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    key = f"singleton:{{adversary-acquire:split-{next(_tags)}}}"
    marker = done_key(key, "a")
    admin.set(marker, "1", px=60_000)
    move = SlotMove(admin, key).start()
    try:
        if marker_on == "target":
            move.migrate(marker)
        copy = take(cluster_client, key=key, boot="b2")
        assert copy.completed and not copy.acquired
        assert key not in move.keys_on(move.source) + move.keys_on(move.target), move.state()
    finally:
        move.finish()

# -------------------------------------------------------------------- 3. replies cut after the script ran


class PooledOnly(redis.ConnectionPool):
    """A pool the lock channel does not take over (as Sentinel's and Cluster's): ``run_pooled``."""


@pytest.mark.parametrize("path", ["channel", "pooled"])
def test_an_acks_late_acquire_sent_again_after_its_reply_was_cut_keeps_its_outcome(
        redis_db: redis.Redis, redis_server: RedisServer, path: str) -> None:
    """The script ran, its reply was lost with the connection, and it was sent again on a new
    one: a run that took the key finds its own value (taken, not "held by a copy of
    itself"); a copy of a completed run still finds the run completed, and wrote nothing."""
    mark_in_use(redis_db)
    proxy = CuttingProxy(redis_server.port)
    try:
        client = (redis.Redis(port=proxy.port, socket_timeout=10) if path == "channel"
                  else redis.Redis(connection_pool=PooledOnly(port=proxy.port, socket_timeout=10)))
        warm = take_lock(client, "singleton:{warm}", 30.0, task="demo.task").lease  # a used connection
        assert warm is not None and warm.release() is True
        proxy.cut_after(ACQUIRE_UNLESS_DONE.sha.encode())
        run = take(client)
        assert proxy.cuts == 1, "the connection was cut after the acquire ran"
        assert run.lease is not None, f"the run was refused by its own lock: {run!r}"
        assert redis_db.get(KEY) == run.lease.value.encode()
        assert run.lease.release(done_ttl=60) is True

        proxy.cut_after(ACQUIRE_UNLESS_DONE.sha.encode())
        copy = take(client, boot="b2")
        assert proxy.cuts == 2
        assert copy.completed and not copy.acquired and not redis_db.exists(KEY)
        client.close()
    finally:
        proxy.close()


# -------------------------------------------------------------------- 4. every server, full or not


def test_the_acks_late_acquire_and_the_marker_first_release_on_every_server() -> None:
    """On each server found (Redis 7.0, and where installed 6.2 without ``SET ... GET``, 8.2
    with ``DELEX``, Valkey 9.1 with ``DELIFEQ``): the acquire script takes a free key,
    the release leaves the marker and frees it, a copy then finds the run completed
    without writing. Full (``noeviction``): a fresh key's acquire is refused as a plain
    ``SET`` is, writing nothing, and a copy of a completed run still finds it completed."""
    servers, _ = available_servers()
    assert "default" in servers
    for name, found in servers.items():
        server = register(RedisServer(name=f"adversary-{name}", binary=found.binary)).start()
        try:
            client = server.client()
            mark_in_use(client)
            run = take(client)
            assert run.lease is not None, name
            assert run.lease.release(done_ttl=600) is True, name
            assert not client.exists(KEY) and client.exists(done_key(KEY, "a")), name
            copy = take(client, boot="b2")
            assert copy.completed and not copy.acquired and not client.exists(KEY), name

            fill_up(client)
            with pytest.raises(redis.RedisError):
                take(client, "fresh", key="singleton:{adversary-acquire:fresh}")
            assert not client.exists("singleton:{adversary-acquire:fresh}"), name
            copy = take(client, boot="b3")
            assert copy.completed and not copy.acquired and not client.exists(KEY), name
            client.close()
        finally:
            server.stop()
