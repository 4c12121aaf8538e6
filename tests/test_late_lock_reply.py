"""A run does not start on a lock whose granting reply came after its lease ran out.

A lease counts from when its acquire was sent. When the reply takes longer than
the lease (a slow link, a stalled proxy, a process paused while it waited), the
lock it grants may have expired and been taken by another run meanwhile: a chaos
run showed exactly that (the reply read 5.4 s after its request, on a 4 s lease,
while another worker's run held the key). Such a reply fails the acquire as a
timeout does: the run waits for its lock Redis (an eager run raises
``LockUnavailable``) and the lock is given back, never run on.
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

    with pytest.raises(LockUnavailable, match="past its 1s lease"):
        job.apply(args=(1,), throw=True)
    assert ran == [], "the body never ran on the late lock"
    wait_for(lambda: lock_keys(locks) == [], timeout=30, message="the late lock given back (or expired)")
