"""Attacks on the put-back rule (``Lease.may_put_back``, ``Lease.late_put_back_at``), each
against real redis-servers, by a reviewer who did not write it.

The rule: a lease whose lock the server lost puts it back at once only if the loss came
before another holder could have taken the lock over (``server.lost_by <
lease.put_back_until``); otherwise only as the recovery window closes, if no other holder
put theirs back by then. ``lost_by`` is the new server's start (``now - uptime + 1``)
when another server process serves the data, else the moment the process noticed. Each
"process" here is a client with a memory of its own (:func:`process`); a lease is renewed
by hand, as the keeper does (``support.locking.renew``), unless the keeper thread itself
is the subject.

Open breaks (``xfail(strict=True, raises=AssertionError)``: the assertion is the promise,
its test's ``documented_break()`` step; a scenario that is not reached, or a set-up that
times out, fails the test instead, see ``support.breaks``):

* A. ``test_a_standby_started_before_the_take_over``: the address now leads to a server
  that was already running (a standby, a surge pod): its start is no bound of the loss.
* C. ``test_a_second_restart_hides_the_first``: the window of a first restart the holder
  never saw closed, another acquired, a second restart lost that lock: the holder dates
  the loss by the second server only, and puts back.
* F. ``test_a_promotion_noticed_early``: "the moment noticed" bounds nothing while the
  old primary goes on taking writes (a take-over) after this process left it.
* G. ``test_a_snapshot_with_the_holders_lock``: not the put-back path: a renewal that finds
  its own value in an older data set (an RDB snapshot, a promoted replica) is trusted
  whatever the epoch (more in ``test_adversary_renewal_epoch``).
* H. ``test_a_restart_of_another_cluster_shard``: epoch and ``lost_by`` are per process,
  not per shard: another shard's restart (even before the lease was taken) lets a holder
  whose shard lost nothing put its lock back after a take-over and a release.

Breaks found and fixed since (each failed before its fix):

* B. ``test_uptime_in_whole_seconds_dates_a_restart_too_early``: ``uptime_in_seconds`` is a
  difference of whole wall-clock seconds: a restart after a take-over was dated before it
  (the start is now taken as ``now - uptime + 1``).
* D. ``test_a_put_back_written_after_a_second_restart``: the decision was made under one
  loss and written after another thread noticed a second one (now judged again).
* E. ``test_a_live_holder_keeps_its_lock_across_a_six_second_restart``: a live holder lost
  its lock when the server took 6 s to come back (the loss dated by its end): it now puts
  it back as the window closes.

Held (kept because each reaches the path it names):

* ``test_a_snapshot_with_the_takers_lock_keeps_it``: the holder finds the taker's value.
* ``test_a_replica_promoted_before_a_take_over_gets_no_put_back``: the rule is asked, refuses.
* ``test_the_keepers_own_client_shares_the_memory_the_rule_reads``: greenlet pools: the
  restart seen on the main thread's connection decides the keeper's own client's put-back.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from celery_singleton_beat import native
from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.commands import look_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.keeper import KeptLease, LeaseKeeper
from celery_singleton_beat.lease.lease import Lease
from celery_singleton_beat.lease.lock import acquire
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery import lock_redis
from celery_singleton_beat.recovery.server import LockServer, server_of
from celery_singleton_beat.recovery.window import mark_in_use

from .support import RedisServer, soak, wait_for, wait_for_phase
from .support.breaks import documented_break
from .support.locking import renew
from .support.loopback import QuietRelay, close_socket, shut_write
from .support.owners import register
from .support.topologies import cluster_shard, start_cluster

KEY = "singleton:{putback:k}"
OTHER = "singleton:{putback:other}"


def promoted_replica(make_redis: Callable[..., RedisServer]) -> tuple[RedisServer, RedisServer]:
    """A primary in use and a replica of it, promoted (``REPLICAOF NO ONE``) while the
    primary goes on taking writes."""
    old = make_redis()
    mark_in_use(old.client())
    replica = make_redis("--replicaof", "127.0.0.1", str(old.port))
    wait_for(lambda: replica.client().info("replication").get("master_link_status") == "up", timeout=20)
    replica.client().replicaof("NO", "ONE")
    return old, replica


def breaks(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)


def reached(condition: Any, what: str) -> None:
    """The scenario got where it must: else a plain failure (never counted as the xfail)."""
    if not condition:
        pytest.fail(f"scenario not reached: {what}")


def spec(boot: str, liveness: float = 1.5, ttl: float = 30.0) -> LockSpec:
    """A worker's run lock; liveness 1.5 s: renewals every 0.5 s, a take-over 2 s after one."""
    return LockSpec(task="putback", ttl=ttl, boot=boot, live=True, liveness_ttl=liveness,
                    liveness_prefix="singleton")


def process(port: int, liveness: float = 1.5) -> redis.Redis:
    """A process of its own: one client, one memory of the servers it saw."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    client.csb_server = LockServer("singleton", liveness)  # type: ignore[attr-defined]
    return client


def in_another_thread(client: Any, key: str = OTHER) -> None:
    """A lock request of another thread of ``client``'s process (a connection of its own)."""
    thread = threading.Thread(target=execute, args=(client, key, lambda info: look_request(key)))
    thread.start()
    thread.join(30)


def take_over(client: Any, lock: LockSpec) -> Lease:
    """Acquire ``KEY`` again and again until the stopped holder's lock is taken over."""
    taken: list[Lease] = []

    def attempt() -> bool:
        lease = acquire(client, KEY, lock, "b").lease
        taken.extend([lease] if lease is not None else [])
        return lease is not None

    wait_for(attempt, timeout=30, interval=0.01, message="b took the stopped holder's lock over")
    return taken[0]


def vouched(lease: Lease) -> bool:
    """What ``ensure_held()`` checks on the lease: no other holder can have the lock yet."""
    return time.monotonic() < lease.vouched_until


class Switch(QuietRelay):
    """One address in front of a server; :meth:`switch` moves it to another one (a VIP, a
    Service, DNS) and cuts the connections open; ``upstream_port`` alone moves new ones."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port, "switch")
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        register(self)
        self._start_accepting()

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self._sockets += [client, upstream]
        for source, sink in ((client, upstream), (upstream, client)):
            self.spawn(self.relay, source, self._to(sink), lambda sink=sink: shut_write(sink), name="switch-relay")

    def _to(self, sink: socket.socket) -> Callable[[bytes], bool]:
        return lambda data: self.forward(sink, data) or True

    def switch(self, port: int) -> None:
        self.upstream_port = port
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            close_socket(sock)

    def close(self) -> None:
        self.switch(self.upstream_port)
        super().close()


# ---------------------------------------------------------------------------- broke


@breaks("a server already running before the take-over dates the loss before it")
def test_a_standby_started_before_the_take_over(make_redis: Callable[..., RedisServer]) -> None:
    """A standby Redis (empty, no replica: behind HAProxy, keepalived, a Service whose new
    pod started before the old one was gone) runs from the start. ``a`` reaches the lock
    Redis through the shared address, takes ``k`` and stops; ``b`` takes it over on the
    old server (higher fence). The address moves to the standby and the old server dies.
    ``a`` resumes: its new connection finds another server process, no record, dates the
    loss by that server's start (before ``a`` even took the lock) and puts its lock back
    beside ``b``, which still vouches for its own. Fix: the new server's start bounds the
    loss only for a restart in place, which a process cannot tell from a switch: never
    date a loss before this process's last reply from the old server, and for anything
    but a proven restart in place compare the put-back's own moment (now) instead."""
    standby, old = make_redis(), make_redis()
    mark_in_use(old.client())
    address = Switch(old.port)
    a, b = process(address.port), process(old.port)
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    taker = take_over(b, spec("b-boot"))
    address.switch(standby.port)
    old.kill()
    put_back = renew(held)
    reached(vouched(taker) and taker.fence > held.fence, "b, the higher fence, still vouches for k")
    with documented_break():
        assert not put_back, "a put its lock back beside the holder that took it over"


def test_uptime_in_whole_seconds_dates_a_restart_too_early(make_redis: Callable[..., RedisServer]) -> None:
    """``uptime_in_seconds`` is ``floor(now) - floor(start)`` in wall-clock seconds: read at
    x.2 s of a server started at (x-1).6 s it says 1 for 0.6 s. ``a`` takes ``k`` at .3 s of a
    second and stops; ``b`` takes it over as soon as it may (at ``a``'s ``put_back_until``);
    the server then crashes and restarts empty within the same wall second. ``a`` resumes
    at .15 s of a later second: the loss is dated at .15 s of the second the server
    started in, before the take-over (0.1-0.2 s), and ``a`` puts its lock back. Fix:
    ``started_by = now - uptime + 1`` (and a wall-clock step on the Redis host moves
    uptime by as much)."""
    server = make_redis()
    mark_in_use(server.client())
    a, b = process(server.port), process(server.port)
    wait_for_phase(1, 0.25, 0.35)
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    earliest = held.put_back_until
    taker = take_over(b, spec("b-boot"))
    taken_at = time.monotonic()
    server.restart()
    reached(int(time.time()) == int(time.time() - time.monotonic() + earliest),
            "the restart came within the wall second of a's put_back_until (a slow machine: run again)")
    wait_for_phase(1, 0.15, 0.2)
    put_back = renew(held)
    reached(server_of(a).epoch > 0, "a found the data lost")
    reached(vouched(taker), "b still vouches for k")
    assert not put_back, (f"a put its lock back: the restart, {time.monotonic() - taken_at:.2f}s ago and after "
                          f"the take-over, was dated {taken_at - server_of(a).lost_by:.2f}s before it")


@breaks("a put-back after a loss the holder never saw, whose window let another acquire")
def test_a_second_restart_hides_the_first(make_redis: Callable[..., RedisServer]) -> None:
    """Default liveness (10 s): window 4.8 s, take-over 7.7 s after a renewal. ``a`` takes
    ``k`` and pauses (a GC pause, a frozen pod) for a few seconds. The server restarts
    empty; ``b`` waits out the recovery window (``a`` is paused: no put-back) and takes
    ``k`` afresh, legitimately (higher fence). The server restarts empty again. ``a``
    resumes: it saw neither the first server nor the window; it dates the loss by the
    second server's start, within 7.7 s of its last renewal, and puts its lock back while
    ``b`` vouches for ``k``. Fix: any loss the holder did not see may hide an earlier one
    whose window closed: put back only if ``lost_by < confirmed_at + grace`` (the window
    bounds ``grace`` too), i.e. ``put_back_until`` = ``vouched_until``."""
    server = make_redis()
    mark_in_use(server.client())
    a, b = process(server.port, 10.0), process(server.port, 10.0)
    held = acquire(a, KEY, spec("a-boot", 10.0), "a").lease
    reached(held, "a took k")
    server.restart()
    fresh = acquire(b, KEY, spec("b-boot", 10.0), "b").lease  # waits for the window first
    reached(fresh and fresh.fence > held.fence, "b took k afresh after the first restart's window")
    server.restart()
    put_back = renew(held)
    reached(vouched(fresh), "b still vouches for k")
    with documented_break():
        assert not put_back, "a put its lock back over b's fresh lease, lost in the second restart"


def test_a_put_back_written_after_a_second_restart(make_redis: Callable[..., RedisServer]) -> None:
    """``a``'s keeper finds ``k`` gone after a restart and decides to put it back (rightly);
    it stalls before the write (CPU starvation, a GIL-bound task). The window closes, ``b``
    takes ``k`` afresh; the server restarts again and another thread of ``a``'s process
    notices (its epoch grows, ``lost_by`` is now past ``a``'s ``put_back_until``). The
    keeper goes on: ``put_back`` reads the epoch at its own start, the new one, so it sees
    no change and writes ``a``'s lock back beside ``b``'s vouched lease. Fix: pass the
    epoch of the decision to ``put_back`` (or ask ``may_put_back`` again right before the
    write, under the keeper's mutex) and re-judge when it moved."""
    server = make_redis()
    mark_in_use(server.client())
    a, b = process(server.port), process(server.port)
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    server.restart()
    decided, resume = threading.Event(), threading.Event()
    judge = held.may_put_back

    def decide_then_stall(via: Any = None) -> bool:
        answer = judge(via)
        decided.set()
        resume.wait(30)
        return answer

    held.may_put_back = decide_then_stall  # type: ignore[method-assign]
    outcome: list[bool] = []
    keeper = threading.Thread(target=lambda: outcome.append(LeaseKeeper().renew(KeptLease(held, None))))
    keeper.start()
    reached(decided.wait(30), "a's keeper reached its decision")
    fresh = acquire(b, KEY, spec("b-boot"), "b").lease
    reached(fresh, "b took k afresh after the window")
    server.restart()
    in_another_thread(a)
    reached(server_of(a).epoch == 2 and server_of(a).lost_by >= held.put_back_until,
            "a's process noticed the second restart, which the rule would refuse")
    resume.set()
    keeper.join(30)
    reached(vouched(fresh), "b still vouches for k")
    assert outcome == [False], "a's stalled put-back wrote its lock back after the second restart"


def test_a_live_holder_keeps_its_lock_across_a_six_second_restart(make_redis: Callable[..., RedisServer]) -> None:
    """Default settings; the keeper thread renews ``k`` every 3.3 s. The server crashes just
    before a renewal and is back, empty, 6 s later (a pod rescheduled, a restart backoff).
    No take-over was possible: the old server died within a renewal of the last one. But
    the loss is dated by the new server's start, 9 s after the last renewal, past the
    7.7 s of ``put_back_until``: the run is told its lock is lost. (With liveness 1.5 s, a
    3 s restart does it.) The parent commit puts the lock back. Fix: date a restart in
    place by the first renewal attempt that found no server at the address (connection
    refused; not a timeout, which a partition gives), when earlier than the new start."""
    server = make_redis()
    mark_in_use(server.client())
    a = process(server.port, 10.0)
    held = acquire(a, KEY, spec("a-boot", 10.0, ttl=60.0), "a").lease
    reached(held, "a took k")
    keeper = LeaseKeeper()
    kept = keeper.keep(held)
    try:
        wait_for(lambda: kept.renewals >= 1, timeout=10, message="a renewal")
        last = held.confirmed_at
        wait_for(lambda: time.monotonic() > last + held.renew_every - 0.3, timeout=10, message="the next renewal near")
        server.kill()
        soak(6.0, check=lambda: not kept.lost, what="the downtime")
        server.start()
        wait_for(lambda: kept.lost or held.confirmed_at > last + 6, timeout=20, message="the keeper's outcome")
        reached(server_of(a).epoch == 1, "the keeper found the data lost")
        assert not kept.lost, f"a live run lost its lock in a plain restart: {kept.lost_reason}"
    finally:
        keeper.forget(kept)


@breaks("the moment a promotion is noticed does not bound the old primary's writes")
def test_a_promotion_noticed_early(make_redis: Callable[..., RedisServer]) -> None:
    """A replica is promoted; the old primary goes on taking writes from processes that did
    not follow yet. ``a`` took ``k`` there and stops; another thread of its process already
    reached the promoted replica (its epoch grows, ``lost_by`` = that moment, before ``a``'s
    ``put_back_until``). ``b``, still on the old primary, takes ``k`` over. ``a`` resumes on
    the promoted replica: ``k`` is gone, ``lost_by`` is early, the lock goes back beside
    ``b``'s. Fix: a promoted replica lacks whatever its old primary took until it stopped,
    later than any moment noticed: compare the put-back's own moment (now)."""
    old, replica = promoted_replica(make_redis)
    address = Switch(old.port)
    a, b = process(address.port), process(old.port)
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    address.upstream_port = replica.port
    in_another_thread(a)
    reached(server_of(a).epoch == 1 and server_of(a).lost_by < held.put_back_until, "a's process saw the promotion")
    taker = take_over(b, spec("b-boot"))
    address.switch(replica.port)
    put_back = renew(held)
    reached(vouched(taker) and taker.fence > held.fence, "b, the higher fence, still vouches for k")
    with documented_break():
        assert not put_back, "a put its lock back on the promoted replica beside b's take-over"


@breaks("a renewal under a grown epoch is trusted: an older data set can hold the older lock")
def test_a_snapshot_with_the_holders_lock(make_redis: Callable[..., RedisServer]) -> None:
    """An RDB snapshot is taken while ``a`` holds ``k``; ``a`` stops, ``b`` takes ``k`` over;
    the server crashes and comes back from the snapshot: ``a``'s lock, not ``b``'s. ``a``'s
    renewal finds its own value and renews it (``may_put_back`` is never asked), while
    ``b`` vouches for ``k``. The same holds for a promoted replica that replicated ``a``'s
    lock and not ``b``'s take-over. Fix: not the put-back's timing rule alone (a renewal
    that failed it gave the lock up: the taker, renewing first, was told lost all the same,
    and live holders lost their locks in slow restarts); it needs to know a take-over
    happened (a fence that survives the loss)."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    direct.save()
    taker = take_over(b, spec("b-boot"))
    server.restart()
    reached(server.client().get(KEY) == held.value.encode(), "the snapshot brought a's lock back")
    renewed = renew(held)
    reached(server_of(a).epoch == 1, "a found the data lost")
    reached(vouched(taker), "b still vouches for k")
    with documented_break():
        assert not renewed, "a renewed its lock from the snapshot after b had taken it over"


@breaks("another shard's loss lets a holder whose shard lost nothing put back")
@pytest.mark.timeout(120)
def test_a_restart_of_another_cluster_shard(make_redis: Callable[..., RedisServer]) -> None:
    """Redis Cluster, 3 primaries. ``a``'s process has used shard 2; shard 2 restarts empty
    (dated by its uptime). Then ``a`` takes ``k`` on shard 1 and stops; ``b`` takes it over
    and its run ends (release). ``a``'s process touches shard 2 again: its epoch grows and
    ``lost_by`` is shard 2's start. ``a``'s renewal finds ``k`` gone on shard 1, which lost
    nothing, and puts it back after ``b``'s run (the lower fence holds the key after the
    higher one). Fix: keep the epoch and ``lost_by`` per server record (shard), and judge
    a lease against its own key's shard (or the run id that last confirmed it)."""
    cluster = start_cluster(primaries=3)
    try:
        for node in cluster.primaries():
            mark_in_use(node)
        a, b = redis_from_url(cluster.url), redis_from_url(cluster.url)
        a.csb_server, b.csb_server = LockServer("singleton", 1.5), LockServer("singleton", 1.5)  # type: ignore[union-attr]
        home, _ = cluster_shard(cluster, key_slot(KEY.encode()))
        other = next(key for key in (f"singleton:{{o{i}}}" for i in range(100))
                     if cluster_shard(cluster, key_slot(key.encode()))[0] is not home)
        elsewhere, _ = cluster_shard(cluster, key_slot(other.encode()))
        execute(a, other, lambda info: look_request(other))
        elsewhere.kill()
        elsewhere.start()
        wait_for(lambda: elsewhere.client().cluster("info").get("cluster_state") == "ok", timeout=30)
        held = acquire(a, KEY, spec("a-boot"), "a").lease
        reached(held, "a took k on its shard")
        taker = take_over(b, spec("b-boot"))
        reached(taker.release(), "b's run ended")
        in_another_thread(a, other)
        reached(server_of(a).epoch == 1, "a's process found shard 2 restarted")
        put_back = renew(held)
        with documented_break():
            assert not put_back, "a put its lock back on a shard that lost nothing, after b's run"
    finally:
        cluster.stop()


# ---------------------------------------------------------------------------- held


def test_a_snapshot_with_the_takers_lock_keeps_it(make_redis: Callable[..., RedisServer]) -> None:
    """The snapshot is taken after ``b``'s take-over: the restart brings ``b``'s lock back;
    ``a``, whose process found the data lost, finds ``b``'s value and never writes."""
    server = make_redis()
    mark_in_use(server.client())
    a, b, direct = process(server.port), process(server.port), server.client()
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    taker = take_over(b, spec("b-boot"))
    direct.save()
    server.restart()
    assert not renew(held)
    assert server_of(a).epoch == 1, "a's process found the data lost"
    assert renew(taker) and server.client().get(KEY) == taker.value.encode()


def test_a_replica_promoted_before_a_take_over_gets_no_put_back(make_redis: Callable[..., RedisServer]) -> None:
    """A replica is promoted while the old primary goes on: ``a`` takes ``k`` there and
    stops, ``b`` takes it over there; only then does ``a``'s process reach the promoted
    replica. The rule is asked (the epoch grew) and refuses (``lost_by``, the moment
    noticed, is past ``a``'s ``put_back_until``); ``b``, noticing within its own reach,
    puts its lock back."""
    old, replica = promoted_replica(make_redis)
    address = Switch(old.port)
    a, b = process(address.port), process(address.port)
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    earliest = held.put_back_until
    taker = take_over(b, spec("b-boot"))
    address.switch(replica.port)
    assert not renew(held)
    assert server_of(a).epoch == 1 and server_of(a).lost_by >= earliest, "the rule was asked and refused"
    assert renew(taker), "b puts its own lock back"
    assert replica.client().get(KEY) == taker.value.encode()


def test_the_keepers_own_client_shares_the_memory_the_rule_reads(
        make_redis: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """In a greenlet pool the keeper renews through a client of its own
    (``lock_redis.thread_client``). The restart is noticed by the main thread's connection
    first; the keeper's client, connecting afterwards, finds nothing new. Its put-back is
    still decided: both clients share one ``LockServer``, hence the epoch and ``lost_by``."""
    monkeypatch.setattr(native, "green", lambda: True)
    server = make_redis()
    mark_in_use(server.client())
    a = process(server.port)
    held = acquire(a, KEY, spec("a-boot"), "a").lease
    reached(held, "a took k")
    server.restart()
    with contextlib.closing(lock_redis.thread_client(a)) as own:
        reached(own is not a, "the keeper has a client of its own")
        execute(a, OTHER, lambda info: look_request(OTHER))  # the main thread notices
        reached(server_of(a).epoch == 1, "the main thread's connection found the data lost")
        assert LeaseKeeper().renew(KeptLease(held, None), own), "the keeper's client put the lock back"
        assert server_of(own) is server_of(a) and server_of(a).epoch == 1
    assert server.client().get(KEY) == held.value.encode()
