"""A lock request sent again after its reply was lost changes no outcome and reports none falsely.

A request whose connection breaks after the server ran it, before its reply
arrived, is sent again on a new connection (see :mod:`celery_singleton_beat.connection.wire`).
The second attempt meets the first one's effect. The rule: every compare-and-set
takes finding its own value as success, and a compare-and-delete that finds
nothing after a re-send reports an unknown outcome, never a lost lock.

A :class:`~tests.support.cutting_proxy.CuttingProxy` in front of a real
redis-server makes the fault: it cuts the connection once the server answered
the request named, and drops the answer. Every test checks that the cut
happened (``proxy.cuts``), after which only a request sent again can have
given the outcome it asserts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_singleton_beat.connection.flusher import read_all_replies
from celery_singleton_beat.lease import counters
from celery_singleton_beat.lease.behalf import read_holder
from celery_singleton_beat.lease.scripts import ADOPT, CLAIM_ON_RETRY, RELEASE, TAKE_OVER
from celery_singleton_beat.recovery.server import parse_info, server_of

from .support import LOCK_DB, RedisServer, wait_for
from .support.cutting_proxy import CuttingProxy
from .support.keeps_lock import KNOBS, load_app, wait_started, worker
from .support.locking import take_lock
from .support.tasks import lock_keys

KEY = "t:{demo.task:resent}"
STATS = "t:{stats}:task:demo.task"


class PooledOnly(redis.ConnectionPool):
    """A connection pool the lock channel does not take over, as Sentinel's and Cluster's
    are not: every lock request borrows a pooled connection (``wire.run_pooled``)."""


@pytest.fixture
def proxy(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[CuttingProxy]:
    cutting = CuttingProxy(redis_server.port)
    yield cutting
    cutting.close()


@pytest.fixture(params=["channel", "pooled"])
def through(request: pytest.FixtureRequest, proxy: CuttingProxy) -> Iterator[redis.Redis]:
    """A lock client whose connections go through ``proxy``: this thread's lock channel,
    or pooled connections."""
    if request.param == "channel":
        client = redis.Redis(port=proxy.port, socket_timeout=10)
    else:
        client = redis.Redis(connection_pool=PooledOnly(port=proxy.port, socket_timeout=10))
    yield client
    client.close()


def take(client: redis.Redis, task_id: str = "id-1", **kw: Any) -> Any:
    kw.setdefault("boot", "b1")
    kw.setdefault("ttl", 30.0)
    return take_lock(client, KEY, task="demo.task", task_id=task_id, node="w1@host", stats_key=STATS, **kw)


def counted(redis_db: redis.Redis) -> dict[str, int]:
    counters.flush()
    return {k.decode(): int(v) for k, v in redis_db.hgetall(STATS).items()}


def test_an_acquire_whose_reply_was_cut_holds_its_lock(
        through: redis.Redis, proxy: CuttingProxy, redis_db: redis.Redis) -> None:
    """The acquire (``SET NX PX GET`` and ``TIME``); cut after it ran, sent again: it finds
    its own value, and the key is taken."""
    warm = take_lock(through, "t:{warm}", 30.0, task="demo.task").lease  # the connection was used before
    assert warm is not None and warm.release() is True
    proxy.cut_after(KEY.encode())
    result = take(through, "a")
    assert proxy.cuts == 1, "the connection was cut after the acquire ran"
    assert result.acquired, f"the run was refused by its own lock: {result!r}"
    assert read_holder(redis_db, KEY).raw == result.lease.value
    assert result.lease.fence > 0 and result.lease.release() is True


def test_a_run_adopting_its_claim_whose_reply_was_cut_holds_its_lock(
        through: redis.Redis, proxy: CuttingProxy, redis_db: redis.Redis) -> None:
    """``until_executed``: the run adopts its own publish claim (ADOPT). Cut after it ran,
    sent again: the run holds its lock.

    Before, the second ADOPT found the run's own value, read it as another holder's,
    and the run was skipped as a duplicate of itself (its lock left for ``lock_ttl``)."""
    assert take(redis_db, "queued", claim=True).acquired
    proxy.cut_after(ADOPT.sha.encode())
    result = take(through, "queued", adopt_claim_of="queued")
    assert proxy.cuts == 1, "the connection was cut after the ADOPT ran"
    assert result.acquired, f"the run was refused by its own lock: {result!r}"
    holder = read_holder(redis_db, KEY)
    assert holder is not None and not holder.claim and holder.raw == result.lease.value
    assert result.lease.fence > 0
    assert result.lease.release() is True and not redis_db.exists(KEY)


def test_a_take_over_whose_reply_was_cut_holds_the_lock(
        through: redis.Redis, proxy: CuttingProxy, redis_db: redis.Redis) -> None:
    """A dead worker's lock (liveness key gone, renewals missed) taken over (TAKE_OVER);
    cut after it ran, sent again: the taker holds the lock."""
    dead = take(redis_db, "dead", boot="gone", live=True, liveness_ttl=0.3, ttl=30.0)
    assert dead.acquired
    wait_for(lambda: redis_db.pttl(KEY) < 30_000 - 2 * 100 - 50, timeout=10, message="missed renewals")
    proxy.cut_after(TAKE_OVER.sha.encode())
    result = take(through, "taker", boot="b2", live=True, liveness_ttl=0.3, liveness_prefix="t")
    assert proxy.cuts == 1, "the connection was cut after the TAKE_OVER ran"
    assert result.acquired and result.taken_over is not None, f"the taker was refused by its own lock: {result!r}"
    holder = read_holder(redis_db, KEY)
    assert holder is not None and holder.task_id == "taker"


def test_a_retry_leaving_its_claim_whose_reply_was_cut_reports_it_done(
        through: redis.Redis, proxy: CuttingProxy, redis_db: redis.Redis) -> None:
    """A retried ``until_executed`` run turns its lock into its retry's claim (CLAIM_ON_RETRY);
    cut after it ran, sent again: done, not "lost"."""
    lease = take(through, "a").lease
    assert lease is not None
    proxy.cut_after(CLAIM_ON_RETRY.sha.encode())
    assert lease.release(claim_ttl=5) is True
    assert proxy.cuts == 1, "the connection was cut after CLAIM_ON_RETRY ran"
    holder = read_holder(redis_db, KEY)
    assert holder is not None and holder.claim and holder.task_id == "a"
    assert "lost" not in counted(redis_db)


def test_a_put_back_whose_reply_was_cut_keeps_the_lease(
        through: redis.Redis, proxy: CuttingProxy, redis_db: redis.Redis) -> None:
    """A lease put back into a server that lost it (``SET NX``); cut after it ran, sent
    again: put back, not "taken by another"."""
    lease = take(through, "a").lease
    assert lease is not None
    redis_db.delete(KEY)  # as a restart without persistence would
    proxy.cut_after(lease.value.encode())
    assert lease.put_back() is True
    assert proxy.cuts == 1, "the connection was cut after the put-back ran"
    assert read_holder(redis_db, KEY).raw == lease.value


def test_a_release_whose_reply_was_cut_reports_no_lost_lock(
        through: redis.Redis, proxy: CuttingProxy, redis_db: redis.Redis) -> None:
    """A blocking release (``Lease.release``: pooled clients, endings that wait); cut after
    the compare-and-delete ran, sent again: it finds nothing, which is no proof of a loss.

    Before, it reported False: a "lost its lock" warning, a ``task-lock-lost`` event and
    the ``lost`` counter for a run that released its own lock."""
    lease = take(through, "a").lease
    assert lease is not None
    info = server_of(through).info
    assert info is not None
    proxy.cut_after({"delifeq": b"DELIFEQ", "delex": b"DELEX"}.get(info.release_kind, b"EVALSHA"))
    assert lease.release() is None, "unknown: the first attempt may have released it"
    assert proxy.cuts == 1, "the connection was cut after the release ran"
    assert not redis_db.exists(KEY)
    assert "lost" not in counted(redis_db), "no lost lock counted"


def test_a_release_written_ahead_whose_reply_was_cut_reports_no_lost_lock(
        proxy: CuttingProxy, redis_db: redis.Redis) -> None:
    """A run's usual release is written at once and its reply read later (``release_soon``);
    cut after it ran, the channel sends it again on a new connection when it reads the
    reply: the outcome handed on is unknown (None), not "not ours"."""
    client = redis.Redis(port=proxy.port, socket_timeout=10)
    lease = take(client, "a").lease
    assert lease is not None
    info = server_of(client).info
    assert info is not None
    proxy.cut_after({"delifeq": b"DELIFEQ", "delex": b"DELEX"}.get(info.release_kind, b"EVALSHA"))
    outcomes: list[tuple[bool | None, BaseException | None]] = []
    assert lease.release_soon(lambda released, error: outcomes.append((released, error)))
    read_all_replies()  # as the process does before it ends (else its next acquire, or the flusher)
    assert proxy.cuts == 1, "the connection was cut after the release ran"
    assert outcomes == [(None, None)], "unknown, not a lost lock"
    assert not redis_db.exists(KEY)
    assert "lost" not in counted(redis_db), "no lost lock counted"
    client.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_gevent_workers_release_whose_reply_was_cut_is_no_lost_lock(
        proxy: CuttingProxy, redis_server: RedisServer, records: redis.Redis, locks: redis.Redis) -> None:
    """A gevent worker (no lock channel: its runs release with a blocking pooled request)
    reaches the lock Redis through the proxy; the run's release is cut after it ran.

    Before, the release sent again reported False: the worker logged "lost its lock"
    and sent ``task-lock-lost`` for a run that had released its own lock."""
    env = {"CSB_LOCK_TTL": "30", "CSB_LIVENESS_TTL": "2", "CSB_LOCK_REDIS": proxy.url(LOCK_DB)}
    app = load_app(redis_server, **env)
    try:
        a = worker(redis_server, "a", env, pool="gevent", concurrency=2)
        records.set("hold:k", "1")
        result = app.hold.apply_async(("k",), queue="a")
        wait_started(records, "k", result)
        info = parse_info(locks.info())
        proxy.cut_after({"delifeq": b"DELIFEQ", "delex": b"DELEX"}.get(info.release_kind, RELEASE.sha.encode()))
        records.delete("hold:k")
        assert result.get(timeout=30).startswith("a@")
        a.wait_for_log(f"hold[{result.id}] succeeded", timeout=30)  # logged after the release returned
        assert proxy.cuts == 1, "the connection was cut after the release ran"
        assert lock_keys(locks) == [], "the lock is free"
        assert "lost its lock" not in a.output(), f"a false lost lock:\n{a.tail(20)}"
    finally:
        for name in KNOBS:
            os.environ.pop(name, None)
