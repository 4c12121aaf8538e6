"""Adversarial review of the keeper's batched renewals (commit 014642a: the leases due within
a short horizon renewed in one pipelined request per server, per node on Cluster, each
lease judged on its own reply), against real redis-servers.

Attacks, and what they found:

1. A batch whose connection is cut mid-reply (two leases' replies read, a third half
   read): HELD. The half-read connection is dropped, the whole batch sent again on a new
   one; every lease is judged from its own reply (distinct TTLs, a lease held by another
   before and one after the cut point), and the next batch on the client reads no stale
   reply. ``test_a_batch_cut_mid_reply_is_sent_again_and_each_lease_judged_on_its_own_reply``.
2. Mixed leases in one batch on a server restarted without persistence: a key taken by
   another holder on the new server, and a run that ends (forgets, releases) after the
   reply came and before its lease is judged: HELD. Each lost lock is put back alone,
   the other's key is left alone (that lease lost), the ended run's lock is neither put
   back nor reported lost. ``test_a_batch_after_a_data_loss_puts_each_lock_back_alone_but_not_an_ended_runs``.
   (Without a restart, a lease taken over and one deleted in the same batch: lost, alone;
   held, as ``tests/test_keeper_batches.py`` already shows.)
3. ``-BUSY`` (a script running on the server) during a batch: HELD. Every lease goes on the
   one-lease path, is retried before its expiry, none lost; once the script is killed the
   next batch renews them all. ``test_a_busy_server_sends_every_lease_of_a_batch_to_its_retry``.
4. A full server (``noeviction``, over ``maxmemory``): HELD. On Redis 7.0 the Lua renewal runs;
   on Valkey 9.1 (run with ``REDIS_SERVER`` pointing at it) the native ``SET IFEQ`` batch is
   refused for memory once (one ``NativeRefused`` for the whole batch) and sent again in
   Lua: all twenty leases renewed. Not kept (Redis 7.0 never reaches the native path).
5. ``SCRIPT FLUSH`` between two batches of Lua renewals: HELD (``NOSCRIPT`` answered for
   each, the whole batch loaded and sent again once). Not kept.
6. Thousands of leases (3,000, TTL 3 s) in one keeper, and more than 512 due at once: HELD
   for losses (none lost, none starved: each lease renewed at least four times). Measured
   from another client, the lowest PTTL was 1,445-1,842 ms over four runs on a loaded
   2-core machine (load average 9), once below half the TTL: a lease's next renewal is
   scheduled from the end of the judging of its batch (``time.monotonic() + renew_every``
   in ``_renew``), not from its confirmation, so a batch that takes 0.35 s to judge under
   load delayed every lease of it by that much (largest gap between two confirmations of a
   lease: 1.35 s for a 1 s interval). Timing only, not kept (no timing thresholds here);
   the next renewal is now scheduled from the lease's confirmation.
7. Redis Cluster: leases on every node in one round; on one node's batch a slot that moved
   (``-MOVED``, the client's slot map stale) and two slots migrating to two different
   targets (``-ASK``, one key of each already migrated): HELD. One request per node; the
   ``-MOVED`` and first target's ``-ASK`` leases are followed by the ask follower, the
   other target's lease is answered ``-MOVED`` by the first target and renewed on the
   one-lease path. ``test_a_node_batch_with_moved_and_migrating_slots_renews_every_lease``.
8. Greenlet workers, the keeper a real OS thread with a client of its own:
   a gevent-patched process holding 600 leases (TTL 1.5 s) with its hub blocked by a CPU
   loop: HELD (all renewed three times, in batches). But the keeper's own client is made
   on the keeper's first renewal, and on Cluster making it connects:
   **BROKE, fixed since** ``test_a_greenlet_keeper_survives_its_cluster_client_copy_failing``.
   The batch path called ``thread_client`` outside any ``try`` (before 014642a, ``_renew``
   called it inside its own, where ``ClusterUnavailable`` was an outage to retry): the
   keeper's thread died, the leases of that round were never renewed again, and never
   reported lost. The client is now made where errors are judged, and a round that
   raises anyway is logged and its entries tried again.
9. A second data loss found by a put-back's own connection (two restarts in a row, or two
   failovers): **BROKE, fixed since** ``test_a_second_data_loss_found_by_a_put_back_does_not_deadlock_the_keeper``.
   The put-back runs under the keeper's mutex; its new connection's check found the data
   lost again and called the ``on_data_lost`` listener, ``renew_all_soon``, which took the
   same (non-reentrant) mutex: the keeper's thread deadlocked, and every ``keep()`` and
   ``forget()`` of the process blocked behind it. Older than 014642a (the put-back under the
   mutex came with f49a1f2). ``renew_all_soon`` now only raises a flag the thread reads.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease import keeper as keeper_module
from celery_singleton_beat.lease import rounds
from celery_singleton_beat.lease.batches import renew_many, renew_scripted
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, wait_for
from .support.fault_proxy import command_length, reply_length
from .support.locking import renew_round, take_leases
from .support.loopback import LoopbackProxy, close_socket, shut_write
from .support.paths import ROOT
from .support.processes import TestProcess
from .support.proxy import DelayProxy
from .support.resharding import SlotMove
from .support.skips import importorskip
from .support.topologies import Topology

#: Distinct TTLs: a renewal sent with another lease's TTL, or a reply read for another lease, shows.
TTLS = [3.0, 30.0, 7.0, 11.0, 19.0, 5.0]


def own_server(make_redis: Callable[..., RedisServer]) -> tuple[RedisServer, redis.Redis]:
    """A redis-server of the test's own, marked in use (no recovery window), and a direct client."""
    server = make_redis()
    direct = server.client()
    mark_in_use(direct)
    return server, direct


# -------------------------------------------------------------------- 1. cut mid-reply


class MidReplyCut(LoopbackProxy):
    """Relays a redis-server; once :meth:`arm`-ed, the next client chunk carrying a renewal
    (``EVALSHA``, or ``SET ... IFEQ``) has only its first ``keep`` replies relayed (and two
    bytes of the next one); then both sides of that connection are closed."""

    def __init__(self, upstream_port: int, keep: int) -> None:
        super().__init__(upstream_port, "mid-reply-cut")
        self.keep = keep
        self.armed = False
        self.cuts = 0
        self._start_accepting()

    def arm(self) -> None:
        self.armed = True

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        commands, replies = bytearray(), bytearray()
        counts = {"sent": 0, "answered": 0}
        cut_at: list[int] = []

        def up(data: bytes) -> bool:
            commands.extend(data)
            complete = 0
            while (end := command_length(commands)) > 0:
                del commands[:end]
                complete += 1
            if self.armed and (b"EVALSHA" in data or b"IFEQ" in data):
                self.armed = False
                cut_at.append(counts["sent"] + self.keep)
            counts["sent"] += complete
            self.forward(upstream, data)
            return True

        def down(data: bytes) -> bool:
            replies.extend(data)
            at = 0
            while True:
                if cut_at and counts["answered"] >= cut_at[0]:
                    self.forward(client, bytes(replies[:at + 2]))  # and two bytes of the next reply
                    for sock in (client, upstream):
                        close_socket(sock)
                    self.cuts += 1
                    return False
                end = reply_length(replies, at)
                if not end:
                    break
                at = end
                counts["answered"] += 1
            self.forward(client, bytes(replies[:at]))
            del replies[:at]
            return True

        self.spawn(self.relay, client, up, lambda: shut_write(upstream), name="cut-up")
        self.spawn(self.relay, upstream, down, lambda: shut_write(client), name="cut-down")


@pytest.mark.parametrize("path", ["pipelined", "scripted"])
def test_a_batch_cut_mid_reply_is_sent_again_and_each_lease_judged_on_its_own_reply(
        make_redis: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Six leases of six TTLs in one batch; the connection is cut once the server's replies
    of two of them (plus the ``SCRIPT LOAD`` ahead) were relayed and two bytes of the third.
    Leases 1 (before the cut point) and 4 (after it) are held by another holder. Scripted
    (one call of the many-lease script, the path on a server without ``SET ... IFEQ``):
    cut after the ``SCRIPT LOAD``'s reply and two bytes of the script's.

    Each lease must be judged on its own reply: only 1 and 4 lost, the others renewed to
    their own TTL; and the next batch on the same client must read no reply left from
    the cut request."""
    server, direct = own_server(make_redis)
    if path == "pipelined":
        monkeypatch.setattr(rounds, "scripted", lambda info, cluster: False)
    proxy = MidReplyCut(server.port, keep=3 if path == "pipelined" else 1)
    client = redis.Redis(port=proxy.port)
    try:
        leases = take_leases(client, "cut", TTLS)
        for lease in leases:
            direct.pexpire(lease.key, 2_000)
        for taken in (1, 4):
            direct.set(leases[taken].key, "another holder's value", keepttl=True)
        keeper = LeaseKeeper()
        kept = [KeptLease(lease, None) for lease in leases]

        proxy.arm()
        renew_round(keeper, kept)

        assert proxy.cuts == 1, "the batch's connection was cut mid-reply"
        assert keeper.batches == 1, "the six renewals went out in one request"
        assert [k.lost for k in kept] == [False, True, False, False, True, False]
        for n in (0, 2, 3, 5):
            assert direct.get(leases[n].key) == leases[n].value.encode()
            assert 2_000 < direct.pttl(leases[n].key) <= TTLS[n] * 1000, f"lease {n} renewed to its own TTL"
        for n in (1, 4):
            assert direct.get(leases[n].key) == b"another holder's value"

        again = [k for k in kept if not k.lost]
        renew_round(keeper, again)
        assert keeper.batches == 2 and not any(k.lost for k in again) and all(k.renewals == 2 for k in again)
    finally:
        client.close()
        proxy.close()


# -------------------------------------------------------------------- 2. data loss, mixed


@pytest.mark.parametrize("path", ["pipelined", "scripted"])
def test_a_batch_after_a_data_loss_puts_each_lock_back_alone_but_not_an_ended_runs(
        make_redis: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Six leases of six TTLs; the server restarts empty (no persistence), and another
    holder takes lease 1's key on the new server. The batch finds every lock gone; run 3
    ends (its lease forgotten, its release sent) right after the reply came, before its
    lease is judged.

    Expected: 0, 2, 4, 5 put back with their own values and TTLs; 1 lost (the other's
    key untouched); 3 neither put back nor reported lost."""
    server, direct = own_server(make_redis)
    client = server.client()
    leases = take_leases(client, "loss", TTLS)
    epoch = server_of(client).epoch
    server.restart()
    direct.set(leases[1].key, "another holder's value")
    keeper = LeaseKeeper()
    kept = [keeper.keep(lease) for lease in leases]  # the thread starts; nothing is due for a second

    def run_3_ends_at_the_reply(via: Any, batch: list[Lease]) -> Any:
        outcomes = (renew_many if path == "pipelined" else renew_scripted)(via, batch)
        keeper.forget(kept[3])
        leases[3].release()
        return outcomes

    if path == "pipelined":
        monkeypatch.setattr(rounds, "scripted", lambda info, cluster: False)
    monkeypatch.setattr(rounds, "renew_many" if path == "pipelined" else "renew_scripted",
                        run_3_ends_at_the_reply)
    try:
        renew_round(keeper, kept)
    finally:
        for k in kept:
            keeper.forget(k)

    assert keeper.batches == 1, "the six renewals went out in one request"
    assert server_of(client).epoch > epoch, "the batch found the data lost (the put-back rules were asked)"
    assert [k.lost for k in kept] == [False, True, False, False, False, False]
    assert direct.get(leases[1].key) == b"another holder's value"
    assert direct.get(leases[3].key) is None, "the ended run's lock was put back"
    for n in (0, 2, 4, 5):
        assert direct.get(leases[n].key) == leases[n].value.encode(), f"lease {n} put back"
        assert 0 < direct.pttl(leases[n].key) <= TTLS[n] * 1000, f"lease {n} put back with its own TTL"


# -------------------------------------------------------------------- 3. -BUSY


def test_a_busy_server_sends_every_lease_of_a_batch_to_its_retry(
        make_redis: Callable[..., RedisServer],
        busy_script: Callable[[RedisServer], Callable[[], None]]) -> None:
    """A script runs on the server (every command answered ``-BUSY``) when six leases are
    renewed together: each goes on the one-lease path, is answered ``-BUSY`` there too and
    is retried before its lease ends; none is lost. Once the script is killed, the next
    batch renews them all."""
    server, direct = own_server(make_redis)
    leases = take_leases(server.client(), "busy", [3.0] * 6)
    keeper = LeaseKeeper()
    kept = [KeptLease(lease, None) for lease in leases]
    alone: list[KeptLease] = []

    def one_lease_path(k: KeptLease) -> None:
        renew_once = k.lease.renew_once

        def observed(client: Any = None) -> Any:  # the one-lease path's request
            alone.append(k)
            return renew_once(client)

        k.lease.renew_once = observed  # type: ignore[method-assign]

    for k in kept:
        one_lease_path(k)
    kill = busy_script(server)

    retries = renew_round(keeper, kept)

    assert keeper.batches == 1 and alone == kept, "each -BUSY reply sent its lease on the one-lease path"
    assert not any(k.lost for k in kept) and all(k.renewals == 0 for k in kept)
    for k, at in retries:
        assert isinstance(k, KeptLease) and at is not None and at <= k.lease.valid_until, "retried before its end"
    kill()
    renew_round(keeper, kept)
    assert keeper.batches == 2 and not any(k.lost for k in kept) and all(k.renewals == 1 for k in kept)
    assert all(direct.pttl(lease.key) > 0 for lease in leases)


# -------------------------------------------------------------------- 7. Cluster


def tags_on(admin: RedisCluster, node: ClusterNode, count: int, start: int) -> list[str]:
    """``count`` hash tags whose slots ``node`` serves."""
    found, n = [], start
    while len(found) < count:
        tag = f"adv-batches-{n}"
        n += 1
        if admin.get_node_from_key(f"{{{tag}}}").name == node.name:
            found.append(tag)
    return found


def test_a_node_batch_with_moved_and_migrating_slots_renews_every_lease(cluster: Topology) -> None:
    """Two leases per slot: on the source node, a slot moved away since the client read the
    layout (``-MOVED``), two slots migrating to two different nodes with one key of each
    migrated (``-ASK`` to either target), a slot that stays; one slot on each other node.
    One round must renew all fourteen, in one request per node, on the node that has each."""
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    client = redis_from_url(cluster.url)
    source, *others = admin.get_primaries()
    moved, ask_a, ask_b, stays = tags_on(admin, source, 4, 0)
    elsewhere = [tags_on(admin, node, 1, 1000)[0] for node in others]
    keys = {tag: [f"singleton:{n}:{{{tag}}}" for n in range(2)] for tag in (moved, ask_a, ask_b, stays, *elsewhere)}
    leases = {}
    for key in (key for pair in keys.values() for key in pair):
        lease = acquire(client, key, LockSpec(task="adv", ttl=30.0), key).lease
        assert lease is not None
        leases[key] = lease
        admin.pexpire(key, 5_000)
    SlotMove(admin, keys[moved][0], target=others[0]).start().finish()
    to_a = SlotMove(admin, keys[ask_a][0], target=others[0]).start()
    to_b = SlotMove(admin, keys[ask_b][0], target=others[1]).start()
    try:
        to_a.migrate(keys[ask_a][0])
        to_b.migrate(keys[ask_b][0])
        assert client.get_node_from_key(keys[moved][0]).name == source.name, "the client's layout is stale"
        keeper = LeaseKeeper()
        kept = {key: KeptLease(lease, None) for key, lease in leases.items()}

        renew_round(keeper, list(kept.values()))

        assert keeper.batches == 3, "one request per node"
        assert not [key for key, k in kept.items() if k.lost or k.renewals != 1]
        pttls = {key: admin.pttl(key) for key in leases if key not in (keys[ask_a][0], keys[ask_b][0])}
        pttls[keys[ask_a][0]] = to_a.on_target("PTTL", keys[ask_a][0])  # only on the target: renewed there
        pttls[keys[ask_b][0]] = to_b.on_target("PTTL", keys[ask_b][0])
        assert all(pttl > 5_000 for pttl in pttls.values()), pttls
    finally:
        to_a.abort()
        to_b.abort()
        client.close()


# -------------------------------------------------------------------- 8. greenlets, Cluster

GREEN_CHILD = r"""
from gevent import monkey
monkey.patch_all()

import os, sys, time

from celery import Celery

from celery_singleton_beat.lease.keeper import get_keeper
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.lock_redis import get_redis

url, go = sys.argv[1], sys.argv[2]
app = Celery("adv-green", set_as_current=False)
app.conf.singleton_redis_url = url
client = get_redis(app)
leases = [acquire(client, f"singleton:adv-green:{n}", LockSpec(task="adv", ttl=30.0), f"run-{n}").lease
          for n in range(4)]
assert all(leases)
print("ACQUIRED", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
keeper = get_keeper()
kept = [keeper.keep(lease) for lease in leases]
end = max(lease.valid_until for lease in leases) + 1.0
while time.monotonic() < end and not all(k.renewals or k.lost for k in kept):
    time.sleep(0.02)
print(f"RESULT renewed={sum(k.renewals > 0 for k in kept)} lost={sum(k.lost for k in kept)} "
      f"keeper_running={keeper._running}", flush=True)
"""


@pytest.fixture
def green_child(tmp_path: Path) -> Iterator[Callable[[str], tuple[TestProcess, Path]]]:
    importorskip("gevent")
    started: list[TestProcess] = []

    def start(url: str) -> tuple[TestProcess, Path]:
        go = tmp_path / "go"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        child = TestProcess("adv-green", [sys.executable, "-c", GREEN_CHILD, url, str(go)], env=env).start()
        started.append(child)
        return child, go

    yield start
    for child in started:
        child.close()


def test_a_greenlet_keeper_survives_its_cluster_client_copy_failing(
        cluster: Topology, green_child: Callable[[str], tuple[TestProcess, Path]]) -> None:
    """BREAK. A gevent-patched process (a greenlet worker) on Redis Cluster, its seed address
    behind a proxy; it holds four leases (TTL 30 s, renewed every 3.3 s: no lease can end
    while the test sets the outage up, however slow the machine).

    1. The process acquires the four leases (its client read the layout through the seed).
    2. The seed address stops answering (the proxy refuses connections: a seed node
       restarting, a load balancer in front of it), the leases are kept.
    3. The keeper's first round: ``Renewer.renew_round`` calls ``thread_client`` (outside any
       ``try``) to make the keeper's own Cluster client; its constructor cannot reach the
       seed: ``ClusterUnavailable`` escapes ``_loop`` and the keeper's thread ends
       ("Exception ignored in thread started by LeaseKeeper._run").
    4. The seed answers again at once (the proxy mends after the one refused connection).

    Expected (as before 014642a, where ``_renew`` made the client inside its ``try`` and
    retried the outage every 0.25 s): every lease renewed once the seed answers, none
    lost. Found: no lease is ever renewed again (their locks expire while the runs go on)
    and none is reported lost; the keeper's thread is gone with the four leases it took."""
    node = cluster.servers[0]
    proxy = DelayProxy(node.port, 0.0).start()
    child, go = green_child(f"redis+cluster://127.0.0.1:{proxy.port}")
    child.wait_for_output("ACQUIRED", timeout=60)
    proxy.cut()
    refused = proxy.connections
    go.touch()
    wait_for(lambda: proxy.connections > refused, timeout=30, message="the keeper tried to reach the seed")
    proxy.mend()
    child.wait_for_output("RESULT", timeout=60)
    result = next(line for line in child.output().splitlines() if line.startswith("RESULT"))
    assert result == "RESULT renewed=4 lost=0 keeper_running=True", f"{result}\n{child.tail(30)}"


# -------------------------------------------------------------------- 9. second data loss


def deadlocked_in_put_back(thread: threading.Thread) -> bool:
    """``thread`` holds the keeper's mutex (``Renewer.settle``) and waits for it (``renew_all_soon``)."""
    frame = sys._current_frames().get(thread.ident or -1)
    names = set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return {"settle", "renew_all_soon"} <= names


def test_a_second_data_loss_found_by_a_put_back_does_not_deadlock_the_keeper(
        make_redis: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """BREAK. Three leases; the server restarts empty (data loss 1). The keeper's batch finds
    the three locks gone on a server that lost data; for the first lease, the rules allow
    the put-back (``may_put_back``) -- and right then the server restarts empty again
    (data loss 2: a crash-looping server, a second failover).

    ``Renewer.settle`` holds the keeper's mutex around ``put_back``; the put-back's pooled
    connection is broken, its new connection's check (``LockServer.check``) finds the data
    lost again and calls the ``on_data_lost`` listeners in this very thread:
    ``_renew_all_soon`` -> ``LeaseKeeper.renew_all_soon`` -> ``with self._mutex``, held by
    the same thread (a non-reentrant lock). The keeper's thread never returns; every
    ``keep()``, ``forget()`` and ``retry_release()`` of the process blocks behind it, no
    lease is renewed or reported lost again. (``put_back`` even has a branch for "written
    after yet another loss, found by this very request's connection": unreachable from the
    keeper.) Expected: the round ends, each lease put back or lost, the mutex free."""
    server, _ = own_server(make_redis)
    client = server.client()
    leases = take_leases(client, "twice", [30.0] * 3)
    server.restart()  # data loss 1
    keeper = LeaseKeeper()
    monkeypatch.setattr(keeper_module, "_keeper", keeper)  # the process's keeper: its listener's
    decide = leases[0].may_put_back
    decided, restarted = threading.Event(), threading.Event()

    def decide_then_lose_again(via: Any = None) -> bool:
        allowed = decide(via)
        if not decided.is_set():
            decided.set()
            restarted.wait(60)
        return allowed

    leases[0].may_put_back = decide_then_lose_again  # type: ignore[method-assign]
    kept = [KeptLease(lease, None) for lease in leases]
    rounds = threading.Thread(target=renew_round, args=(keeper, kept), daemon=True, name="adv-keeper-round")
    rounds.start()
    assert decided.wait(60), "the round found lease 0's lock gone and decided to put it back"
    server.restart()  # data loss 2, before the put-back is written (from this thread: the server dies with its parent)
    restarted.set()
    wait_for(lambda: not rounds.is_alive() or deadlocked_in_put_back(rounds), timeout=60,
             message="the keeper's round ended, or waits for the mutex it holds")
    assert not rounds.is_alive(), ("the keeper deadlocked: Renewer.settle holds its mutex around put_back, whose "
                                   "connection found the data lost again and called renew_all_soon")
    assert keeper.batches == 1 and not keeper._mutex.locked()
    with server.client() as after:
        for k in kept:
            assert k.lost or after.get(k.lease.key) == k.lease.value.encode()
