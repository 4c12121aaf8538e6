"""Adversary of the re-ask after a recovery window's wait (:func:`.pooled.run_pooled`,
:meth:`.sentinel.FollowingSentinelPool.primary_after_wait`).

An acquire that waited for a window asks the sentinels again before it writes, and moves
to the primary they name. These tests attack what that question trusts: the first
sentinel's answer (one that has not learnt the failover yet names the former primary:
every sentinel is asked now, the newest epoch wins), and no answer at all (every
sentinel out of reach: an outage now, where the pool kept the primary it knew), and a
release that waited and moved (written once: "not ours" stays False).
Each fails the group over inside the wait (the test's own hook in place of the sleep,
as in ``test_sentinel_wait.py``), makes the former primary take writes again (one back
from a pause does, until the sentinels make it a replica) and lets another run take the
key on the promoted primary: an acquire written to the former primary is a second holder.

How long a sentinel names the former primary: on loopback with every link up, ~0.1 s after
the sentinel that led the failover (the leader sends its new configuration at once; three
user-requested failovers, 2026-12-03); a sentinel cut off from the others (a partition that
leaves it, the client and the former primary on one side) names it until it is reached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_singleton_beat.connection.client import redis_from_url
from celery_singleton_beat.lease.commands import release_request
from celery_singleton_beat.lease.executor import execute
from celery_singleton_beat.lease.holder import lock_value
from celery_singleton_beat.lease.spec import LockSpec
from celery_singleton_beat.recovery.server import LockServer
from celery_singleton_beat.recovery.window import mark_in_use
from harness.sentinel import master_address

from .support import wait_for
from .support.locking import take_lock
from .support.topologies import MASTER_NAME, SentinelGroup, start_sentinels

KEY = "singleton:{adv-sentinel-wait:k}"
Address = tuple[str, int]


def _server(address: Address) -> redis.Redis:
    return redis.Redis(host=address[0], port=address[1], socket_timeout=5)


def _named_by(group: SentinelGroup, index: int) -> Address | None:
    try:
        return master_address(group.sentinel(index))
    except redis.RedisError:
        return None


def _fail_over(group: SentinelGroup, old: Address, via: int, informed: list[int]) -> Address:
    """``SENTINEL FAILOVER`` through sentinel ``via``; wait until the sentinels ``informed``
    name a promoted primary that takes writes, then make ``old`` take writes again."""
    group.sentinel(via).execute_command("SENTINEL", "FAILOVER", MASTER_NAME)

    def promoted() -> Address | None:
        named = {_named_by(group, i) for i in informed}
        if len(named) != 1 or None in named or old in named:
            return None
        new = next(iter(named))
        assert new is not None
        try:
            with _server(new) as primary:
                return new if primary.set("csb:probe", "1") else None
        except redis.RedisError:
            return None

    new: Address = wait_for(promoted, timeout=30, interval=0.05,
                            message="the informed sentinels name a promoted primary")
    with _server(old) as former:
        former.execute_command("REPLICAOF", "NO", "ONE")
    return new


def _another_run_takes(new: Address) -> str:
    """Another process's run takes the key on the promoted primary (its value, as it writes it)."""
    value = lock_value(LockSpec(task="adv-sentinel-wait", ttl=30.0), "the-other-run", None)
    with _server(new) as promoted:
        assert promoted.set(KEY, value, nx=True, px=30_000)
    return value


def _waiting_client(group: SentinelGroup, wait: Callable[[], float]) -> Any:
    """A Sentinel client whose connection to the primary is lent and checked (a window
    recorded as in use), with ``wait`` in place of the recovery window's sleep."""
    old = group.master_address()
    with _server(old) as primary:
        mark_in_use(primary)
    client = redis_from_url(group.url)
    server = LockServer("singleton", 1.5)
    client.csb_server = server  # type: ignore[union-attr]
    client.ping()  # the pool's connection to the current primary, checked; the pool knows it
    server.pause = wait  # type: ignore[method-assign]
    return client


def _holders(old: Address, new: Address) -> tuple[bytes | None, bytes | None]:
    with _server(old) as former, _server(new) as promoted:
        return former.get(KEY), promoted.get(KEY)


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    # down-after well above a sentinel's link reconnects (a sentinel kept from the hello
    # channel reconnects its subscription every few seconds): no false "down" here.
    started = start_sentinels(down_after_ms=30_000)
    try:
        yield started
    finally:
        started.stop()


def _keep_from_hellos(group: SentinelGroup, index: int) -> None:
    """Sentinel ``index`` keeps watching the data servers but hears no other sentinel from
    now on: it logs in to them as a user that may not subscribe to the hello channel (nor
    turn a server into a replica), and the other sentinels may not PUBLISH to it. It names
    the primary it knew until told otherwise: a sentinel that has not received the new
    configuration yet (hellos go every 2 s), kept so for the test, deterministically."""
    sentinel = group.sentinel(index)
    myid = str(sentinel.execute_command("SENTINEL", "MYID"))[:8]
    data = [("127.0.0.1", s.port or 0) for s in group.servers[:2]]
    for address in data:
        with _server(address) as server:
            server.execute_command("ACL", "SETUSER", "deaf", "on", ">deaf", "~*", "&*", "+@all", "-subscribe",
                                   "-psubscribe", "-ssubscribe", "-slaveof", "-replicaof")
    sentinel.execute_command("SENTINEL", "SET", MASTER_NAME, "auth-user", "deaf", "auth-pass", "deaf")
    # The other sentinels also PUBLISH their hellos to it directly.
    sentinel.execute_command("ACL", "SETUSER", "default", "-publish")

    def deaf_everywhere() -> bool:
        for address in data:
            with _server(address) as server:
                # SENTINEL SET made the sentinel log in again; its subscription is refused
                mine = [c for c in server.client_list() if c.get("name", "").startswith(f"sentinel-{myid}")]
                if not mine or any(c.get("user") != "deaf" or c.get("sub") != "0" for c in mine):
                    return False
        return True

    wait_for(deaf_everywhere, timeout=30, interval=0.1, message=f"sentinel {index} logged in without hellos")


@pytest.mark.timeout(120)
def test_an_acquire_after_a_wait_goes_to_the_newest_primary_though_the_first_sentinel_lags(
        group: SentinelGroup) -> None:
    old = group.master_address()
    _keep_from_hellos(group, 0)  # the client's first sentinel
    seen: list[tuple[Address, str]] = []

    def fail_over_while_waiting() -> float:
        if seen:
            return 0.0
        new = _fail_over(group, old, via=1, informed=[1, 2])
        assert _named_by(group, 0) == old, "the first sentinel still names the former primary"
        seen.append((new, _another_run_takes(new)))
        return 2.0

    client = _waiting_client(group, fail_over_while_waiting)
    taken = take_lock(client, KEY, 30.0, task="adv-sentinel-wait", task_id="after-the-wait")
    assert seen, "the failover happened inside the acquire's wait"
    new, other = seen[0]
    on_former, on_promoted = _holders(old, new)
    assert on_promoted == other.encode()
    assert taken.lease is None, (f"the key is held on the promoted primary, yet the acquire took it "
                                 f"(on the former primary: {on_former!r})")


@pytest.mark.timeout(120)
def test_no_sentinel_answering_after_the_wait_is_not_a_go_ahead(group: SentinelGroup) -> None:
    old = group.master_address()
    seen: list[tuple[Address, str]] = []

    def fail_over_then_lose_the_sentinels() -> float:
        """The group fails over, another run takes the key on the promoted primary, then
        this process loses its way to every sentinel (stopped here: refused at once)."""
        if seen:
            return 0.0
        new = _fail_over(group, old, via=0, informed=[0, 1, 2])
        seen.append((new, _another_run_takes(new)))
        for sentinel in group.servers[2:]:
            sentinel.stop(timeout=10)
        return 2.0

    client = _waiting_client(group, fail_over_then_lose_the_sentinels)
    try:
        taken = take_lock(client, KEY, 30.0, task="adv-sentinel-wait", task_id="after-the-wait")
    except redis.ConnectionError:
        taken = None  # an outage: the caller retries later (the safe answer)
    assert seen, "the failover happened inside the acquire's wait"
    new, other = seen[0]
    on_former, on_promoted = _holders(old, new)
    assert on_promoted == other.encode()
    assert taken is None or taken.lease is None, \
        f"no sentinel confirmed a primary, yet the acquire took the key (on the former primary: {on_former!r})"


@pytest.mark.timeout(120)
def test_a_release_that_waited_and_moved_once_still_says_not_ours(group: SentinelGroup) -> None:
    old = group.master_address()
    seen: list[Address] = []

    def fail_over_while_waiting() -> float:
        if seen:
            return 0.0
        new = _fail_over(group, old, via=0, informed=[0, 1, 2])
        seen.append(new)
        _another_run_takes(new)
        return 2.0

    client = _waiting_client(group, fail_over_while_waiting)
    released = execute(client, KEY, lambda info: release_request(info, KEY, "not-this-value"),
                       before_write=fail_over_while_waiting)
    assert seen, "the failover happened inside the release's wait"
    assert _holders(old, seen[0])[1] is not None, "the other run's lock is untouched"
    assert released is False, f"written once, not ours: False, not 'unknown' ({released!r})"


@pytest.mark.timeout(120)
def test_a_reconnect_refused_after_the_wait_is_an_outage_with_nothing_written_and_nothing_lent(
        group: SentinelGroup) -> None:
    """The sentinels name the promoted primary, which refuses the connection made again
    (it died right after its promotion): the acquire fails as an outage (a connection
    error, which the caller handles), writes nothing to the former primary, and leaves no
    connection lent."""
    old = group.master_address()
    seen: list[Address] = []

    def fail_over_then_lose_the_promoted() -> float:
        if seen:
            return 0.0
        new = _fail_over(group, old, via=0, informed=[0, 1, 2])
        group.server_on(new[1]).stop(timeout=10)  # named for down-after (30 s) more: refused meanwhile
        seen.append(new)
        return 2.0

    client = _waiting_client(group, fail_over_then_lose_the_promoted)
    with pytest.raises(redis.ConnectionError):
        take_lock(client, KEY, 30.0, task="adv-sentinel-wait", task_id="after-the-wait")
    assert seen, "the failover happened inside the acquire's wait"
    assert _named_by(group, 0) == seen[0], "the sentinels still name the promoted primary"
    with _server(old) as former:
        assert former.get(KEY) is None, "nothing was written to the former primary"
    assert not client.connection_pool._in_use_connections, "every connection went back to the pool"


@pytest.mark.timeout(120)
def test_the_request_moved_to_the_promoted_primary_waits_for_the_window_it_opens(group: SentinelGroup) -> None:
    """After the move, the connection's check on the promoted primary opens a window (the
    data's record predates the failover): the request waits for it (the library's own wait
    this time) before it writes there, not in the first window's stead."""
    old = group.master_address()
    calls: list[float] = []
    server: LockServer | None = None

    def fail_over_then_wait_for_real() -> float:
        assert server is not None
        if calls:
            waited = LockServer.pause(server)
            calls.append(waited)
            return waited
        _fail_over(group, old, via=0, informed=[0, 1, 2])
        calls.append(2.0)
        return 2.0

    client = _waiting_client(group, fail_over_then_wait_for_real)
    server = client.csb_server
    taken = take_lock(client, KEY, 30.0, task="adv-sentinel-wait", task_id="after-the-wait")
    assert taken.lease is not None
    assert len(calls) >= 2 and calls[1] > 0, f"the moved request waited for the promoted primary's window ({calls})"
    assert not server.recovery().open, "written once the window had closed"
    new = group.master_address()
    assert _holders(old, new) == (None, taken.lease.value.encode()), "written to the promoted primary only"
