"""A run does not start on a lock whose granting reply came after its lease ran out.

A lease counts from when its acquire was sent. When the reply takes longer than
the lease (a slow link, a stalled proxy, a process paused while it waited), the
lock it grants may have expired and been taken by another run meanwhile: a chaos
run showed exactly that (the reply read 5.4 s after its request, on a 4 s lease,
while another worker's run held the key). Such a reply fails the acquire as a
timeout does: the run waits for its lock Redis (an eager run raises
``LockUnavailable``) and the lock is given back, never run on.

The bound is not the lease but the time its holder can vouch for it (``ensure_held``'s
grace): a failover can lose the lock, and its recovery window close with another run
holding the key, well within a long lease (a Sentinel chaos run: the reply read 5.9 s
after its request, on a longer lease, to a process paused through the failover; the
run started beside the one that took the key on the promoted replica).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_singleton_beat import LockUnavailable, SingletonTask
from celery_singleton_beat.recovery.lock_redis import reset_clients

from .support import LOCK_DB, RedisServer, wait_for
from .support.proxy import DelayProxy
from .support.tasks import lock_keys

#: The lease of the runs here, and the delay of each chunk through the proxy: a round
#: trip (request, then reply) takes at least twice the delay, longer than the lease.
LEASE, DELAY = 1.0, 0.6


@pytest.fixture
def slow_app(redis_db: redis.Redis, redis_server: RedisServer) -> Iterator[Celery]:
    proxy = DelayProxy(redis_server.port, DELAY).start()
    app = Celery("late-reply", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, singleton_lock_ttl=LEASE,
                    singleton_redis_url=f"redis://127.0.0.1:{proxy.port}/{LOCK_DB}",
                    singleton_redis_options={"socket_timeout": 10.0, "socket_connect_timeout": 10.0})
    yield app
    reset_clients()
    proxy.close()


def test_a_lock_granted_by_a_reply_later_than_its_lease_is_not_run_on(slow_app: Celery, locks: redis.Redis) -> None:
    ran: list[str] = []

    @slow_app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        ran.append("ran")
        return x

    with pytest.raises(LockUnavailable, match="past the 1s its holder could vouch for it"):
        job.apply(args=(1,), throw=True)
    assert ran == [], "the body never ran on the late lock"
    wait_for(lambda: lock_keys(locks) == [], timeout=30, message="the late lock given back (or expired)")


#: A lease much longer than a round trip through a slower proxy, which is longer than the
#: grace of a process on a 1.5 s liveness TTL (its recovery window 2 s, less half a second).
LONG_LEASE, SLOWER, LIVENESS = 30.0, 0.8, 1.5


def test_a_lock_granted_later_than_its_holder_could_vouch_for_it_is_not_run_on(
        redis_server: RedisServer, locks: redis.Redis) -> None:
    proxy = DelayProxy(redis_server.port, SLOWER).start()
    app = Celery("late-reply-grace", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, singleton_lock_ttl=LONG_LEASE, singleton_liveness_ttl=LIVENESS,
                    singleton_redis_url=f"redis://127.0.0.1:{proxy.port}/{LOCK_DB}",
                    singleton_redis_options={"socket_timeout": 10.0, "socket_connect_timeout": 10.0})
    ran: list[str] = []

    @app.task(base=SingletonTask, shared=False)
    def job(x: int) -> int:
        ran.append("ran")
        return x

    try:
        with pytest.raises(LockUnavailable, match="its holder could vouch for it"):
            job.apply(args=(1,), throw=True)
        assert ran == [], "the body never ran on a lock it could not vouch for when it started"
        wait_for(lambda: lock_keys(locks) == [], timeout=30, message="the late lock given back")
    finally:
        reset_clients()
        proxy.close()
